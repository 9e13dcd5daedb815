"""S3ImageFolder: images listed in a manifest, fetched with one GET each, a batch at a time.

dask-pytorch-ddp's class of this name listed the bucket on every rank and sent a HEAD and
a GET through a new boto3 resource per image. This one takes the manifest, so nothing is
listed, and implements `__getitems__`, which the DataLoader calls with a whole batch of
indices: the batch's images are fetched concurrently (`prefect_ddp.tasks.data.object_reads.fetch_objects`, exact
paths, never glob patterns), so their latencies overlap, then decoded. A batch that cannot
be fetched within `fetch_timeout_s` fails the rank with the images' names rather than
stalling the gang. Any fsspec URL works (s3://, file://, local path).

An image that is gone (deleted since it was listed) or does not decode (decode-check did
not sample it, or it changed since) is left out rather than failing the rank: the rank
would fail again in every re-formed gang, as the image stays unreadable. Its place in the
batch holds a stand-in labelled `unreadable_label(position)`, which the training loop
masks out of the loss and the counts and names (prefect_ddp.tasks.training.unreadable), so that no rank takes
a step more or less than the others (DDP would hang in a collective) and no batch
shrinks to the one image BatchNorm cannot train on, or to none. Other fetch failures
(throttling, resets, timeouts, permissions) are retried and then fail the batch as before.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import thread as executor_threads
from functools import partial
from typing import Any, NamedTuple, TypeGuard, TypeVar

import torch
from fsspec import AbstractFileSystem
from PIL import Image
from torch.utils.data import Dataset
from torchvision.transforms import InterpolationMode, v2

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.byte_cache import ByteCache
from prefect_ddp.tasks.data.decoding import RESIZED_QUALITY, decoded_tensor, open_rgb, stored_resized
from prefect_ddp.tasks.data.fetch_ahead import BATCHES_AT_ONCE, FetchesAhead
from prefect_ddp.tasks.data.loader_leftovers import use_own_temp_folder
from prefect_ddp.tasks.data.object_reads import fetch_objects, object_read_options
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.storage import ProcessFilesystem

FETCH_ATTEMPTS = 4
BLANK_SIDE = 8
DEFAULT_FETCH_TIMEOUT_S = TrainingConfig.model_fields["fetch_timeout_s"].default
SHOWN_KEYS = 3


class EncodedImage(NamedTuple):
    """An image's bytes as a uint8 tensor, for a rank that decodes on its device, with its
    position in its dataset: the rank names it there if it does not decode."""

    data: torch.Tensor
    position: int


Sample = tuple[torch.Tensor | EncodedImage | None, int]
# An image as a batch holds it: a tensor decoded (in the loader or on the device) or its encoded bytes.
ImageT = TypeVar("ImageT", bound=torch.Tensor | EncodedImage)


def unreadable_label(position: int) -> int:
    """The label of the stand-in for the unreadable image at `position`: -(1 + position).

    Negative, so no class matches it; it carries the position so that the rank can name the
    image, also from a loader's worker process, where only the batch reaches the rank.

    >>> unreadable_label(0), unreadable_label(41)
    (-1, -42)
    """
    return -(1 + position)


def unreadable_positions(labels: torch.Tensor) -> list[int]:
    """The dataset positions of a batch's stand-ins for unreadable images (`unreadable_label`).

    >>> unreadable_positions(torch.tensor([2, -1, 0, -42]))
    [0, 41]
    """
    return (-1 - labels[labels < 0]).tolist()


def decoded(data: bytes | None, side: int | None, as_tensor: bool = True) -> torch.Tensor | Image.Image | None:
    """`data` decoded at `side` by `decoded_tensor`, or by `open_rgb` to a PIL image where not
    `as_tensor`; None for an image that is gone (`data` None) or does not decode."""
    if data is None:
        return None
    try:
        return decoded_tensor(data, side) if as_tensor else open_rgb(data, side)
    except Exception:  # any decoder error means unreadable, as decode-check takes it (prefect_ddp.tasks.data.validation)
        return None


def encoded_tensor(data: bytes | None) -> torch.Tensor:
    """`data` as a uint8 tensor; an empty one for an image that is gone, which then fails to
    decode on the rank like any unreadable image (prefect_ddp.tasks.data.device_batches)."""
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def prepare(data: bytes | None, label: int, position: int, transform: Callable[..., Any] | None) -> Sample:
    """A fetched image as the loader hands it over: decoded (no smaller than the transform needs,
    `needed_side`) and transformed, or, with no transform, its bytes (none for an image that is
    gone) for a rank that decodes on its device. The project's transforms (`SizedTransform`) are
    given a uint8 tensor (`decoded_tensor`); any other transform the PIL image it was written for.

    An image that is gone (`data` None) or does not decode comes back as None, labelled
    `unreadable_label(position)`: `with_stand_ins` fills its place. Only the decode is
    guarded: an error of the transform is a bug, not an unreadable image.
    """
    if transform is None:
        return EncodedImage(encoded_tensor(data), position), label
    image = decoded(data, needed_side(transform), as_tensor=takes_tensor(transform))
    if image is None:
        return None, unreadable_label(position)
    return transform(image), label


def blank_image(transform: Callable[..., Any] | None) -> torch.Tensor:
    """A black image, as `prepare` would hand it to `transform`, run through it: the stand-in
    when no image of a batch could be read.

    Loaders pass their own transform, None where they hand over encoded images; those are
    never unreadable in the loader (`prepare`), so a stand-in asked for there is a bug.
    """
    if transform is None:
        raise ValueError("blank_image got transform=None: a loader that hands over encoded images (no "
                         "transform) has no unreadable image to stand in for; a stand-in needs a transform.")
    black = (torch.zeros(3, BLANK_SIDE, BLANK_SIDE, dtype=torch.uint8) if takes_tensor(transform)
             else Image.new("RGB", (BLANK_SIDE, BLANK_SIDE)))
    blank: torch.Tensor = transform(black)
    return blank


def _all_readable(samples: list[tuple[ImageT | None, int]]) -> TypeGuard[list[tuple[ImageT, int]]]:
    """Whether no image of `samples` is unreadable (None): then they are a batch as they are."""
    return all(image is not None for image, _ in samples)


def with_stand_ins(samples: list[tuple[ImageT | None, int]], blank: Callable[[], ImageT]) -> list[tuple[ImageT, int]]:
    """`samples` with each unreadable image (None) replaced by the batch's first readable one.

    A copy of a real image, not a blank, where there is one: in training mode BatchNorm
    normalises with the statistics of the whole batch, stand-ins included, and a real image
    of the same batch moves them least. With none readable, `blank()` stands in for all;
    their loss is zero, but BatchNorm's running statistics still take in that batch.
    """
    if _all_readable(samples):
        return samples
    stand_in = next((image for image, _ in samples if image is not None), None)
    if stand_in is None:
        stand_in = blank()
    return [(stand_in if image is None else image, label) for image, label in samples]


# RandomResizedCrop's range of crop areas (a share of the image's) and torchvision's default aspect ratios.
CROP_SCALE = (0.6, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)


class SizedTransform(v2.Compose):
    """torchvision's Compose that says the shorter side its input needs (`decode_side`), so
    that whoever decodes for it (`prepare`, batch-predict) decodes no larger (`open_rgb`)."""

    def __init__(self, transforms: list[Callable[..., Any]], decode_side: int) -> None:
        super().__init__(transforms)
        self.decode_side = decode_side


def takes_tensor(transform: Callable[..., Any]) -> bool:
    """Whether `transform` is given a decoded image as a uint8 tensor (`decoded_tensor`): the project's
    own (`SizedTransform`, made of torchvision's v2 steps); a user's is given the PIL image it was written for."""
    return isinstance(transform, SizedTransform)


def needed_side(transform: Callable[..., Any] | None) -> int | None:
    """The shorter side `transform`'s input needs; None (decode fully) for a transform that does not say."""
    return transform.decode_side if isinstance(transform, SizedTransform) else None


def train_transform(image_size: int, preprocessing: Preprocessing = Preprocessing(), trivial_augment: bool = False,
                    random_erasing: float = 0.0) -> SizedTransform:
    """A random crop of `image_size` of a random share of the image, flipped at random, scaled
    with the weights' interpolation and normalised with their statistics (`preprocessing`).

    The fine-tuning knobs (docs/models.md, "Fine-tuning knobs") add steps where torchvision's
    reference recipe has them: `trivial_augment`, TrivialAugmentWide on the uint8 crop after the
    flip; `random_erasing`, RandomErasing with this probability on the normalised image. Off, they
    add no step: the transform is the one before they existed. TrivialAugmentWide turns, shears
    and shifts bilinearly, whatever the weights' interpolation: torchvision's kernels for those
    take nearest or bilinear on a tensor and raise for bicubic (the weights' other choice).
    """
    return SizedTransform([
        v2.PILToTensor(),
        v2.RandomResizedCrop(image_size, scale=CROP_SCALE, ratio=CROP_RATIO, interpolation=preprocessing.mode,
                             antialias=True),
        v2.RandomHorizontalFlip(),
        *([v2.TrivialAugmentWide(interpolation=InterpolationMode.BILINEAR)] if trivial_augment else []),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(preprocessing.mean, preprocessing.std),
        *([v2.RandomErasing(p=random_erasing)] if random_erasing else []),
    ], decode_side(image_size))


def train_transform_for(cfg: TrainingConfig, preprocessing: Preprocessing) -> SizedTransform:
    """`train_transform` as the run's recipe (`cfg`) asks for it: its crop side and image knobs."""
    return train_transform(cfg.image_size, preprocessing, cfg.trivial_augment, cfg.random_erasing)


def decode_side(image_size: int) -> int:
    """The shorter side an image needs, decoded, for training's crop at `image_size` to scale
    down what a full decode would: `open_rgb` decodes no smaller. (Validation needs its resize.)

    RandomResizedCrop's smallest crop takes CROP_SCALE[0] of the area at the narrowest ratio:
    on a square image, a short side of sqrt(0.6 * 3/4) = 0.67 of the image's, which must
    still hold `image_size` pixels.

    >>> [decode_side(side) for side in (64, 224, 448)]
    [96, 334, 668]
    """
    return math.ceil(image_size / math.sqrt(CROP_SCALE[0] * CROP_RATIO[0]))


def eval_transform(image_size: int, preprocessing: Preprocessing = Preprocessing()) -> SizedTransform:
    """Resize the shorter side to `preprocessing.resize(image_size)` (256 for 224 with torchvision's
    usual weights), crop the centre, normalise: validation's, batch-predict's and the champion's, as
    model.json records it (`Preprocessing.of_card`).

    Its input needs no more than the resize on its shorter side (`open_rgb` decodes no smaller)."""
    size = preprocessing.resize(image_size)
    return SizedTransform([
        v2.PILToTensor(),
        v2.Resize(size, interpolation=preprocessing.mode, antialias=True),
        v2.CenterCrop(image_size),
        v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(preprocessing.mean, preprocessing.std),
    ], size)


def forget_parent_exit_hooks(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: drop the exit hooks a forked loader worker inherited.

    Prefect registers a threading exit hook for each background service it starts (log and
    event shipping); a rank's process has them, and a loader worker forked from it inherits
    the hooks but not the services' threads. At the worker's exit the hook fails, and
    multiprocessing then ends the worker with code 1 without a word: torch reports
    "DataLoader worker exited unexpectedly with exit code 1", at the end of an epoch or when
    the loader is collected. concurrent.futures' hook stays: it stops executors the worker
    itself started.
    """
    hooks = threading._threading_atexits  # type: ignore[attr-defined]
    hooks[:] = [hook for hook in hooks if hook is executor_threads._python_exit]


def start_loader_process(worker_id: int) -> None:
    """DataLoader `worker_init_fn` of the recipe's loader processes: drop the exit hooks inherited
    from the rank (`forget_parent_exit_hooks`), and make a temp folder named for this process, which
    a later rank removes if the process is killed (prefect_ddp.tasks.data.loader_leftovers)."""
    forget_parent_exit_hooks(worker_id)
    use_own_temp_folder()


def forked_workers() -> dict[str, Any]:
    """DataLoader options for loader processes forked from a rank.

    Fork, not the spawn Dask workers default to: spawn starts Python afresh, 18 s per loader
    start in a Dask worker here against 0.5 s forked.
    """
    return {"multiprocessing_context": "fork", "worker_init_fn": start_loader_process}


class FetchTimeout(OSError):
    """A batch's images did not arrive within fetch_timeout_s.

    Not the builtin TimeoutError: Prefect takes that for the task's own timeout and would
    record the rank as TimedOut, as if the rank, not the storage, had run too long.
    """


class S3ImageFolder(Dataset[tuple[torch.Tensor | EncodedImage, int]]):
    """(image tensor, label) pairs for the images at `keys` below `root`.

    Args:
        root: folder URL; keys are relative to it.
        keys: the images to serve.
        labels: their class indices, one per key.
        storage_options: fsspec options (endpoint, credentials) for `root`.
        transform: applied to each decoded image: a uint8 CHW tensor for the project's transforms
            (`SizedTransform`, `decoded_tensor`), else a PIL image (8-bit RGB, `open_rgb`); None
            serves the encoded bytes as a uint8 tensor, for decoding on the rank's device.
        fetch_threads: images fetched at once within a batch.
        fetch_timeout_s: limit for fetching one batch, retries included; past it the batch
            fails with a FetchTimeout naming its images. An image that is gone or does not
            decode does not fail it: its place holds a stand-in (module docstring).
        sizes: each image's size from the manifest, part of its key in `cache`.
        cache: keeps fetched bytes on local disk, so later epochs read them from there;
            its entries are keyed on the endpoint `storage_options` name as well. Where
            `transform` names the side it needs (`needed_side`), an image larger than that
            is kept as a copy resized to it (`stored_resized`, as pre-resized shards store
            it), not as the original: later epochs then decode a small JPEG instead of a
            camera original (~2 ms instead of ~50-200), and a 12-MP photo takes ~20 KB of
            the cache instead of ~5 MB. Every epoch, the first too, trains on that copy.
        copy_shrink: None keeps every image in `cache`, as fetched or as such a copy; a
            number keeps only copies, of images more than that many times the side on their
            shorter side (tasks/data/cache_choice.py: the others are fetched every epoch).

    >>> from prefect_ddp.tasks.data.dataset import S3ImageFolder, eval_transform
    >>> dataset = S3ImageFolder("s3://bucket/flowers", ["daisy/1.jpg"], [0], {}, eval_transform(224))
    >>> len(dataset)
    1
    """

    def __init__(
        self, root: str, keys: Sequence[str], labels: Sequence[int],
        storage_options: dict[str, Any], transform: Callable[..., Any] | None, fetch_threads: int = 16,
        fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
        sizes: Sequence[int] | None = None, cache: ByteCache | None = None, copy_shrink: float | None = None,
    ) -> None:
        if len(keys) != len(labels) or (sizes is not None and len(sizes) != len(keys)):
            raise ValueError(f"Got {len(keys)} keys, {len(labels)} labels and "
                             f"{'no' if sizes is None else len(sizes)} sizes; they must pair up.")
        self.root = root.rstrip("/")
        self.keys = list(keys)
        self.labels = list(labels)
        # A loader process fetches BATCHES_AT_ONCE batches at once, each `fetch_threads` at a
        # time: s3fs's connection pool must hold them all, or it caps what is in flight at
        # one batch's worth.
        in_flight = fetch_threads * BATCHES_AT_ONCE
        self.storage_options = {
            **object_read_options(root, storage_options, in_flight), "skip_instance_cache": True,
        }
        self.transform = transform
        self.fetch_threads = fetch_threads
        self.fetch_timeout_s = fetch_timeout_s
        self.sizes = list(sizes) if sizes is not None else [None] * len(self.keys)
        self.cache = cache.for_storage(self.storage_options) if cache else None
        self.copy_side = needed_side(transform) if cache else None
        self.copy_shrink = copy_shrink
        self._copying = True  # until the cache cannot keep a copy: then making one each epoch is waste
        self._files = ProcessFilesystem(self.root, self.storage_options)
        self._ahead = FetchesAhead()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def fs(self) -> AbstractFileSystem:
        return self._files.get()[0]

    def fetch(self, indices: Sequence[int]) -> list[bytes | None]:
        """The bytes of the images at `indices`, None for one that is gone: from the cache
        where it has them, else one GET each."""
        if self.cache is None:
            return self._get(indices)
        found = {i: self.cache.get(self._url(i), self.sizes[i], variant=self._variant) for i in indices}
        uncached = list(dict.fromkeys(i for i, data in found.items() if data is None))
        for i, data in zip(uncached, self._get(uncached) if uncached else []):
            found[i] = self._kept(self.cache, i, data)
        return [found[i] for i in indices]

    @property
    def _variant(self) -> str:
        """How the cache's entries of this dataset were made from the objects: "" for the bytes as
        fetched. Named with its version: copies made another way are other entries."""
        return f"resized to {self.copy_side} as JPEG {RESIZED_QUALITY}, v1" if self.copy_side else ""

    def _kept(self, cache: ByteCache, index: int, data: bytes | None) -> bytes | None:
        """`data`, fetched, kept in `cache`; what the batch decodes (a resized copy where one is
        made: every epoch trains on the same image, whether fetched or read from the cache).

        An image that changed since it was listed (another size) is neither kept nor copied; one
        that does not decode is kept as fetched, and the batch meets it unreadable every epoch, as
        it would without the cache. Once the cache cannot keep a copy (full, or not writable),
        this dataset stops making them: each epoch would pay for a copy that is thrown away."""
        if data is None or (self.sizes[index] is not None and len(data) != self.sizes[index]):
            return data
        if self.copy_side is None:
            if self.copy_shrink is None:
                cache.put(self._url(index), self.sizes[index], data)
        elif self._copying:
            stored = stored_resized(data, self.copy_side, shrink=self.copy_shrink or 1.0)
            data = stored.data or data
            if stored.resized or self.copy_shrink is None:
                self._copying = cache.put(self._url(index), self.sizes[index], data, variant=self._variant)
        return data

    def _url(self, index: int) -> str:
        return f"{self.root}/{self.keys[index]}"

    def _get(self, indices: Sequence[int]) -> list[bytes | None]:
        """The bytes of the images at `indices`, one GET each, retrying transient errors; None
        for an image that is gone (fetch_objects never retries that)."""
        fs, root = self._files.get()
        paths = [f"{root}/{self.keys[i]}" for i in indices]
        got = fetch_objects(fs, paths, self.fetch_threads, FETCH_ATTEMPTS, self.fetch_timeout_s)
        found: dict[str, bytes | None] = {}
        failed: dict[str, Exception] = {}
        for path, result in got.items():
            if isinstance(result, FileNotFoundError):
                found[path] = None
            elif isinstance(result, Exception):
                failed[path] = result
            else:
                found[path] = result
        if failed:
            raise self._fetch_error(failed)
        return [found[path] for path in paths]

    def _fetch_error(self, failed: dict[str, Exception]) -> OSError:
        timed_out = [path for path, error in failed.items() if isinstance(error, TimeoutError)]
        if timed_out:
            return FetchTimeout(
                f"Could not fetch {len(timed_out)} image(s) within fetch_timeout_s="
                f"{self.fetch_timeout_s:g} s, e.g. {', '.join(timed_out[:SHOWN_KEYS])}. The "
                "storage endpoint stalled or is too slow: check it, or raise "
                "training.fetch_timeout_s for large images or a slow link."
            )
        path, error = next(iter(failed.items()))
        return OSError(
            f"Could not fetch {len(failed)} image(s) after {FETCH_ATTEMPTS} attempts, e.g. "
            f"{path}: {error!r}"
        )

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[torch.Tensor | EncodedImage, int]]:
        """The batch at `indices`, as long as asked: an unreadable image's place holds a stand-in
        labelled `unreadable_label(index)` (module docstring). Batches from a FetchAheadLoader
        say which batches follow; their fetches start before this one decodes
        (prefect_ddp.tasks.data.fetch_ahead)."""
        fetched = self._ahead.take(indices, self.fetch)
        samples = [prepare(data, self.labels[i], i, self.transform) for data, i in zip(fetched, indices)]
        return with_stand_ins(samples, partial(blank_image, self.transform))

    def __getitem__(self, index: int) -> tuple[torch.Tensor | EncodedImage, int]:
        return self.__getitems__([index])[0]

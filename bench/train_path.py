"""The training path's CPU cost per image on one core, today's against the new and against its peers (issue 55).

    .venv/bin/python -m bench.train_path [--rounds 8] [--images N] [--sets 500x375,256px,12MP] [--quick]

Makes three sets of photo-like JPEGs once, in memory (`bench.photos.photo`, quality 90):
500x375 (256 images, about ImageNet's median size), copies of those stored at a 256-px
shorter side (341x256, as shards and the byte cache keep them: `stored_resized(data, 256)`,
LANCZOS, quality 90) and 4032x3024 12-MP photos (32, a phone's). Each variant turns the same
bytes into batches of 32 224-px training samples as its users get them, on one thread
(`torch.set_num_threads(1)`, no loader processes, DALI with `num_threads=1`):

- today: the project's training path as it was at a04c32a, frozen here: `open_rgb(data, 334)`
  (libjpeg's reduced-size decode to `decode_side(224)`), then a v2 Compose of PILToTensor,
  RandomResizedCrop(224, scale=(0.6, 1), ratio=(3/4, 4/3), bilinear, antialias), RandomHorizontalFlip,
  ToDtype(float32, scale=True), Normalize(ImageNet), collated by `default_collate` (a
  `torch.stack` of the float32 images): a float32 NCHW batch, normalised;
- new: the project's loader path now: `prepare(data, label, position, loader_steps(train_transform(224)))`
  per image (prefect_ddp.tasks.data.dataset; `decoded_tensor`: libjpeg-turbo through simplejpeg
  at the scale PIL's `draft` picks, PIL's pixels) and
  `collate_images` (prefect_ddp.tasks.data.loader_steps): a uint8 NCHW (channels-last) batch,
  converted and normalised later on the rank's device. Switched off, saying why, where that API is missing;
- new, decoded as at 092522c: the same loader steps and collation on the decoder the uint8 path
  first had, frozen here (torchvision's `decode_jpeg` where PIL decodes at full size, `open_rgb`
  where PIL's reduced-size decode applies): what the decoder alone changes;
- torchvision: torchvision's reference recipe (references/classification/presets.py,
  `ClassificationPresetTrain` as its train.py builds it by default: crop 224, PIL backend,
  v1 transforms): `pil_loader` (PIL open and convert("RGB"), a full decode), RandomResizedCrop(224)
  with its defaults (scale 0.08-1, bilinear, antialias), RandomHorizontalFlip(0.5) on the PIL
  image, PILToTensor, ConvertImageDtype(float), Normalize; `default_collate`. Written out here:
  the references folder is not installed;
- dali: NVIDIA DALI's CPU pipeline (`device_id=None`, `num_threads=1`, batch 32):
  `fn.external_source` of the encoded bytes, `fn.decoders.image(device="cpu")` (a full decode),
  `fn.random_resized_crop(size=224, random_area=[0.6, 1])` (the project's areas, so the work is
  alike; DALI's ResNet-50 example draws 0.08-1), `fn.crop_mirror_normalize` to float32 CHW with a
  `coin_flip` mirror, copied into a torch tensor by the PyTorch plugin's `feed_ndarray` as its
  iterators do;
- dali fused: the same with DALI's own fused step, as its ResNet-50 example reads:
  `fn.decoders.image_random_crop` (libjpeg-turbo decodes only the crop's window) then
  `fn.resize` to 224x224 and the same `crop_mirror_normalize`;
- litdata: how a LitData user reads a JPEG: its `JPEGSerializer().deserialize` (torchvision's
  `decode_jpeg`, a full decode, to a uint8 CHW tensor) on the stored bytes, then today's v2
  transform from RandomResizedCrop on, `default_collate`. Measured directly on the bytes in
  memory: its streaming from chunk files is left out, as every variant's reading is;
- the floor, what every path that keeps today's pixels runs and nothing else: libjpeg-turbo's
  exact decode alone (as the new path calls it, without PIL's EXIF read), and that decode with the
  box's draw, the crop's copy, torch's uint8 antialiased resize and the collation. The 0.5x target
  leaves the rest of a path (EXIF's read, the flip, its own Python) what these leave of it. Not
  peers: the targets print them as ratios to today's.

DALI (nvidia-dali-cuda120 2.4.0 with nvImageCodec) and LitData (0.2.76) are installed under
bench/.cache on first use (bench.outside); where they cannot be, or DALI cannot run, their rows
say why. DALI runs on a machine without a GPU; its nvImageCodec says on loading that it finds no
nvJPEG, nvJPEG2000 or nvTIFF, its GPU codecs, and decodes on the CPU with libjpeg-turbo.

Interleaved: each round runs every variant once over each set, the sets and the variants in an
order that rotates by one each round, after one untimed batch of each. The cost is the
process's CPU time (`time.process_time`: every thread's, DALI's own included) per image of the
whole set, batches and collation included; the table gives each variant's median over the
rounds with its interquartile range, and the median of its per-round ratios to today's. The
targets (issue 55): the new at most 0.5x today's on 500x375, and below every peer on each set.
Then whether the new batch, as float/255 normalised, equals today's from the same seed.
Record the table, machine and load in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from io import BytesIO

import numpy as np
import PIL
import torch
import torchvision
from PIL import Image, features
from torch.utils.data import default_collate
from torchvision import transforms as v1
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import InterpolationMode, v2

from bench.outside import install_beside
from bench.photos import photo
from prefect_ddp.tasks.data.decoding import open_rgb, stored_resized

SIDE = 224
BATCH = 32
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
STORED_SIDE = 256
# name -> (what it is, images by default, images with --quick)
SETS = {"500x375": ("500x375 originals", 256, 8), "256px": ("the same stored at 256 px (341x256)", 256, 8),
        "12MP": ("12 MP, 4032x3024", 32, 2)}
LIBRARIES = {
    "dali": (["nvidia-dali-cuda120==2.4.0", "nvidia-nvimgcodec-cu12==0.9.0.20", "astunparse==1.6.3",
              "gast==0.7.0", "optree==0.20.0", "nvtx==0.2.17", "makefun==1.16.0"], "nvidia/dali"),
    "litdata": (["litdata==0.2.76", "lightning-utilities==0.15.2"], "litdata"),
}

Batch = tuple[torch.Tensor, torch.Tensor]
Variant = Callable[[list[bytes], list[int]], Batch]

# --- today: the training path at a04c32a, frozen ------------------------------------------------

TODAY_DECODE_SIDE = math.ceil(SIDE / math.sqrt(0.6 * 3 / 4))  # decode_side(224) then: 334


def crop_flip_normalise() -> list[Callable]:
    """today's v2 steps after PILToTensor: a random crop of 60-100 % of the area, a flip, float, normalised."""
    return [v2.RandomResizedCrop(SIDE, scale=(0.6, 1.0), ratio=(3 / 4, 4 / 3),
                                 interpolation=InterpolationMode.BILINEAR, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD)]


TODAY_TRANSFORM = v2.Compose([v2.PILToTensor(), *crop_flip_normalise()])


def today(datas: list[bytes], labels: list[int]) -> Batch:
    return default_collate([(TODAY_TRANSFORM(open_rgb(data, TODAY_DECODE_SIDE)), label)
                            for data, label in zip(datas, labels)])


# --- new: the project's loader path now ---------------------------------------------------------

def new_variant(decoder: Callable[[bytes, int], torch.Tensor] | None = None) -> Variant | str:
    """The project's new path, on `decoder` in place of its own where given, or why it cannot run."""
    try:
        from prefect_ddp.tasks.data.dataset import prepare, train_transform  # noqa: PLC0415
        from prefect_ddp.tasks.data.loader_steps import collate_images, loader_steps  # noqa: PLC0415
    except ImportError as error:
        return f"the new loader path is not in this checkout ({error})"
    steps = loader_steps(train_transform(SIDE))

    def new(datas: list[bytes], labels: list[int]) -> Batch:
        if decoder is None:
            return collate_images([prepare(data, label, position, steps)
                                   for position, (data, label) in enumerate(zip(datas, labels))])
        return collate_images([(steps(decoder(data, steps.decode_side)), label) for data, label in zip(datas, labels)])
    return new


def first_decoder(data: bytes, side: int) -> torch.Tensor:
    """`decoded_tensor` as the uint8 path first had it (092522c), for a plain colour JPEG: torchvision's
    full decode where PIL's `draft` would not reduce, else PIL's reduced-size decode."""
    with Image.open(BytesIO(data)) as header:
        width, height = header.size
    if min(width // side, height // side) < 2:
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return torch.from_numpy(np.array(open_rgb(data, side))).permute(2, 0, 1)


# --- the floor: what any path with today's pixels runs ------------------------------------------

DECODE_ALONE, KERNELS_ALONE = "floor: libjpeg-turbo's decode alone", "floor: the decode, box, crop and resize alone"
FLOORS = (DECODE_ALONE, KERNELS_ALONE)


def floor_variants() -> dict[str, Variant | str]:
    """What every path that keeps today's pixels runs, and nothing else: libjpeg-turbo's exact decode
    at the scale PIL's `draft` picks (`libjpeg_decoded`, the frame's size read by `jpeg_header`, no
    EXIF read: a path may skip PIL's where no APP1 segment is), alone (then a batch made once); and
    that decode with RandomResizedCrop's box drawn, the crop copied and resized by torch's uint8
    antialiased kernel (`resized_crop`), collated. The new path's reading of the header and EXIF
    through PIL (`exif_orientation`) and its flip are left out. What the 0.5x target leaves to the rest of a path is the target less the second;
    or why they cannot run."""
    try:
        from prefect_ddp.tasks.data.dataset import train_transform  # noqa: PLC0415
        from prefect_ddp.tasks.data.decoding import draft_scale, jpeg_header, libjpeg_decoded  # noqa: PLC0415
        from prefect_ddp.tasks.data.loader_steps import collate_images, loader_steps, resized_crop  # noqa: PLC0415
    except ImportError as error:
        return dict.fromkeys(FLOORS, f"the new loader path is not in this checkout ({error})")
    steps = loader_steps(train_transform(SIDE))
    crop = steps.transforms[0]
    made = torch.zeros((BATCH, 3, SIDE, SIDE), dtype=torch.uint8)

    def decoded(data: bytes) -> torch.Tensor:
        header = jpeg_header(data)
        image = (libjpeg_decoded(data, header.size, draft_scale(header.size, steps.decode_side))
                 if header and header.size else None)
        if image is None:
            raise AssertionError("libjpeg-turbo refused one of the bench's own JPEGs")
        return image

    def decode_alone(datas: list[bytes], labels: list[int]) -> Batch:
        for data in datas:
            decoded(data)
        return made[:len(datas)], torch.tensor(labels)

    def kernels_alone(datas: list[bytes], labels: list[int]) -> Batch:
        return collate_images([(resized_crop(crop, decoded(data).unsqueeze(0))[0], label)
                               for data, label in zip(datas, labels)])
    return {DECODE_ALONE: decode_alone, KERNELS_ALONE: kernels_alone}


# --- torchvision's reference recipe -------------------------------------------------------------

# references/classification/presets.py, ClassificationPresetTrain(crop_size=224) as train.py builds
# it by default (backend "pil", use_v2 False): the PIL steps, then PILToTensor, ConvertImageDtype, Normalize.
REFERENCE_TRANSFORM = v1.Compose([
    v1.RandomResizedCrop(SIDE, interpolation=InterpolationMode.BILINEAR, antialias=True),
    v1.RandomHorizontalFlip(0.5),
    v1.PILToTensor(),
    v1.ConvertImageDtype(torch.float),
    v1.Normalize(mean=MEAN, std=STD),
])


def pil_loader(data: bytes) -> Image.Image:
    """torchvision.datasets.folder.pil_loader, from bytes rather than a path."""
    image = Image.open(BytesIO(data))
    return image.convert("RGB")


def reference(datas: list[bytes], labels: list[int]) -> Batch:
    return default_collate([(REFERENCE_TRANSFORM(pil_loader(data)), label) for data, label in zip(datas, labels)])


# --- LitData --------------------------------------------------------------------------------------

LITDATA_TRANSFORM = v2.Compose(crop_flip_normalise())


def litdata_variant() -> Variant | str:
    missing = install_beside("litdata", *LIBRARIES["litdata"])
    if missing:
        return missing
    from litdata.streaming.serializers import JPEGSerializer  # noqa: PLC0415 - bench.outside

    serializer = JPEGSerializer()

    def litdata(datas: list[bytes], labels: list[int]) -> Batch:
        return default_collate([(LITDATA_TRANSFORM(serializer.deserialize(data)), label)
                                for data, label in zip(datas, labels)])
    return litdata


# --- DALI -----------------------------------------------------------------------------------------

@contextlib.contextmanager
def stderr_to(path: str) -> Iterator[None]:
    """File descriptor 2 into `path`: DALI's libraries write to it from C."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as sink:
        os.dup2(sink.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def dali_variants() -> dict[str, Variant | str]:
    """DALI's CPU pipeline, plain and fused, or why they cannot run."""
    missing = install_beside("dali", *LIBRARIES["dali"])
    if missing:
        return {"dali": missing, "dali fused": missing}
    handle, log = tempfile.mkstemp(prefix="dali-", suffix=".log")
    os.close(handle)
    try:
        with stderr_to(log):
            variants = {"dali": dali_pipeline(fused=False), "dali fused": dali_pipeline(fused=True)}
    except Exception as error:  # noqa: BLE001 - any failure to load or build DALI is the row's verdict
        said = open(log).read().strip().splitlines()
        why = f"DALI could not run: {type(error).__name__}: {str(error).strip()[:300]}"
        return {"dali": why + (f" (it said: {said[-1][:200]})" if said else ""), "dali fused": why}
    said = open(log).read()
    if said.strip():
        print(f"DALI on loading (stderr, {len(said.splitlines())} lines): "
              + ("its GPU codecs (nvJPEG, nvJPEG2000, nvTIFF) are not found; it decodes on the CPU"
                 if "Failed to load nvjpeg library" in said else said.strip().splitlines()[-1][:200]))
    return variants


def dali_pipeline(fused: bool) -> Variant:
    import nvidia.dali.fn as fn  # noqa: PLC0415 - bench.outside
    import nvidia.dali.types as types  # noqa: PLC0415
    from nvidia.dali import pipeline_def  # noqa: PLC0415
    from nvidia.dali.plugin.pytorch import feed_ndarray  # noqa: PLC0415

    @pipeline_def(batch_size=BATCH, num_threads=1, device_id=None, seed=55, prefetch_queue_depth=1)
    def pipeline():  # noqa: ANN202
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
        if fused:  # DALI's ResNet-50 example's way: decode the crop's window, then resize it
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_area=[0.6, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
            images = fn.resize(images, size=[SIDE, SIDE])
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            images = fn.random_resized_crop(images, size=SIDE, random_area=[0.6, 1.0],
                                            random_aspect_ratio=[3 / 4, 4 / 3])
        return fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW",
                                        mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
                                        mirror=fn.random.coin_flip())

    pipe = pipeline()
    pipe.build()

    def dali(datas: list[bytes], labels: list[int]) -> Batch:
        pipe.feed_input("jpegs", [np.frombuffer(data, dtype=np.uint8) for data in datas])
        (out,) = pipe.run()
        images = torch.empty((len(datas), 3, SIDE, SIDE), dtype=torch.float32)
        feed_ndarray(out.as_tensor(), images)  # as its PyTorch iterators hand a batch over
        return images, torch.tensor(labels)
    return dali


# --- the run --------------------------------------------------------------------------------------

def make_sets(names: list[str], images: int | None, quick: bool) -> dict[str, list[bytes]]:
    sets: dict[str, list[bytes]] = {}
    originals: list[bytes] = []
    for name in names:
        count = images or SETS[name][2 if quick else 1]
        if name == "12MP":
            sets[name] = [photo(4032, 3024, 1000 + n) for n in range(count)]
            continue
        originals += [photo(500, 375, n) for n in range(len(originals), count)]
        if name == "500x375":
            sets[name] = originals[:count]
        else:
            sets[name] = [stored_resized(data, STORED_SIDE).data for data in originals[:count]]
    return sets


def batches(datas: list[bytes]) -> Iterator[tuple[list[bytes], list[int]]]:
    for start in range(0, len(datas), BATCH):
        chunk = datas[start:start + BATCH]
        yield chunk, [(start + n) % 10 for n in range(len(chunk))]


def run_set(variant: Variant, datas: list[bytes]) -> tuple[float, float]:
    """(ms of CPU, ms of wall time) per image for `variant` over `datas`, in batches of `BATCH`."""
    cpu, wall = time.process_time(), time.perf_counter()
    for chunk, labels in batches(datas):
        images, _ = variant(chunk, labels)
        if images.shape != (len(chunk), 3, SIDE, SIDE):
            raise AssertionError(f"a batch of shape {tuple(images.shape)}")
    return ((time.process_time() - cpu) / len(datas) * 1e3, (time.perf_counter() - wall) / len(datas) * 1e3)


@dataclass
class Measured:
    cpu_ms: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (variant, set) -> per round
    wall_ms: dict[tuple[str, str], list[float]] = field(default_factory=dict)


def rotated(items: list, by: int) -> list:
    by %= len(items)
    return items[by:] + items[:by]


def measure(variants: dict[str, Variant], sets: dict[str, list[bytes]], rounds: int) -> Measured:
    for name, variant in variants.items():  # one untimed batch each: DALI's buffers, first calls
        for datas in sets.values():
            variant(*next(batches(datas)))
    measured = Measured()
    for round_ in range(rounds):
        for set_name in rotated(list(sets), round_):
            for name in rotated(list(variants), round_):
                cpu, wall = run_set(variants[name], sets[set_name])
                measured.cpu_ms.setdefault((name, set_name), []).append(cpu)
                measured.wall_ms.setdefault((name, set_name), []).append(wall)
        print(f"round {round_ + 1}/{rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    return measured


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def ratio_to_today(measured: Measured, name: str, set_name: str) -> float:
    """The median of the per-round ratios of `name`'s cost to today's, on `set_name`."""
    return statistics.median(v / t for v, t in zip(measured.cpu_ms[(name, set_name)],
                                                   measured.cpu_ms[("today", set_name)]))


def table(measured: Measured, names: list[str], sets: list[str], off: dict[str, str]) -> list[str]:
    lines = ["| variant | " + " | ".join(f"{s}: ms/image (IQR) | x today" for s in sets) + " |",
             "|---|" + "---:|---:|" * len(sets)]
    for name in names:
        if name in off:
            lines.append(f"| {name} | " + " | ".join("off | " for _ in sets) + " |")
            continue
        cells = []
        for s in sets:
            values = measured.cpu_ms[(name, s)]
            q1, q3 = quartiles(values)
            cells.append(f"{statistics.median(values):.2f} ({q1:.2f}-{q3:.2f}) | {ratio_to_today(measured, name, s):.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def targets(measured: Measured, names: list[str], sets: list[str], off: dict[str, str]) -> list[str]:
    if "new" in off:
        return ["targets: not judged, the new path is off"]
    lines = []
    if "500x375" in sets:
        r = ratio_to_today(measured, "new", "500x375")
        lines.append(f"- new <= 0.5x today on 500x375: {r:.2f}x: {'held' if r <= 0.5 else 'NOT held'}")
        if not any(name in off for name in FLOORS):
            floors = [f"{name.removeprefix('floor: ')} {ratio_to_today(measured, name, '500x375'):.2f}x"
                      for name in FLOORS]
            lines.append(f"- what the kernels every path with today's pixels runs cost on 500x375: "
                         f"{', '.join(floors)} of today's whole path")
    peers = [n for n in names if n not in ("today", "new", "new, decoded as at 092522c", *FLOORS) and n not in off]
    for s in sets:
        mine = statistics.median(measured.cpu_ms[("new", s)])
        verdicts = [f"{p} {statistics.median(measured.cpu_ms[(p, s)]):.2f}"
                    + ("" if mine < statistics.median(measured.cpu_ms[(p, s)]) else " (NOT above)") for p in peers]
        held = all(mine < statistics.median(measured.cpu_ms[(p, s)]) for p in peers)
        lines.append(f"- new below every peer on {s}: new {mine:.2f} ms against {', '.join(verdicts)}: "
                     f"{'held' if held else 'NOT held'}")
    return lines


def pixel_check(new: Variant, datas: list[bytes], seed: int = 0) -> str:
    """Whether the new batch, as float/255 normalised, equals today's from the same seed on `datas`' first batch."""
    chunk, labels = next(batches(datas))
    torch.manual_seed(seed)
    want, want_labels = today(chunk, labels)
    torch.manual_seed(seed)
    got, got_labels = new(chunk, labels)
    if got.dtype != torch.uint8 or got.shape != want.shape:
        return f"not comparable: new gives {got.dtype} {tuple(got.shape)}, today {want.dtype} {tuple(want.shape)}"
    layout = "channels-last" if got.is_contiguous(memory_format=torch.channels_last) else "not channels-last"
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    normalised = (got.float() / 255 - mean) / std
    levels = (want * std + mean) * 255 - got.float()  # today's batch back in 0-255 levels, against the new
    same_labels = torch.equal(got_labels, want_labels)
    # the same through torchvision's own steps (ToDtype multiplies by 1/255: a float's last bit from /255)
    as_today = v2.functional.normalize(v2.functional.to_dtype(got, torch.float32, scale=True), MEAN, STD)
    tail = f"{len(chunk)} images, uint8 {layout}; labels {'equal' if same_labels else 'DIFFER'}"
    if torch.equal(normalised, want):
        return f"equal exactly ({tail})"
    if torch.equal(as_today, want):
        return (f"equal exactly through ToDtype(scale=True) and Normalize; .float()/255 normalised differs by at most "
                f"{(normalised - want).abs().max().item():.3g} (float rounding) ({tail})")
    return (f"max abs difference {(normalised - want).abs().max().item():.3g} normalised, "
            f"{levels.abs().max().item():.3g} of 255 levels ({int((levels.abs() > 0.5).sum())} of {levels.numel()} "
            f"values off by more than half a level) ({tail})")


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def versions() -> str:
    found = [f"torch {torch.__version__}", f"torchvision {torchvision.__version__}",
             f"Pillow {PIL.__version__} (libjpeg-turbo {features.version('libjpeg_turbo')})"]
    for module, label in (("simplejpeg", "simplejpeg"), ("nvidia.dali", "DALI"), ("litdata", "LitData")):
        if module in sys.modules:
            found.append(f"{label} {getattr(sys.modules[module], '__version__', '?')}")
    return ", ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--images", type=int, default=None, help="images per set (default 256, 256 and 32)")
    parser.add_argument("--sets", default=",".join(SETS), help=f"a comma-separated subset of {', '.join(SETS)}")
    parser.add_argument("--quick", action="store_true", help="a tiny run to check the code: 2 rounds, few images")
    args = parser.parse_args()
    names = [s for s in args.sets.split(",") if s]
    unknown = [s for s in names if s not in SETS]
    if unknown:
        parser.error(f"unknown set(s) {unknown}; choose from {list(SETS)}")
    rounds = 2 if args.quick else args.rounds
    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    with contextlib.suppress(ImportError):
        import cv2  # noqa: PLC0415 - only where a decoder brings it

        cv2.setNumThreads(1)
    load_before = os.getloadavg()

    started = time.perf_counter()
    sets = make_sets(names, args.images, args.quick)
    print(f"sets made in {time.perf_counter() - started:.0f} s: "
          + "; ".join(f"{n}: {len(d)} images, {sum(map(len, d)) / len(d) / 1e3:.0f} KB each" for n, d in sets.items()),
          flush=True)

    candidates: dict[str, Variant | str] = {"today": today, "new": new_variant(),
                                           "new, decoded as at 092522c": new_variant(first_decoder), "torchvision": reference,
                                           **dali_variants(), "litdata": litdata_variant(), **floor_variants()}
    off = {name: why for name, why in candidates.items() if isinstance(why, str)}
    variants = {name: v for name, v in candidates.items() if not isinstance(v, str)}
    for name, why in off.items():
        print(f"{name}: {why}", flush=True)

    pixels = {s: pixel_check(variants["new"], datas) for s, datas in sets.items()} if "new" in variants else {}
    measured = measure(variants, sets, rounds)
    load_after = os.getloadavg()

    print(f"\n`.venv/bin/python -m bench.train_path {' '.join(sys.argv[1:])}`".rstrip())
    print(f"\n{os.cpu_count()} cores ({cpu_model()}), torch CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {versions()}; Python {platform.python_version()}")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; {rounds} rounds, "
          + ", ".join(f"{s} {len(d)} images" for s, d in sets.items()))
    print(f"\nms of CPU per image, one core, batches of {BATCH}: median of {rounds} rounds (interquartile range), "
          "and the median of the per-round ratios to today's:\n")
    order = list(candidates)
    print("\n".join(table(measured, order, list(sets), off)))
    print("\nCPU time / wall time (median over sets and rounds; 1.00 = one core busy): "
          + ", ".join(f"{n} {statistics.median(c / w for s in sets for c, w in zip(measured.cpu_ms[(n, s)], measured.wall_ms[(n, s)])):.2f}"
                      for n in variants))
    print("\ntargets (issue 55):")
    print("\n".join(targets(measured, order, list(sets), off)))
    if pixels:
        print("\nthe new batch as float/255, normalised, against today's from the same seed (first batch of each set):")
        for s, verdict in pixels.items():
            print(f"- {s}: {verdict}")
    for name, why in off.items():
        print(f"\n{name} off: {why}")


if __name__ == "__main__":
    main()

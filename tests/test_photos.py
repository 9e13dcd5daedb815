"""Real photos: decoded no larger than the transform needs, upright as a person sees them, stored pre-resized in shards.

Unit tier: local folders, no services.
"""

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.preprocessing import IMAGENET_MEAN, IMAGENET_STD
from prefect_ddp.tasks.data.dataset import (
    S3ImageFolder,
    SizedTransform,
    decode_side,
    eval_transform,
    prepare,
    train_transform,
)
from prefect_ddp.tasks.data.byte_cache import ByteCache
from prefect_ddp.tasks.data.decoding import open_rgb, stored_resized
from prefect_ddp.tasks.data.device_batches import decode_on
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.shard_reader import read_samples
from prefect_ddp.tasks.data.shard_writer import (
    ShardFormat,
    shard_format,
    shards_markdown,
    write_shards,
)
from prefect_ddp.tasks.data.validation import decode_check
from prefect_ddp.tasks.prediction.scoring import fetch_images

pytestmark = pytest.mark.unit

WIDTH, HEIGHT = 48, 32
# The transposition that stores an upright image so that its EXIF tag turns it back (PIL's exif_transpose inverted).
STORED_AS = {1: None, 2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
             4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90,
             7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270}


def upright_photo() -> Image.Image:
    """Grey, landscape, with a red block in its top-left corner: where a sideways decode moves it."""
    pixels = np.full((HEIGHT, WIDTH, 3), 128, dtype=np.uint8)
    pixels[:10, :10] = (255, 0, 0)
    return Image.fromarray(pixels)


def stored_with_tag(tag: int) -> bytes:
    """The upright photo as a camera stores it with EXIF orientation `tag`."""
    stored = upright_photo() if STORED_AS[tag] is None else upright_photo().transpose(STORED_AS[tag])
    exif = Image.Exif()
    exif[0x0112] = tag
    buffer = io.BytesIO()
    stored.save(buffer, format="JPEG", quality=95, exif=exif.tobytes())
    return buffer.getvalue()


def red_top_left(image: torch.Tensor | Image.Image) -> bool:
    tensor = v2.functional.pil_to_tensor(image) if isinstance(image, Image.Image) else image
    corner = tensor[:, :4, :4].float().mean(dim=(1, 2))
    return bool(corner[0] > 200 and corner[1] < 60 and corner[2] < 60)


@pytest.mark.parametrize("tag", range(1, 9))
def test_every_decode_turns_a_tagged_photo_upright_the_same_way(tag, tmp_path):
    data = stored_with_tag(tag)
    (tmp_path / "photos" / "cat").mkdir(parents=True)
    (tmp_path / "photos" / "cat" / "1.jpg").write_bytes(data)
    as_tensor = SizedTransform([v2.PILToTensor()], decode_side=HEIGHT)

    decoded = open_rgb(data)
    assert decoded.size == (WIDTH, HEIGHT) and red_top_left(decoded)
    assert decode_check(data) == (WIDTH, HEIGHT)  # decode-check's sizes: the stored size, upright
    trained = S3ImageFolder(str(tmp_path / "photos"), ["cat/1.jpg"], [0], {}, as_tensor)[0][0]
    assert trained.shape == (3, HEIGHT, WIDTH) and red_top_left(trained)
    as_small = SizedTransform([v2.PILToTensor()], decode_side=16)
    for _ in ("kept", "read back"):  # the byte cache's resized copy: made from the fetch, then read from the cache
        cached = S3ImageFolder(str(tmp_path / "photos"), ["cat/1.jpg"], [0], {}, as_small, sizes=[len(data)],
                               cache=ByteCache(10**6, tmp_path / "cache"))[0][0]
        assert cached.shape == (3, 16, 24) and red_top_left(cached)
    on_device = decode_on(torch.device("cpu"), [torch.frombuffer(bytearray(data), dtype=torch.uint8)])[0]
    assert on_device.shape == (3, HEIGHT, WIDTH) and red_top_left(on_device)
    predicted, unreadable = fetch_images(DataLocation(url=str(tmp_path / "photos")), ["cat/1.jpg"], as_tensor, 30)
    assert not unreadable and predicted["cat/1.jpg"].shape == (3, HEIGHT, WIDTH)
    assert red_top_left(predicted["cat/1.jpg"])
    for side, stored_side in ((None, HEIGHT), (16, 16)):  # shards of the photo as stored, and resized
        member = shard_members(tmp_path / f"shards-{side}", tmp_path / "photos", ShardFormat(images_per_shard=2, side=side))
        from_shard = open_rgb(member)
        assert min(from_shard.size) == stored_side and from_shard.width > from_shard.height
        assert red_top_left(from_shard)


def shard_members(output: Path, photos: Path, fmt: ShardFormat) -> bytes:
    """The first image member of the one shard that `fmt` writes of `photos`."""
    manifest = folder_manifest(photos)
    index, _ = write_shards(manifest, range(len(manifest)), {}, str(output), {}, fmt, "split-digest")
    shard = next(output.rglob(index.shards[0])).read_bytes()
    return next(data for _, data, _ in read_samples(shard))


def folder_manifest(photos: Path) -> Manifest:
    """Every JPEG below `photos`, of one class (the manifest's own checks want two classes)."""
    paths = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.jpg"))
    return Manifest(root=str(photos), classes=["cat"], paths=paths, sizes=[(photos / p).stat().st_size for p in paths],
                    labels=[0] * len(paths))


def photo_jpeg(width: int, height: int) -> bytes:
    """A smooth photo-like JPEG (gradients, no noise): what DCT scaling keeps well."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.mark.parametrize("image_size", [64, 224])
def test_a_reduced_size_decode_gives_the_shapes_and_values_of_a_full_one(image_size):
    data = photo_jpeg(2400, 1800)
    side = decode_side(image_size)
    reduced = open_rgb(data, side)
    assert side <= min(reduced.size) < 1800 // 2  # decoded smaller, never below what the crop needs
    lowest = min((0 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    highest = max((1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    for make in (train_transform, eval_transform):  # random crops differ by draw: compare shapes and ranges
        transform = make(image_size)
        full, small = transform(open_rgb(data)), prepare(data, 0, 0, transform)[0]
        assert small.shape == full.shape == (3, image_size, image_size) and small.dtype == full.dtype
        assert lowest - 1e-5 <= small.min() and small.max() <= highest + 1e-5
    evaluated = eval_transform(image_size)  # deterministic: the same centre crop, within DCT scaling's error
    assert (prepare(data, 0, 0, evaluated)[0] - evaluated(open_rgb(data))).abs().mean() < 0.02


def test_the_byte_cache_keeps_a_photo_resized_to_the_side_its_transform_needs(tmp_path):
    photos, cache = tmp_path / "photos", tmp_path / "cache"
    (photos / "cat").mkdir(parents=True)
    originals = {"cat/big.jpg": photo_jpeg(2400, 1800), "cat/small.jpg": photo_jpeg(120, 90)}
    originals["cat/cut.jpg"] = originals["cat/big.jpg"][:5000]  # does not decode
    for key, data in originals.items():
        (photos / key).write_bytes(data)
    keys = list(originals)

    def dataset(transform):
        return S3ImageFolder(str(photos), keys, [0] * len(keys), {}, transform,
                             sizes=[len(originals[key]) for key in keys], cache=ByteCache(10**8, cache))

    big, small, cut = dataset(train_transform(64)).fetch([0, 1, 2])
    assert min(open_rgb(big).size) == decode_side(64) and open_rgb(big).size[0] > open_rgb(big).size[1]
    assert small == originals["cat/small.jpg"] and cut == originals["cat/cut.jpg"]  # not resized; unreadable as before
    kept = ByteCache(10**8, cache).bytes_on_disk()
    assert 0 < kept < len(small) + len(cut) + 20_000  # the big original is not kept, its copy is
    for key in keys:
        (photos / key).unlink()
    assert dataset(train_transform(64)).fetch([0, 1, 2]) == [big, small, cut]  # a later epoch or run: from the cache
    image, label = dataset(train_transform(64))[0]
    assert image.shape == (3, 64, 64) and label == 0
    assert dataset(eval_transform(224)).fetch([0]) == [None]  # another side is another entry: fetched, here gone
    assert dataset(None).fetch([1]) == [None]  # bytes for decoding on the device are the originals'


def test_a_cache_that_cannot_keep_copies_is_not_paid_for_every_epoch(tmp_path):
    photos = tmp_path / "photos"
    (photos / "cat").mkdir(parents=True)
    originals = [photo_jpeg(2400, 1800), photo_jpeg(2000, 1500)]
    for i, data in enumerate(originals):
        (photos / "cat" / f"{i}.jpg").write_bytes(data)
    full = ByteCache(100, tmp_path / "cache")  # room for no copy
    dataset = S3ImageFolder(str(photos), ["cat/0.jpg", "cat/1.jpg"], [0, 0], {}, train_transform(64),
                            sizes=[len(data) for data in originals], cache=full)
    first, second = dataset.fetch([0, 1])
    assert min(open_rgb(first).size) == decode_side(64)  # made, then found to be unkeepable
    assert second == originals[1]  # not made again: decoded at reduced size, as without the cache
    assert dataset[1][0].shape == (3, 64, 64)


def test_small_images_and_other_formats_decode_fully():
    small = photo_jpeg(300, 200)
    assert open_rgb(small, decode_side(224)).size == (300, 200)  # not twice the side: no reduction
    buffer = io.BytesIO()
    Image.open(io.BytesIO(photo_jpeg(1200, 900))).save(buffer, format="PNG")
    assert open_rgb(buffer.getvalue(), 96).size == (1200, 900)  # DCT scaling is a JPEG's only


def test_shards_store_photos_at_the_side_asked_and_a_new_format_writes_a_new_set(tmp_path):
    photos = tmp_path / "photos"
    for n in range(4):
        (photos / "cat").mkdir(parents=True, exist_ok=True)
        (photos / "cat" / f"{n}.jpg").write_bytes(photo_jpeg(1600, 1200))
    (photos / "cat" / "small.jpg").write_bytes(small := photo_jpeg(120, 90))
    manifest = folder_manifest(photos)

    def write(fmt: ShardFormat):
        return write_shards(manifest, range(len(manifest)), {}, str(tmp_path / "out"), {}, fmt, "split-digest")

    index, reused = write(ShardFormat(images_per_shard=8, side=100, quality=85))
    assert not reused and index.resized == 4 and index.side == 100
    assert index.source_bytes == sum(manifest.sizes) > 10 * sum(index.bytes) and index.decode_cpu_s > 0
    folder = next((tmp_path / "out").rglob("index.json")).parent
    with tarfile.open(folder / index.shards[0]) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if not m.name.endswith(".cls")}
    sides = sorted(min(Image.open(io.BytesIO(data)).size) for data in members.values())
    assert sides == [90, 100, 100, 100, 100]  # resized to the side; the small one as it was
    assert small in members.values() and sum(name.endswith(".jpg") for name in members) == 5
    assert write(ShardFormat(images_per_shard=8, side=100, quality=85)) == (index, True)  # unchanged: reused
    for other in (ShardFormat(images_per_shard=8, side=120, quality=85), ShardFormat(images_per_shard=8, side=100),
                  ShardFormat(images_per_shard=8)):
        assert write(other)[0].key != index.key  # another side, quality or none: a set of its own


def test_a_shard_changed_since_its_write_is_written_again_and_the_totals_survive_a_resume(tmp_path):
    photos = tmp_path / "photos"
    (photos / "cat").mkdir(parents=True)
    for n in range(6):
        (photos / "cat" / f"{n}.jpg").write_bytes(photo_jpeg(400, 300))
    manifest, fmt = folder_manifest(photos), ShardFormat(images_per_shard=2, side=100)

    def write():
        return write_shards(manifest, range(len(manifest)), {}, str(tmp_path / "out"), {}, fmt, "split-digest")

    index, _ = write()
    folder = next((tmp_path / "out").rglob("index.json")).parent
    (folder / "index.json").unlink()
    shard = folder / index.shards[1]
    shard.write_bytes(shard.read_bytes()[:1024])  # cut short by something else than the writer
    again, reused = write()
    assert not reused and again.bytes == index.bytes and shard.stat().st_size == index.bytes[1]
    assert (again.resized, again.source_bytes) == (index.resized, index.source_bytes) == (6, sum(manifest.sizes))
    assert "(6 of them, as JPEG)" in shards_markdown(again, False, str(folder))
    (folder / "index.json").unlink()
    for record, text in (("shard-000000.json", ""), ("shard-000002.json", '{"name": "shard-000002.tar"}')):
        (folder / record).write_text(text)  # cut short, or of another shape: its shard is written again
    rewritten, reused = write()
    assert not reused and (rewritten.bytes, rewritten.paths, rewritten.resized) == (index.bytes, index.paths, 6)


def test_the_shards_artifact_says_what_was_stored_and_costs_only_what_was_resized(tmp_path):
    photos = tmp_path / "photos"
    (photos / "cat").mkdir(parents=True)
    (photos / "cat" / "1.jpg").write_bytes(photo_jpeg(400, 300))
    manifest = folder_manifest(photos)
    as_stored, _ = write_shards(manifest, [0], {}, str(tmp_path / "out"), {}, ShardFormat(images_per_shard=2), "d")
    text = shards_markdown(as_stored, False, "s3://b/out/shards/k")
    assert "images stored as they are" in text and "CPU s" not in text
    resized, _ = write_shards(manifest, [0], {}, str(tmp_path / "out"), {}, ShardFormat(images_per_shard=2, side=100), "d")
    text = shards_markdown(resized, False, "s3://b/out/shards/k")
    assert "stored resized to it (1 of them, as JPEG)" in text and "ms per resized image" in text


def test_a_panorama_too_wide_for_a_jpeg_is_stored_as_it_is():
    buffer = io.BytesIO()
    Image.new("RGB", (140_000, 8), (9, 9, 9)).save(buffer, format="PNG")  # at side 4: 70,000 px wide
    stored = stored_resized(buffer.getvalue(), 4)
    assert stored.data == buffer.getvalue() and not stored.resized


def test_decode_check_sizes_a_tiff_whose_reader_turns_it_itself():
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.new("RGB", (50, 30)).save(buffer, format="TIFF", exif=exif.tobytes())
    assert decode_check(buffer.getvalue()) == open_rgb(buffer.getvalue()).size == (30, 50)


def test_shards_smaller_than_the_crop_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"training.shard_side=32 is below training.image_size=224.*0 to store"):
        TrainingConfig(image_size=224, shard_side=32)
    assert shard_format(TrainingConfig(image_size=224, images_per_shard=8)).side == 334
    assert shard_format(TrainingConfig(image_size=224, images_per_shard=8, shard_side=0)).side is None

"""uint8 batches: the loaders decode (libjpeg-turbo through simplejpeg, at the scale PIL's draft
picks), crop and flip on uint8; the rank converts and normalises. The pixels are today's, and the
loaders refuse what decode-check (`open_rgb`) refuses.

Unit tier (no processes) but for the last test, which runs a real loader process.
"""

import io
import platform
import random
import struct
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import InterpolationMode, v2

from prefect_ddp.tasks.data.dataset import (
    S3ImageFolder,
    blank_image,
    decoded,
    eval_transform,
    forked_workers,
    prepare,
    train_transform,
)
from prefect_ddp.tasks.data.decoding import decoded_tensor, draft_scale, jpeg_header, libjpeg_decoded, open_rgb
from prefect_ddp.tasks.data.device_batches import ToDevice, decode_on, pixel_chunks
from prefect_ddp.tasks.data.loader_steps import (collate_images, device_steps, loader_steps, native_uint8_bilinear, resized,
                                                 resized_crop)
from prefect_ddp.tasks.data.preprocessing import Preprocessing

CPU = torch.device("cpu")


def photo(width: int, height: int, seed: int, mode: str = "RGB", orientation: int = 1, xmp: bool = False,
          **save: object) -> bytes:
    """A photo-like JPEG (a ramp under grain, red top left) in `mode`, tagged with `orientation`
    in EXIF, or in XMP alone where `xmp`."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 200, width)[None, :, None] * np.linspace(0.3, 1, height)[:, None, None]
    pixels = (ramp + rng.integers(0, 56, (height, width, 3))).astype(np.uint8)
    pixels[: height // 4, : width // 4] = (255, 0, 0)
    image, buffer = Image.fromarray(pixels).convert(mode), io.BytesIO()
    if xmp:
        save["xmp"] = f'<x:xmpmeta><rdf:Description tiff:Orientation="{orientation}"/></x:xmpmeta>'.encode()
    elif orientation != 1:
        exif = image.getexif()
        exif[0x0112] = orientation
        save["exif"] = exif
    image.save(buffer, "JPEG", quality=90, **save)
    return buffer.getvalue()


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


# Every kind of image a bucket holds, each where the two decoders part ways: EXIF tags in both
# places, grey and CMYK, progressive, 4:4:4, a PNG, and one large enough for a reduced-size decode.
IMAGES = {
    **{f"exif {tag}": photo(120, 90, tag, orientation=tag) for tag in range(1, 9)},
    "xmp 6": photo(120, 90, 9, orientation=6, xmp=True),
    "grey": photo(120, 90, 10, mode="L"),
    "cmyk": photo(120, 90, 11, mode="CMYK"),
    "progressive": photo(120, 90, 12, progressive=True),
    "4:4:4": photo(120, 90, 13, subsampling=0),
    "png": png(120, 90),
    "reduced": photo(400, 300, 14),
    # Reduced-size decodes (at 1/2, 1/4 and 1/8 for the sides below) of every kind, odd sides rounded up.
    "reduced 4:4:4": photo(401, 299, 16, subsampling=0),
    "reduced 4:2:2": photo(403, 301, 17, subsampling=1),
    "reduced grey": photo(401, 303, 18, mode="L"),
    "reduced progressive": photo(402, 298, 19, progressive=True),
    "reduced exif 6": photo(400, 300, 20, orientation=6),
}
# Cut short and padded with zeros, no end marker: libjpeg warns, simplejpeg refuses, PIL (and so
# decode-check) decodes it, the missing rows grey. The loaders must decide as decode-check did.
_WHOLE = photo(120, 90, 15)
IMAGES["padded"] = _WHOLE[:len(_WHOLE) * 9 // 10] + bytes(4096)


def todays(data: bytes, transform: v2.Compose) -> torch.Tensor:
    """The image as the loaders made it before uint8 batches: `open_rgb`'s PIL image through the whole transform."""
    return transform(open_rgb(data, transform.decode_side))


@pytest.mark.unit
@pytest.mark.parametrize("name", IMAGES)
def test_decoded_tensor_has_open_rgbs_pixels(name):
    data = IMAGES[name]
    for side in (None, 32, 37, 64, 96):
        expected = torch.from_numpy(np.array(open_rgb(data, side))).permute(2, 0, 1)
        assert torch.equal(decoded_tensor(data, side), expected), (name, side)


@pytest.mark.unit
def test_an_image_past_pils_decompression_bomb_limit_is_refused_as_open_rgb_refuses_it(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 120 * 90 // 3)  # the photo is past twice the limit
    with pytest.raises(Image.DecompressionBombError):
        open_rgb(IMAGES["exif 1"])
    with pytest.raises(Image.DecompressionBombError):
        decoded_tensor(IMAGES["exif 1"])


@pytest.mark.unit
def test_which_decoder_takes_an_image_is_read_from_its_header():
    assert jpeg_header(IMAGES["exif 1"]) == (((120, 90), 3, False, False))
    assert jpeg_header(IMAGES["exif 6"]).app1 and jpeg_header(IMAGES["xmp 6"]).app1
    assert jpeg_header(IMAGES["grey"]).components == 1 and jpeg_header(IMAGES["cmyk"]).components == 4
    assert jpeg_header(IMAGES["progressive"]).size == (120, 90)
    assert jpeg_header(IMAGES["png"]) is None and jpeg_header(b"\xff\xd8\xff") is None
    assert jpeg_header(b"\xff\xd8\xff\xff" + IMAGES["exif 1"][3:]) is None  # fill bytes: left to PIL


def segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def after_start(data: bytes, segments: bytes, drop_jfif: bool = False) -> bytes:
    """`data` with `segments` right after its start-of-image marker (its own JFIF segment dropped first)."""
    if drop_jfif:
        data = data[:2] + data[4 + (data[4] << 8 | data[5]):]
    return data[:2] + segments + data[2:]


# Headers libjpeg passes over and PIL refuses (opening them, or turning the image by EXIF it cannot
# read or rewrite): decode-check (open_rgb) refuses them, so the loaders must too.
JFIF_72_DPI = b"JFIF\0\1\1\1\0\x48\0\x48\0\0"
REFUSED = {
    "jfif cut short": after_start(IMAGES["exif 1"], segment(0xE0, b"JFIF\0"), drop_jfif=True),
    "adobe cut short": after_start(IMAGES["exif 1"], segment(0xEE, b"Adobe")),
    "icc empty": after_start(IMAGES["exif 1"], segment(0xE2, b"ICC_PROFILE\0")),
    "exif not tiff": after_start(IMAGES["reduced"], segment(0xE0, JFIF_72_DPI) + segment(0xE1, b"Exif\0\0garbage!"),
                                 drop_jfif=True),
}
# The JFIF cut short with "PCD_" at byte 2048 (in a comment): PIL's JPEG reader refuses it and its
# PhotoCD reader, which looks only there, takes it; cut short as a PhotoCD, open_rgb refuses it.
REFUSED["read as photocd"] = after_start(  # the comment's text starts at byte 2 + 9 + 4
    IMAGES["exif 1"], segment(0xE0, b"JFIF\0") + segment(0xFE, b"x" * (2048 - 15) + b"PCD_"), drop_jfif=True)


def damaged_exif(seed: int) -> bytes:
    """A 64x48 JPEG turned by EXIF (orientation 6, with Exif and GPS sub-IFDs), 1-3 of its EXIF bytes changed."""
    rng = random.Random(seed)
    image = Image.fromarray(np.random.default_rng(7).integers(0, 255, (48, 64, 3), dtype=np.uint8))
    exif = image.getexif()
    exif[0x0112], exif[0x010F], exif[0x011A] = 6, "Maker", 72.0
    exif.get_ifd(0x8769)[0x927C] = b"notes\0\1\2"
    exif.get_ifd(0x8825)[2] = (1.0, 2.0, 3.0)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", exif=exif, dpi=(72, 72))
    data = bytearray(buffer.getvalue())
    start = data.find(b"Exif\0\0") + 6
    length = (data[start - 8] << 8 | data[start - 7]) - 8
    for _ in range(rng.choice((1, 2, 3))):
        at = start + rng.randrange(length)
        data[at] = rng.choice((0, 0xFF, rng.randrange(256), data[at] ^ (1 << rng.randrange(8))))
    return bytes(data)


def outcome(decode: Callable[[], object]) -> object:
    """What `decode` gives: its pixels, or the kind of error it raised."""
    try:
        result = decode()
    except Exception as error:  # noqa: BLE001 - the kind is the outcome compared
        return type(error)
    return torch.from_numpy(np.array(result)).permute(2, 0, 1) if isinstance(result, Image.Image) else result


@pytest.mark.unit
@pytest.mark.parametrize("name", REFUSED)
def test_a_jpeg_pil_refuses_for_its_header_is_refused_by_the_loaders_and_the_device_path(name):
    data = REFUSED[name]
    for side in (None, 32):
        with pytest.raises(Exception) as refused:
            open_rgb(data, side)
        with pytest.raises(refused.type):
            decoded_tensor(data, side)
        assert decoded(data, side) is None
    assert decode_on(CPU, [torch.frombuffer(bytearray(data), dtype=torch.uint8)]) == [None]


@pytest.mark.unit
def test_a_jpeg_pil_reads_as_another_format_is_decoded_as_open_rgb_decodes_it():
    whole_photocd = REFUSED["read as photocd"] + bytes(800_000)  # long enough for PhotoCD's 768x512
    expected = torch.from_numpy(np.array(open_rgb(whole_photocd))).permute(2, 0, 1)
    assert sorted(expected.shape[1:]) == [512, 768] and torch.equal(decoded_tensor(whole_photocd), expected)


def lossless_jpeg(pixels: np.ndarray) -> bytes:
    """`pixels` (HxWx3 uint8) as a lossless JPEG (SOF3, predictor 1: each sample from its left
    neighbour, the first column from the one above), hand-encoded: PIL writes no lossless JPEGs."""
    height, width, channels = pixels.shape
    bits: list[int] = []
    for y in range(height):
        for x in range(width):
            for c in range(channels):
                predicted = 128 if x == y == 0 else pixels[y - 1, x, c] if x == 0 else pixels[y, x - 1, c]
                difference = int(pixels[y, x, c]) - int(predicted)
                category = abs(difference).bit_length()
                bits += [(category >> i) & 1 for i in range(4, -1, -1)]  # 17 symbols, each a 5-bit code
                value = difference if difference > 0 else difference - 1 + (1 << category)
                bits += [(value >> i) & 1 for i in range(category - 1, -1, -1)]
    bits += [1] * (-len(bits) % 8)
    scan = bytearray()
    for at in range(0, len(bits), 8):
        scan.append(int("".join(map(str, bits[at:at + 8])), 2))
        scan += b"\0" if scan[-1] == 0xFF else b""  # a data byte 0xFF is stuffed
    table = bytes([0, 0, 0, 0, 0, 17] + [0] * 11) + bytes(range(17))  # DC table 0: 17 codes of 5 bits
    frame = bytes([8]) + struct.pack(">HH", height, width) + bytes([channels])
    frame += b"".join(bytes([c + 1, 0x11, 0]) for c in range(channels))
    scan_header = bytes([channels]) + b"".join(bytes([c + 1, 0]) for c in range(channels)) + bytes([1, 0, 0])
    return (b"\xff\xd8" + segment(0xC4, table) + segment(0xC3, frame) + segment(0xDA, scan_header) + bytes(scan)
            + b"\xff\xd9")


@pytest.mark.unit
def test_a_lossless_jpeg_is_left_to_open_rgb():
    """libjpeg-turbo 3.1.2 (simplejpeg's) wrote a lossless JPEG decoded at a reduced scale past its
    buffer: wrong pixels, then the process aborted (found by review). open_rgb decides instead."""
    data = lossless_jpeg(np.random.default_rng(0).integers(0, 256, (97, 130, 3), dtype=np.uint8))
    assert jpeg_header(data) == ((130, 97), 3, False, True)  # its size still counts (device_batches.pixel_chunks)
    for side in (None, 4, 30, 60):  # whole, then at 1/8, 1/2 and 1/2 for PIL's draft
        expected = outcome(lambda: open_rgb(data, side))
        got = outcome(lambda: decoded_tensor(data, side))
        assert got is expected if isinstance(expected, type) else torch.equal(got, expected), side


@pytest.mark.unit
def test_a_stuffed_zero_in_the_header_leaves_a_hidden_lossless_frame_to_pil():
    """FF 00 read as a segment landed on a baseline frame inside a comment that libjpeg and PIL read
    past, and skipped the real lossless frame: the JPEG went to libjpeg through simplejpeg, which at
    a reduced scale writes past its buffer on a lossless frame (found by review)."""
    pixels = np.random.default_rng(2).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    lossless = lossless_jpeg(pixels)
    baseline = segment(0xC0, bytes([8]) + struct.pack(">HH", 48, 64) + bytes([3, 1, 0x11, 0, 2, 0x11, 0, 3, 0x11, 0]))
    # To jpeg_header: a segment "FF 00" of 10 bytes, the baseline frame, then a comment over the real
    # segments up to the scan. To libjpeg and PIL: the FF 00 passed over, then a comment over the baseline frame.
    data = (b"\xff\xd8" + b"\xff\x00\x00\x0a" + b"\xff\xfe" + struct.pack(">H", 29) + b"abcd" + baseline
            + b"\xff\xfe" + struct.pack(">H", 2 + lossless.index(b"\xff\xda") - 2) + lossless[2:])
    assert jpeg_header(data) is None
    for side in (None, 8, 24):
        expected = outcome(lambda: open_rgb(data, side))
        got = outcome(lambda: decoded_tensor(data, side))
        assert got is expected if isinstance(expected, type) else torch.equal(got, expected), side


@pytest.mark.unit
def test_a_lossless_jpegs_pixels_count_in_the_devices_decode_chunks():
    """Counted as no pixels, any number of lossless camera frames joined one chunk, held whole at full
    size on the device at once (device_batches.DECODE_PIXELS)."""
    pixels = np.random.default_rng(1).integers(0, 256, (60, 80, 3), dtype=np.uint8)
    data = torch.frombuffer(bytearray(lossless_jpeg(pixels)), dtype=torch.uint8)
    assert [len(chunk) for chunk in pixel_chunks([data] * 4, pixels=2 * 60 * 80)] == [2, 2]
    decoded = decode_on(torch.device("cpu"), [data])[0]  # whichever decoder takes it, open_rgb's pixels
    assert torch.equal(decoded, torch.from_numpy(np.array(open_rgb(lossless_jpeg(pixels)))).permute(2, 0, 1))


@pytest.mark.unit
def test_a_marker_that_stands_alone_in_the_header_leaves_the_size_to_pil():
    """A restart marker (no length of its own) before a comment: read as a segment, its next bytes
    were a length that jumped into a later comment holding a smaller frame, and the image decoded
    at that frame's size (found by review). libjpeg and PIL pass over such a marker."""
    whole = photo(800, 600, 21)
    jump = 0xFFFE  # what the comment's marker bytes, FF FE, read as a length
    fake = bytes([0xFF, 0xC0, 0, 17, 8]) + struct.pack(">HH", 75, 100) + bytes([3, 1, 0x22, 0, 2, 0x11, 1, 3, 0x11, 1])
    padding = segment(0xFE, b"x" * (2 + 2 + jump - 4 - 4 - 4))  # the fake frame lands where the jump does
    data = whole[:2] + b"\xff\xd0" + padding + segment(0xFE, fake) + whole[2:]
    assert jpeg_header(data) is None
    for side in (None, 96, 334):
        expected = torch.from_numpy(np.array(open_rgb(data, side))).permute(2, 0, 1)
        assert torch.equal(decoded_tensor(data, side), expected), side


@pytest.mark.unit
def test_jpegs_with_damaged_exif_decode_or_fail_as_open_rgb_does():
    refused = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PIL's "Corrupt EXIF data"
        for seed in range(200):
            data = damaged_exif(seed)
            for side in (None, 8):
                expected = outcome(lambda: open_rgb(data, side))
                got = outcome(lambda: decoded_tensor(data, side))
                assert (torch.equal(got, expected) if isinstance(expected, torch.Tensor) else got is expected), (seed, side)
                refused += not isinstance(expected, torch.Tensor)
    assert refused  # some of the damage is what PIL refuses: the case the test is for


@pytest.mark.unit
def test_libjpeg_takes_every_colour_and_grey_jpeg_at_the_scale_pil_picks_and_leaves_the_rest_to_pil():
    for name in [name for name in IMAGES if name not in ("cmyk", "png", "padded")]:
        size = jpeg_header(IMAGES[name]).size
        for side in (None, 32, 64, 96):
            scale = draft_scale(size, side)
            image = libjpeg_decoded(IMAGES[name], size, scale)
            assert image is not None and image.shape == (3, -(-size[1] // scale), -(-size[0] // scale)), (name, side)
    assert {draft_scale((400, 300), side) for side in (None, 32, 64, 96, 200)} == {1, 2, 4, 8}
    assert libjpeg_decoded(IMAGES["padded"], (120, 90), 1) is None  # libjpeg's warning: open_rgb decides


@pytest.mark.unit
@pytest.mark.parametrize("trivial_augment", [False, True])
@pytest.mark.parametrize("make", [train_transform, eval_transform], ids=["train", "eval"])
def test_a_uint8_batch_finished_on_the_device_is_todays_batch(make, trivial_augment):
    transform = (train_transform(48, Preprocessing(), trivial_augment=True) if trivial_augment and make is train_transform
                 else make(48))
    torch.manual_seed(0)
    expected = torch.stack([todays(data, transform) for data in IMAGES.values()])
    torch.manual_seed(0)  # the same draws: the loader's steps draw as the whole transform does
    steps = loader_steps(transform)
    images, labels = collate_images([prepare(data, 7, at, steps) for at, data in enumerate(IMAGES.values())])
    assert images.dtype == torch.uint8 and images.is_contiguous(memory_format=torch.channels_last)
    finished, moved_labels = ToDevice(CPU, channels_last=True, transform=transform)(images, labels)
    assert torch.equal(finished, expected)  # exactly: same decode, crop, resize, flip and normalisation
    assert finished.is_contiguous(memory_format=torch.channels_last) and moved_labels.tolist() == [7] * len(IMAGES)


@pytest.mark.unit
def test_random_erasing_runs_on_the_device_on_the_normalised_batch():
    transform = train_transform(32, random_erasing=1.0)
    assert [type(step).__name__ for step in device_steps(transform)] == ["ToDtype", "Normalize", "RandomErasing"]
    images, labels = collate_images([prepare(IMAGES["exif 1"], 0, 0, loader_steps(transform))] * 4)
    finished, _ = ToDevice(CPU, transform=transform)(images, labels)
    unerased = v2.Compose(device_steps(transform)[:2])(images)
    erased = (finished != unerased).any(dim=1)  # each image has a box of its own, set to 0
    assert all(erased[i].any() for i in range(4)) and (finished[~erased.unsqueeze(1).expand_as(finished)] ==
                                                       unerased[~erased.unsqueeze(1).expand_as(unerased)]).all()
    assert not all(torch.equal(erased[0], erased[i]) for i in range(1, 4))


@pytest.mark.unit
def test_stand_ins_and_other_transforms_keep_their_inputs():
    steps = loader_steps(eval_transform(32))
    blank = blank_image(steps)  # the stand-in for a batch of unreadable images: uint8, as its batch
    assert blank.dtype == torch.uint8 and blank.shape == (3, 32, 32) and not blank.any()
    as_pil = v2.Compose([v2.PILToTensor()])  # not the project's transform: given the PIL image it was written for
    assert isinstance(blank_image(lambda image: image), Image.Image)
    image, label = prepare(IMAGES["exif 6"], 3, 0, as_pil)
    assert image.shape == (3, 120, 90) and label == 3


@pytest.mark.unit
def test_finishing_refuses_a_batch_it_cannot_finish():
    finished = torch.zeros(2, 3, 16, 16)
    with pytest.raises(TypeError, match="float32 images with a transform"):
        ToDevice(CPU, transform=eval_transform(16))(finished, torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="uint8 images without a transform"):
        ToDevice(CPU)(finished.to(torch.uint8), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="must come last"):
        loader_steps(type(eval_transform(16))([v2.ToDtype(torch.float32, scale=True), v2.CenterCrop(8)], 8))


def test_a_loader_process_hands_over_uint8_batches_in_shared_memory(tmp_path):
    folder = tmp_path / "images"
    (folder / "a").mkdir(parents=True)
    for name, data in IMAGES.items():
        (folder / "a" / f"{name}.jpg").write_bytes(data)
    keys = [f"a/{name}.jpg" for name in IMAGES]
    transform = eval_transform(32)
    dataset = S3ImageFolder(str(folder), keys, [0] * len(keys), {}, loader_steps(transform))
    loader = DataLoader(dataset, batch_size=len(keys), num_workers=1, collate_fn=collate_images, **forked_workers())
    images, labels = next(iter(loader))
    assert images.dtype == torch.uint8 and images.is_contiguous(memory_format=torch.channels_last)
    finished, _ = ToDevice(CPU, transform=transform)(images, labels)
    assert torch.equal(finished, torch.stack([todays(data, transform) for data in IMAGES.values()]))


# (height, width) of a decoded image, the crop's size and its area's share: boxes that downscale and
# upscale, that span the whole width (a view that is channels-last already), the whole image, thin ones.
CROPS = [(375, 500, 224, (0.6, 1.0)), (445, 334, 224, (0.6, 1.0)), (90, 120, 224, (0.6, 1.0)),
         (224, 224, 224, (1.0, 1.0)), (7, 1, 3, (0.08, 1.0)), (2000, 31, (64, 48), (0.08, 1.0))]


def loader_crops(interpolation, antialias) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(torchvision's RandomResizedCrop, the loaders' `resized_crop`) of each of CROPS' images, on the same seeds."""
    generator = torch.Generator().manual_seed(0)
    pairs = []
    for height, width, size, scale in CROPS:
        step = v2.RandomResizedCrop(size, scale=scale, interpolation=interpolation, antialias=antialias)
        # As LoaderSteps has it: a decoder's CHW view of HWC memory, made a batch of one by unsqueeze.
        decoded = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator).permute(2, 0, 1)
        for seed in range(20):
            torch.manual_seed(seed)
            expected = step(decoded.unsqueeze(0))
            torch.manual_seed(seed)
            pairs.append((expected, resized_crop(step, decoded.unsqueeze(0))))
    return pairs


@pytest.mark.unit
@pytest.mark.parametrize("interpolation", [InterpolationMode.BILINEAR, "bilinear", InterpolationMode.BICUBIC])
@pytest.mark.parametrize("antialias", [True, False])
def test_the_loaders_crop_and_resize_give_torchvisions_pixels_channels_last(interpolation, antialias):
    for expected, got in loader_crops(interpolation, antialias):
        assert torch.equal(got, expected) and got.is_contiguous(memory_format=torch.channels_last)
        copy = got.clone(memory_format=torch.channels_last)  # `resized` as resized_crop calls it, on one copy
        through = v2.functional.resize(copy, [9, 7], interpolation, antialias=antialias)
        assert torch.equal(resized(copy, [9, 7], interpolation, antialias), through)


@pytest.mark.unit
def test_where_torchvision_resizes_uint8_in_float_so_do_the_loaders(monkeypatch):
    """On a CPU without AVX2 (or ATEN_CPU_CAPABILITY=default) torchvision resizes uint8 in float and
    rounds: pixels one level off torch's uint8 kernel, which the loaders then must not call."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    native_uint8_bilinear.cache_clear()
    try:
        pairs = loader_crops(InterpolationMode.BILINEAR, True)
    finally:
        native_uint8_bilinear.cache_clear()
    assert all(torch.equal(got, expected) for expected, got in pairs)


@pytest.mark.unit
@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
                    and platform.machine() not in ("aarch64", "arm64"),
                    reason="torchvision resizes uint8 in float on this CPU: the loaders' shortcut is off by design")
def test_on_a_cpu_torchvision_resizes_uint8_on_the_loaders_take_the_shortcut():
    """Where torchvision's own check is gone (a release renamed it), the loaders would silently lose
    their resize shortcut: every pixel test would still pass."""
    native_uint8_bilinear.cache_clear()
    assert native_uint8_bilinear()

"""Decoding an image the one way every CPU path does: upright, 8-bit RGB, no larger than needed.

Training, validation, decode-check, batch-predict, shard writing and the byte cache all
decode through `open_rgb` (docs/architecture.md, "Data: pre-resized shards"), so an image
turns out the same wherever it is read. The loaders take it as a tensor (`decoded_tensor`):
the same pixels, a colour or grey JPEG decoded straight into one by libjpeg-turbo's own API
(simplejpeg), at the scale PIL's `draft` would pick (docs/architecture.md, "Data: uint8 batches"). `stored_resized` is the copy of an image that shards
and the byte cache keep in place of a camera original: resized to the side training needs and
stored as a JPEG, so that later epochs decode a small image instead of the original.
"""

from __future__ import annotations

import io
import time
from typing import NamedTuple

import numpy as np
import simplejpeg
import torch
from PIL import ExifTags, Image, ImageOps

JPEG_MAX_SIDE = 65500  # libjpeg's largest width or height
RESIZED_QUALITY = 90  # of the JPEGs resized copies are stored as, unless told (training.shard_quality)


def open_rgb(data: bytes, side: int | None = None) -> Image.Image:
    """Decode an image fully (verify() alone misses truncated JPEGs) into 8-bit RGB, upright.

    `side`: the shorter side the caller needs (`decode_side`). A JPEG at least twice as
    large is decoded in libjpeg's reduced-size mode (DCT scaling by 1/2, 1/4 or 1/8, PIL's
    `draft`) to the smallest scale whose sides both stay at least `side`: a 12-MP photo
    for a 224-px crop decodes at 1/8 in about a third of the time. libjpeg still reads
    every byte, so a truncated file fails as in a full decode. Other formats decode fully.

    Upright: the EXIF orientation tag that phone cameras set on sideways-stored photos is
    applied (PIL's `exif_transpose`), so a portrait photo trains as any viewer shows it.

    Buckets mix modes: grayscale (L), RGBA, CMYK and palette (P) convert as torchvision's
    ImageFolder does. 16-bit grayscale (I;16, from PNG or TIFF) is scaled to its high
    byte first: PIL's convert("RGB") clips it, turning everything above 255 of 65535 white.

    >>> buffer = io.BytesIO()
    >>> Image.fromarray(np.array([[0, 32768, 65535]], dtype=np.uint16)).save(buffer, "PNG")
    >>> open_rgb(buffer.getvalue()).getpixel((1, 0))
    (128, 128, 128)
    """
    return decode_upright(data, side)[0]


def decode_upright(data: bytes, side: int | None) -> tuple[Image.Image, tuple[int, int]]:
    """`open_rgb`'s image, with the (width, height) of the whole stored image as it is turned upright."""
    with Image.open(io.BytesIO(data)) as image:
        stored = image.size
        if side:
            image.draft("RGB", (side, side))
        image.load()
        loaded = image.size
        ImageOps.exif_transpose(image, in_place=True)  # (a TIFF's reader turns it on load: nothing left here)
        size = (stored[1], stored[0]) if image.size != loaded else stored
        if image.mode.startswith("I;16"):
            return Image.fromarray((np.asarray(image) >> 8).astype(np.uint8)).convert("RGB"), size
        return image.convert("RGB"), size


class JpegHeader(NamedTuple):
    """What a JPEG's segments before its image data say: its frame (None where no frame came
    before the data), whether an APP1 segment (EXIF or XMP, where an orientation tag lives) did,
    and whether the frame is lossless (LOSSLESS_FRAME: PIL decodes it, not libjpeg through simplejpeg)."""

    size: tuple[int, int] | None  # (width, height) as stored
    components: int
    app1: bool
    lossless: bool = False


JPEG_MAGIC = b"\xff\xd8\xff"  # the start-of-image marker and the first segment's marker byte
APP1, START_OF_SCAN = 0xE1, 0xDA
# Start-of-frame markers: every SOFn but DHT (C4), JPG (C8) and DAC (CC), which share the range.
START_OF_FRAME = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Lossless frames (SOF3, 7, 11, 15): libjpeg-turbo before 3.1.4 (simplejpeg's is 3.1.2) ignores the
# scale asked for one and writes the whole image into a buffer sized for the scaled one, which
# corrupted the heap of the process decoding it (found by review). PIL decodes those.
LOSSLESS_FRAME = frozenset({0xC3, 0xC7, 0xCB, 0xCF})
# Markers that stand alone, with no length after them (TEM, RST0-7, SOI, EOI): libjpeg and PIL pass
# over them in a header; read as a segment, the next marker's bytes would be taken for a length.
STANDALONE = frozenset({0x01, *range(0xD0, 0xDA)})


def jpeg_header(data: bytes | memoryview) -> JpegHeader | None:
    """The header of a JPEG read from its segments' lengths alone, without a decoder (a few us);
    None where the data is not a JPEG or its header is not a plain run of segments. A lossless
    frame is said (`lossless`): its size counts what decoding it holds, though PIL decodes it.

    >>> buffer = io.BytesIO()
    >>> Image.new("RGB", (40, 30)).save(buffer, "JPEG")
    >>> jpeg_header(buffer.getvalue())
    JpegHeader(size=(40, 30), components=3, app1=False, lossless=False)
    """
    if data[:3] != JPEG_MAGIC:
        return None
    size, components, app1, lossless, at = None, 0, False, False, 2  # past the start-of-image marker (FF D8)
    while at + 4 <= len(data) and data[at] == 0xFF:
        marker = data[at + 1]
        if marker == START_OF_SCAN:
            return JpegHeader(size, components, app1, lossless)
        length = data[at + 2] << 8 | data[at + 3]  # the segment's length, which counts itself
        if marker in (0x00, 0xFF) or marker in STANDALONE or length < 2:
            # Fill bytes, a stuffed zero or a marker alone: not a plain run. libjpeg and PIL pass over
            # them; read as a segment, the next bytes would be a length that lands elsewhere than theirs.
            return None
        if marker in START_OF_FRAME and at + 10 <= len(data):
            size = (data[at + 7] << 8 | data[at + 8], data[at + 5] << 8 | data[at + 6])
            components = data[at + 9]
            lossless |= marker in LOSSLESS_FRAME
        app1 |= marker == APP1
        at += 2 + length
    return None


def draft_scale(size: tuple[int, int], side: int | None) -> int:
    """The reduction PIL's `draft` picks for an image of `size` (width, height) decoded for `side`
    (`open_rgb`): the largest of 8, 4 and 2 that keeps both sides at least `side`, else 1.

    >>> draft_scale((4032, 3024), 334), draft_scale((500, 375), 334), draft_scale((500, 375), 96)
    (8, 1, 2)
    """
    most = min(size[0] // side, size[1] // side) if side else 1
    return next((scale for scale in (8, 4, 2) if most >= scale), 1)


def decoded_tensor(data: bytes, side: int | None = None) -> torch.Tensor:
    """`open_rgb`'s pixels as a uint8 CHW tensor (a view of HWC memory, as both decoders write it).

    A colour or grey JPEG is decoded by libjpeg-turbo through its own API (simplejpeg) straight
    into the tensor, at the scale PIL's `draft` picks (`draft_scale`), its EXIF orientation
    applied: the same libjpeg-turbo decode with the same settings (the slow exact DCT, smooth
    upsampling), without PIL's four bytes a pixel and the copy to a tensor (bench/RESULTS.md,
    "The train path per image"; tests/test_uint8_batches.py compares every kind of JPEG). Others
    (CMYK, PNG, 16-bit, one past PIL's decompression-bomb limit) go through `open_rgb`, and so
    does a JPEG libjpeg complains of (its data cut short and padded, which PIL passes over):
    `open_rgb`, decode-check's decoder, decides whether it decodes, so training and decode-check
    agree. Raises as `open_rgb` does.

    >>> buffer = io.BytesIO()
    >>> Image.new("RGB", (40, 30), (255, 0, 0)).save(buffer, "JPEG")
    >>> image = decoded_tensor(buffer.getvalue())
    >>> tuple(image.shape), image.dtype, bool(torch.equal(image, torch.from_numpy(np.array(open_rgb(buffer.getvalue()))).permute(2, 0, 1)))
    ((3, 30, 40), torch.uint8, True)
    """
    header = jpeg_header(data)
    if (header and header.size and not header.lossless and header.components in (1, 3)
            and within_pil_limit(header.size)):
        tag = exif_orientation(data)  # raising where open_rgb would, pixels aside; None: not a JPEG to PIL
        image = None if tag is None else libjpeg_decoded(data, header.size, draft_scale(header.size, side))
        if tag is not None and image is not None:
            return upright(image, tag)
    return torch.from_numpy(np.array(open_rgb(data, side))).permute(2, 0, 1)


def libjpeg_decoded(data: bytes, size: tuple[int, int], scale: int) -> torch.Tensor | None:
    """A JPEG of `size` (width, height) decoded at 1/`scale` to RGB as a CHW view of HWC memory;
    None where libjpeg complains (simplejpeg raises its warnings too) or picks another scale
    (libjpeg-turbo scales by any n/8: the smallest that keeps the sides asked for, here no
    smaller than 1/`scale`), so that `open_rgb` decides."""
    width, height = -(-size[0] // scale), -(-size[1] // scale)  # libjpeg rounds a scaled side up
    try:
        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_height=height, min_width=width,
                                        min_factor=scale)
    except ValueError:
        return None
    if pixels.shape != (height, width, 3):
        return None
    return torch.from_numpy(pixels).permute(2, 0, 1)


def within_pil_limit(size: tuple[int, int]) -> bool:
    """Whether an image of `size` is within PIL's decompression-bomb limit (`Image.MAX_IMAGE_PIXELS`):
    one beyond it goes to `open_rgb`, which refuses it as decode-check does."""
    return Image.MAX_IMAGE_PIXELS is None or size[0] * size[1] <= Image.MAX_IMAGE_PIXELS


# What PIL names an image its JPEG readers opened (MPO: a camera's multi-picture JPEG).
PIL_JPEG_FORMATS = frozenset({"JPEG", "MPO"})


def exif_orientation(data: bytes) -> int | None:
    """The orientation tag `open_rgb` turns a JPEG by (1: upright), read by PIL from its header
    alone (about 35 us an image here, 70-115 with EXIF), in EXIF or XMP (torchvision's own reading
    skips XMP): an int in any well-formed file; a malformed one may hold another type, which
    `upright` turns by only where it equals 2-8, as `exif_transpose` does. None where PIL reads
    the data as something other than a JPEG (its JPEG reader refused the header and another
    reader, PhotoCD's, took it): then `open_rgb` must decide.

    Raises where `open_rgb` raises whatever the pixels: at a header PIL cannot parse (a JFIF,
    Adobe or ICC segment cut short, which libjpeg passes over), and where `exif_transpose` cannot
    read the EXIF or, once it has turned the image, rewrite it without the tag: its steps but the
    turn, on the image as PIL opened it (whose own reading at opening may already have passed
    over bad EXIF). So a decoder other than PIL's refuses what decode-check refuses
    (tests/test_uint8_batches.py)."""
    with Image.open(io.BytesIO(data)) as image:
        if image.format not in PIL_JPEG_FORMATS:
            return None
        exif = image.getexif()
        tag: int = exif.get(ExifTags.Base.Orientation, 1)
        if tag in UPRIGHT_TURNS and tag != 1 and ExifTags.Base.Orientation in exif and "exif" in image.info:
            del exif[ExifTags.Base.Orientation]
            exif.tobytes()
    return tag


# EXIF orientation -> the turns that make the stored image upright, as PIL's exif_transpose
# does: (quarter turns counter-clockwise, then mirror left-right).
UPRIGHT_TURNS = {1: (0, False), 2: (0, True), 3: (2, False), 4: (2, True),
                 5: (3, True), 6: (3, False), 7: (1, True), 8: (1, False)}


def upright(image: torch.Tensor, tag: int) -> torch.Tensor:
    """A decoded CHW image turned as its EXIF orientation `tag` says (`open_rgb` does the same to a PIL image)."""
    turns, mirror = UPRIGHT_TURNS.get(tag, (0, False))
    image = torch.rot90(image, turns, dims=(-2, -1)) if turns else image
    return image.flip(-1) if mirror else image


class Stored(NamedTuple):
    """An image as a shard or the byte cache stores it: its bytes (None: gone or undecodable),
    whether resized, the CPU time that took."""

    data: bytes | None
    resized: bool = False
    cpu_s: float = 0.0


def stored_resized(data: bytes | None, side: int, quality: int = RESIZED_QUALITY, shrink: float = 1.0) -> Stored:
    """An image larger than `shrink` x `side` on its shorter side as a JPEG at `side` and `quality`,
    upright (`open_rgb`); one no larger as it is; None for one that is gone or does not decode."""
    started = time.thread_time()
    if data is None:
        return Stored(None, cpu_s=time.thread_time() - started)
    try:
        with Image.open(io.BytesIO(data)) as header:
            if min(header.size) <= side * shrink:
                return Stored(data)
        image = open_rgb(data, side)
    except Exception:  # any decoder error means unreadable, as decode-check takes it
        return Stored(None, cpu_s=time.thread_time() - started)
    scale = side / min(image.size)
    if scale < 1:  # a reduced-size decode stops at or above the side: what is left is resized here
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                             Image.Resampling.LANCZOS)
    if max(image.size) > JPEG_MAX_SIDE:  # a panorama JPEG cannot hold even resized: stored as it is
        return Stored(data, cpu_s=time.thread_time() - started)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return Stored(buffer.getvalue(), True, time.thread_time() - started)

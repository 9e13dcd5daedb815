"""Decoding an image the one way every CPU path does: upright, 8-bit RGB, no larger than needed.

Training, validation, decode-check, batch-predict, shard writing and the byte cache all
decode through `open_rgb` (docs/architecture.md, "Data: pre-resized shards"), so an image
turns out the same wherever it is read. `stored_resized` is the copy of an image that shards
and the byte cache keep in place of a camera original: resized to the side training needs and
stored as a JPEG, so that later epochs decode a small image instead of the original.
"""

from __future__ import annotations

import io
import time
from typing import NamedTuple

import numpy as np
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


def orientation(image: Image.Image) -> int:
    """The EXIF orientation tag of an opened JPEG (1, upright, when it has none), from its header alone."""
    tag: int = image.getexif().get(ExifTags.Base.Orientation, 1)
    return tag


class Stored(NamedTuple):
    """An image as a shard or the byte cache stores it: its bytes (None: gone or undecodable),
    whether resized, the CPU time that took."""

    data: bytes | None
    resized: bool = False
    cpu_s: float = 0.0


def stored_resized(data: bytes | None, side: int, quality: int = RESIZED_QUALITY) -> Stored:
    """An image larger than `side` on its shorter side as a JPEG at that side and `quality`,
    upright (`open_rgb`); one no larger as it is; None for one that is gone or does not decode."""
    started = time.thread_time()
    if data is None:
        return Stored(None, cpu_s=time.thread_time() - started)
    try:
        with Image.open(io.BytesIO(data)) as header:
            if min(header.size) <= side:
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

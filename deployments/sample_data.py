"""A small learnable image folder of real JPEGs: coloured shapes, one class per shape.

Each class has its own shape and a hue range; position, size, brightness and background
noise vary, so a small CNN learns it from scratch in a few epochs on a CPU.
"""

from __future__ import annotations

import io
import random

from PIL import Image, ImageDraw

CLASSES = {"circle": (200, 40, 40), "square": (40, 170, 40), "triangle": (40, 60, 210)}


def draw_shape(shape: str, colour: tuple[int, int, int], size: int, rng: random.Random) -> Image.Image:
    background = tuple(rng.randint(90, 200) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    for _ in range(6):  # clutter, so the shape is not the only thing in the picture
        x, y = rng.randrange(size), rng.randrange(size)
        draw.point((x, y), fill=tuple(rng.randint(0, 255) for _ in range(3)))
    r = rng.randint(size // 5, size // 3)
    cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
    fill = tuple(max(0, min(255, c + rng.randint(-40, 40))) for c in colour)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def shapes_dataset(per_class: int, size: int = 64, seed: int = 0) -> dict[str, bytes]:
    """`{"<class>/<n>.jpg": jpeg bytes}` for every class."""
    rng = random.Random(seed)
    files = {}
    for shape, colour in CLASSES.items():
        for n in range(per_class):
            buffer = io.BytesIO()
            draw_shape(shape, colour, size, rng).save(buffer, format="JPEG", quality=90)
            files[f"{shape}/{n:04d}.jpg"] = buffer.getvalue()
    return files

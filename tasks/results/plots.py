"""Training curves as a PNG that the Prefect UI shows inline.

The UI renders a markdown artifact's image given as a data URI (docs/architecture.md,
"Facts: Prefect"), so a report
carries its plot with it and needs no image host. Figures are built with matplotlib's
object API, not pyplot, so no global figure state is shared between threads.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from matplotlib.figure import Figure


def training_curves_png(history: list[dict[str, Any]]) -> bytes:
    """Loss and accuracy per epoch, train and val side by side, as PNG bytes."""
    epochs = [h["epoch"] for h in history]
    figure = Figure(figsize=(9, 3.2), dpi=90, layout="constrained")
    for axes, metric in zip(figure.subplots(1, 2), ("loss", "acc")):
        for split, style in (("train", "o-"), ("val", "s--")):
            axes.plot(epochs, [h[f"{split}_{metric}"] for h in history], style, label=split)
        axes.set_xlabel("epoch")
        axes.set_title("accuracy" if metric == "acc" else "loss")
        axes.set_xticks(epochs)
        axes.grid(alpha=0.3)
        axes.legend()
    return png_bytes(figure)


def png_bytes(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def markdown_image(png: bytes, alt: str) -> str:
    """A markdown image whose source is the PNG itself, as a data URI."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"

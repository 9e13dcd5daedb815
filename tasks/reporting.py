"""Small formatting helpers shared by the artifacts of every step."""

from __future__ import annotations

import html
import logging
from typing import Any

from prefect import get_run_logger
from prefect.context import get_run_context
from prefect.exceptions import MissingContextError


def in_prefect_run() -> bool:
    """Whether this code runs inside a Prefect flow or task run (not a unit test or script)."""
    try:
        get_run_context()
        return True
    except MissingContextError:
        return False


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's logger for the current run, or a plain one outside a run (unit tests)."""
    return get_run_logger() if in_prefect_run() else logging.getLogger("prefect_ddp")


# The per-epoch columns people read, in the live table and in the final report.
EPOCH_COLUMNS = ["epoch", "train_loss", "train_acc", "val_loss", "val_acc", "lr", "seconds"]


def markdown_text(value: Any) -> str:
    """`value` as text that the UI's markdown shows as it is, on one line.

    The UI renders HTML in artifacts, so a key or error message holding `<...>` (PIL's
    "cannot identify image file <_io.BytesIO ...>") would lose those words; `|` would end
    a table cell early.
    """
    return html.escape(str(value), quote=False).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table; floats get 4 significant digits."""

    def cell(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else markdown_text(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"

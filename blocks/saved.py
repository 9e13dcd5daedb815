"""Loading a saved block by name, with a message that says how to create it when it is missing."""

from __future__ import annotations

from typing import TypeVar

from prefect.blocks.core import Block

from prefect_ddp.tasks.reporting import ran_sync

B = TypeVar("B", bound=Block)


def load_block(block_class: type[B], name: str) -> B:
    """The saved block `name` of `block_class`; ValueError naming the block and the fix."""
    try:
        return ran_sync(block_class.load(name), f"{block_class.__name__}.load")
    except ValueError as exc:
        raise ValueError(
            f"No {block_class.get_block_type_slug()} block named {name!r} on this Prefect "
            f"server ({exc}). Create it with {block_class.__name__}(...).save({name!r}) or in "
            "the UI under Blocks."
        ) from exc

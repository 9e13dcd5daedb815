"""What the project logs while a block runs, for the benchmarks' reports and the tests' assertions.

Collected by a handler on the project's own logger (`prefect_ddp`), not the root logger's:
Prefect's logging set-up replaces the root logger's handlers (pytest's caplog among them) when a
process first reaches it, which left caplog empty once in CI (tests/test_warm_cluster.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def project_messages() -> Iterator[list[str]]:
    """The messages the project logs at INFO and above while the block runs, in order; its
    logger's level is set to INFO for the block and restored after it."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logger, handler = logging.getLogger("prefect_ddp"), Collect(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)

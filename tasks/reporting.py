"""Small helpers shared by the artifacts and logs of every step, and the Prefect API this process reports to."""

from __future__ import annotations

import contextvars
import html
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from prefect import get_run_logger
from prefect.context import get_run_context
from prefect.exceptions import MissingContextError

R = TypeVar("R")


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


def ran_sync(result: R | Coroutine[Any, Any, R], call: str) -> R:
    """The result of a Prefect call that runs sync or async by its caller's context
    (`Block.load`, `create_progress_artifact`, `Flow.to_deployment`), called from sync code.

    Such a call returns a coroutine instead when the run context around it is an async flow
    or task; our sync code cannot await it, so that is an error here, not a coroutine that
    fails later far from its cause.
    """
    if isinstance(result, Coroutine):
        result.close()  # never awaited: close it so Python does not warn about it as well
        raise TypeError(f"{call} returned a coroutine: it was called from sync code inside an "
                        "async flow or task. Call it from a sync flow or task.")
    return result


# The per-epoch columns people read, in the live table and in the final report.
EPOCH_COLUMNS = ["epoch", "train_loss", "train_acc", "val_loss", "val_acc", "lr", "seconds", "images_per_s",
                 "data_wait_pct"]


# With training.ema_decay: the model's and the average's validation, and which of them the epoch
# kept (its val_acc's), after val_acc (tasks/training/weights_average.py).
AVERAGE_COLUMNS = ["model_val_acc", "ema_val_acc", "weights"]


def epoch_columns(history: list[dict[str, Any]]) -> list[str]:
    """The per-epoch columns of `history`: EPOCH_COLUMNS, and AVERAGE_COLUMNS where the run kept an average.

    >>> epoch_columns([{"epoch": 1, "weights": "ema"}])[4:8]
    ['val_acc', 'model_val_acc', 'ema_val_acc', 'weights']
    """
    if not any("weights" in h for h in history):
        return EPOCH_COLUMNS
    after = EPOCH_COLUMNS.index("val_acc") + 1
    return EPOCH_COLUMNS[:after] + AVERAGE_COLUMNS + EPOCH_COLUMNS[after:]


def epoch_table(history: list[dict[str, Any]]) -> str:
    """The epochs of `history` as a markdown table of their `epoch_columns`; blank where an epoch recorded
    by an older version lacks one."""
    columns = epoch_columns(history)
    return markdown_table(columns, [[h.get(k, "") for k in columns] for h in history])


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


class BackgroundPublisher:
    """Runs calls to the Prefect API on a thread of its own, so the caller never waits on them.

    Rank 0 of a gang updates its progress artifacts between steps. Calling the API from
    the step loop would stall rank 0 as long as the API hangs (the client retries for
    minutes), and its peers would hit their collective timeout. Calls are keyed: a newer
    call under a key replaces one not yet sent, so a slow API gets the latest progress,
    not a backlog. A failing call is logged and dropped. Calls run in the caller's
    context (a copy of it), so artifacts attach to the caller's run.
    """

    def __init__(self, log: Any) -> None:
        self.log = log
        self._context = contextvars.copy_context()
        self._pending: dict[str, Any] = {}
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="prefect-ddp-publisher", daemon=True)
        self._thread.start()

    def submit(self, key: str, call: Any) -> None:
        """Queue `call()` under `key`, replacing a queued call of the same key; returns at once."""
        with self._wake:
            self._pending[key] = call
            self._wake.notify()

    def close(self, timeout_s: float) -> bool:
        """Send what is queued, waiting at most `timeout_s`; False when the API did not take it."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.log.warning("The Prefect API did not answer within %.0f s; the last progress "
                             "update was dropped (training itself is unaffected).", timeout_s)
            return False
        return True

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if not self._pending:
                    return
                _, call = self._pending.popitem()
            try:
                self._context.run(call)
            except Exception as exc:  # the API being away must not cost the training run
                self.log.warning("Could not publish training progress (to Prefect or MLflow): %s", exc)


def flow_api_url() -> str:
    """The Prefect API this process records runs on, also when it is a temporary server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    # Without a configured URL the client's is the temporary server's, which Prefect
    # starts once per process and reuses.
    return (PREFECT_API_URL.value() or str(get_client(sync_client=True).api_url)).rstrip("/")

"""The boundary part that shows training: rank 0's live view in the Prefect UI (and MLflow).

The loop calls it after every step and epoch through the boundary interface
(tasks/training/boundary.py); everything about showing them (Prefect artifacts, each epoch's
metrics in the run's MLflow run, a background publisher so a slow API never holds up a step)
lives here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from uuid import UUID

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact

from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.reporting import BackgroundPublisher, epoch_table, in_prefect_run, ran_sync
from prefect_ddp.tasks.tracking import TrackedRun, log_epoch
from prefect_ddp.tasks.training.boundary import BoundaryPart, EpochEnd, StepEnd, Stop
from prefect_ddp.tasks.training.step_times import live_text

PROGRESS_INTERVAL_S = 5.0
PROGRESS_CLOSE_TIMEOUT_S = 30.0


class ProgressReporter(BoundaryPart):
    """Rank 0's live view in the Prefect UI: a progress bar and a table of epochs so far; with
    `tracked`, each epoch's metrics in MLflow too (only rank 0 logs them).

    Updates go through a BackgroundPublisher: a slow or hanging API never holds up a step.
    """

    name = "progress"

    def __init__(self, ctx: RankContext, epochs: int, log: Any, tracked: TrackedRun | None = None) -> None:
        # Outside a Prefect run (a unit test, a plain script) there is no run to attach to.
        self.shows = ctx.is_main and in_prefect_run()
        self.tracked = tracked if ctx.is_main else None
        self.publisher = BackgroundPublisher(log) if self.shows or self.tracked else None
        self.epochs = epochs
        self.artifact_id: UUID | None = None  # touched only by the publisher's thread
        self.last_update = -PROGRESS_INTERVAL_S
        self._set_progress(0.0)

    def _publish_progress(self, percent: float, description: str) -> None:
        if self.artifact_id is None:
            self.artifact_id = ran_sync(
                create_progress_artifact(percent, key="training-progress", description=description),
                "create_progress_artifact",
            )
        else:
            update_progress_artifact(self.artifact_id, percent, description=description)

    def _submit(self, key: str, call: Callable[[], Any]) -> None:
        assert self.publisher is not None, "shows or tracked, so __init__ made a publisher"
        self.publisher.submit(key, call)

    def _set_progress(self, percent: float, detail: str = "") -> None:
        if self.shows:
            description = f"Epochs done of {self.epochs}" + (f". {detail}" if detail else "")
            self._submit("progress", lambda: self._publish_progress(percent, description))
            self.last_update = time.monotonic()

    def note(self, epochs_done: float, detail: str) -> None:
        """Say `detail` with the bar at `epochs_done` (a fraction within an epoch too): a change of
        the gang's size, as it happens."""
        self._set_progress(100.0 * epochs_done / self.epochs, detail)

    def after_step(self, step: StepEnd) -> None:
        """Move the bar, described by where rank 0's time went so far this epoch."""
        self.step(step.epoch, step.step, step.steps,
                  lambda: live_text(step.clock.totals(), step.images, step.seconds))

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        self.epoch_done(end.history)
        return None

    def step(self, epoch: int, done: int, total: int, describe: Callable[[], str]) -> None:
        """Within an epoch: move the bar, with `describe()` (where rank 0's time goes so far)
        as its description, at most every PROGRESS_INTERVAL_S seconds."""
        if self.shows and time.monotonic() - self.last_update >= PROGRESS_INTERVAL_S:
            self._set_progress(100.0 * (epoch + done / max(total, 1)) / self.epochs, describe())

    def epoch_done(self, history: list[dict[str, Any]]) -> None:
        """The bar at the epoch's end, the gang's verdict on it, and the table of epochs so far."""
        verdict = history[-1].get("time", {}).get("verdict", "")
        said = f"Epoch {history[-1]['epoch']}: {verdict}"
        self._set_progress(100.0 * len(history) / self.epochs, said)
        if self.tracked:  # keyed by epoch: every epoch is logged, none replaces another
            record, tracked = history[-1], self.tracked
            self._submit(f"mlflow-epoch-{record['epoch']}", lambda: log_epoch(tracked, record))
        if self.shows:
            table = epoch_table(history)
            self._submit("table", lambda: create_markdown_artifact(
                key="training-epochs",
                description="Per-epoch metrics, all ranks reduced",
                markdown="# Training so far\n\n" + table + (f"\n{said}\n" if verdict else ""),
            ))

    def close(self) -> None:
        """Send the last updates; a hanging API costs at most PROGRESS_CLOSE_TIMEOUT_S."""
        if self.publisher:
            self.publisher.close(PROGRESS_CLOSE_TIMEOUT_S)

"""The sweep's end of a trial's link: its gang's reports go into the study, the pruner answers.

Runs in the sweep's process, beside the trial's flow run, for as long as the trial trains:
a thread takes each report rank 0 put in the trial's queue (prefect_ddp.tasks.gang.trial.TrialLink),
records it on the Optuna trial, asks the sweep's pruner, and puts the answer back. The
ranks never open the study, so it may live where only the sweep's process can reach it
(SQLite on the flow's host), and every report goes through the sweep's one storage
engine.
"""

from __future__ import annotations

import threading
import uuid
from types import TracebackType
from typing import Any

import distributed
import optuna

from prefect_ddp.tasks.gang import PRUNED_AT, REPORTED_AT, TrialLink, scheduler_queue
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.selection import Direction

POLL_S = 0.2
CHANNEL_PREFIX = "prefect-ddp-trial"


class TrialRelay:
    """Serve `trial`'s reports while the block runs; `link` is what its gang's ranks get.

    >>> with TrialRelay(client, study, trial, "val_acc", "maximize") as relay:  # doctest: +SKIP
    ...     train_the_trial(relay.link)
    """

    def __init__(self, client: distributed.Client, study: optuna.Study, trial: optuna.Trial,
                 metric: str, direction: Direction) -> None:
        self.client = client
        self.study = study
        self.trial = trial
        self.link = TrialLink(channel=f"{CHANNEL_PREFIX}:{uuid.uuid4().hex}", number=trial.number,
                              metric=metric, direction=direction)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"trial-{trial.number}-relay", daemon=True)

    def __enter__(self) -> TrialRelay:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._done.set()
        self._thread.join()

    def _serve(self) -> None:
        with scheduler_queue(self.link.reports, self.client) as reports, \
                scheduler_queue(self.link.answers, self.client) as answers:
            while not self._done.wait(POLL_S):
                try:
                    # Whatever has arrived, without waiting in the scheduler: a get with a
                    # timeout that runs out logs an ERROR with a traceback there, twice a
                    # second for as long as a trial trains (distributed 2026.8).
                    arrived = reports.get(batch=True)
                except Exception:  # the scheduler is gone: the trial's gang fails on its own
                    run_logger().exception("Trial %d: could not read its reports", self.trial.number)
                    return
                for report in arrived:
                    answers.put(self.answer(report))

    def answer(self, report: dict[str, Any]) -> bool | str:
        """Whether to stop, or why the report could not be recorded (rank 0 raises it)."""
        try:
            return self.record(report)
        except Exception as exc:
            run_logger().exception("Trial %d: could not record its report of epoch %s", self.trial.number,
                                   report.get("step"))
            return f"the sweep could not record the report of epoch {report.get('step')}: {exc!r}"

    def record(self, report: dict[str, Any]) -> bool:
        """Put one epoch's report on the trial; whether the pruner stops the trial now."""
        step = report["step"]
        self.trial.report(report["value"], step)
        # When, so the sweep can plot the metric against wall time.
        self.trial.set_user_attr(f"{REPORTED_AT}{step}", report["at"])
        prune = self.trial.should_prune()
        if prune:
            self.trial.set_user_attr(PRUNED_AT, step)
        return prune

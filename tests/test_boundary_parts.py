"""The loop's boundary interface (tasks/training/boundary.py) and the parts that plug into it,
each without a process group; a part of the test's own added to the real recipe through
`train_classifier(parts=...)`, with tasks/training/recipe.py left as it is."""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
from typing import Any

import pytest
import torch

from prefect_ddp.tasks.gang import GangRegroup, GangStopped, RankContext, context, handover
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.training.boundary import (
    Boundaries,
    BoundaryPart,
    EpochEnd,
    StepEnd,
    Stop,
    TrainingEnd,
)
from prefect_ddp.tasks.training.champion import Champion
from prefect_ddp.tasks.training.heartbeats import Heartbeats
from prefect_ddp.tasks.training.parts import RankTraining
from prefect_ddp.tasks.training.pass_sums import PassSums
from prefect_ddp.tasks.training import progress
from prefect_ddp.tasks.training.pruning import Pruning
from prefect_ddp.tasks.training.recipe import train_classifier
from prefect_ddp.tasks.training.step_times import StepClock
from tests.test_training import CTX, local_job

pytestmark = pytest.mark.unit


class Recorder(BoundaryPart):
    """Writes down every boundary it sees, as (hook, what) pairs."""

    name = "recorder"

    def __init__(self, seen: list[tuple[str, Any]], stop_after: int | None = None, pruned: bool = False) -> None:
        self.seen = seen
        self.stop_after = stop_after
        self.pruned = pruned

    def after_step(self, step: StepEnd) -> None:
        self.seen.append(("step", (step.epoch, step.step, step.steps, step.images)))

    def after_epoch(self, end: EpochEnd) -> Stop | None:
        self.seen.append(("epoch", (end.epoch, end.record["epoch"], len(end.history), end.last)))
        return Stop("enough", pruned=self.pruned) if end.record["epoch"] == self.stop_after else None

    def after_training(self, end: TrainingEnd) -> None:
        self.seen.append(("training", ([row["epoch"] for row in end.history], end.completed)))

    def close(self) -> None:
        self.seen.append(("close", None))


def step_end(epoch: int = 0, step: int = 1) -> StepEnd:
    return StepEnd(epoch, step, 4, 4 * step, 1.0, PassSums(), StepClock(torch.device("cpu")))


def epoch_end(epoch: int = 0, last: bool = False) -> EpochEnd:
    return EpochEnd(epoch, [{"epoch": number + 1, "val_acc": 0.5} for number in range(epoch + 1)], last)


def test_a_part_of_the_test_s_own_sees_every_boundary_of_the_real_recipe(tmp_path):
    seen: list[tuple[str, Any]] = []
    built: list[RankTraining] = []

    def recorder(training: RankTraining) -> Recorder:
        built.append(training)
        return Recorder(seen)

    result = train_classifier(CTX, local_job(tmp_path, epochs=2), parts=[recorder])
    steps = [what for hook, what in seen if hook == "step"]
    per_epoch = len(steps) // 2
    assert per_epoch >= 1 and steps == [(epoch, step, per_epoch, 4 * step)
                                        for epoch in (0, 1) for step in range(1, per_epoch + 1)]
    assert [entry for entry in seen if entry[0] != "step"] == [
        ("epoch", (0, 1, 1, False)), ("epoch", (1, 2, 2, True)), ("training", ([1, 2], True)), ("close", None)]
    assert built[0].formation.history is result.history  # what the part was given is the run's own
    assert result.pruned_at is None and [row["epoch"] for row in result.history] == [1, 2]


@pytest.mark.parametrize("pruned", [False, True])
def test_a_part_that_says_stop_ends_the_run_after_that_epoch_keeping_it(tmp_path, caplog, pruned):
    seen: list[tuple[str, Any]] = []
    with caplog.at_level("INFO"):
        result = train_classifier(CTX, local_job(tmp_path, epochs=3),
                                  parts=[lambda training: Recorder(seen, 1, pruned)])
    assert [row["epoch"] for row in result.history] == [1]
    assert result.pruned_at == (1 if pruned else None)  # only a sweep's prune keeps the run from promotion
    assert ("training", ([1], not pruned)) in seen and seen[-1] == ("close", None)
    assert "Stopped after epoch 1: enough" in caplog.text
    # The epoch it stopped after is the checkpoint's and model.pt's: kept, not lost with the stop.
    assert torch.load(tmp_path / "run" / "checkpoints" / "checkpoint.pt", weights_only=True)["epoch"] == 0
    assert json.loads((tmp_path / "run" / "model.json").read_text())["epoch"] == 1


def test_a_factory_may_leave_its_part_out_of_a_run(tmp_path):
    result = train_classifier(CTX, local_job(tmp_path, epochs=1), parts=[lambda training: None])
    assert [row["epoch"] for row in result.history] == [1]


def test_the_champion_is_scored_beside_the_run_s_best_epoch_unless_a_sweep_pruned_the_run(tmp_path):
    kept = tmp_path / "kept"
    train_classifier(CTX, local_job(kept, epochs=1))

    def against_kept(folder, epochs: int):
        job = local_job(folder, epochs)
        return job.model_copy(update={"champion": Champion(
            folder=Location(url=str(kept / "run")), version=str(kept / "run"), run="kept",
            positions=list(job.split.val), left_out=0, split_known=True)})

    job = against_kept(tmp_path / "scored", epochs=2)
    scored = train_classifier(CTX, job)
    assert scored.comparison is not None and scored.comparison["images"] == len(job.split.val)
    assert scored.comparison["challenger_epoch"] == scored.best_epoch
    early = train_classifier(CTX, against_kept(tmp_path / "early", epochs=3),
                             parts=[lambda training: Recorder([], stop_after=1)])
    assert early.comparison is not None and early.comparison["challenger_epoch"] == early.best_epoch == 1
    pruned = train_classifier(CTX, against_kept(tmp_path / "pruned", epochs=3),
                              parts=[lambda training: Recorder([], stop_after=1, pruned=True)])
    assert pruned.pruned_at == 1 and pruned.comparison is None


def test_parts_are_called_in_order_and_a_stop_ends_the_boundary():
    seen: list[tuple[str, Any]] = []

    class Named(Recorder):
        def __init__(self, name: str, stop: bool = False) -> None:
            super().__init__(seen)
            self.name, self.stop = name, stop

        def after_epoch(self, end: EpochEnd) -> Stop | None:
            seen.append(("epoch", self.name))
            return Stop(self.name) if self.stop else None

        def close(self) -> None:
            seen.append(("close", self.name))

    with Boundaries([Named("first"), Named("stops", stop=True), Named("after")]) as boundary:
        boundary.after_step(step_end())
        assert boundary.after_epoch(epoch_end()) == Stop("stops")
    assert [entry for entry in seen if entry[0] != "step"] == [
        ("epoch", "first"), ("epoch", "stops"), ("close", "after"), ("close", "stops"), ("close", "first")]
    assert [hook for hook, _ in seen].count("step") == 3  # every part sees every step


def test_every_part_is_closed_even_when_one_fails_to_close():
    closed: list[str] = []

    class Closing(BoundaryPart):
        def __init__(self, name: str, fails: bool = False) -> None:
            self.name, self.fails = name, fails

        def close(self) -> None:
            closed.append(self.name)
            if self.fails:
                raise RuntimeError(f"{self.name} could not close")

    with pytest.raises(RuntimeError, match="middle could not close"):
        with Boundaries([Closing("first"), Closing("middle", fails=True), Closing("last")]):
            pass
    assert closed == ["last", "middle", "first"]


def test_a_part_failing_to_close_does_not_hide_why_the_formation_failed(caplog):
    class Failing(BoundaryPart):
        name = "failing"

        def close(self) -> None:
            raise RuntimeError("could not close")

    with pytest.raises(GangStopped, match="asked to stop"):
        with Boundaries([Failing()]):
            raise GangStopped("asked to stop")
    assert "The failing part could not close while the rank was already failing" in caplog.text


@dataclasses.dataclass(frozen=True)
class ToldContext(RankContext):
    """A rank's context that writes down what it tells the supervisor and asks the sweep."""

    told: list = dataclasses.field(default_factory=list)
    prune_at: int | None = None
    stopping: bool = False

    def progress(self, phase: str, epoch: int | None = None, step: int | None = None) -> None:
        self.told.append((phase, epoch, step))

    def check_stop(self) -> None:
        if self.stopping:
            raise GangStopped("asked to stop")

    def report(self, step: int, metrics: dict[str, Any]) -> bool:
        self.told.append(("report", step, metrics["val_acc"]))
        return step == self.prune_at


def told_context(**changes: Any) -> ToldContext:
    return ToldContext(**{field.name: getattr(CTX, field.name) for field in dataclasses.fields(RankContext)},
                       **changes)


def test_heartbeats_say_each_step_and_epoch_and_leave_a_gang_being_stopped():
    ctx = told_context()
    part = Heartbeats(ctx)
    part.after_step(step_end(epoch=1, step=3))
    assert part.after_epoch(epoch_end(epoch=1)) is None
    assert ctx.told == [("step", 2, 3), ("checkpoint", 2, None)]  # epochs counted from 1, as the supervisor shows
    with pytest.raises(GangStopped):
        Heartbeats(told_context(stopping=True)).after_step(step_end())


def test_pruning_reports_every_epoch_and_stops_the_run_the_sweep_prunes():
    ctx = told_context(prune_at=2)
    part = Pruning(ctx)
    assert part.after_epoch(epoch_end(epoch=0)) is None
    assert part.after_epoch(epoch_end(epoch=1)) == Stop("pruned by the sweep", pruned=True)
    assert ctx.told == [("report", 1, 0.5), ("report", 2, 0.5)]


def test_a_caller_s_part_sees_the_epoch_boundary_where_an_elastic_gang_grows(tmp_path, monkeypatch):
    """The grow checks may leave the formation at a boundary: the caller's parts come before them."""
    seen: list[tuple[str, Any]] = []
    ctx = dataclasses.replace(CTX, gang_id="grows-after-epoch-1", stop_flag="flag", max_world_size=2, elastic=True)
    asks = itertools.count(1)
    monkeypatch.setattr(context, "stop_requested", lambda flag: False)
    # regroup_every_steps (50) is past an epoch's steps here: the first ask is at the end of epoch 1.
    monkeypatch.setattr(context, "grow_requested", lambda flag: next(asks) == 1)
    try:
        with pytest.raises(GangRegroup):
            train_classifier(ctx, local_job(tmp_path, epochs=3), parts=[lambda training: Recorder(seen)])
    finally:
        handover.drop_parked()
    assert [what for hook, what in seen if hook == "epoch"] == [(0, 1, 1, False)]


def test_a_factory_that_fails_leaves_no_part_holding_a_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "in_prefect_run", lambda: True)  # rank 0's bar starts its publisher thread
    monkeypatch.setattr(progress.ProgressReporter, "_publish_progress", lambda self, percent, description: None)

    def publishers() -> list[threading.Thread]:
        return [thread for thread in threading.enumerate() if thread.name == "prefect-ddp-publisher"]

    before = publishers()

    def broken(training: RankTraining) -> BoundaryPart:
        raise RuntimeError("the caller's part could not be made")

    with pytest.raises(RuntimeError, match="could not be made"):
        train_classifier(CTX, local_job(tmp_path, epochs=1), parts=[broken])
    assert publishers() == before


def test_a_boundary_s_seconds_are_counted_by_part_whatever_a_caller_names_its_part():
    """checkpoint_s adds up the writing parts' seconds by kind, not by name: a caller's part named
    "checkpoint" is not counted as the checkpoint's."""
    class Named(BoundaryPart):
        name = "checkpoint"  # the name of a part of the project's own

    boundary = Boundaries([Named(), Recorder([]), Recorder([])])
    boundary.after_epoch(epoch_end())
    boundary.seconds = [5.0, 1.0, 2.0]  # as the boundary measured them
    assert boundary.spent((Recorder,)) == 3.0

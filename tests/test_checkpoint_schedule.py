"""Checkpoints that choose their interval (Young/Daly) and are written off the training path.

Units: the interval against docs/scaling.md's table, the schedule's decisions, the writer's
order and failures. Then real gloo ranks: `checkpoint_every="auto"` skips the epochs the
interval allows, always saves the last, and model.pt never names an epoch the checkpoint lacks.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import json
import threading
from pathlib import Path

import fsspec.implementations.local
import pytest
import torch
import torch.multiprocessing as mp

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.data.storage import load_torch, write_bytes
from prefect_ddp.tasks.gang import GangError, GangStopped, RankContext, free_port
from prefect_ddp.tasks.gang.trial import TrialLink
from prefect_ddp.tasks.results.aggregation import checkpoint_plan, last_epoch_time
from prefect_ddp.tasks.training.checkpoint_interval import CheckpointSchedule, young_daly_interval_s
from prefect_ddp.tasks.training.checkpoint_writer import BackgroundWriter, CheckpointWriteError, to_cpu
from prefect_ddp.tasks.training.checkpoints import TrainingState
from prefect_ddp.tasks.training.best_weights import BestWeights
from prefect_ddp.tasks.training.checkpointing import Checkpointing
from prefect_ddp.tasks.training.boundary import EpochEnd
from prefect_ddp.tasks.training.job import RunFiles, TrainJob
from prefect_ddp.tasks.training.step_times import PARTS, EpochTiming
from prefect_ddp.tasks.selection import Selection
from tests.support.image_folders import local_image_folder
from tests.support.rank_processes import start_ranks
from tests.support.two_ranks import train_as_rank

HOUR = 3600.0


@pytest.mark.unit
@pytest.mark.parametrize("save_s, mtbf_h, young, daly", [
    (2, 792, 3377, 3376), (12, 792, 8272, 8264), (2, 79.2, 1068, 1067), (12, 79.2, 2616, 2608),
])
def test_the_interval_is_daly_s_for_docs_scaling_cases(save_s, mtbf_h, young, daly):
    assert round((2 * save_s * mtbf_h * HOUR) ** 0.5) == young
    assert round(young_daly_interval_s(save_s, mtbf_h * HOUR)) == daly


@pytest.mark.unit
def test_a_save_longer_than_twice_the_mtbf_checkpoints_every_mtbf_and_a_free_save_always():
    assert young_daly_interval_s(100, 40) == 40
    assert young_daly_interval_s(0, HOUR) == 0
    with pytest.raises(ValueError, match="mtbf_s=0 is not positive"):
        young_daly_interval_s(1, 0)


def schedule(**kwargs) -> CheckpointSchedule:
    return CheckpointSchedule(every_epoch=kwargs.pop("every_epoch", False), mtbf_s=kwargs.pop("mtbf_s", HOUR),
                              max_lost_s=kwargs.pop("max_lost_s", 10 * HOUR), **kwargs)


def decisions(plan: CheckpointSchedule, epochs: int, epoch_s: float, save_s: float) -> list[bool]:
    saved = []
    for epoch in range(epochs):
        saved.append(plan.due(epoch_s, last=epoch == epochs - 1))
        if saved[-1]:
            plan.saved(save_s)
    return saved


@pytest.mark.unit
def test_auto_saves_first_to_measure_then_at_the_interval_and_always_last():
    # δ 0.1 s, M 1 h: τ = 26.8 s. With 5 s epochs, it saves once 5 more s would leave over τ unsaved.
    plan = schedule()
    assert decisions(plan, 12, epoch_s=5, save_s=0.1) == [True, False, False, False, False, True,
                                                          False, False, False, False, True, True]
    assert plan.decisions[1] == {"auto": True, "interval_s": 26.8, "capped": False, "unsaved_s": 5.0, "saved": False}
    assert decisions(schedule(every_epoch=True), 3, epoch_s=5, save_s=0.1) == [True, True, True]


@pytest.mark.unit
def test_the_ceiling_and_the_failures_seen_shorten_the_interval():
    capped = schedule(max_lost_s=12)
    assert decisions(capped, 6, epoch_s=5, save_s=0.1) == [True, False, True, False, True, True]
    assert capped.decisions[-1]["capped"] and not capped.decisions[0]["capped"]  # none chosen before the first save
    assert checkpoint_plan(capped.decisions) == "4 of 6 epochs checkpointed, auto: interval 12 s, capped at training.max_lost_min"
    # Two failures in 100 s trained: M = 50 s, τ = 3.1 s: every epoch.
    seen = schedule(failures=2, trained_s=100)
    assert seen.mtbf_seen_s == 50
    assert decisions(seen, 3, epoch_s=5, save_s=0.1) == [True, True, True]


@pytest.mark.unit
def test_the_schedule_follows_the_recipe():
    cfg = TrainingConfig(checkpoint_every="auto", mtbf_h=2, max_lost_min=15)
    plan = CheckpointSchedule.for_run(cfg, failures=1, history=[{"seconds": 30.0}, {"seconds": 30.5}])
    assert (plan.every_epoch, plan.mtbf_s, plan.max_lost_s, plan.trained_s) == (False, 7200, 900, 60.5)
    assert CheckpointSchedule.for_run(TrainingConfig(), failures=0, history=[]).every_epoch


@pytest.mark.unit
def test_the_copy_owns_its_memory_and_writes_run_in_order():
    weights = {"w": torch.zeros(3), "groups": [{"lr": 0.1, "params": [0]}]}
    copied = to_cpu(weights)
    weights["w"] += 1
    weights["groups"][0]["lr"] = 9.0
    assert copied["w"].tolist() == [0, 0, 0] and copied["groups"][0]["lr"] == 0.1
    order: list[str] = []
    slow = threading.Event()
    with BackgroundWriter() as writer:
        writer.submit("first", lambda: (slow.wait(0.3), order.append("first")))
        writer.submit("second", lambda: order.append("second"))
    assert order == ["first", "second"] and len(writer.write_s) == 2


@pytest.mark.unit
def test_a_failed_write_is_raised_at_the_next_wait_and_leaves_no_part_behind(tmp_path, monkeypatch):
    target = tmp_path / "checkpoint.pt"
    write_bytes(str(target), b"epoch 1", {})

    def disk_full(self, path1, path2, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "mv", disk_full)
    writer = BackgroundWriter()
    writer.submit("the checkpoint of epoch 2", lambda: write_bytes(str(target), b"epoch 2", {}))
    with pytest.raises(CheckpointWriteError, match=r"could not write the checkpoint of epoch 2: .*No space left"):
        writer.wait()
    assert target.read_bytes() == b"epoch 1"  # the one before stays whole
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no part left to fill the disk more
    with pytest.raises(CheckpointWriteError):
        with BackgroundWriter() as failing:
            failing.submit("model.pt", lambda: write_bytes(str(target), b"x", {}))
    with pytest.raises(KeyError):  # the block's own error wins; the write's is logged
        with BackgroundWriter() as failing:
            failing.submit("model.pt", lambda: write_bytes(str(target), b"x", {}))
            raise KeyError("the rank's own failure")


@pytest.mark.unit
def test_a_lease_that_could_not_be_asked_about_does_not_hide_the_ranks_own_stop(tmp_path):
    """Before a write the writer asks whether the gang still holds its worker; an unanswered
    question is a GangError (tasks/gang/fencing.py). Raised while the rank was already stopping, it
    replaced the GangStopped that ends the rank Cancelled, and the rank ended Failed."""
    def unanswered() -> None:
        raise GangError("could not ask the scheduler whether its gang still holds this worker")

    with pytest.raises(GangStopped):
        with BackgroundWriter(before_write=unanswered) as writer:
            writer.submit("the checkpoint of epoch 2", lambda: None)
            raise GangStopped("stopped by the gang supervisor")
    writer = BackgroundWriter(before_write=unanswered)
    writer.submit("the checkpoint of epoch 2", lambda: None)
    with pytest.raises(GangError, match="could not ask"):
        writer.wait()


@pytest.mark.unit
def test_writes_after_a_failed_one_are_skipped_and_the_failure_is_seen_at_the_next_boundary(tmp_path):
    written: list[str] = []

    def fails() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = BackgroundWriter()
    writer.submit("the checkpoint of epoch 3", fails)
    writer.submit("model.pt (epoch 3)", lambda: written.append("model.pt"))
    writer._pool.submit(lambda: None).result()  # the writing thread is past both
    with pytest.raises(CheckpointWriteError, match="could not write the checkpoint of epoch 3"):
        writer.check()  # an epoch boundary, no checkpoint due: the failure is raised all the same
    assert written == []  # model.pt would name an epoch no checkpoint holds
    healthy = BackgroundWriter()
    healthy.submit("the checkpoint of epoch 1", lambda: written.append("checkpoint"))
    healthy._pool.submit(lambda: None).result()
    healthy.check()  # nothing failed: returns
    assert written == ["checkpoint"]


@pytest.mark.unit
def test_a_fenced_rank_writes_nothing_it_had_queued_and_a_cancelled_write_stops_the_rest():
    rank_context: contextvars.ContextVar[str] = contextvars.ContextVar("rank_context")
    rank_context.set("rank 0's task")
    checked_in: list[str | None] = []
    held = threading.Event()
    held.set()

    def check_lease() -> None:  # as RankContext.check_lease: it needs the task's context (get_worker)
        checked_in.append(rank_context.get(None))
        if not held.is_set():
            raise GangStopped("the gang no longer holds this worker")

    writing, release = threading.Event(), threading.Event()
    written: list[str] = []
    writer = BackgroundWriter(before_write=check_lease)
    writer.submit("model.pt (epoch 1)", lambda: (writing.set(), release.wait(10), written.append("model.pt")))
    writer.submit("the checkpoint of epoch 2", lambda: written.append("checkpoint"))
    writer.submit("model.pt (epoch 2)", lambda: written.append("model.pt 2"))
    assert writing.wait(10)
    held.clear()  # the lease is given back while the first write is under way
    release.set()
    with pytest.raises(GangStopped):
        writer.wait()
    assert written == ["model.pt"] and checked_in == ["rank 0's task"] * 2
    cancelled = BackgroundWriter()
    cancelled.submit("the checkpoint of epoch 3", lambda: (_ for _ in ()).throw(asyncio.CancelledError()))
    cancelled.submit("model.pt (epoch 3)", lambda: written.append("model.pt 3"))
    with pytest.raises(CheckpointWriteError, match="could not write the checkpoint of epoch 3"):
        cancelled.wait()
    assert written == ["model.pt"]


def train_job(images: Path, output: Path, epochs: int, every: str) -> TrainJob:
    manifest = local_image_folder(images, per_class=6)
    return TrainJob(
        source=DataLocation(url=str(images)), output=DataLocation(url=str(output)), manifest=manifest,
        split=stratified_split(manifest, 0.25, 0), model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=epochs, batch_size=4, image_size=32, num_workers=0, optimizer="adamw",
                                lr=1e-3, checkpoint_every=every, mtbf_h=100_000, max_lost_min=600),
    )


def ended(history: list[dict]) -> EpochEnd:
    """The boundary after the last epoch of `history`."""
    return EpochEnd(len(history) - 1, history, last=False)


def kept_best(ctx: RankContext, model: torch.nn.Module, job: TrainJob) -> BestWeights:
    return BestWeights(ctx, model, RunFiles.of(job, {}), ctx.trial.selection if ctx.trial else Selection())


@pytest.mark.unit
def test_the_best_epoch_waits_in_memory_for_the_next_checkpoint(tmp_path):
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=3, every="auto")
    ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device="cpu",
                      worker_address="local", master_addr="127.0.0.1", master_port=0)
    model = torch.nn.Linear(2, 2)
    kept = kept_best(ctx, model, job)
    best_weight = model.weight.detach().clone()  # (w + 1) - 1 is not w in float32: compare with a copy
    kept.after_epoch(ended([{"epoch": 1, "val_acc": 0.5}]))
    with torch.no_grad():
        model.weight += 1  # training goes on after the copy
    with BackgroundWriter() as writer:
        assert not (tmp_path / "out" / "model.pt").exists()  # not before its checkpoint
        kept.write_after_checkpoint(writer)
    assert json.loads((tmp_path / "out" / "model.json").read_text())["epoch"] == 1
    assert torch.equal(load_torch(str(tmp_path / "out" / "model.pt"), {})["weight"], best_weight)


def one_rank_state(trial: TrialLink | None = None) -> tuple[RankContext, TrainingState]:
    ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device="cpu",
                      worker_address="local", master_addr="127.0.0.1", master_port=0, trial=trial)
    model = torch.nn.Linear(2, 2)
    state = TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.1), None,
                          torch.amp.GradScaler("cpu", enabled=False))
    return ctx, state


def checkpointing(ctx: RankContext, state: TrainingState, job: TrainJob, writer: BackgroundWriter,
                  kept: BestWeights) -> Checkpointing:
    schedule = CheckpointSchedule.for_run(job.training, failures=0, history=[], every_epoch=ctx.trial is not None)
    return Checkpointing(ctx, state, schedule, RunFiles.of(job, {}), {}, writer, kept)


@pytest.mark.unit
def test_a_checkpoint_carries_the_best_epoch_that_model_pt_has_not_got_yet(tmp_path, monkeypatch):
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=3, every="auto")
    ctx, state = one_rank_state()
    kept = kept_best(ctx, state.model, job)
    best_weight = state.model.weight.detach().clone()
    history = [{"epoch": 1, "val_acc": 0.9, "seconds": 1.0}]
    kept.after_epoch(ended(history))  # the best epoch; auto mode saves it later
    with torch.no_grad():
        state.model.weight += 1
    history.append({"epoch": 2, "val_acc": 0.1, "seconds": 1.0})
    kept.after_epoch(ended(history))
    # The process dies after the checkpoint is written and before model.pt is.
    monkeypatch.setattr(BestWeights, "_write", lambda self, best: (_ for _ in ()).throw(OSError("killed")))
    with pytest.raises(CheckpointWriteError, match=r"model.pt \(epoch 1\)"):
        with BackgroundWriter() as writer:
            checkpointing(ctx, state, job, writer, kept).save(history)
    assert not (tmp_path / "out" / "model.pt").exists()
    monkeypatch.undo()
    _, resumed_state = one_rank_state()
    resumed = resumed_state.resume(RunFiles.of(job, {}).checkpoint, {}, {}, 1, scale_lr=False)
    assert resumed.next_epoch == 2 and resumed.best is not None and resumed.best[0] == 1
    again = kept_best(ctx, resumed_state.model, job)
    with BackgroundWriter() as writer:
        again.after_resume(resumed)
        again.write_after_checkpoint(writer)
    assert json.loads((tmp_path / "out" / "model.json").read_text())["epoch"] == again.epoch == 1
    assert torch.equal(load_torch(str(tmp_path / "out" / "model.pt"), {})["weight"], best_weight)


@pytest.mark.unit
def test_a_trial_checkpoints_every_epoch_and_has_it_written_before_it_reports(tmp_path):
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=3, every="auto")
    ctx, state = one_rank_state(trial=TrialLink("sweep-1", 0, "val_acc"))
    kept = kept_best(ctx, state.model, job)
    history: list[dict] = []
    with BackgroundWriter() as writer:
        saves = checkpointing(ctx, state, job, writer, kept)
        for epoch in (1, 2):
            history.append({"epoch": epoch, "val_acc": 0.1 * epoch, "seconds": 1.0})
            kept.after_epoch(ended(history))
            saves.after_epoch(ended(history))
            # What the study is told next exists in storage already.
            assert load_torch(saves.files.checkpoint, {})["epoch"] == epoch - 1
            assert json.loads((tmp_path / "out" / "model.json").read_text())["epoch"] == epoch


def test_auto_skips_the_epochs_its_interval_allows_and_model_pt_stays_within_the_checkpoint(tmp_path):
    jobs = {"auto": train_job(tmp_path / "images", tmp_path / "auto", epochs=4, every="auto"),
            "epoch": train_job(tmp_path / "images", tmp_path / "epoch", epochs=2, every="epoch")}
    start_ranks(train_as_rank, (free_port(), jobs, tmp_path, ("checkpoints", "checkpoint_s", "best_epoch")), 2)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    # δ is measured at the first save; with M = 100,000 h the interval (minutes, whatever δ) outlasts
    # these epochs, also on a busy machine: the last saves.
    assert [d["saved"] for d in rank0["auto"]["checkpoints"]] == [True, False, False, True]
    assert [d["saved"] for d in rank0["epoch"]["checkpoints"]] == [True, True]
    assert len(rank0["auto"]["checkpoint_s"]) == 4  # one wait per epoch trained, 0 or more
    checkpoint = load_torch(str(tmp_path / "auto" / "checkpoints" / "checkpoint.pt"), {})
    assert checkpoint["epoch"] == 3 and len(checkpoint["history"]) == 4
    card = json.loads((tmp_path / "auto" / "model.json").read_text())
    assert card["epoch"] == rank0["auto"]["best_epoch"] <= len(checkpoint["history"])
    assert json.loads((tmp_path / "rank1.json").read_text())["auto"]["checkpoints"] == []  # rank 0 alone decides


@pytest.mark.unit
def test_the_summary_says_what_checkpoints_cost_and_which_epochs_were_saved():
    timing = {"images_per_s": 10.0, "shares": dict.fromkeys(PARTS, 0.0), "per_rank": [], "slowest_rank": 0,
              "slower_by": 1.0, "verdict": "compute-bound"}
    history = [{"epoch": e, "seconds": 9.0, "time": timing} for e in (1, 2, 3, 4)]
    plan = schedule()
    decisions(plan, 3, epoch_s=9, save_s=1.0)
    summary = last_epoch_time(history, [1.0, 0.0, 2.0], plan.decisions)
    assert (summary.checkpoint_s, summary.checkpoint_share) == (1.0, round(3 / 30, 4))  # the last 3 epochs
    assert summary.checkpoints == "2 of 3 epochs checkpointed, auto: interval 84.2 s, by Young/Daly"
    every = last_epoch_time(history, [0.5], [{"auto": False, "interval_s": 0.0, "unsaved_s": 9.0, "saved": True}])
    assert every.checkpoints == "1 of 1 epochs checkpointed, every epoch"
    assert "checkpoints" not in EpochTiming.model_validate(timing).model_dump()  # an epoch's own record

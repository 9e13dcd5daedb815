"""The best epoch's weights survive a write the store refuses (issue 56): an elastic gang's next
formation takes the run over in memory, and model.pt ends up holding the epoch the run reports.

Real gloo ranks in processes of their own; the store refuses one write of rank 0 (retries
exhausted), the one part stood in for.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from prefect_ddp.tasks.data.storage import load_torch
from prefect_ddp.tasks.gang import free_port
from prefect_ddp.tasks.gang.handover import drop_parked
from prefect_ddp.tasks.training import best_weights, checkpointing
from prefect_ddp.tasks.training.checkpoint_writer import BackgroundWriter, CheckpointWriteError
from prefect_ddp.tasks.training.recipe import train_classifier
from tests.support.rank_processes import start_ranks
from tests.support.two_ranks import (
    StopAfterEpochsSeen,
    hand_over_as_rank,
    refuse_one_write,
    scored_epochs,
    stop_and_retry_as_rank,
    take_over_as_rank,
)
from tests.test_checkpoint_schedule import ended, kept_best, one_rank_state, train_job
from tests.test_training import CTX

# Epoch 2 is the best; epochs 3 and 4 are worse, so nothing after epoch 2 replaces its weights.
SCORES = [0.5, 0.9, 0.6, 0.6]


def test_a_refused_write_of_the_best_epoch_is_written_by_the_formation_that_takes_over(tmp_path):
    """Rank 0's model.pt of epoch 2 is refused; the first formation fails at epoch 3's boundary and
    both ranks park at the same position. Before, rank 0 parked without epoch 2's weights (forgotten
    when handed to the writer), its park won the tie, and model.pt kept epoch 1's weights."""
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=4, every="epoch")
    start_ranks(take_over_as_rank, ((free_port(), free_port()), job, tmp_path, SCORES, "model.pt"), 2)
    ranks = [json.loads((tmp_path / f"taken{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["failed"] == "CheckpointWriteError"  # the refused write failed the first formation
    assert [r["handed_over"] for r in ranks][0] == [False, True]  # the second took over from memory
    assert [r["history"] for r in ranks] == [[1, 2, 3, 4]] * 2
    assert [r["best_epoch"] for r in ranks] == [2, 2]
    card = json.loads((tmp_path / "out" / "model.json").read_text())
    assert card["epoch"] == 2
    assert_model_pt_holds(tmp_path / "out", tmp_path / "epoch2.pt")


def assert_model_pt_holds(output: Path, weights: Path) -> None:
    kept = load_torch(str(output / "model.pt"), {})
    best = torch.load(weights, weights_only=True)
    assert all(torch.equal(kept[name], best[name]) for name in best), f"model.pt does not hold {weights.name}"


@pytest.mark.unit
def test_a_refused_checkpoint_of_the_best_epoch_leaves_its_weights_to_the_formation_that_takes_over(tmp_path,
                                                                                                   monkeypatch):
    """The checkpoint of epoch 2 is refused, so model.pt of epoch 2 is skipped after it: the copy stays
    with rank 0's park (an elastic gang of one), and the next formation writes it."""
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=4, every="epoch")
    ctx = dataclasses.replace(CTX, gang_id="gang-refused", elastic=True)
    scored_epochs(SCORES, keep_weights=tmp_path, patch=monkeypatch.setattr)
    refuse_one_write("checkpoint", epoch=2, patch=monkeypatch.setattr)
    try:
        with pytest.raises(CheckpointWriteError, match="the checkpoint of epoch 2"):
            train_classifier(ctx, job)
        again = train_classifier(dataclasses.replace(ctx, attempt=1), job)
    finally:
        drop_parked("gang-refused")
    assert again.attempts[-1]["handed_over"] and [h["epoch"] for h in again.history] == [1, 2, 3, 4]
    assert again.best_epoch == 2 and json.loads((tmp_path / "out" / "model.json").read_text())["epoch"] == 2
    assert_model_pt_holds(tmp_path / "out", tmp_path / "epoch2.pt")


def test_a_stop_is_the_run_s_end_for_a_retry_under_either_checkpoint_setting(tmp_path):
    """A caller's part stops the run after epoch 2 of 5; the same job run again, as a flow retry does,
    ends there too: it trains nothing (under "auto" the stopped epoch was not checkpointed, and was
    trained twice), and not past the stop ([1, 2, 3, 4] before)."""
    jobs = {every: train_job(tmp_path / "images", tmp_path / every, epochs=5, every=every) for every in ("auto", "epoch")}
    start_ranks(stop_and_retry_as_rank, (free_port(), jobs, tmp_path), 2)
    ranks = [json.loads((tmp_path / f"retried{rank}.json").read_text()) for rank in (0, 1)]
    for every in jobs:
        first, again = ranks[0][every]["first"], ranks[0][every]["again"]
        assert ranks[1][every] == ranks[0][every], every
        assert first["history"] == again["history"] == [1, 2], (every, first, again)
        assert (first["trained"], again["trained"]) == (2, 0), every
        assert again["best_epoch"] == first["best_epoch"]
        checkpoint = load_torch(str(tmp_path / every / "checkpoints" / "checkpoint.pt"), {})
        assert checkpoint["stopped"] == {"epoch": 2, "why": "patience ran out", "kind": "stop"}
        assert json.loads((tmp_path / every / "model.json").read_text())["epoch"] == first["best_epoch"]


@pytest.mark.unit
def test_the_best_epoch_is_forgotten_only_once_model_pt_landed(tmp_path, monkeypatch):
    """Rank 0's copy of the best epoch stays when the store refuses model.pt, so that a park or the
    next checkpoint carries it (before, it was forgotten when handed to the writer)."""
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=4, every="epoch")
    ctx, state = one_rank_state()
    kept = kept_best(ctx, state.model, job)
    kept.after_epoch(ended([{"epoch": 1, "val_acc": 0.9}]))
    monkeypatch.setattr(best_weights, "save_torch", refused)
    with pytest.raises(CheckpointWriteError, match=r"model.pt \(epoch 1\)"):
        with BackgroundWriter() as writer:
            kept.write_after_checkpoint(writer)
    assert kept.unwritten(None) is not None and kept.unwritten(None)[0] == 1  # a park carries it
    assert not kept.waiting()  # given to the writer: no checkpoint waits for it now...
    monkeypatch.undo()
    with BackgroundWriter() as writer:  # ...and the next formation's writer lands it
        kept.write_after_checkpoint(writer)
    assert kept.unwritten(None) is None and json.loads((tmp_path / "out" / "model.json").read_text())["epoch"] == 1


def refused(url: str, *args, **kwargs) -> None:
    raise OSError(f"503 SlowDown for {url}: the store's retries are exhausted")


@pytest.mark.unit
def test_an_elastic_take_over_of_a_stopped_run_trains_nothing_more(tmp_path, monkeypatch):
    """The stop's checkpoint is refused: the formation fails and parks the stop with its state; the
    next formation takes it over in memory and ends where the stop ended the run, writing its
    checkpoint then."""
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=4, every="epoch")
    ctx = dataclasses.replace(CTX, gang_id="gang-stop", elastic=True)
    landing = checkpointing.save_torch

    def refuse_the_stop(url, snapshot, options, **kwargs):
        if "stopped" in snapshot:
            refused(url)
        landing(url, snapshot, options, **kwargs)

    monkeypatch.setattr(checkpointing, "save_torch", refuse_the_stop)
    with pytest.raises(CheckpointWriteError, match=r"the run stopped"):
        train_classifier(ctx, job, parts=[StopAfterEpochsSeen])
    monkeypatch.undo()
    try:
        again = train_classifier(dataclasses.replace(ctx, attempt=1), job, parts=[StopAfterEpochsSeen])
    finally:
        drop_parked("gang-stop")
    assert again.attempts[-1]["handed_over"] and [h["epoch"] for h in again.history] == [1, 2]
    assert again.local_train_samples == []
    assert load_torch(str(tmp_path / "out" / "checkpoints" / "checkpoint.pt"), {})["stopped"]["epoch"] == 2


@pytest.mark.parametrize(("carries", "handed"), [([-1, 2], "rank1"), ([2, 2], "rank0")])
def test_of_states_parked_at_one_position_the_one_carrying_the_best_weights_is_handed_over(tmp_path, carries,
                                                                                            handed):
    """Rank 0 parked without the best weights its write lost, rank 1 with them: rank 1's is handed over
    (ties went to rank 0 before, and the weights were lost); otherwise the lowest rank's."""
    start_ranks(hand_over_as_rank, (free_port(), carries, tmp_path), 2)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"handed{rank}.json").read_text()) == {"data": handed, "carries": max(carries)}


@pytest.mark.unit
def test_a_stop_after_a_refused_model_pt_is_checkpointed_all_the_same(tmp_path, monkeypatch):
    """A fixed-size gang: the stop comes after epoch 2, whose model.pt the store refused. The stop's
    checkpoint used to wait for the writes before it, raise their failure and never be written:
    the retry trained past the stop (break-it review of issue 56)."""
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=5, every="epoch")
    scored_epochs([0.5, 0.9, 0.6, 0.6, 0.6], keep_weights=tmp_path, patch=monkeypatch.setattr)
    refuse_one_write("model.pt", epoch=2, patch=monkeypatch.setattr)
    with pytest.raises(CheckpointWriteError, match=r"model.pt \(epoch 2\)"):
        train_classifier(CTX, job, parts=[StopAfterEpochsSeen])
    again = train_classifier(CTX, job, parts=[StopAfterEpochsSeen])
    assert [h["epoch"] for h in again.history] == [1, 2] and again.local_train_samples == []
    assert again.best_epoch == 2 and json.loads((tmp_path / "out" / "model.json").read_text())["epoch"] == 2
    assert_model_pt_holds(tmp_path / "out", tmp_path / "epoch2.pt")


class FailsInTheNextEpoch(torch.nn.Module):
    """The DDP-wrapped model of a rank whose peer is lost in the first step after `armed` is set: the
    forward pass has run (BatchNorm's running statistics moved) when the step fails."""

    def __init__(self, inner: torch.nn.Module, armed: dict[str, bool]) -> None:
        super().__init__()
        self.inner = inner
        self.armed = armed

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = self.inner(images)
        if self.training and self.armed["on"]:
            raise RuntimeError("Connection closed by peer: the gang lost a rank")
        return out


@pytest.mark.unit
def test_a_take_over_after_a_failed_first_step_keeps_the_best_epoch_s_own_weights(tmp_path, monkeypatch):
    """Epoch 1 is the best and its model.pt landed; a peer is lost in epoch 2's first step, after its
    forward pass. The next formation took the parked model for epoch 1's and wrote it over model.pt,
    though its BatchNorm statistics had moved (found by bench.soak --recipe, issue 56)."""
    from prefect_ddp.tasks.training import recipe

    job = train_job(tmp_path / "images", tmp_path / "out", epochs=3, every="epoch")
    ctx = dataclasses.replace(CTX, gang_id="gang-first-step", elastic=True)
    scored_epochs([0.9, 0.5, 0.5], keep_weights=tmp_path, patch=monkeypatch.setattr)
    armed = {"on": False}
    scored, wrap = recipe.run_epoch, recipe.wrap_ddp

    def epoch_then_arm(*args, **kwargs):
        recorded = scored(*args, **kwargs)
        armed["on"] = True  # the first epoch is recorded: the next training forward fails
        return recorded

    monkeypatch.setattr(recipe, "run_epoch", epoch_then_arm)
    monkeypatch.setattr(recipe, "wrap_ddp", lambda model, device: FailsInTheNextEpoch(wrap(model, device), armed))
    try:
        with pytest.raises(RuntimeError, match="Connection closed by peer"):
            train_classifier(ctx, job)
        armed["on"] = False
        monkeypatch.setattr(recipe, "run_epoch", scored)
        again = train_classifier(dataclasses.replace(ctx, attempt=1), job)
    finally:
        drop_parked("gang-first-step")
    assert again.attempts[-1]["handed_over"] and again.best_epoch == 1
    assert_model_pt_holds(tmp_path / "out", tmp_path / "epoch1.pt")

"""An elastic gang's decisions that need no cluster: where a formation parks, what it keeps, its limits
(tasks/training/regrouping.py, tasks/gang/plan.py); then the recipe on real gloo ranks growing
mid-epoch from 2 to 3 ranks."""

from __future__ import annotations

import io
import itertools
import json

import pytest
import torch

from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler
from prefect_ddp.tasks.gang import GangRegroup, GangStopped, RankContext, context, free_port, handover
from prefect_ddp.tasks.gang.plan import plan_ranks
from prefect_ddp.tasks.selection import Selection
from prefect_ddp.tasks.training.checkpoints import failures_seen
from prefect_ddp.tasks.training import recipe
from prefect_ddp.tasks.training.best_weights import BestWeights
from prefect_ddp.tasks.training.boundary import EpochEnd
from prefect_ddp.tasks.training.job import RunFiles
from prefect_ddp.tasks.training.recipe import train_classifier
from prefect_ddp.tasks.training.step_times import time_gradient_sync
from prefect_ddp.tasks.training.regrouping import Position
from tests.support.rank_processes import start_ranks
from tests.support.two_ranks import grow_as_rank
from tests.test_checkpoint_schedule import train_job

ADDRESSES = ["tcp://10.0.0.1:1", "tcp://10.0.0.1:2"]


@pytest.mark.unit
def test_a_formation_that_took_over_mid_epoch_parks_where_it_took_over_until_it_steps():
    sampler = PositionedSampler(600, 2, 0, seed=0, batch_size=4)
    sampler.set_epoch(2, 120)
    position = Position(2, start=120)
    assert position.global_position(sampler) == 120  # lost before its first step: not the epoch's start
    position.stepped(2, 8)
    assert position.global_position(sampler) == 120 + 8 * 2
    position.epoch_done(2)
    assert (position.epoch, position.global_position(sampler)) == (3, 0)


@pytest.mark.unit
def test_an_elastic_gang_s_top_and_regroups_reach_its_ranks():
    probes = {a: {"cuda": False} for a in ADDRESSES}
    every_worker = plan_ranks(ADDRESSES, probes, 29500, 2, None, 30, elastic=True, max_world_size=None, regroups=1)
    assert [(c.max_world_size, c.elastic, c.regroups) for c in every_worker] == [(None, True, 1)] * 2
    fixed = plan_ranks(ADDRESSES, probes, 29500, 0, None, 30, max_world_size=None)
    assert [c.max_world_size for c in fixed] == [2, 2]


@pytest.mark.unit
def test_every_rank_of_an_elastic_gang_keeps_the_unwritten_best_weights_and_rank_0_alone_writes(tmp_path):
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=3, every="auto")
    model = torch.nn.Linear(2, 2)
    for rank, elastic, keeps in [(1, True, True), (1, False, False), (0, False, True)]:
        ctx = RankContext(rank=rank, local_rank=rank, world_size=2, local_world_size=2, backend="gloo", device="cpu",
                          worker_address="local", master_addr="127.0.0.1", master_port=0, elastic=elastic)
        kept = BestWeights(ctx, model, RunFiles.of(job, {}), Selection())
        kept.after_epoch(EpochEnd(0, [{"epoch": 1, "val_acc": 0.5}], last=False))
        assert (kept.unwritten(2) is not None) == keeps, (rank, elastic)


def test_the_recipe_grows_mid_epoch_at_its_step_boundary_and_the_larger_gang_trains_the_rest_once(tmp_path):
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=2, every="epoch")
    job = job.model_copy(update={"training": job.training.model_copy(update={"batch_size": 2,
                                                                             "regroup_every_steps": 2})})
    train_size = len(job.split.train)
    at = 2 * 2 * 2  # told to grow at the first ask, after step 2 of epoch 1: 2 steps of 2 images on 2 ranks
    assert at + 2 * 2 < train_size  # mid-epoch: a step is left to take
    start_ranks(grow_as_rank, ((free_port(), free_port()), job, tmp_path, 1), 3)
    ranks = [json.loads((tmp_path / f"grown{rank}.json").read_text()) for rank in range(3)]
    assert [r["regrouped"] for r in ranks] == [f"rank {rank} regroups at sample {at} of epoch 1" for rank in (0, 1)] + [""]
    attempts = ranks[0]["attempts"]
    assert [(a["world_size"], a["at_sample"], a["handed_over"]) for a in attempts] == [(2, 0, False), (3, at, True)]
    first, second = ranks[0]["history"]
    assert first["taken_over_at_sample"] == at and "taken_over_at_sample" not in second
    # The first formation's train sums of the epoch went along, added up over both its ranks: the
    # epoch's loss and accuracy cover its images too, not the second formation's part alone.
    assert [r["parked_trained"]["sums"][2] for r in ranks[:2]] == [at, at]
    assert ranks[0]["parked_trained"] == ranks[1]["parked_trained"]
    # Each epoch trained the train set once, up to the sampler's bounded remainder (fewer than 3
    # repeats, at most 3 left out), the grown epoch counting both formations' images.
    assert all(train_size - 3 <= h["train_samples"] < train_size + 3 for h in (first, second)), (train_size, first)
    metrics = ("train_samples", "train_loss", "train_acc", "val_loss", "val_acc")
    assert all([{k: h[k] for k in metrics} for h in r["history"]] == [{k: h[k] for k in metrics} for h in
                                                                      ranks[0]["history"]] for r in ranks)


def lost_in_set_up(*args) -> None:
    raise GangStopped("a peer was lost as the gang was set up")


def formations_of_one_rank(job, events: list[tuple[str, int] | None], monkeypatch,
                           parked: list | None = None) -> list[dict]:
    """Formations of a one-rank elastic gang in turn, each ending as `events` says: ("fail", k),
    its k-th step's stop check raises (a peer lost; k=0: before its first step, as the gang is
    set up); ("grow", k), its k-th ask answers yes; None,
    it trains to the end. Returns the last one's history; appends to `parked` what each formation
    before it parked of the epoch so far (`trained`)."""
    regroups = 0
    for attempt, event in enumerate(events):
        kind, at = event or ("", 0)
        steps, asks = itertools.count(1), itertools.count(1)
        monkeypatch.setattr(context, "stop_requested", lambda flag, kind=kind, at=at, steps=steps:
                            kind == "fail" and next(steps) == at)
        monkeypatch.setattr(context, "grow_requested", lambda flag, kind=kind, at=at, asks=asks:
                            kind == "grow" and next(asks) == at)
        monkeypatch.setattr(recipe, "time_gradient_sync", lost_in_set_up if (kind, at) == ("fail", 0) else
                            time_gradient_sync)
        ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device="cpu",
                          worker_address="local", master_addr="127.0.0.1", master_port=0, gang_id="gang-one",
                          stop_flag="flag", max_world_size=2, elastic=True, attempt=attempt, regroups=regroups)
        try:
            return train_classifier(ctx, job).history
        except GangRegroup:
            regroups += 1
        except GangStopped:
            pass
        if parked is not None:
            parked.append(torch.load(io.BytesIO(handover._parked["gang-one"].data), weights_only=True)["trained"])
    raise AssertionError("the last formation did not complete")


def one_rank_job(tmp_path):
    job = train_job(tmp_path / "images", tmp_path / "out", epochs=1, every="epoch")
    return job.model_copy(update={"training": job.training.model_copy(update={"batch_size": 2,
                                                                             "regroup_every_steps": 2})})


@pytest.mark.unit
@pytest.mark.parametrize("events", [
    [("fail", 3), ("grow", 1), None],  # the images before the failure have no sums, yet are counted
    [("grow", 1), ("grow", 1), None],
    [("grow", 1), ("fail", 3), None],
    [("grow", 1), ("fail", 0), None],  # lost before its first step: what it took over goes on whole
])
def test_an_epoch_with_several_formations_counts_every_image_it_trained_once(tmp_path, monkeypatch, events):
    job = one_rank_job(tmp_path)
    handover.drop_parked()
    parked: list = []
    (record,) = formations_of_one_rank(job, events, monkeypatch, parked)
    if events[1] == ("fail", 0):
        assert parked[1] == parked[0] and parked[0]["sums"][2] == 4  # passed on whole: 2 steps of 2 images
    (plain,) = formations_of_one_rank(job.model_copy(update={"output": job.output.model_copy(
        update={"url": str(tmp_path / "plain")})}), [None], monkeypatch)
    size = len(job.split.train)
    assert record["taken_over_at_sample"] > 0
    assert size - 1 <= record["train_samples"] <= size, (size, record)  # one rank: at most 1 left out, no repeats
    if events[1] != ("fail", 3):  # no rank lost with its sums: the accuracy is over every image trained
        assert 0 <= record["train_acc"] * record["train_samples"] == pytest.approx(
            round(record["train_acc"] * record["train_samples"]))
        assert record["train_samples"] == plain["train_samples"]


@pytest.mark.unit
def test_an_unreadable_image_met_before_a_grow_counts_against_the_limit(tmp_path, monkeypatch):
    job = one_rank_job(tmp_path)
    job = job.model_copy(update={"unreadable": job.unreadable.model_copy(update={"limit": 0.01})})
    order = PositionedSampler(len(job.split.train), 1, 0, job.split.seed, batch_size=2)
    first = job.manifest.paths[job.split.train[next(iter(order))]]
    (tmp_path / "images" / first).unlink()  # the epoch's first image: met before the grow at step 2
    handover.drop_parked()
    regroups = []
    monkeypatch.setattr(context, "stop_requested", lambda flag: False)
    monkeypatch.setattr(context, "grow_requested", lambda flag: not regroups)
    ctx = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device="cpu",
                      worker_address="local", master_addr="127.0.0.1", master_port=0, gang_id="gang-one",
                      stop_flag="flag", max_world_size=2, elastic=True)
    with pytest.raises(GangRegroup):
        train_classifier(ctx, job)
    regroups.append(1)
    result = train_classifier(RankContext(**{**ctx.__dict__, "attempt": 1, "regroups": 1}), job)
    assert result.stopped and "could not be read" in result.stopped, result
    assert [key.endswith(first) for key in result.unreadable["keys"]] == [True]


@pytest.mark.unit
def test_regroups_are_no_failures_for_the_checkpoint_schedule_across_a_prefect_retry():
    # One run_gang call: 3 grows, then a failure; then a Prefect retry's call, from attempt 1 again.
    rows = [{"attempt": n, "regroups": r} for n, r in [(1, 0), (2, 1), (3, 2), (4, 3), (1, 0)]]
    assert failures_seen(rows, attempt=0, regroups=0) == 1
    assert failures_seen(rows[:4], attempt=3, regroups=3) == 0
    assert failures_seen([], attempt=2, regroups=1) == 1  # rank 0's record missing an attempt that failed early

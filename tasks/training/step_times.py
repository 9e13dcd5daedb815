"""Where a rank's training time goes, and the one-line verdict a person can act on.

Each training step is cut into consecutive parts by marks on one clock, so the parts of an
epoch add up to the time of its training pass (tests/test_step_times.py checks it on a real
2-rank gloo run):

- data: waiting for the next batch and putting it on the device (decoding it there with
  `decode_on="device"`); the first batch's wait includes starting the loader.
- forward, backward: the model's compute.
- sync: the part of backward that waits for the gradient all-reduce, i.e. on the network
  and on slower peers. DDP all-reduces gradients in buckets while backward still runs; a
  hook on each parameter marks its gradient's arrival, the last of which hands DDP its
  last bucket, and what backward spends after that waits on the other ranks. Without a
  process group it is zero.
- optimizer: the update (and the loss scaler's).
- other: metric sums, progress reports and the stop check between steps.

On CPU the clock is `time.perf_counter`; on CUDA each mark records an event on the
device's stream, so the parts are the device's timeline (a rank waiting for data shows as
the device idle) and reading them costs one synchronisation per epoch, not one per mark.

At the end of the epoch every rank's parts are gathered (one all-reduce of a small
matrix) and `epoch_timing` turns them into shares, images per second, the slowest rank
and a verdict; docs/troubleshooting.md, "Where the time goes", says what each verdict means.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.loaders import LoaderWorkers
from prefect_ddp.tasks.training.decode_cost import DecodeCost, cpu_verdict, decode_verdict

PARTS = ("data", "forward", "backward", "sync", "optimizer", "other")
COMPUTE = ("forward", "backward", "optimizer")  # the parts the rank's own device works in
# One row per rank in the gathered matrix: the parts, then these.
EXTRA = ("validation", "train_wall", "images")
# Thresholds of the verdict: the share of step time, and how much slower than the others
# a rank's own work (its step less the sync it waits in) must be to be called a straggler.
INPUT_BOUND = 0.25
SYNC_BOUND = 0.30
STRAGGLER = 1.25
# ... and lose the others at least this many seconds in the epoch: on short epochs a
# moment's scheduling noise is a large ratio.
STRAGGLER_MIN_S = 1.0
# EpochTiming's fields that only the run's summary fills in.
SUMMARY_ONLY = ("checkpoint_s", "checkpoint_share", "checkpoints")
# CUDA marks are folded into totals once this many are pending (one synchronisation).
FOLD_EVERY = 4096


@dataclass
class StepClock:
    """One rank's clock for an epoch's training pass; `totals()` are seconds per part."""

    device: torch.device
    totals_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    _pending: list[tuple[str, Any]] = field(default_factory=list)  # (part ending here, stamp), CUDA only
    _last: Any = None
    _last_gradient: Any = None  # when this step's latest gradient arrived

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def _stamp(self) -> Any:
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> None:
        """Begin an epoch: everything from here until the first batch arrives is data."""
        self.totals_s = dict.fromkeys(PARTS, 0.0)
        self._pending.clear()
        self._last, self._last_gradient = self._stamp(), None

    def mark(self, part: str) -> None:
        """The time since the last mark was spent in `part`."""
        self._add(part, self._stamp())

    def gradient_ready(self) -> None:
        """Called as each parameter's gradient arrives; the last call ends backward's compute."""
        self._last_gradient = self._stamp()

    def after_backward(self) -> None:
        """Split backward at the last gradient's arrival: compute before it, sync after it."""
        if self._last_gradient is not None:
            self._add("backward", self._last_gradient)
            self._last_gradient = None
            self.mark("sync")
        else:
            self.mark("backward")

    def totals(self) -> dict[str, float]:
        """Seconds per part since `start`."""
        self._fold()
        return dict(self.totals_s)

    def _add(self, part: str, stamp: Any) -> None:
        if self.on_cuda:
            self._pending.append((part, stamp))
            if len(self._pending) >= FOLD_EVERY:
                self._fold()
            return
        self.totals_s[part] += max(0.0, stamp - self._last)
        self._last = stamp

    def _fold(self) -> None:
        if not self._pending:
            return
        self._pending[-1][1].synchronize()
        for part, event in self._pending:
            self.totals_s[part] += max(0.0, self._last.elapsed_time(event) / 1000)
            self._last = event
        self._pending.clear()


def time_gradient_sync(ddp_model: torch.nn.Module, clock: StepClock) -> None:
    """Have `clock` see when backward has computed the last gradient; nothing to do without DDP.

    A hook on each trained parameter marks its gradient's arrival; the last one is when
    DDP hands its last bucket to the all-reduce, and what backward spends after it waits on
    the other ranks. Not a DDP comm hook: a Python comm hook replaces DDP's fused
    all-reduce and adds a pass over every gradient (5 % of a CPU step in bench/step_times.py).
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        return
    for parameter in ddp_model.parameters():
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(lambda _: clock.gradient_ready())


def gang_rows(parts: dict[str, float], validation_s: float, train_wall_s: float, images: int,
              rank: int, world_size: int) -> list[float]:
    """This rank's row, in its place in a flat zero matrix of every rank's: summed over the
    ranks (the metrics' all-reduce), it becomes every rank's rows (`split_rows`)."""
    row = [parts[p] for p in PARTS] + [validation_s, train_wall_s, float(images)]
    flat = [0.0] * (len(row) * world_size)
    flat[rank * len(row):(rank + 1) * len(row)] = row
    return flat


def split_rows(flat: list[float]) -> list[list[float]]:
    """The summed matrix back into one row per rank."""
    width = len(PARTS) + len(EXTRA)
    return [flat[i:i + width] for i in range(0, len(flat), width)]


def input_advice(cfg: TrainingConfig, from_object_store: bool, loader_processes: int, cached: bool) -> str:
    """What would feed the ranks faster, given how this run reads its images with `loader_processes`,
    through a byte cache that keeps every image where `cached` (`CacheChoice.keeps_every_image`)."""
    advice = []
    if loader_processes == 0:
        advice.append("loader workers (training.num_workers) would decode in parallel with the steps")
    if from_object_store and not cfg.images_per_shard:
        advice.append("shards (training.images_per_shard) would read whole shards with one request each")
    if from_object_store and not cached:
        advice.append("the byte cache (training.cache_gb) would serve later epochs from local disk")
    if not advice:
        advice.append("more loader workers, or a host with more cores per rank, would decode faster")
    return "; ".join(advice)


class RankTime(BaseModel):
    """One rank's time in an epoch: its step time, cut into PARTS (seconds each), then its
    validation pass, its whole training pass, and the images it trained on."""

    rank: int
    step_s: float  # the sum of its PARTS
    data: float
    forward: float
    backward: float
    sync: float
    optimizer: float
    other: float
    validation: float
    train_wall_s: float
    images: int


class EpochTiming(BaseModel):
    """Where the gang's time went in one epoch: each epoch record's `time`, and the run's summary's.

    Attributes:
        images_per_s: the gang's images over its slowest rank's training pass.
        shares: per part of PARTS, its share of the ranks' summed step time.
        per_rank: every rank's time, in rank order.
        slowest_rank, slower_by: the rank whose own work (its step less the sync it waits in)
            took longest, and how many times the median of the others' it took.
        verdict: the one line a person can act on (docs/troubleshooting.md, "Where the time goes").
        checkpoint_s: in the run's summary only (None elsewhere, and then left out of the
            record, as the two below): the seconds training waited for rank 0's checkpoints
            (tasks/training/checkpoint_writer.py), per epoch this attempt trained, on average.
        checkpoint_share: those seconds' share of the time those epochs trained and waited.
        checkpoints: which epochs rank 0 checkpointed, and why (checkpoint_interval.py).
    """

    images_per_s: float
    shares: dict[str, float]
    per_rank: list[RankTime]
    slowest_rank: int
    slower_by: float
    verdict: str
    checkpoint_s: float | None = None
    checkpoint_share: float | None = None
    checkpoints: str | None = None

    @model_serializer(mode="wrap")
    def _without_unmeasured(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        record: dict[str, Any] = handler(self)
        return {k: v for k, v in record.items() if v is not None or k not in SUMMARY_ONLY}


def epoch_timing(rows: list[list[float]], advice: str,
                 decode: Callable[[], DecodeCost | None] | None = None,
                 loaders: LoaderWorkers | None = None) -> EpochTiming:
    """The gang's time for one epoch from every rank's row: shares, rate, slowest rank, verdict.

    Shares are of the ranks' summed step time; images per second is the gang's images over
    its slowest rank's training pass (the others wait for it at every step). `decode`: what
    decoding this run's images costs (rank 0's probe), asked only for an input-bound verdict;
    `loaders`: each rank's loader processes and CPUs, which that cost keeps busy or not (`cpu_verdict`).

    >>> fast = [1.0, 2.0, 4.0, 0.5, 0.4, 0.1, 1.0, 8.0, 100.0]
    >>> epoch_timing([fast, fast], "shards").verdict
    'compute-bound: 80% of each step is forward, backward and optimizer; the input keeps up.'
    """
    ranks = [dict(zip(PARTS + EXTRA, row)) for row in rows]
    step_s = [sum(r[p] for p in PARTS) for r in ranks]
    total = max(sum(step_s), 1e-9)
    shares = {p: sum(r[p] for r in ranks) / total for p in PARTS}
    own_work = [s - r["sync"] for s, r in zip(step_s, ranks)]
    slowest = max(range(len(ranks)), key=lambda i: own_work[i])
    others = [w for i, w in enumerate(own_work) if i != slowest]
    median = statistics.median(others) if others else own_work[slowest]
    slower_by = own_work[slowest] / max(median, 1e-9)
    straggles = slower_by >= STRAGGLER and own_work[slowest] - median >= STRAGGLER_MIN_S
    wall = max(r["train_wall"] for r in ranks)
    return EpochTiming(
        images_per_s=round(sum(r["images"] for r in ranks) / max(wall, 1e-9), 1),
        shares={p: round(s, 3) for p, s in shares.items()},
        per_rank=[RankTime(rank=i, step_s=round(s, 3), **{p: round(r[p], 3) for p in PARTS},
                           validation=round(r["validation"], 3), train_wall_s=round(r["train_wall"], 3),
                           images=int(r["images"]))
                  for i, (s, r) in enumerate(zip(step_s, ranks))],
        slowest_rank=slowest,
        slower_by=round(slower_by, 2),
        verdict=verdict(shares, slowest, slower_by if straggles else None, ranks[slowest], advice, decode,
                        sum(r[p] for r in ranks for p in COMPUTE) / max(sum(r["images"] for r in ranks), 1),
                        loaders),
    )


def verdict(shares: dict[str, float], slowest: int, slower_by: float | None, slowest_parts: dict[str, float],
            advice: str, decode: Callable[[], DecodeCost | None] | None = None,
            compute_s_per_image: float = 0.0, loaders: LoaderWorkers | None = None) -> str:
    """One line: what bounds the steps, and what would help; `slower_by` None when no rank straggles."""
    if slower_by is not None:
        cause = "waiting for its data" if slowest_parts["data"] >= max(
            slowest_parts[p] for p in COMPUTE) else "computing"
        return (f"rank {slowest} is {slower_by:.1f}x slower than the median of the others (most of it "
                f"{cause}); the others wait for it in every gradient sync. Look at its host: load, "
                "a slower CPU or GPU, its network to the images.")
    cost = decode() if shares["data"] >= INPUT_BOUND and decode is not None else None
    if cost is not None and cost.bounds(compute_s_per_image):
        return decode_verdict(cost, shares["data"], compute_s_per_image)
    rate = slowest_parts["images"] / max(slowest_parts["train_wall"], 1e-9)
    if cost is not None and loaders is not None and cost.keeps_busy(rate, loaders.workers):
        return cpu_verdict(cost, shares["data"], compute_s_per_image, loaders)
    if shares["data"] >= INPUT_BOUND:
        return f"input-bound: {shares['data']:.0%} of each step waits for data; {advice}."
    if shares["sync"] >= SYNC_BOUND:
        return (f"communication-bound: {shares['sync']:.0%} of each step waits on gradient sync; a larger "
                "batch (fewer syncs per image) or a faster network between the workers would cut it.")
    compute = sum(shares[p] for p in COMPUTE)
    return f"compute-bound: {compute:.0%} of each step is forward, backward and optimizer; the input keeps up."


def live_text(parts: dict[str, float], images: int, seconds: float) -> str:
    """Rank 0's own shares so far this epoch, for the live progress artifact.

    >>> live_text({"data": 6.0, "forward": 1.0, "backward": 2.0, "sync": 0.5, "optimizer": 0.5, "other": 0.0}, 50, 10.0)
    'rank 0 this epoch: 60% waiting for data, 35% compute, 5% gradient sync; 5.0 images/s'
    """
    total = max(sum(parts.values()), 1e-9)
    compute = sum(parts[p] for p in COMPUTE)
    return (f"rank 0 this epoch: {parts['data'] / total:.0%} waiting for data, {compute / total:.0%} compute, "
            f"{parts['sync'] / total:.0%} gradient sync; {images / max(seconds, 1e-9):.1f} images/s")

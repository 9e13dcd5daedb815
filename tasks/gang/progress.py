"""How far each rank has got, and the rule that calls a gang hung (docs/architecture.md, "Gang: progress").

A frozen worker process (SIGSTOP, a hung host, a swap storm) is alive and silent: its peers
wait in a collective until its timeout (gloo 300 s, NCCL 600 s) and Dask drops the worker
only after the scheduler's worker TTL. The supervisor can do better, because the ranks tell
it how far they have got:

- Each rank sends its progress (phase, epoch, step) as a Dask structured event
  (`Worker.log_event`: fire and forget over the worker's batched stream, no round trip),
  when its phase changes and at most once a second otherwise; the scheduler stamps each
  with its own clock. Nothing is sent while nothing changes, so the last event's time is
  the time of the rank's last progress.
- The supervisor asks the scheduler, in one call, for the events that arrived since its
  last poll and how long ago each rank's worker last heartbeated, and keeps each rank's
  last event and the longest gap between two events seen so far (a frozen process stops its heartbeats too; one blocked in a collective does
  not, as its event loop runs in another thread).
- The gang is hung when no rank has made progress for the hang limit and a rank's worker
  has stopped heartbeating (frozen), or, with every worker alive, for the longer limit of
  a slow phase: before the first step, in validation and around checkpoints a rank may be
  silent for long (`SLOW_PHASE_FACTOR` times the limit). A function that never reports
  beyond the rendezvous is only ever taken for hung when its worker freezes.
- The limit is `hang_timeout_s` when given; otherwise the larger of `DEFAULT_HANG_S` and
  `GAP_FACTOR` times the longest gap between progress events seen so far in the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import distributed

PHASES = ("rendezvous", "data", "step", "validation", "checkpoint")
# Phases in which a rank may legitimately be silent for long: meeting the others, building
# loaders and the first step (compilation, cuDNN autotuning, the first fetches), a whole
# validation pass (no step reports inside it), and checkpoints.
SLOW_PHASES = {"rendezvous", "data", "validation", "checkpoint"}
SEND_EVERY_S = 1.0
DEFAULT_HANG_S = 60.0
GAP_FACTOR = 5.0
SLOW_PHASE_FACTOR = 5.0
# A worker that has not heartbeated for this long (its heartbeats come every 0.5-5 s,
# depending on the cluster's size) is taken for frozen.
FROZEN_AFTER_S = 10.0

# (topic, rank) -> this rank's progress in this process: the record, when it was last sent
_ranks: dict[tuple[str, int], dict[str, Any]] = {}
_ranks_lock = threading.Lock()


def send_progress(topic: str | None, rank: int, phase: str | None = None, epoch: int | None = None,
                  step: int | None = None) -> None:
    """Tell the supervisor how far this rank has got; cheap enough to call every step.

    With a phase: the rank is now there (`epoch` and `step` as far as known). Without one
    (what `ctx.check_stop()` sends): one more step of the phase it is in. Sent when the
    phase changes and at most every SEND_EVERY_S otherwise. Without a topic (a context made
    by hand) or outside a Dask worker it does nothing.
    """
    if topic is None:
        return
    if phase is not None and phase not in PHASES:
        raise ValueError(f"Progress phase {phase!r} is not one of {', '.join(PHASES)}.")
    now = time.monotonic()
    with _ranks_lock:
        state = _ranks.setdefault((topic, rank), {"sent_at": -SEND_EVERY_S, "record": None})
        previous = state["record"]
        if phase is None:
            record = previous or {"rank": rank, "phase": "step", "epoch": None, "step": None}
        else:
            record = {"rank": rank, "phase": phase, "epoch": epoch, "step": step}
        state["record"] = record
        new_phase = previous is None or previous["phase"] != record["phase"]
        if not new_phase and now - state["sent_at"] < SEND_EVERY_S:
            return
        state["sent_at"] = now
    try:
        distributed.get_worker().log_event(topic, record)
    except ValueError:  # not in a Dask worker
        pass


def forget_progress(topic: str | None) -> None:
    """Drop this process's memory of a finished attempt's topic."""
    with _ranks_lock:
        for key in [k for k in _ranks if k[0] == topic]:
            del _ranks[key]


def _silent_for(dask_scheduler: Any, address: str, now: float) -> float | None:
    """Seconds since `address` last heartbeated; None for a worker the scheduler no longer has."""
    state = dask_scheduler.workers.get(address)
    return None if state is None else now - state.last_seen


def progress_on_scheduler(topic: str, addresses: list[str], after: float, dask_scheduler: Any = None
                          ) -> dict[str, Any]:
    """Run on the scheduler: the progress events stamped after `after` (oldest first), and the
    workers' silences. Reads the topic from its newest end, so a poll costs what arrived
    since the last one, not the whole run's history."""
    now = time.time()
    new = []
    for stamp, record in reversed(dask_scheduler.get_events(topic)):
        if stamp <= after:
            break
        new.append((stamp, record))
    silences = {address: _silent_for(dask_scheduler, address, now) for address in addresses}
    return {"now": now, "events": new[::-1], "worker_silence": silences}


def forget_on_scheduler(topic: str, dask_scheduler: Any = None) -> None:
    # The scheduler drops a worker's or a client's topic the same way when it leaves; it
    # has no public call for a topic of our own.
    dask_scheduler._broker._topics.pop(topic, None)


async def remove_unresponsive(addresses: list[str], dask_scheduler: Any = None) -> list[str]:
    """Run on the scheduler: drop those of `addresses` that stopped heartbeating. A frozen
    worker without a nanny (nothing can restart it) must not be leased again by the next
    attempt; the scheduler would drop it only after its worker TTL (minutes)."""
    now = time.time()
    silent = [a for a in addresses if (_silent_for(dask_scheduler, a, now) or 0) >= FROZEN_AFTER_S]
    for address in silent:
        await dask_scheduler.remove_worker(address, stimulus_id=f"prefect-ddp-frozen-{now}", close=True)
    return silent


@dataclass
class HangWatch:
    """The supervisor's side: polls the scheduler and says when, and why, the gang is hung."""

    client: distributed.Client
    topic: str
    workers: dict[int, str]  # rank -> worker address
    hang_timeout_s: float | None = None
    started_at: float | None = None  # scheduler clock, set at the first poll
    last: dict[int, tuple[float, dict[str, Any]]] = field(default_factory=dict)  # rank -> (stamp, record)
    longest_gap: float = 0.0  # between two reports of one rank in one phase that may not be slow

    def limit(self) -> float:
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        return max(DEFAULT_HANG_S, GAP_FACTOR * self.longest_gap)

    def take(self, events: list[tuple[float, dict[str, Any]]]) -> None:
        """Fold newly arrived reports into each rank's last one and the longest gap."""
        for stamp, record in events:
            previous = self.last.get(record["rank"])
            if previous is not None and record["phase"] == previous[1]["phase"] not in SLOW_PHASES:
                self.longest_gap = max(self.longest_gap, stamp - previous[0])
            self.last[record["rank"]] = (stamp, record)

    def check(self) -> str | None:
        """Why the gang is hung, naming the rank, its worker and its last progress; None while it is not."""
        after = max([stamp for stamp, _ in self.last.values()], default=0.0)
        seen = self.client.run_on_scheduler(progress_on_scheduler, self.topic, list(self.workers.values()), after)
        self.started_at = self.started_at if self.started_at is not None else seen["now"]
        self.take(seen["events"])
        last = self.last
        progressed = max((stamp for stamp, _ in last.values()), default=0.0)
        silent = seen["now"] - max(progressed, self.started_at)
        limit = self.limit()
        if silent < limit:
            return None
        frozen = [rank for rank, address in self.workers.items()
                  if (seen["worker_silence"][address] or 0) >= FROZEN_AFTER_S]
        # A function that reports nothing beyond the rendezvous (it never calls ctx.progress
        # or ctx.check_stop) is only ever taken for hung when its worker is frozen.
        reporting = len(last) == len(self.workers) and all(r["phase"] != "rendezvous" for _, r in last.values())
        slow = any(r["phase"] in SLOW_PHASES for _, r in last.values())
        if not frozen and (not reporting or silent < (SLOW_PHASE_FACTOR * limit if slow else limit)):
            return None
        ranks = frozen or sorted(self.workers, key=lambda r: last.get(r, (0.0, {}))[0])[:1]
        return "; ".join(self.describe(rank, last.get(rank), seen, limit, rank in frozen) for rank in ranks)

    def describe(self, rank: int, last: tuple[float, dict[str, Any]] | None, seen: dict[str, Any],
                 limit: float, frozen: bool) -> str:
        address = self.workers[rank]
        since = seen["now"] - (last[0] if last else self.started_at)
        where = "before its first progress report" if last is None else after_text(last[1])
        why = (f"its worker has not answered the scheduler for {seen['worker_silence'][address]:.0f} s (frozen)"
               if frozen else "its worker is alive but the rank is stuck")
        return (f"Rank {rank} on {address} made no progress for {since:.0f} s {where}: {why}; "
                f"the hang limit is {limit:.0f} s (cluster.hang_timeout_s)")

    def forget(self) -> None:
        self.client.run_on_scheduler(forget_on_scheduler, self.topic)


def after_text(record: dict[str, Any]) -> str:
    """'after step 412 of epoch 3 (phase: step)'."""
    parts = []
    if record.get("step") is not None:
        parts.append(f"step {record['step']}")
    if record.get("epoch") is not None:
        parts.append(f"epoch {record['epoch']}")
    return f"after {' of '.join(parts) or 'starting'} (phase: {record['phase']})"

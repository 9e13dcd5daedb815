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
  last event and its last `GAP_WINDOW` gaps between two steps (a frozen process stops its
  heartbeats too; one blocked in a collective does not, as its event loop runs in another
  thread).
- The gang is hung when no rank has made progress for the hang limit and a rank's worker
  has stopped heartbeating (frozen), or, with every worker alive, for the allowance: the
  limit (`SLOW_PHASE_FACTOR` times it in a slow phase: before the first step, in
  validation and around checkpoints a rank may be slow), never less than the floor (the
  recipe's fetch timeout: a live rank waiting for one batch is silent that long before its
  own error says so). A function that never reports beyond the rendezvous is only ever
  taken for hung when its worker freezes.
- The limit is `hang_timeout_s` when given; otherwise an estimate that follows the run:
  the larger of `DEFAULT_HANG_S` and `GAP_FACTOR` times the longest of the recent gaps
  between steps, so one slow step raises it only for the next `GAP_WINDOW` steps. An
  estimated limit and allowance stay below `CAP_SHARE` of the process group's timeout:
  a rank stuck longer leaves its peers failing on that timeout in their next collective,
  which names no culprit.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import distributed

PHASES = ("rendezvous", "download", "data", "step", "validation", "checkpoint")
# Phases in which a rank may legitimately be silent for long: meeting the others, building
# loaders and the first step (compilation, cuDNN autotuning, the first fetches), a
# validation batch (the first one's images are not fetched ahead), and checkpoints. A
# download reports as its bytes arrive, so it gets the plain limit.
SLOW_PHASES = {"rendezvous", "data", "validation", "checkpoint"}
SEND_EVERY_S = 1.0
DEFAULT_HANG_S = 60.0
GAP_FACTOR = 5.0
# Gaps between steps each rank's estimate remembers: one slow step (a stall, a swap burst)
# raises the limit only until this many steps have come after it.
GAP_WINDOW = 20
SLOW_PHASE_FACTOR = 5.0
# An estimated limit or allowance stays below this share of the process group's timeout,
# so a hang is named before the peers fail on that timeout (docs/architecture.md, "Gang: progress").
CAP_SHARE = 0.8
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


def collective_timeout_s(init_timeout_s: float, floor_s: float) -> float:
    """The process group's timeout: `init_timeout_s`, raised where a live rank may wait on its
    own (`floor_s`, the recipe's fetch timeout) longer than CAP_SHARE of it. Its peers wait that
    long in their next collective: with the timeout below the floor, they failed on it first,
    naming no cause, where the rank's own error names the images it waited for.

    >>> collective_timeout_s(300, 60), collective_timeout_s(60, 60)
    (300, 75.0)
    """
    return max(init_timeout_s, floor_s / CAP_SHARE)


@dataclass
class HangWatch:
    """The supervisor's side: polls the scheduler and says when, and why, the gang is hung."""

    # Settings
    client: distributed.Client
    topic: str
    workers: dict[int, str]  # rank -> worker address
    hang_timeout_s: float | None = None  # None: estimated from the recent gaps between steps
    floor_s: float = 0.0  # the least silence a gang of live workers is allowed (the fetch timeout)
    collective_timeout_s: float = 300.0  # the process group's timeout, which caps an estimate
    # Runtime attributes
    started_at: float | None = None  # scheduler clock, set at the first poll
    last: dict[int, tuple[float, dict[str, Any]]] = field(default_factory=dict)  # rank -> (stamp, record)
    gaps: dict[int, deque[float]] = field(default_factory=dict)  # rank -> its last GAP_WINDOW gaps between steps

    def recent_gap(self) -> float:
        """The longest gap between two steps of one rank among each rank's last GAP_WINDOW."""
        return max((max(gaps) for gaps in self.gaps.values() if gaps), default=0.0)

    def cap(self) -> float:
        return CAP_SHARE * self.collective_timeout_s

    def limit(self) -> float:
        """How long a gang with a frozen worker may make no progress: hang_timeout_s, or the estimate."""
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        return min(max(DEFAULT_HANG_S, GAP_FACTOR * self.recent_gap()), self.cap())

    def allowance(self, slow: bool) -> float:
        """How long a gang of live workers may make no progress, in a slow phase or not.

        At least the floor: a frozen worker waits on nothing, but a live rank may wait that
        long for one batch before its own fetch timeout fails it, naming the images.
        """
        allowed = self.limit() * (SLOW_PHASE_FACTOR if slow else 1.0)
        if self.hang_timeout_s is None:
            allowed = min(allowed, self.cap())
        return max(allowed, self.floor_s)

    def take(self, events: list[tuple[float, dict[str, Any]]]) -> None:
        """Fold newly arrived reports into each rank's last one and its recent gaps between steps."""
        for stamp, record in events:
            rank = record["rank"]
            previous = self.last.get(rank)
            if previous is not None and record["phase"] == previous[1]["phase"] == "step":
                self.gaps.setdefault(rank, deque(maxlen=GAP_WINDOW)).append(stamp - previous[0])
            self.last[rank] = (stamp, record)

    def poll(self) -> dict[str, Any]:
        """Fold in the reports that reached the scheduler since the last poll; what the scheduler said
        (`progress_on_scheduler`)."""
        after = max([stamp for stamp, _ in self.last.values()], default=0.0)
        seen: dict[str, Any] = self.client.run_on_scheduler(progress_on_scheduler, self.topic,
                                                            list(self.workers.values()), after)
        self.started_at = self.started_at if self.started_at is not None else seen["now"]
        self.take(seen["events"])
        return seen

    def reported(self) -> set[int]:
        """The ranks that reported progress, counting those whose reports reached the scheduler since
        the last poll (a gang stopped between polls); as last polled where the scheduler cannot be asked."""
        try:
            self.poll()
        except Exception:  # the scheduler may be what failed
            pass
        return set(self.last)

    def check(self) -> str | None:
        """Why the gang is hung, naming the rank, its worker and its last progress; None while it is not."""
        seen = self.poll()
        assert self.started_at is not None  # set by the first poll
        last = self.last
        progressed = max((stamp for stamp, _ in last.values()), default=0.0)
        silent = seen["now"] - max(progressed, self.started_at)
        limit = self.limit()
        if silent < limit:  # the allowance is never shorter
            return None
        frozen = [rank for rank, address in self.workers.items()
                  if (seen["worker_silence"][address] or 0) >= FROZEN_AFTER_S]
        # A function that reports nothing beyond the rendezvous (it never calls ctx.progress
        # or ctx.check_stop) is only ever taken for hung when its worker is frozen.
        reporting = len(last) == len(self.workers) and all(r["phase"] != "rendezvous" for _, r in last.values())
        allowed = self.allowance(slow=any(r["phase"] in SLOW_PHASES for _, r in last.values()))
        if not frozen and (not reporting or silent < allowed):
            return None
        ranks = frozen or sorted(self.workers, key=lambda r: last.get(r, (0.0, {}))[0])[:1]
        return "; ".join(self.describe(rank, last.get(rank), seen, limit if frozen else allowed, rank in frozen)
                         for rank in ranks)

    def describe(self, rank: int, last: tuple[float, dict[str, Any]] | None, seen: dict[str, Any],
                 limit: float, frozen: bool) -> str:
        address = self.workers[rank]
        since = seen["now"] - (last[0] if last else self.started_at)
        where = "before its first progress report" if last is None else after_text(last[1])
        why = (f"its worker has not answered the scheduler for {seen['worker_silence'][address]:.0f} s (frozen)"
               if frozen else "its worker is alive but the rank is stuck")
        return (f"Rank {rank} on {address} made no progress for {since:.0f} s {where}: {why}; "
                f"the hang limit is {limit:.0f} s (cluster.hang_timeout_s; raise it if the rank was only slow)")

    def forget(self) -> None:
        self.client.run_on_scheduler(forget_on_scheduler, self.topic)


def after_text(record: dict[str, Any]) -> str:
    """'after step 412 of epoch 3 (phase: step)'; a validation pass counts batches."""
    parts = []
    if record.get("step") is not None:
        parts.append(f"{'batch' if record['phase'] == 'validation' else 'step'} {record['step']}")
    if record.get("epoch") is not None:
        parts.append(f"epoch {record['epoch']}")
    return f"after {' of '.join(parts) or 'starting'} (phase: {record['phase']})"

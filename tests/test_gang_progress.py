"""The hang rule on its own: which silences the supervisor takes for a hung gang, and which not.

A fake scheduler holds the ranks' progress events and the workers' last heartbeats, as a
real one would after the ranks sent them (tests/test_gang_hangs.py runs the real thing).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from prefect_ddp.tasks.gang.progress import DEFAULT_HANG_S, HangWatch, after_text, send_progress

pytestmark = pytest.mark.unit

WORKERS = {0: "tcp://10.0.0.1:1", 1: "tcp://10.0.0.2:1"}


class FakeScheduler:
    def __init__(self, events: list[tuple[float, dict]], heartbeat_ago: dict[str, float]) -> None:
        now = time.time()
        self.events = [(now - ago, record) for ago, record in events]
        self.workers = {a: SimpleNamespace(last_seen=now - ago) for a, ago in heartbeat_ago.items()}

    def get_events(self, topic: str):
        return tuple(self.events)

    def run_on_scheduler(self, function, *args):
        self.returned = function(*args, dask_scheduler=self)
        return self.returned


def step(rank: int, n: int, phase: str = "step") -> dict:
    return {"rank": rank, "phase": phase, "epoch": 1, "step": n}


def watch(events, heartbeat_ago, hang_timeout_s=10.0, running_for=1000.0) -> HangWatch:
    scheduler = FakeScheduler(events, heartbeat_ago)
    return HangWatch(scheduler, "t", WORKERS, hang_timeout_s, started_at=time.time() - running_for)


ALIVE = {a: 0.5 for a in WORKERS.values()}


def test_a_gang_that_progressed_within_the_limit_is_not_hung():
    assert watch([(9, step(0, 5)), (9, step(1, 5))], {WORKERS[0]: 0.5, WORKERS[1]: 30}).check() is None


def test_a_silent_gang_with_a_frozen_worker_is_hung_and_the_frozen_rank_named():
    found = watch([(12, step(0, 7)), (12, step(1, 7))], {WORKERS[0]: 0.5, WORKERS[1]: 12}).check()
    assert found.startswith("Rank 1 on tcp://10.0.0.2:1 made no progress for 12 s after step 7 of epoch 1 "
                            "(phase: step): its worker has not answered the scheduler for 12 s (frozen)")
    assert "Rank 0" not in found


def test_a_silent_gang_of_live_workers_stuck_in_steps_is_hung_naming_the_rank_silent_longest():
    found = watch([(14, step(0, 7)), (12, step(1, 8))], ALIVE).check()
    assert found.startswith("Rank 0 on tcp://10.0.0.1:1 made no progress for 14 s after step 7") and "alive" in found


@pytest.mark.parametrize("phase", ["data", "validation", "checkpoint"])
def test_slow_phases_of_live_workers_get_five_times_the_limit(phase):
    events = [(30, step(0, 3)), (25, step(0, 3, phase)), (25, step(1, 3, phase))]
    assert watch(events, ALIVE).check() is None
    assert "made no progress for 60 s" in watch([(60, e) for _, e in events], ALIVE).check()


def test_a_function_that_reports_nothing_is_hung_only_when_its_worker_freezes():
    rendezvous = [(500, {"rank": r, "phase": "rendezvous", "epoch": None, "step": None}) for r in WORKERS]
    assert watch(rendezvous, ALIVE).check() is None
    assert "before" not in watch(rendezvous, {WORKERS[0]: 0.5, WORKERS[1]: 20}).check()
    assert "Rank 1" in watch(rendezvous, {WORKERS[0]: 0.5, WORKERS[1]: 20}).check()


def test_by_default_the_limit_follows_the_longest_gap_between_steps_seen():
    hang = watch([], ALIVE, hang_timeout_s=None)
    hang.take([(0.0, step(0, 1)), (0.5, step(0, 2))])
    assert hang.longest_gap == 0.5 and hang.limit() == DEFAULT_HANG_S
    hang.take([(30.5, step(0, 3))])
    assert hang.longest_gap == 30 and hang.limit() == 150
    slow_steps = [(300, step(0, 1)), (270, step(0, 2)), (100, step(0, 3)), (100, step(1, 3))]
    # Steps 30 s and 170 s apart: the limit is 850 s, so 100 s of silence is no hang.
    assert watch(slow_steps, {WORKERS[0]: 0.5, WORKERS[1]: 99}, hang_timeout_s=None).check() is None


def test_outside_a_worker_or_without_a_topic_progress_is_not_sent_and_a_wrong_phase_is_refused():
    send_progress(None, 0, "step")
    send_progress("topic-outside-a-worker", 0, "step", epoch=1, step=1)
    with pytest.raises(ValueError, match="'stepping' is not one of rendezvous, data, step, validation, checkpoint"):
        send_progress("t", 0, "stepping")


def test_a_poll_reads_only_the_reports_that_arrived_since_the_last_one():
    scheduler = FakeScheduler([(30, step(0, 1)), (20, step(1, 1))], ALIVE)
    hang = HangWatch(scheduler, "t", WORKERS, 60.0, started_at=time.time() - 100)
    assert hang.check() is None and set(hang.last) == {0, 1}
    newest = hang.last[1][0]
    scheduler.events.append((newest + 5, step(1, 2)))
    assert hang.check() is None and hang.last[1][1]["step"] == 2 and hang.last[0][1]["step"] == 1
    assert scheduler.returned["events"] == [(newest + 5, step(1, 2))] and hang.longest_gap == 5


def test_the_last_progress_reads_as_a_person_would_say_it():
    assert after_text(step(1, 412)) == "after step 412 of epoch 1 (phase: step)"
    assert after_text({"phase": "data", "epoch": None, "step": None}) == "after starting (phase: data)"

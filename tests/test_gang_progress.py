"""The hang rule on its own: which silences the supervisor takes for a hung gang, and which not.

A fake scheduler holds the ranks' progress events and the workers' last heartbeats, as a
real one would after the ranks sent them (tests/test_gang_hangs.py runs the real thing).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from prefect_ddp.tasks.gang.progress import (
    DEFAULT_HANG_S,
    GAP_WINDOW,
    HangWatch,
    after_text,
    collective_timeout_s,
    send_progress,
)

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


def watch(events, heartbeat_ago, hang_timeout_s=10.0, running_for=1000.0, **settings) -> HangWatch:
    scheduler = FakeScheduler(events, heartbeat_ago)
    return HangWatch(scheduler, "t", WORKERS, hang_timeout_s, started_at=time.time() - running_for, **settings)


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


def steps(rank: int, gaps: list[float], start: float = 0.0) -> list[tuple[float, dict]]:
    """Rank `rank`'s step reports, `gaps` apart, on the scheduler's clock from `start`."""
    stamps = [start]
    for gap in gaps:
        stamps.append(stamps[-1] + gap)
    return [(stamp, step(rank, n)) for n, stamp in enumerate(stamps, start=1)]


def test_by_default_the_limit_follows_the_recent_gaps_between_steps():
    hang = watch([], ALIVE, hang_timeout_s=None)
    hang.take(steps(0, [0.5]))
    assert hang.limit() == DEFAULT_HANG_S
    hang.take(steps(0, [30.0], start=0.5)[1:])
    assert hang.limit() == 150
    slow_steps = [(300, step(0, 1)), (270, step(0, 2)), (100, step(0, 3)), (100, step(1, 3))]
    # Steps 30 s and 170 s apart: the limit is 240 s (the cap), so 100 s of silence is no hang.
    assert watch(slow_steps, {WORKERS[0]: 0.5, WORKERS[1]: 99}, hang_timeout_s=None).check() is None


def test_one_slow_step_raises_the_limit_only_for_the_steps_after_it_in_the_window():
    hang = watch([], ALIVE, hang_timeout_s=None)
    hang.take(steps(0, [1.0] * 10 + [30.0] + [1.0] * (GAP_WINDOW - 1)))
    assert hang.limit() == 150  # the slow gap is among rank 0's last GAP_WINDOW
    hang.take(steps(0, [1.0], start=hang.last[0][0])[1:])
    assert hang.limit() == DEFAULT_HANG_S  # one step more and it has left the window


def test_an_estimated_limit_stays_below_the_process_groups_timeout_in_every_phase():
    # One 100 s gap between steps: 5x is 500 s, 25x in validation; gloo would time out at 300 s.
    for phase in ("step", "validation"):
        events = [(360, step(0, 1)), (260, step(0, 2)), (250, step(0, 3, phase)), (250, step(1, 3, phase))]
        found = watch(events, ALIVE, hang_timeout_s=None, collective_timeout_s=300).check()
        assert "made no progress for 250 s" in found and "the hang limit is 240 s" in found


def test_a_live_gang_may_be_silent_for_the_fetch_timeout_but_a_frozen_worker_is_found_at_the_limit():
    waiting = [(150, step(0, 7)), (150, step(1, 7))]  # a batch takes long to fetch; both workers answer
    assert watch(waiting, ALIVE, hang_timeout_s=10, floor_s=200).check() is None
    late = watch([(201, e) for _, e in waiting], ALIVE, hang_timeout_s=10, floor_s=200).check()
    assert "made no progress for 201 s" in late and "the hang limit is 200 s" in late
    frozen = watch([(12, e) for _, e in waiting], {WORKERS[0]: 0.5, WORKERS[1]: 12}, hang_timeout_s=10, floor_s=200)
    assert "Rank 1" in frozen.check() and "(frozen); the hang limit is 10 s" in frozen.check()


def test_a_fetch_timeout_longer_than_the_cap_raises_the_process_groups_timeout_so_the_rank_is_named_first():
    """With fetch_timeout_s 600 and init_timeout_s 300, a live rank's peers failed on gloo's 300 s
    timeout, naming no cause, before the hang rule (which held them 600 s) or the rank's own error."""
    timeout_s = collective_timeout_s(300, floor_s=600)
    assert timeout_s == 750 and collective_timeout_s(300, floor_s=60) == 300
    waiting = [(599, step(0, 7)), (599, step(1, 7))]
    assert watch(waiting, ALIVE, hang_timeout_s=None, floor_s=600, collective_timeout_s=timeout_s).check() is None
    late = watch([(601, e) for _, e in waiting], ALIVE, hang_timeout_s=None, floor_s=600,
                 collective_timeout_s=timeout_s).check()
    assert "the hang limit is 600 s" in late and 600 < timeout_s  # named before the peers' timeout


def test_a_download_reports_progress_and_gets_the_plain_limit():
    send_progress("topic-outside-a-worker", 0, "download")
    downloading = [(5, {"rank": r, "phase": "download", "epoch": None, "step": None}) for r in WORKERS]
    assert watch(downloading, ALIVE).check() is None
    assert "(phase: download)" in watch([(12, e) for _, e in downloading], ALIVE).check()


def test_outside_a_worker_or_without_a_topic_progress_is_not_sent_and_a_wrong_phase_is_refused():
    send_progress(None, 0, "step")
    send_progress("topic-outside-a-worker", 0, "step", epoch=1, step=1)
    with pytest.raises(ValueError, match="'stepping' is not one of rendezvous, download, data, step, validation, "
                                         "checkpoint"):
        send_progress("t", 0, "stepping")


def test_a_poll_reads_only_the_reports_that_arrived_since_the_last_one():
    scheduler = FakeScheduler([(30, step(0, 1)), (20, step(1, 1))], ALIVE)
    hang = HangWatch(scheduler, "t", WORKERS, 60.0, started_at=time.time() - 100)
    assert hang.check() is None and set(hang.last) == {0, 1}
    newest = hang.last[1][0]
    scheduler.events.append((newest + 5, step(1, 2)))
    assert hang.check() is None and hang.last[1][1]["step"] == 2 and hang.last[0][1]["step"] == 1
    assert scheduler.returned["events"] == [(newest + 5, step(1, 2))] and hang.recent_gap() == 5


def test_the_ranks_that_reported_include_those_heard_of_since_the_last_poll_and_survive_a_lost_scheduler():
    """A gang stopped between polls (every 2 s) still counts a rank whose first report arrived since the
    last one as started: its task run is on its way to the server (tasks/gang/states.py waits for it)."""
    scheduler = FakeScheduler([(30, step(0, 1))], ALIVE)
    hang = HangWatch(scheduler, "t", WORKERS, 60.0, started_at=time.time() - 100)
    assert hang.check() is None and set(hang.last) == {0}
    scheduler.events.append((time.time(), {"rank": 1, "phase": "rendezvous", "epoch": None, "step": None}))
    assert hang.reported() == {0, 1}

    def lost(*args):
        raise OSError("Timed out trying to connect to the scheduler")

    scheduler.run_on_scheduler = lost
    assert hang.reported() == {0, 1}  # as last polled: the stop goes on


def test_the_last_progress_reads_as_a_person_would_say_it():
    assert after_text(step(1, 412)) == "after step 412 of epoch 1 (phase: step)"
    assert after_text({"phase": "data", "epoch": None, "step": None}) == "after starting (phase: data)"
    assert after_text(step(1, 3, "validation")) == "after batch 3 of epoch 1 (phase: validation)"

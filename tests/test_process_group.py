"""A worker process whose join of a gang failed still joins the next gang (real gloo ranks).

torch counts process groups per process before the rendezvous, and names the group's store
keys by that count; a join that failed left the count raised, and the next join of that
process waited for keys no fresh peer writes (`process_group.forget_failed_joins`).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from prefect_ddp.tasks.gang.ports import free_port
from prefect_ddp.tasks.gang.process_group import all_reduce_sum, process_group
from tests.support.rank_processes import rank_context

JOIN_TIMEOUT_S = 30  # a generous rendezvous for a busy machine; the old code waited it out and failed


def join(rank: int, port: int, timeout_s: float) -> Any:
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                       timeout=timedelta(seconds=timeout_s)):
        return all_reduce_sum([1.0])[0]


def rank_after_a_failed_join(rank: int, lonely_port: int, port: int, results: Any) -> None:
    """Rank 0 first joins a gang whose peer never comes (as one that died mid-rendezvous)."""
    failed = None
    if rank == 0:
        try:
            join(0, lonely_port, 2)
        except Exception as exc:  # the store's timeout
            failed = type(exc).__name__
    try:
        results.put((rank, failed, join(rank, port, JOIN_TIMEOUT_S)))
    except Exception as exc:
        results.put((rank, failed, repr(exc)[:300]))


def test_a_process_whose_join_failed_joins_the_next_gang_with_a_fresh_peer():
    context = rank_context()
    results = context.Queue()
    lonely_port, port = free_port(), free_port()
    ranks = [context.Process(target=rank_after_a_failed_join, args=(rank, lonely_port, port, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        got = sorted(results.get(timeout=JOIN_TIMEOUT_S + 90) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=30)
            process.kill()
    assert got[0][1] is not None, "the first join was meant to fail"
    # Before the fix: DistStoreError('wait timeout ..., keys: /default_pg/1//cpu//0/1') on both.
    assert [sum_ for _, _, sum_ in got] == [2.0, 2.0], got


def rank_slow_to_join(rank: int, port: int, results: Any) -> None:
    """Rank 1's join returns 3 s late, as a peer still connecting; each says when its work began."""
    import torch.distributed as dist

    real_init = dist.init_process_group

    def slow_init(*args: Any, **kwargs: Any) -> None:
        real_init(*args, **kwargs)
        if rank == 1:
            time.sleep(3)
        results.put(("joined", rank, time.time()))

    dist.init_process_group = slow_init
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                       timeout=timedelta(seconds=JOIN_TIMEOUT_S)):
        results.put(("began", rank, time.time()))


def test_no_rank_begins_its_work_before_every_rank_has_joined():
    context = rank_context()
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=rank_slow_to_join, args=(rank, port, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        times = {(kind, rank): at for kind, rank, at in (results.get(timeout=JOIN_TIMEOUT_S + 90) for _ in range(4))}
    finally:
        for process in ranks:
            process.join(timeout=30)
            process.kill()
    # Before the fix rank 0 began about 3 s before rank 1 had joined.
    assert times[("began", 0)] >= times[("joined", 1)], times


WRITE_S, COLLECTIVE_TIMEOUT_S = 4.0, 2.0  # rank 0's write outlasts the process group's timeout


def rank_waiting_for_a_long_write(rank: int, port: int, together: bool, results: Any) -> None:
    """Rank 0 writes for WRITE_S while its peer waits for it: in `wait_for_main`'s rounds, or in one
    collective (the recipe's way before issue 46), which the process group's timeout ends."""
    from prefect_ddp.tasks.gang import RankContext

    ctx = RankContext(rank=rank, local_rank=rank, world_size=2, local_world_size=2, backend="gloo", device="cpu",
                      worker_address="local", master_addr="127.0.0.1", master_port=port)
    written_at = time.monotonic() + WRITE_S

    def written(timeout_s: float) -> bool:
        time.sleep(max(0.0, min(timeout_s, written_at - time.monotonic())))
        return time.monotonic() >= written_at

    try:
        with process_group(backend="gloo", rank=rank, world_size=2, master_addr="127.0.0.1", master_port=port,
                           timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)):
            all_reduce_sum([0.0])  # both are in the group before the write starts
            if together:
                ctx.wait_for_main(written)
            elif rank == 0:
                written(WRITE_S)
            results.put((rank, all_reduce_sum([1.0])[0]))
    except Exception as exc:
        results.put((rank, type(exc).__name__))


def test_ranks_waiting_for_rank_0s_long_write_outlast_the_process_groups_timeout():
    """Issue 46: the ranks waited for rank 0's last write in one collective, so a write longer than
    the process group's timeout (gloo's 300 s by default) failed every peer after all of training."""
    context = rank_context()
    outcomes = {}
    for together in (False, True):
        results = context.Queue()
        port = free_port()
        ranks = [context.Process(target=rank_waiting_for_a_long_write, args=(rank, port, together, results))
                 for rank in range(2)]
        for process in ranks:
            process.start()
        try:
            outcomes[together] = dict(results.get(timeout=JOIN_TIMEOUT_S + 90) for _ in ranks)
        finally:
            for process in ranks:
                process.join(timeout=30)
                process.kill()
    assert outcomes[False][1] != 2.0, outcomes  # the peer's collective timed out: the premise holds
    assert outcomes[True] == {0: 2.0, 1: 2.0}, outcomes

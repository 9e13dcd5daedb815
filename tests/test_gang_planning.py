"""Fast unit tests of how a gang is laid out and how a rank's process group behaves alone."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tasks.gang.plan import plan_ranks
from tasks.process_group import (
    all_reduce_sum,
    default_backend,
    process_group,
    sync_buffers,
    wrap_ddp,
)

ADDRESSES = ["tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002", "tcp://10.0.0.2:4001"]


def test_local_ranks_count_within_each_host():
    probes = {a: {"cuda": False, "cpus": 8} for a in ADDRESSES}
    ranks = plan_ranks(ADDRESSES, probes, port=29511, attempt=0, output_url=None, init_timeout_s=30)
    assert [(r.rank, r.local_rank, r.local_world_size) for r in ranks] == [(0, 0, 2), (1, 1, 2), (2, 0, 1)]
    assert {(r.master_addr, r.master_port) for r in ranks} == {("10.0.0.1", 29511)}


@pytest.mark.parametrize("cuda, backend, device", [
    ({"a": True, "b": True}, "nccl", "cuda:0"),
    ({"a": True, "b": False}, "gloo", "cpu"),
])
def test_nccl_only_when_every_rank_has_cuda(cuda, backend, device):
    addresses = ["tcp://h:1", "tcp://h:2"]
    probes = {addr: {"cuda": cuda[key], "cpus": 4} for addr, key in zip(addresses, "ab")}
    ranks = plan_ranks(addresses, probes, 1, 0, None, 30)
    assert {r.backend for r in ranks} == {backend} and {r.device for r in ranks} == {device}
    assert default_backend(True) == "nccl" and default_backend(False) == "gloo"


def test_world_size_one_needs_no_process_group_and_wrappers_do_nothing():
    model = torch.nn.Linear(2, 2)
    with process_group(backend="gloo", rank=0, world_size=1, master_addr="127.0.0.1", master_port=1,
                       timeout=timedelta(seconds=5)):
        assert not dist.is_initialized()
        assert wrap_ddp(model, torch.device("cpu")) is model
        assert all_reduce_sum([1.0, 2.0]) == [1.0, 2.0]
        sync_buffers(model)


def test_a_second_group_in_one_process_is_refused():
    from tasks.gang import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already belongs to a process group .* two gangs share a Dask worker"):
            with process_group(backend="gloo", rank=1, world_size=2, master_addr="127.0.0.1", master_port=1,
                               timeout=timedelta(seconds=5)):
                pass
    finally:
        dist.destroy_process_group()


def test_the_rank_that_failed_first_hand_is_named_before_its_peers():
    from tasks.gang.supervise import root_cause_first

    peer = "Rank 0 on tcp://a:1 ended FAILED: RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:1"
    own = "Rank 1 on tcp://b:1 ended FAILED: RuntimeError: boom on rank 1"
    message = root_cause_first([peer, own])
    assert message.startswith(own) and message.endswith(f"(then 1 more rank(s) failed: {peer})")
    assert root_cause_first([own]) == own


@pytest.mark.parametrize("limits, message", [
    ({"max_restarts": -1}, r"max_restarts=-1 is negative; it counts how often a failed gang is re-formed: 0 \(never"),
    ({"timeout": timedelta(0)}, r"timeout=datetime.timedelta\(0\) is not positive; give a positive timedelta .* or None"),
])
def test_meaningless_limits_are_refused_before_any_worker_is_touched(limits, message):
    from tasks.gang import run_gang

    with pytest.raises(ValueError, match=message):
        run_gang(lambda ctx, config: None, {}, **limits)  # outside a flow: refused before looking for one


def test_attempts_travel_with_results_and_errors_through_pickling():
    import pickle

    from tasks.gang import GangAttempt, GangResults, GangTimeout

    attempt = GangAttempt(number=1, workers=["tcp://a:1"], world_size=1, ended="completed", seconds=0.5)
    results = pickle.loads(pickle.dumps(GangResults(["r0"], [attempt])))
    assert results == ["r0"] and results.attempts == [attempt]
    error = pickle.loads(pickle.dumps(GangTimeout("too slow").after([attempt], max_restarts=2)))
    assert type(error) is GangTimeout and error.attempts == [attempt]
    assert str(error) == ("too slow [after 1 attempt(s) of at most 3 (max_restarts=2); this error's .attempts "
                          "lists each one's workers and end]")

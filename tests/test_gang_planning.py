"""Fast unit tests of how a gang is laid out and how a rank's process group behaves alone."""

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from prefect_ddp.tasks.gang import GangRefused
from prefect_ddp.tasks.gang.gpu_claims import GpuClaim, claim_gpu
from prefect_ddp.tasks.gang.plan import by_host, cluster_workers, plan_ranks, thread_shares
from prefect_ddp.tasks.gang import ports
from prefect_ddp.tasks.gang.ports import free_port
from prefect_ddp.tasks.gang.process_group import (
    all_reduce_sum,
    choose_gloo_interface,
    default_backend,
    interface_holding,
    process_group,
    sync_buffers,
    tcp_init_method,
    wrap_ddp,
)
from prefect_ddp.tasks.gang.worker_checks import probe_worker
from tests.support.rank_processes import start_ranks

ADDRESSES = ["tcp://10.0.0.1:4001", "tcp://10.0.0.1:4002", "tcp://10.0.0.2:4001"]


def cpu_probes(addresses: list[str]) -> dict[str, dict]:
    return {a: {"cuda": False, "gpus": [], "cpus": 8} for a in addresses}


@pytest.mark.unit
def test_local_ranks_count_within_each_host():
    probes = cpu_probes(ADDRESSES)
    ranks = plan_ranks(ADDRESSES, probes, port=29511, attempt=0, output_url=None, init_timeout_s=30)
    assert [(r.rank, r.local_rank, r.local_world_size) for r in ranks] == [(0, 0, 2), (1, 1, 2), (2, 0, 1)]
    assert {(r.master_addr, r.master_port) for r in ranks} == {("10.0.0.1", 29511)}


@pytest.mark.unit
def test_a_rank_shares_its_cores_with_every_worker_that_may_run_on_them():
    eight, numa_0, numa_1 = tuple(range(8)), tuple(range(4)), tuple(range(4, 8))
    cluster = {
        # Two workers of a 8-core host: a single-rank gang on one gets 4 threads, not 8, since
        # the other worker may train another gang (a sweep's next trial) on the same cores.
        "tcp://10.0.0.1:1": eight, "tcp://10.0.0.1:2": eight,
        # Four workers of another host, pinned two by two to its NUMA nodes (dask-cuda).
        "tcp://10.0.0.2:1": numa_0, "tcp://10.0.0.2:2": numa_0, "tcp://10.0.0.2:3": numa_1, "tcp://10.0.0.2:4": numa_1,
        # A worker alone on a 2-core host, and one on a host with more workers than cores.
        "tcp://10.0.0.3:1": (0, 1), **{f"tcp://10.0.0.4:{i}": (0, 1) for i in range(3)},
    }
    assert thread_shares(cluster, ["tcp://10.0.0.1:1"]) == {"tcp://10.0.0.1:1": 4}
    assert thread_shares(cluster, ["tcp://10.0.0.2:1", "tcp://10.0.0.2:3"]) == {"tcp://10.0.0.2:1": 2, "tcp://10.0.0.2:3": 2}
    assert thread_shares(cluster, ["tcp://10.0.0.3:1", "tcp://10.0.0.4:0"]) == {"tcp://10.0.0.3:1": 2, "tcp://10.0.0.4:0": 1}
    with pytest.raises(KeyError):  # a gang worker that did not answer: the attempt forms again
        thread_shares(cluster, ["tcp://10.0.0.9:1"])


@pytest.mark.unit
@pytest.mark.parametrize("cuda, backend, device", [
    ({"a": True, "b": True}, "nccl", "cuda:0"),
    ({"a": True, "b": False}, "gloo", "cpu"),
])
def test_nccl_only_when_every_rank_has_cuda(cuda, backend, device):
    addresses = ["tcp://h1:1", "tcp://h2:1"]
    probes = {addr: {"cuda": cuda[key], "gpus": [f"GPU-{key}"] if cuda[key] else [], "cpus": 4,
                     "gpu_claim": GpuClaim(f"GPU-{key}", 0) if cuda[key] else None}
              for addr, key in zip(addresses, "ab")}
    ranks = plan_ranks(addresses, probes, 1, 0, None, 30)
    assert {r.backend for r in ranks} == {backend} and {r.device for r in ranks} == {device}
    assert default_backend(True) == "nccl" and default_backend(False) == "gloo"


def claimed(claims: dict[str, GpuClaim]) -> dict[str, dict]:
    """Probes of workers on 4-GPU hosts that claimed `claims` (tests/test_gpu_claims.py claims for real)."""
    return {address: {"cuda": True, "gpus": ["A", "B", "C", "D"], "cpus": 4, "gpu_claim": claim}
            for address, claim in claims.items()}


# The device was the local rank within the gang, so a second gang on the host got the same
# cuda:0 and cuda:1; now it is the GPU the worker process claimed, whatever its rank.
@pytest.mark.unit
@pytest.mark.parametrize("claims, devices", [
    # dask-cuda: each worker's CUDA_VISIBLE_DEVICES lists its own GPU first, and it claims that one
    ({"tcp://h:1": GpuClaim("A", 0), "tcp://h:2": GpuClaim("B", 0)}, ["cuda:0", "cuda:0"]),
    # plain `dask worker`s that see the same 4 GPUs: another gang's workers hold A and B
    ({"tcp://h:1": GpuClaim("D", 3), "tcp://h:2": GpuClaim("C", 2)}, ["cuda:3", "cuda:2"]),
    # one rank per host: GPUs of two hosts never meet
    ({"tcp://h1:1": GpuClaim("A", 0), "tcp://h2:1": GpuClaim("E", 0)}, ["cuda:0", "cuda:0"]),
])
def test_each_rank_gets_the_gpu_its_worker_claimed(claims, devices):
    ranks = plan_ranks(list(claims), claimed(claims), 1, 0, None, 30)
    assert [r.device for r in ranks] == devices and {r.backend for r in ranks} == {"nccl"}


@pytest.mark.unit
def test_ranks_whose_workers_hold_one_gpu_are_refused_with_the_fix():
    claims = {"tcp://h:1": GpuClaim("A", 0), "tcp://h:2": GpuClaim("B", 1), "tcp://h:3": GpuClaim("A", 0)}
    with pytest.raises(GangRefused, match=r"Ranks would share a GPU: A is held by the workers of 2 ranks "
                       r"\(tcp://h:1, tcp://h:3\)\. .*LocalCluster\(processes=False\).*another HOME.* dask-cuda "
                       r".*CUDA_VISIBLE_DEVICES"):
        plan_ranks(list(claims), claimed(claims), 1, 0, None, 30)


@pytest.mark.unit
def test_a_worker_that_cannot_keep_claims_is_refused_with_the_fix(tmp_path):
    (tmp_path / "home").write_text("a file where the claims folder's parent should be")
    claim = claim_gpu(["A", "B"], "worker tcp://h:1", tmp_path / "home" / "gpu-claims")  # claims nothing
    with pytest.raises(GangRefused, match=r"Worker tcp://h:1 on host h has no GPU of its own: its GPU claims cannot "
                       r"be kept in .*gpu-claims \(\[Errno 20\] Not a directory.*Give the worker a HOME it can write"):
        plan_ranks(["tcp://h:1"], claimed({"tcp://h:1": claim}), 1, 0, None, 30)


@pytest.mark.unit
def test_an_ipv6_master_is_the_bare_host_and_its_init_method_has_brackets():
    addresses = ["tcp://[fd00::1]:4001", "tcp://[fd00::2]:4001"]
    ranks = plan_ranks(addresses, cpu_probes(addresses), 29500, 0, None, 30)
    assert {r.master_addr for r in ranks} == {"fd00::1"} and [r.local_rank for r in ranks] == [0, 0]
    assert tcp_init_method("fd00::1", 29500) == "tcp://[fd00::1]:29500"
    assert tcp_init_method("10.0.0.1", 29500) == "tcp://10.0.0.1:29500"
    assert tcp_init_method("node-3", 29500) == "tcp://node-3:29500"


IF_INET6 = Path("/proc/net/if_inet6")  # Linux: one line per IPv6 address; ::1 is 000...001
IPV6_LOOPBACK = socket.has_ipv6 and IF_INET6.exists() and "0" * 31 + "1" in IF_INET6.read_text()


@pytest.mark.unit
@pytest.mark.skipif(not socket.has_ipv6, reason="Python here was built without IPv6")
def test_a_free_port_is_free_on_ipv4_and_ipv6_alike_and_outside_the_ephemeral_range():
    """An ephemeral port can be handed to an outgoing connection before the store binds it (EADDRINUSE)."""
    ephemeral = ports.ephemeral_range()
    low, high = ephemeral if ports.ports_outside(ephemeral) else (0, 0)  # no room outside: any port
    for _ in range(20):
        port = free_port()
        assert not low <= port <= high, (port, (low, high))
        families = [(socket.AF_INET, "127.0.0.1")] + ([(socket.AF_INET6, "::1")] if IPV6_LOOPBACK else [])
        for family, host in families:
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.bind((host, port))


@pytest.mark.unit
def test_a_port_taken_on_ipv4_is_not_picked_and_with_no_other_outside_the_range_any_free_port_is(tmp_path,
                                                                                                   monkeypatch):
    """Only 65535 lies outside this range; held on IPv4, it is not free, whatever IPv6 says."""
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "ip_local_port_range")
    ports.EPHEMERAL_RANGE.write_text("1024\t65534\n")
    assert ports.ports_outside(ports.ephemeral_range()) == [65535]
    try:
        held = socket.create_server(("127.0.0.1", 65535))
    except OSError:
        pytest.skip("port 65535 is taken on this host")
    with held:
        picked = {free_port() for _ in range(5)}
    assert 65535 not in picked and all(1024 <= port < 65535 for port in picked)
    assert free_port() == 65535


@pytest.mark.unit
def test_numbers_drawn_outside_the_range_are_not_tried_twice(tmp_path, monkeypatch):
    """Of the 20 ports outside this range 19 are held: the one left is found, as the 20 draws are distinct."""
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "ip_local_port_range")
    ports.EPHEMERAL_RANGE.write_text("1024 65515")
    outside = ports.ports_outside(ports.ephemeral_range())
    assert outside == list(range(65516, 65536)) and ports.TRIES == len(outside)
    try:
        ports.bound_port(outside[0])
    except OSError:
        pytest.skip(f"port {outside[0]} is taken on this host")
    held = []
    for port in outside[1:]:
        try:
            held.append(socket.create_server(("127.0.0.1", port)))
        except OSError:
            pass  # taken already: held all the same
    try:
        assert {free_port() for _ in range(10)} == {outside[0]}
    finally:
        for server in held:
            server.close()


@pytest.mark.unit
def test_a_host_that_does_not_say_its_ephemeral_range_gets_any_free_port(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE", tmp_path / "absent")
    assert ports.ephemeral_range() is None
    assert 1024 <= free_port() <= 65535


@pytest.mark.gpu
def test_plain_workers_on_this_gpu_host_claim_gpus_of_their_own_or_are_refused(tmp_path):
    import distributed

    def uuid_of_set_device(device: str) -> str:  # what a rank's limit_threads selects
        torch.cuda.set_device(torch.device(device))
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)

    with (distributed.LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster,
          distributed.Client(cluster) as client):
        addresses = by_host(cluster_workers(client))  # plain workers that share the host's GPUs
        probes = client.run(probe_worker, None, None, tmp_path, workers=addresses)  # the real probe, torch's GPUs
        assert all(p["cuda"] and len(set(p["gpus"])) == torch.cuda.device_count() for p in probes.values())
        holders = [address for address in addresses if probes[address]["gpu_claim"].uuid is not None]
        assert len(holders) == min(2, torch.cuda.device_count())
        for ctx in plan_ranks(holders, probes, 1, 0, None, 30):
            on_worker = client.submit(uuid_of_set_device, ctx.device, workers=[ctx.worker_address], pure=False)
            assert on_worker.result() == probes[ctx.worker_address]["gpu_claim"].uuid
        if len(holders) < 2:  # one GPU: the second plain worker is refused
            with pytest.raises(GangRefused, match=r"Worker tcp://127.0.0.1:\d+ .* has no GPU of its own: all 1 GPU"):
                plan_ranks(addresses, probes, 1, 0, None, 30)


def sum_over_ipv6(rank: int, port: int, out: str) -> None:
    with process_group(backend="gloo", rank=rank, world_size=2, master_addr="::1", master_port=port,
                       timeout=timedelta(seconds=60)):
        total = all_reduce_sum([rank + 1.0])
    if rank == 0:
        open(out, "w").write(str(total))


@pytest.mark.skipif(not IPV6_LOOPBACK, reason="this machine has no IPv6 loopback (::1 not in /proc/net/if_inet6)")
def test_two_gloo_ranks_meet_at_an_ipv6_master(tmp_path):
    out = tmp_path / "total"
    start_ranks(sum_over_ipv6, (free_port(), str(out)), 2)
    assert out.read_text() == "[3.0]"


@pytest.mark.unit
def test_world_size_one_needs_no_process_group_and_wrappers_do_nothing():
    model = torch.nn.Linear(2, 2)
    with process_group(backend="gloo", rank=0, world_size=1, master_addr="127.0.0.1", master_port=1,
                       timeout=timedelta(seconds=5)):
        assert not dist.is_initialized()
        assert wrap_ddp(model, torch.device("cpu")) is model
        assert all_reduce_sum([1.0, 2.0]) == [1.0, 2.0]
        sync_buffers(model)


def test_a_second_group_in_one_process_is_refused():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already belongs to a process group .* two gangs share a Dask worker"):
            with process_group(backend="gloo", rank=1, world_size=2, master_addr="127.0.0.1", master_port=1,
                               timeout=timedelta(seconds=5)):
                pass
    finally:
        dist.destroy_process_group()


@pytest.mark.unit
def test_the_rank_that_failed_first_hand_is_named_before_its_peers():
    from prefect_ddp.tasks.gang.supervise import root_cause_first

    peer = "Rank 0 on tcp://a:1 ended FAILED: RuntimeError: [pair.cc:561] Connection closed by peer [127.0.0.1]:1"
    own = "Rank 1 on tcp://b:1 ended FAILED: RuntimeError: boom on rank 1"
    message = root_cause_first([peer, own])
    assert message.startswith(own) and message.endswith(f"(then 1 more rank(s) failed: {peer})")
    assert root_cause_first([own]) == own


@pytest.mark.unit
@pytest.mark.parametrize("limits, message", [
    ({"max_restarts": -1}, r"max_restarts=-1 is negative; it counts how often a failed gang is re-formed: 0 \(never"),
    ({"timeout": timedelta(0)}, r"timeout=datetime.timedelta\(0\) is not positive; give a positive timedelta .* or None"),
])
def test_meaningless_limits_are_refused_before_any_worker_is_touched(limits, message):
    from prefect_ddp.tasks.gang import run_gang

    with pytest.raises(ValueError, match=message):
        run_gang(lambda ctx, config: None, {}, **limits)  # outside a flow: refused before looking for one


@pytest.mark.unit
def test_attempts_travel_with_results_and_errors_through_pickling():
    import pickle

    from prefect_ddp.tasks.gang import GangAttempt, GangResults, GangTimeout

    attempt = GangAttempt(number=1, workers=["tcp://a:1"], world_size=1, ended="completed", seconds=0.5)
    results = pickle.loads(pickle.dumps(GangResults(["r0"], [attempt])))
    assert results == ["r0"] and results.attempts == [attempt]
    error = pickle.loads(pickle.dumps(GangTimeout("too slow").after([attempt], max_restarts=2)))
    assert type(error) is GangTimeout and error.attempts == [attempt]
    assert str(error) == ("too slow [after 1 attempt(s) of at most 3 (max_restarts=2); this error's .attempts "
                          "lists each one's workers and end]")


@pytest.mark.unit
def test_gloo_sends_from_the_interface_of_the_ranks_own_address():
    before = os.environ.pop("GLOO_SOCKET_IFNAME", None)
    try:
        choose_gloo_interface("203.0.113.9")  # an address no interface here has: left to gloo
        assert "GLOO_SOCKET_IFNAME" not in os.environ
        choose_gloo_interface("127.0.0.1")
        assert os.environ["GLOO_SOCKET_IFNAME"] == interface_holding("127.0.0.1") == "lo"
        os.environ["GLOO_SOCKET_IFNAME"] = "eth7"  # the cluster owner's choice stands
        choose_gloo_interface("127.0.0.1")
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)
        if before is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = before

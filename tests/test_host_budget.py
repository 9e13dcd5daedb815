"""A rank's loader processes and reads in flight fit its host's limits (tasks/data/host_budget.py).

The hosts are simulated by building `HostLimits` by hand, the seam every number is read through;
the sizing is the project's own, unchanged. Each host is an 8-GPU host whose 8 ranks share it, at
batch 256 of ImageNet-like images (1,281,167 of 110 kB on average), 224-px crops handed over as
uint8 tensors (the loaders' steps, loader_steps.py) or float32 ones (the whole transform, as before),
pinned for CUDA:

- 64 cores (64 CPUs, no SMT), 512 GiB of memory;
- 192 cores with SMT (384 CPUs), 2 TiB;

each with /dev/shm half of its memory or Docker's default 64 MiB, and RLIMIT_NOFILE 1,024 (a
common soft limit) or 1,048,576; and each with a limit on threads (a cgroup's pids.max of 4,915 or
32,768, or RLIMIT_NPROC 4,096) or none. Their CPUs per rank come from the gang's plan
(`thread_shares`) for 8 workers that may all run on every CPU. Counts are per rank; a host's is 8
times as many.
"""

from __future__ import annotations

import dataclasses
import os
import resource

import psutil
import pytest
import torch
from torchvision.transforms import v2

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.dataset import eval_transform
from prefect_ddp.tasks.data.host_budget import (
    CONNECTIONS_PER_ENDPOINT,
    LOADERS,
    MEMORY_SHARE,
    SHM_SHARE,
    Budget,
    HostLimits,
    OPEN_FILES_WANTED,
    RAISE_NPROC,
    RAISE_PIDS,
    THREADS_SHARE,
    LoaderLoad,
    ThreadsLeft,
    handed_over_bytes,
    memory_limit,
    rank_budget,
    threads_left,
)
from prefect_ddp.tasks.data.loaders import loader_workers
from prefect_ddp.tasks.gang.plan import cpu_set, thread_shares

pytestmark = pytest.mark.unit

MiB, GiB, TiB = 2**20, 2**30, 2**40
RANKS = 8
BATCH = TrainingConfig(batch_size=256)
IMAGENET = [110_000] * 1_281_167  # the stored sizes of ImageNet's training images, on average
FLOAT32, UINT8 = 3 * 224 * 224 * 4, 3 * 224 * 224  # a 224-px crop handed over, as before and now


def pids(cpus: int) -> int:
    """Linux's default pid_max: 1,024 per CPU, at least 32,768. Every thread takes a pid."""
    return max(32_768, 1024 * cpus)


def gpu_host(cores: int, memory: int, shm: int, open_files: int) -> HostLimits:
    """An 8-GPU host of `cores` CPUs whose 8 workers (one per GPU) may all run on every CPU."""
    workers = {f"tcp://gpu-host:{port}": tuple(range(cores)) for port in range(RANKS)}
    share = thread_shares(workers, list(workers))["tcp://gpu-host:0"]
    return HostLimits(cpus=share, affinity=cores, ranks=RANKS, memory_bytes=memory, shm_bytes=shm,
                      open_files=open_files)


HOSTS = {
    f"{name}, /dev/shm {shm_name}, nofile {files}": gpu_host(cores, memory, shm, files)
    for name, cores, memory in (("64 cores", 64, 512 * GiB), ("192 cores with SMT", 384, 2 * TiB))
    for shm_name, shm in (("half of memory", memory // 2), ("64 MiB", 64 * MiB))
    for files in (1024, 1_048_576)
}


def imagenet(image_bytes: int, cfg: TrainingConfig = BATCH) -> LoaderLoad:
    return LoaderLoad.of(cfg, IMAGENET, image_bytes, pinned=True)


def assert_within(budget: Budget, limits: HostLimits, load: LoaderLoad) -> None:
    """The whole host's loaders, `limits.ranks` ranks of `budget`'s two choices (loader processes per
    loader, images fetched at once per batch), within every limit of `limits`.

    Counted here from how the loaders behave, not from the budget's own totals, so that a budget that
    miscounts is caught: each rank has two loaders (train's and validation's, both busy while the next
    epoch starts during validation); each loader process keeps 2 batches ready (DataLoader's
    prefetch_factor) and 3 batches of GETs in flight (its own and 2 fetched ahead), holds ~115 MiB of
    its own, 150 bytes per indexed image, its fetched-ahead encoded images and the batch it decodes;
    the rank takes one batch per loader; ready batches sit in /dev/shm (or, handed over through the
    processes' pipes, in the loader processes' memory) and again in pinned memory for CUDA; every tensor handed over is a file each side holds; loaders may fill half of /dev/shm and of
    memory (the rest is the ranks' and NCCL's). Threads: each rank's torch threads (its CPU share) and
    pin thread; each loader process's own, its fetch-ahead's 3 batches' threads, s3fs' event loop and
    obstore's 2 runtime threads; a read thread per GET in flight; the ranks may take half of what the
    host's tightest limit on threads leaves (the rest is their workers', CUDA's, NCCL's, the host's).
    """
    ranks, workers, fetches = limits.ranks, budget.loader_processes, budget.fetches_in_flight
    batch = load.batch_size * load.image_bytes
    held = (2 * (2 * workers + 1) if workers else 1) * batch
    handed = held if workers else 0
    pinned = held if load.pinned else 0
    own = 115 * MiB + 150 * load.indexed_images + 3 * load.batch_size * load.stored_image_bytes + batch
    assert limits.shm_bytes is not None
    assert ranks * (handed if budget.handover == "shm" else 0) <= 0.5 * limits.shm_bytes
    assert ranks * (2 * workers * own + handed + pinned) <= 0.5 * limits.memory_bytes
    if workers:
        assert 3 * fetches + 2 * load.tensors_per_batch + 64 <= limits.open_files  # a loader process's
        assert 256 + 2 * (workers * (3 + 2 * load.tensors_per_batch) + load.tensors_per_batch) <= limits.open_files
    else:
        assert 256 + 3 * fetches <= limits.open_files  # the rank fetching its own batches
    assert ranks * (2 * workers if workers else 1) * 3 * fetches <= 8192 == limits.connections
    threads = limits.cpus + load.pinned + 2 * workers * (1 + 3 + 1 + 2) + (2 * workers if workers else 1) * 3 * fetches
    assert budget.threads == threads
    if limits.threads is not None:
        assert ranks * threads <= 0.5 * limits.threads.count


# Hosts where /dev/shm, memory or open files cut part of the way (neither nothing nor everything):
# 16 GiB of /dev/shm for 8 ranks, 64 GiB of memory, 512 or 1,024 open files (soft limits the rank
# could not raise),
# each for photos handed over as uint8 and for images handed over encoded (decode_on="device").
PARTLY = {
    "64 cores, /dev/shm 16 GiB": dataclasses.replace(gpu_host(64, 512 * GiB, 16 * GiB, 1_048_576)),
    "64 cores, 64 GiB of memory": gpu_host(64, 64 * GiB, 32 * GiB, 1_048_576),
    "16 cores, 1 rank, nofile 512": HostLimits(cpus=16, affinity=16, ranks=1, memory_bytes=64 * GiB,
                                               shm_bytes=32 * GiB, open_files=512),
    "16 cores, 1 rank, nofile 1024": HostLimits(cpus=16, affinity=16, ranks=1, memory_bytes=64 * GiB,
                                                shm_bytes=32 * GiB, open_files=1024),
}
LOADS = {
    "uint8": imagenet(UINT8),
    "encoded, batch 64": LoaderLoad.of(TrainingConfig(batch_size=64), IMAGENET, None, pinned=True),
    "camera photos": LoaderLoad.of(BATCH, [5_000_000] * 100_000, UINT8, pinned=True),
}


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("host", PARTLY)
def test_a_host_whose_limits_cut_part_of_the_way_stays_within_them(host, load):
    limits, loaded = PARTLY[host], LOADS[load]
    cfg = BATCH.model_copy(update={"batch_size": loaded.batch_size})
    budget = rank_budget(cfg, limits, loaded)
    assert_within(budget, limits, loaded)
    assert budget.fetches_in_flight >= 1


def test_the_partly_cut_hosts_are_cut_part_of_the_way():
    """The hosts above are cut, but not to nothing: where loader processes remain, a miscount shows."""
    chosen = {(host, load): rank_budget(BATCH.model_copy(update={"batch_size": LOADS[load].batch_size}),
                                        PARTLY[host], LOADS[load]).loader_processes
              for host in PARTLY for load in LOADS}
    assert 0 < chosen["64 cores, /dev/shm 16 GiB", "uint8"] < 7
    assert 0 < chosen["64 cores, 64 GiB of memory", "uint8"] < 7
    assert 0 < chosen["16 cores, 1 rank, nofile 1024", "encoded, batch 64"] < 15


@pytest.mark.parametrize(("host", "processes", "fetches", "shm_gib", "gets", "handover"), [
    ("64 cores, /dev/shm half of memory, nofile 1024", 112, 24, 8.6, 8064, "shm"),
    ("64 cores, /dev/shm 64 MiB, nofile 1024", 112, 24, 0, 8064, "pipe"),
    ("192 cores with SMT, /dev/shm half of memory, nofile 1024", 512, 5, 37.3, 7680, "shm"),
    ("192 cores with SMT, /dev/shm 64 MiB, nofile 1048576", 512, 5, 0, 7680, "pipe"),
])
def test_what_the_budget_decides_on_each_host(host, processes, fetches, shm_gib, gets, handover):
    """The numbers docs/architecture.md quotes, for the whole host: the cores' loader processes, their
    batches in /dev/shm where it holds them, through the processes' pipes where it cannot hold one; as
    many images fetched at once as the host's GETs in flight leave each batch."""
    budget = rank_budget(BATCH, HOSTS[host], imagenet(UINT8))
    host_shm = round(RANKS * budget.shm_bytes / GiB, 1)
    assert (RANKS * LOADERS * budget.loader_processes, budget.fetches_in_flight, host_shm,
            RANKS * budget.gets_in_flight, budget.handover) == (processes, fetches, shm_gib, gets, handover)


@pytest.mark.parametrize("host", HOSTS)
def test_the_cores_alone_are_past_a_limit_of_every_gpu_host_and_a_setting_past_one_is_kept_with_a_warning(host):
    """What the cores alone chose before, set by hand, breaks a limit on each host; the run's own
    numbers are kept, and the warnings name each limit they are past."""
    limits = HOSTS[host]
    cores_only = min(32, limits.cpus - 1)
    cfg = BATCH.model_copy(update={"num_workers": cores_only, "fetch_threads": BATCH.batch_size})
    budget = rank_budget(cfg, limits, imagenet(UINT8))
    assert (budget.loader_processes, budget.fetches_in_flight) == (cores_only, 256)
    assert RANKS * budget.gets_in_flight > CONNECTIONS_PER_ENDPOINT
    assert any(warning.startswith("training.fetch_threads=256 is past a limit of this host: this host keeps at "
                                  "most 8192 GETs in flight per storage endpoint") for warning in budget.warnings)
    assert all("Lower it, or leave it empty to have it sized" in warning for warning in budget.warnings)
    # Past /dev/shm, the number set is kept with its batches through the processes' pipes, which rank 0 says.
    piped = limits.shm_bytes == 64 * MiB
    assert (budget.handover, len(budget.cuts)) == (("pipe", 1) if piped else ("shm", 0))
    assert not any("/dev/shm" in warning for warning in budget.warnings)


SMALL_HOSTS = [(cores, ranks) for cores in (2, 4, 8, 16) for ranks in (1, 2)]


@pytest.mark.parametrize("batch_size", [32, 64])
@pytest.mark.parametrize(("cores", "ranks"), SMALL_HOSTS)
def test_a_small_host_without_a_gpu_gets_what_its_cores_gave_before(cores, ranks, batch_size):
    """2-16 cores, 2 GiB of memory each, half of it /dev/shm, 1,024 open files, one or two CPU ranks
    sharing the cores, a set of 10,000 100-kB images: a loader process per CPU of the rank's share
    less one, and the whole batch fetched at once, as before the budget (the default batch, and twice it)."""
    cfg = TrainingConfig(batch_size=batch_size)
    limits = HostLimits(cpus=cores // ranks, affinity=cores, ranks=ranks, memory_bytes=2 * GiB * cores,
                        shm_bytes=GiB * cores, open_files=1024)
    load = LoaderLoad.of(cfg, [100_000] * 10_000, handed_over_bytes(eval_transform(cfg.image_size), cfg.image_size),
                         pinned=False)
    budget = rank_budget(cfg, limits, load)
    assert (budget.loader_processes, budget.fetches_in_flight) == (max(0, cores // ranks - 1), batch_size)
    assert (budget.cuts, budget.warnings) == ((), ())
    assert_within(budget, limits, load)


def cut_by(limits: HostLimits, load: LoaderLoad, cfg: TrainingConfig = BATCH) -> list[str]:
    """The sentences rank 0 logs: what each limit cut, in the order it says them (loader_workers' why)."""
    budget = rank_budget(cfg, limits, load)
    assert loader_workers(budget).why == "; ".join((budget.why, *budget.cuts))
    return list(budget.cuts)


def test_each_limit_that_cuts_a_number_says_so_with_its_value():
    host = HOSTS["64 cores, /dev/shm half of memory, nofile 1024"]
    # /dev/shm: 11 GiB for 8 ranks holds 4 of 7 loader processes' batches of 256 224-px images.
    shm, _ = cut_by(dataclasses.replace(host, shm_bytes=11 * GiB), imagenet(UINT8))
    assert shm.startswith("Loader processes 4, not 7: /dev/shm holds 11 GiB for the 8 rank(s) on this host")
    assert shm.endswith("give the host (a container: docker run --shm-size) a larger /dev/shm for more")
    # Docker's default holds none: the batches cross the processes' pipes instead, which rank 0 says, and why.
    piped, _ = cut_by(dataclasses.replace(host, shm_bytes=64 * MiB), imagenet(UINT8))
    assert piped.startswith("Batches cross the loader processes' pipes, not /dev/shm: /dev/shm holds 64 MiB for the "
                            "8 rank(s) on this host")
    assert "room for 0 loader process(es), not 7; through a pipe the rank copies each batch of 36.8 MiB out" in piped
    assert piped.endswith("give the host (a container: docker run --shm-size) a larger /dev/shm to hand them over there")
    # Connections: 14 loader processes of batch 256 at once would keep 10,752 GETs in flight per rank.
    [connections] = cut_by(host, imagenet(UINT8))
    assert connections.startswith("Images fetched at once per batch 24, not 256: this host keeps at most 8192 GETs "
                                  "in flight per storage endpoint (host_budget.CONNECTIONS_PER_ENDPOINT), 1024 for "
                                  "each of its 8 rank(s), which the rank's 14 loader processes")
    # Open files: images handed over encoded (decode_on="device") are a tensor, and so a file, each.
    encoded = LoaderLoad.of(BATCH, IMAGENET, None, pinned=True)
    assert encoded.tensors_per_batch == 258
    files = [sentence for sentence in cut_by(host, encoded) if "RLIMIT_NOFILE" in sentence]
    assert files[0].startswith("Loader processes 0, not 7: a process may open 1024 files (RLIMIT_NOFILE)")
    assert "ulimit -n" in files[0]
    assert cut_by(dataclasses.replace(host, open_files=1_048_576), encoded)[0].startswith(
        "Images fetched at once per batch")  # the GETs in flight alone
    # Memory: camera photos of 5 MB, three batches of them fetched ahead in each loader process.
    photos = LoaderLoad.of(BATCH, [5_000_000] * 100_000, UINT8, pinned=True)
    memory = [sentence for sentence in cut_by(host, photos) if "memory is" in sentence]
    assert memory[0].startswith("Loader processes 4, not 7: the host's memory is 512 GiB for the 8 rank(s)")
    # Open files of a loader process: a batch of 512 fetched at once holds 1,536 sockets (one rank, one
    # loader process per loader: its GETs in flight fit the host's).
    one_rank = dataclasses.replace(host, cpus=2, ranks=1)
    large = BATCH.model_copy(update={"batch_size": 512})
    [sockets] = cut_by(one_rank, imagenet(UINT8, large), large)
    assert sockets.startswith("Images fetched at once per batch 318, not 512: a process may open 1024 files "
                              "(RLIMIT_NOFILE), and each loader process holds a socket per image in flight")


def test_the_batches_are_counted_in_the_bytes_their_transform_makes():
    """A uint8 batch takes a quarter of the float32 one's /dev/shm: the count follows the transform's tensors."""
    as_float = v2.Compose([v2.PILToTensor(), v2.ToDtype(torch.float32)])
    assert handed_over_bytes(as_float, 224) == FLOAT32 and handed_over_bytes(v2.PILToTensor(), 224) == UINT8
    assert handed_over_bytes(eval_transform(224), 224) in (FLOAT32, UINT8)
    host = HOSTS["64 cores, /dev/shm half of memory, nofile 1024"]
    as_float32, as_uint8 = (rank_budget(BATCH, host, imagenet(size)) for size in (FLOAT32, UINT8))
    assert as_float32.shm_bytes == 4 * as_uint8.shm_bytes == LOADERS * (7 * 2 + 1) * 256 * FLOAT32


def test_this_host_is_read_through_one_seam():
    limits = HostLimits.of_this_host(local_ranks=1)
    assert (limits.cpus, limits.affinity) == (torch.get_num_threads(), len(cpu_set()))
    assert limits.ranks == max(1, len(cpu_set()) // torch.get_num_threads())
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert limits.open_files == soft or soft == resource.RLIM_INFINITY
    assert 0 < limits.memory_bytes and limits.connections == CONNECTIONS_PER_ENDPOINT
    if os.path.isdir("/dev/shm"):
        found = os.statvfs("/dev/shm")
        assert limits.shm_bytes == found.f_frsize * found.f_blocks
    if os.path.isfile("/proc/sys/kernel/pid_max"):  # Linux: the host's own limit on threads, at least
        with open("/proc/sys/kernel/pid_max") as pid_max:
            assert limits.threads is not None and 0 < limits.threads.count <= int(pid_max.read())
    assert HostLimits.of_this_host(local_ranks=64).ranks == 64


def test_a_soft_limit_of_open_files_below_the_rank_s_own_says_so_and_fetches_one_at_a_time():
    """256 open files (macOS' soft limit, where the hard one allows no more) leave the rank none for its
    loaders: it loads its batches itself, one GET at a time, and says which limit and how to raise it."""
    host = HostLimits(cpus=8, affinity=8, ranks=1, memory_bytes=64 * GiB, shm_bytes=32 * GiB, open_files=256)
    budget = rank_budget(TrainingConfig(batch_size=32), host, LoaderLoad.of(TrainingConfig(batch_size=32), IMAGENET,
                                                                             UINT8, pinned=False))
    assert (budget.loader_processes, budget.fetches_in_flight) == (0, 1)
    assert all("RLIMIT_NOFILE" in cut and "ulimit -n" in cut for cut in budget.cuts) and len(budget.cuts) == 2


def test_the_rank_raises_its_soft_limit_of_open_files_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lower = min(soft, 256) if soft != resource.RLIM_INFINITY else 256
    resource.setrlimit(resource.RLIMIT_NOFILE, (lower, hard))
    try:
        raised = HostLimits.of_this_host().open_files
        assert raised > lower and resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
        assert raised == (min(hard, OPEN_FILES_WANTED) if hard != resource.RLIM_INFINITY else OPEN_FILES_WANTED)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(("cgroup", "files", "limit"), [
    ("0::/system.slice/job.service\n", {"sys/fs/cgroup/system.slice/job.service/memory.max": "4294967296",
                                         "sys/fs/cgroup/memory.max": "max"}, 4 * GiB),
    ("0::/slurm/uid_1/job_7/step_0\n", {"sys/fs/cgroup/slurm/uid_1/job_7/memory.max": "2147483648",
                                        "sys/fs/cgroup/slurm/uid_1/job_7/step_0/memory.max": "max"}, 2 * GiB),
    ("12:cpu,cpuacct:/x\n4:memory:/docker/abc\n", {"sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes":
                                                     "1073741824"}, GiB),
    ("0::/\n", {"sys/fs/cgroup/memory.max": "536870912"}, 512 * MiB),
    ("0::/unlimited\n", {"sys/fs/cgroup/unlimited/memory.max": "max"}, None),
    # The root's limit, whatever /proc/self/cgroup says (nothing; no memory line), and a blank line in it.
    ("", {"sys/fs/cgroup/memory/memory.limit_in_bytes": "2147483648"}, 2 * GiB),
    ("12:cpu:/x\n", {"sys/fs/cgroup/memory.max": "2147483648"}, 2 * GiB),
    ("0::/a\n\n", {"sys/fs/cgroup/a/memory.max": "1073741824"}, GiB),
])
def test_the_memory_limit_of_the_process_s_own_cgroup_counts(tmp_path, cgroup, files, limit):
    """A Slurm job's, a systemd unit's or a container's limit sits below the cgroup root, on the path
    /proc/self/cgroup names: it, or an ancestor's, bounds the loaders' memory where lower than the host's."""
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = memory_limit(tmp_path)
    assert found == (psutil.virtual_memory().total if limit is None else min(limit, psutil.virtual_memory().total))


def test_loader_processes_set_past_the_host_s_gets_in_flight_are_warned_of():
    """200 loader processes per loader on each of 8 ranks keep, at one image each, 9,600 GETs in flight."""
    cfg = BATCH.model_copy(update={"num_workers": 200})
    budget = rank_budget(cfg, HOSTS["192 cores with SMT, /dev/shm half of memory, nofile 1048576"], imagenet(UINT8))
    assert budget.loader_processes == 200 and budget.fetches_in_flight == 1
    assert any("GETs in flight per storage endpoint" in warning for warning in budget.warnings)


def test_ranks_on_this_host_count_the_workers_sharing_its_cpus():
    """A rank whose share is one CPU of the 2+ its worker may run on shares the host with as many ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert HostLimits.of_this_host(local_ranks=1).ranks == len(cpu_set())
    finally:
        torch.set_num_threads(threads)


# Limits on threads, as `threads_left` reads them (what each allows, less what it counts now): a systemd
# service's pids.max (DefaultTasksMax, 15% of a pid_max of 32,768: 4,915), a pod's or a container's of
# 32,768, and RLIMIT_NPROC 4,096 (RHEL's soft limit for users' logins), each with 400 threads running
# already (the Dask workers, their nannies, the host's services).
RUNNING = 400
SERVICE = "/sys/fs/cgroup/system.slice/dask-worker.service"
THREAD_LIMITS = {
    "pids.max 4915": ThreadsLeft(4915 - RUNNING, f"the cgroup {SERVICE} allows 4915 threads (pids.max) and runs "
                                                 f"{RUNNING}", RAISE_PIDS),
    "pids.max 32768": ThreadsLeft(32768 - RUNNING, f"the cgroup {SERVICE} allows 32768 threads (pids.max) and runs "
                                                   f"{RUNNING}", RAISE_PIDS),
    "nproc 4096": ThreadsLeft(4096 - RUNNING, f"user 1000 may run 4096 threads (RLIMIT_NPROC) and runs {RUNNING}",
                              RAISE_NPROC),
}
THREADED = {
    f"{name}, {limit}, nofile {files}": dataclasses.replace(gpu_host(cores, memory, memory // 2, files),
                                                            threads=THREAD_LIMITS[limit])
    for name, cores, memory in (("64 cores", 64, 512 * GiB), ("192 cores with SMT", 384, 2 * TiB))
    for limit in THREAD_LIMITS
    for files in (1024, 1_048_576)
}


@pytest.mark.parametrize("image_bytes", [FLOAT32, UINT8], ids=["float32", "uint8"])
@pytest.mark.parametrize("host", [*HOSTS, *THREADED])
def test_a_gpu_host_s_loaders_stay_within_its_limits(host, image_bytes):
    """Also the hosts with a limit on threads (THREADED): their threads within their share of it (assert_within)."""
    limits = HOSTS.get(host) or THREADED[host]
    budget = rank_budget(BATCH, limits, imagenet(image_bytes))
    assert_within(budget, limits, imagenet(image_bytes))
    assert budget.fetches_in_flight >= 1 and budget.loader_processes <= limits.cpus - 1
    if limits.threads is None:  # these stay well within Linux's smallest default pid_max anyway
        assert RANKS * budget.threads <= pids(limits.affinity) // 4
    else:  # a limit on threads cuts the images fetched at once first: every such host keeps loader processes
        assert budget.loader_processes >= 1


def test_the_thread_limited_hosts_are_past_their_share_without_the_bound_and_only_the_smaller_ones_are():
    """What the other limits alone leave is past the share of 4,915 and of 4,096 threads on every host, so
    that a budget that left threads unbounded fails the test above; within 32,768 it is not."""
    for host, limits in THREADED.items():
        assert limits.threads is not None
        unbounded = rank_budget(BATCH, dataclasses.replace(limits, threads=None), imagenet(UINT8))
        past = RANKS * unbounded.threads > THREADS_SHARE * limits.threads.count
        assert past == ("32768" not in host), host


@pytest.mark.parametrize(("host", "processes", "fetches", "threads", "gets"), [
    ("64 cores, pids.max 4915, nofile 1048576", 112, 4, 2200, 1344),
    ("64 cores, nproc 4096, nofile 1048576", 112, 2, 1528, 672),
    ("192 cores with SMT, pids.max 4915, nofile 1048576", 176, 1, 2152, 528),
    ("192 cores with SMT, nproc 4096, nofile 1048576", 144, 1, 1832, 432),
    ("64 cores, pids.max 32768, nofile 1048576", 112, 24, 8920, 8064),
    ("192 cores with SMT, pids.max 32768, nofile 1048576", 512, 5, 11656, 7680),
])
def test_what_the_budget_decides_within_each_limit_on_threads(host, processes, fetches, threads, gets):
    """The numbers docs/architecture.md quotes, for the whole host: images fetched at once are cut first,
    then loader processes where even one image at a time is past the share; within 32,768 threads they
    are the numbers of the host without a limit on threads."""
    limits = THREADED[host]
    budget = rank_budget(BATCH, limits, imagenet(UINT8))
    assert (RANKS * LOADERS * budget.loader_processes, budget.fetches_in_flight, RANKS * budget.threads,
            RANKS * budget.gets_in_flight) == (processes, fetches, threads, gets)
    if "32768" in host:
        unbounded = rank_budget(BATCH, dataclasses.replace(limits, threads=None), imagenet(UINT8))
        assert (budget.loader_processes, budget.fetches_in_flight) == (unbounded.loader_processes,
                                                                       unbounded.fetches_in_flight)


def test_a_limit_on_threads_that_cuts_a_number_says_which_its_value_and_the_fix():
    service = THREADED["192 cores with SMT, pids.max 4915, nofile 1048576"]
    processes, *fetches = [sentence for sentence in cut_by(service, imagenet(UINT8)) if "pids.max" in sentence]
    assert processes.startswith(f"Loader processes 11, not 32: the cgroup {SERVICE} allows 4915 threads (pids.max) "
                                "and runs 400, which leaves 4515 threads, of which the ranks may start 50% (282 for "
                                "each of the host's 8 rank(s)), where the rank runs 49 of its own")
    assert processes.endswith("room for 11; raise the cgroup's pids.max (TasksMax= of a systemd unit, docker run "
                              "--pids-limit, a Kubernetes pod's podPidsLimit) for more")
    assert [sentence[:40] for sentence in fetches] == ["Images fetched at once per batch 1, not "]
    # Fetches alone: on 64 cores 14 loader processes at one image each fit 282 threads per rank.
    user = THREADED["64 cores, nproc 4096, nofile 1048576"]
    [nproc] = [sentence for sentence in cut_by(user, imagenet(UINT8)) if "RLIMIT_NPROC" in sentence]
    assert nproc.startswith("Images fetched at once per batch 2, not 256: user 1000 may run 4096 threads "
                            "(RLIMIT_NPROC) and runs 400, which leaves 3696 threads")
    assert "ulimit -u" in nproc and "LimitNPROC=" in nproc


def test_settings_past_a_limit_on_threads_are_kept_with_a_warning():
    """The whole batch fetched at once, 32 loader processes per loader: 100,000 threads on the 384-CPU
    host, past even 32,768; both kept as set, each warned of with the limit and its fix, nothing cut."""
    cfg = BATCH.model_copy(update={"num_workers": 32, "fetch_threads": 256})
    for host in ("192 cores with SMT, pids.max 32768, nofile 1048576",
                 "192 cores with SMT, nproc 4096, nofile 1048576"):
        budget = rank_budget(cfg, THREADED[host], imagenet(UINT8))
        assert (budget.loader_processes, budget.fetches_in_flight, budget.cuts) == (32, 256, ())
        limit = THREADED[host].threads
        assert limit is not None
        threads = [warning for warning in budget.warnings if limit.limit in warning]
        assert [warning.split(" is past")[0] for warning in threads] == ["training.num_workers=32"] * (
            "nproc" in host) + ["training.fetch_threads=256"]
        assert all(warning.endswith(f"Lower it, or leave it empty to have it sized; or {limit.fix}.")
                   for warning in threads)


CGROUP_V2 = "0::/system.slice/dask-worker.service\n"
V2 = "sys/fs/cgroup/system.slice/dask-worker.service"
HOST_THREADS = {"proc/loadavg": "0.52 0.58 0.59 3/900 4242\n", "proc/sys/kernel/threads-max": "4126409\n",
                "proc/sys/kernel/pid_max": "4194304\n"}


@pytest.mark.parametrize(("files", "uid", "nproc", "left"), [
    # cgroup v2: the process's own cgroup, and an ancestor (a pod's limit over its container's "max").
    ({"proc/self/cgroup": CGROUP_V2, f"{V2}/pids.max": "4915\n", f"{V2}/pids.current": "400\n"}, 1000, None,
     (4515, f"the cgroup /{V2} allows 4915 threads (pids.max) and runs 400")),
    ({"proc/self/cgroup": "0::/kubepods/pod7/ctr\n", "sys/fs/cgroup/kubepods/pod7/pids.max": "1024",
      "sys/fs/cgroup/kubepods/pod7/pids.current": "1000", "sys/fs/cgroup/kubepods/pod7/ctr/pids.max": "max",
      "sys/fs/cgroup/kubepods/pod7/ctr/pids.current": "990"}, 1000, None,
     (24, "the cgroup /sys/fs/cgroup/kubepods/pod7 allows 1024 threads (pids.max) and runs 1000")),
    # cgroup v1: below the pids hierarchy, and Docker's own cgroup mounted at its root.
    ({"proc/self/cgroup": "12:memory:/docker/abc\n8:pids:/docker/abc\n",
      "sys/fs/cgroup/pids/docker/abc/pids.max": "32768", "sys/fs/cgroup/pids/docker/abc/pids.current": "100"},
     1000, None, (32668, "the cgroup /sys/fs/cgroup/pids/docker/abc allows 32768 threads (pids.max) and runs 100")),
    ({"proc/self/cgroup": "8:pids:/docker/abc\n", "sys/fs/cgroup/pids/pids.max": "2048",
      "sys/fs/cgroup/pids/pids.current": "48"}, 1000, None,
     (2000, "the cgroup /sys/fs/cgroup/pids allows 2048 threads (pids.max) and runs 48")),
    # No limit: "max", a pids.current missing, no cgroup files at all.
    ({"proc/self/cgroup": CGROUP_V2, f"{V2}/pids.max": "max", f"{V2}/pids.current": "400"}, 1000, None, None),
    ({"proc/self/cgroup": CGROUP_V2, f"{V2}/pids.max": "4915"}, 1000, None, None),
    ({}, 1000, None, None),
    # RLIMIT_NPROC less the threads of the processes whose real uid is the user's; root is exempt.
    ({"proc/101/status": "Name:\tpython\nUid:\t1000\t1000\t1000\t1000\nThreads:\t300\n",
      "proc/102/status": "Name:\tsshd\nUid:\t0\t0\t0\t0\nThreads:\t50\n",
      "proc/103/status": "Name:\tsu\nUid:\t0\t1000\t0\t1000\nThreads:\t1\n"}, 1000, 4096,
     (3796, "user 1000 may run 4096 threads (RLIMIT_NPROC) and runs 300")),
    ({"proc/102/status": "Name:\tsshd\nUid:\t0\t0\t0\t0\nThreads:\t50\n"}, 0, 4096, None),
    # Root in a rootless container (uid 0 mapped from another) is not exempt.
    ({"proc/self/uid_map": "         0     100000      65536\n",
      "proc/102/status": "Name:\tsshd\nUid:\t0\t0\t0\t0\nThreads:\t50\n"}, 0, 4096,
     (4046, "user 0 may run 4096 threads (RLIMIT_NPROC) and runs 50")),
    # A name in no encoding counts; a status unlike one (no Uid, threads not a number) is passed over.
    ({"proc/101/status": b"Name:\tloader\xe9\nUid:\t1000\t1000\t1000\t1000\nThreads:\t201\n",
      "proc/104/status": "Name:\todd\nThreads:\t7\n",
      "proc/105/status": "Name:\todd\nUid:\t1000\t1000\t1000\t1000\nThreads:\t?\n"}, 1000, 4096,
     (3895, "user 1000 may run 4096 threads (RLIMIT_NPROC) and runs 201")),
    ({"proc/self/cgroup": CGROUP_V2 + "\n", f"{V2}/pids.max": "4915\n", f"{V2}/pids.current": "400\n"}, 1000, None,
     (4515, f"the cgroup /{V2} allows 4915 threads (pids.max) and runs 400")),
    # The host's: the least of threads-max and pid_max, less its threads; and the least of all limits.
    ({**HOST_THREADS, "proc/sys/kernel/pid_max": "32768\n"}, 1000, None,
     (31868, "the host may run 32768 threads (kernel.pid_max) and runs 900")),
    ({**HOST_THREADS, "proc/self/cgroup": CGROUP_V2, f"{V2}/pids.max": "4915", f"{V2}/pids.current": "400"},
     1000, 4096, (4096, "user 1000 may run 4096 threads (RLIMIT_NPROC) and runs 0")),
])
def test_the_threads_left_are_read_from_the_process_s_cgroup_its_user_and_the_host(tmp_path, monkeypatch, files, uid,
                                                                                    nproc, left):
    """The cgroup's pids.max less pids.current, on the path /proc/self/cgroup names, v2 and v1, "max"
    meaning none; RLIMIT_NPROC's soft limit less the user's threads; the host's threads-max or pid_max
    less its threads (/proc/loadavg): the least of them."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    rlimit = resource.getrlimit
    soft = resource.RLIM_INFINITY if nproc is None else nproc
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, soft) if which == resource.RLIMIT_NPROC
                        else rlimit(which))
    monkeypatch.setattr(os, "getuid", lambda: uid)
    found = threads_left(tmp_path)
    assert (None if found is None else (found.count, found.limit)) == left


def test_a_limit_on_threads_that_leaves_no_room_at_all_is_warned_of():
    """10 threads left for 8 ranks: none has room even for its own; each loads its own batches, one image at
    a time, and warns that it runs past its share rather than saying there is room for one."""
    left = ThreadsLeft(10, "the cgroup /x allows 500 threads (pids.max) and runs 490", RAISE_PIDS)
    host = HostLimits(cpus=8, affinity=64, ranks=8, memory_bytes=64 * GiB, shm_bytes=32 * GiB, open_files=2**20,
                      threads=left)
    budget = rank_budget(BATCH, host, imagenet(UINT8))
    assert (budget.loader_processes, budget.fetches_in_flight) == (0, 1)
    assert len(budget.warnings) == 1 and budget.warnings[0].startswith(f"This rank runs {budget.threads} threads")
    assert "(0 for each of the host's 8 rank(s))" in budget.warnings[0] and RAISE_PIDS in budget.warnings[0]
    roomy = rank_budget(BATCH, dataclasses.replace(host, threads=ThreadsLeft(10_000_000, "plenty", RAISE_PIDS)), imagenet(UINT8))
    assert roomy.warnings == ()

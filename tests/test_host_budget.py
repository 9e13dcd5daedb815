"""A rank's loader processes and reads in flight fit its host's limits (tasks/data/host_budget.py).

The hosts are simulated by building `HostLimits` by hand, the seam every number is read through;
the sizing is the project's own, unchanged. Each host is an 8-GPU host whose 8 ranks share it, at
batch 256 of ImageNet-like images (1,281,167 of 110 kB on average), 224-px crops handed over as
uint8 tensors (the loaders' steps, loader_steps.py) or float32 ones (the whole transform, as before),
pinned for CUDA:

- 64 cores (64 CPUs, no SMT), 512 GiB of memory;
- 192 cores with SMT (384 CPUs), 2 TiB;

each with /dev/shm half of its memory or Docker's default 64 MiB, and RLIMIT_NOFILE 1,024 (a
common soft limit) or 1,048,576. Their CPUs per rank come from the gang's plan (`thread_shares`)
for 8 workers that may all run on every CPU. Counts are per rank; a host's is 8 times as many.
"""

from __future__ import annotations

import dataclasses
import os
import resource

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
    LoaderLoad,
    handed_over_bytes,
    rank_budget,
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


def assert_within(budget: Budget, limits: HostLimits) -> None:
    """The whole host's loaders, `limits.ranks` ranks of `budget`, within every limit of `limits`."""
    ranks = limits.ranks
    assert limits.shm_bytes is not None
    assert ranks * budget.shm_bytes <= SHM_SHARE * limits.shm_bytes
    assert ranks * budget.memory_bytes <= MEMORY_SHARE * limits.memory_bytes
    assert max(budget.loader_open_files, budget.rank_open_files) <= limits.open_files
    assert ranks * budget.gets_in_flight <= limits.connections == CONNECTIONS_PER_ENDPOINT
    assert ranks * budget.threads <= pids(limits.affinity) // 4


@pytest.mark.parametrize("image_bytes", [FLOAT32, UINT8], ids=["float32", "uint8"])
@pytest.mark.parametrize("host", HOSTS)
def test_a_gpu_host_s_loaders_stay_within_its_limits(host, image_bytes):
    limits = HOSTS[host]
    budget = rank_budget(BATCH, limits, imagenet(image_bytes))
    assert_within(budget, limits)
    assert budget.fetches_in_flight >= 1 and budget.loader_processes <= limits.cpus - 1


@pytest.mark.parametrize(("host", "processes", "fetches", "shm_gib", "gets"), [
    ("64 cores, /dev/shm half of memory, nofile 1024", 112, 24, 8.6, 8064),
    ("64 cores, /dev/shm 64 MiB, nofile 1024", 0, 256, 0, 6144),
    ("192 cores with SMT, /dev/shm half of memory, nofile 1024", 512, 5, 37.3, 7680),
    ("192 cores with SMT, /dev/shm 64 MiB, nofile 1048576", 0, 256, 0, 6144),
])
def test_what_the_budget_decides_on_each_host(host, processes, fetches, shm_gib, gets):
    """The numbers docs/architecture.md quotes, for the whole host: the cores' loader processes where
    /dev/shm holds their batches, none where it cannot hold one; as many images fetched at once as the
    host's GETs in flight leave each batch."""
    budget = rank_budget(BATCH, HOSTS[host], imagenet(UINT8))
    host_shm = round(RANKS * budget.shm_bytes / GiB, 1)
    assert (RANKS * LOADERS * budget.loader_processes, budget.fetches_in_flight, host_shm,
            RANKS * budget.gets_in_flight) == (processes, fetches, shm_gib, gets)


@pytest.mark.parametrize("host", HOSTS)
def test_the_cores_alone_are_past_a_limit_of_every_gpu_host_and_a_setting_past_one_is_kept_with_a_warning(host):
    """What the cores alone chose before, set by hand, breaks a limit on each host; the run's own
    numbers are kept, and the warnings name each limit they are past."""
    limits = HOSTS[host]
    cores_only = min(32, limits.cpus - 1)
    cfg = BATCH.model_copy(update={"num_workers": cores_only, "fetch_threads": BATCH.batch_size})
    budget = rank_budget(cfg, limits, imagenet(UINT8))
    assert (budget.loader_processes, budget.fetches_in_flight, budget.cuts) == (cores_only, 256, ())
    assert RANKS * budget.gets_in_flight > CONNECTIONS_PER_ENDPOINT
    assert any(warning.startswith("training.fetch_threads=256 is past a limit of this host: this host keeps at "
                                  "most 8192 GETs in flight per storage endpoint") for warning in budget.warnings)
    if limits.shm_bytes == 64 * MiB:
        assert any(warning.startswith(f"training.num_workers={cores_only} is past a limit of this host: /dev/shm "
                                      "holds 64 MiB") for warning in budget.warnings)
    assert all("Lower it, or leave it empty to have it sized" in warning for warning in budget.warnings)


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
    assert_within(budget, limits)


def cut_by(limits: HostLimits, load: LoaderLoad, cfg: TrainingConfig = BATCH) -> list[str]:
    """The sentences rank 0 logs: what each limit cut, in the order it says them (loader_workers' why)."""
    budget = rank_budget(cfg, limits, load)
    assert loader_workers(budget).why == "; ".join((budget.why, *budget.cuts))
    return list(budget.cuts)


def test_each_limit_that_cuts_a_number_says_so_with_its_value():
    host = HOSTS["64 cores, /dev/shm half of memory, nofile 1024"]
    # /dev/shm: Docker's default holds no batch of 256 224-px images.
    [shm] = cut_by(dataclasses.replace(host, shm_bytes=64 * MiB), imagenet(UINT8))
    assert shm.startswith("Loader processes 0, not 7: /dev/shm holds 64 MiB for the 8 rank(s) on this host")
    assert shm.endswith("give the host (a container: docker run --shm-size) a larger /dev/shm for more")
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
    assert HostLimits.of_this_host(local_ranks=64).ranks == 64

"""A rank's loader processes and reads in flight, sized from its host's limits, not its cores alone
(docs/architecture.md, "Data: loader processes from the host").

The cores-only default (a loader process per CPU of the rank's share less one, at most 32; a batch's
images all fetched at once) grew with the host's cores and nothing else. Sized that way, an 8-GPU host
of 192 cores (384 CPUs with SMT) at batch 256 ran 512 loader processes holding ~150 GiB of float32
batches (~37 GiB as uint8) in /dev/shm while the next epoch started during validation, and had 197,000
GETs in flight at an epoch's start, each on a thread, far past the ~28,000 ephemeral ports a host has
towards one endpoint address and the 4,915 threads a systemd service may run by default; each loader
process held ~780 sockets, past the 1,024 open files many hosts allow a process. Here every number
starts from that
default and is cut to what the host's limits leave the rank, its share of each being the host's over
the ranks on it; a limit that cut says so in a sentence rank 0 logs. A number the run sets
(training.num_workers, training.fetch_threads) is kept, with a warning where it is past a limit.

The host is read in one place, `HostLimits.of_this_host`; `rank_budget` is pure, so a test sizes a
simulated host by building a `HostLimits` of its own.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from prefect_ddp.tasks.config import TrainingConfig
from prefect_ddp.tasks.data.fetch_ahead import BATCHES_AT_ONCE
from prefect_ddp.tasks.data.object_reads import OBSTORE_RUNTIME_THREADS
from prefect_ddp.tasks.gang import cpu_set

# The most loader processes a rank starts by default, however many cores it has: a 96-core host with
# one GPU would otherwise start 95 for training and 95 for validation. Set training.num_workers for more.
MAX_DEFAULT_LOADER_WORKERS = 32
# A rank's loaders, train and validation: both keep their processes for the run (persistent_workers),
# and both fetch and hold batches at once while the next epoch starts during validation (epoch_ahead.py).
LOADERS = 2
# Batches each loader process has ready: DataLoader's prefetch_factor, left at its default by the loaders.
PREFETCH_FACTOR = 2
# The shares of the host's memory and /dev/shm the loaders may fill: the rest is the rank's own (its
# model and optimizer, the CUDA context, checkpoints copied to memory), its Dask worker's, and, in
# /dev/shm, NCCL's shared-memory transport between the host's GPUs.
MEMORY_SHARE = 0.5
SHM_SHARE = 0.5
# A loader process's own memory, forked from a rank: ~115 MiB, and ~260 MiB with a 1M-image index, which
# copy-on-write copies as the process touches it (measured for issue 55).
LOADER_PROCESS_BYTES = 115 * 2**20
INDEX_BYTES_PER_IMAGE = 150
# Open files of a loader process besides its sockets and its batches: libraries, its pipes to the rank.
FILES_MARGIN = 64
# The rank process's own open files: its Dask worker's connections, the process group's, libraries.
RANK_FILES_MARGIN = 256
# The rank's files per loader process besides its batches: the process's index queue (2) and sentinel.
RANK_FILES_PER_LOADER_PROCESS = 3
# GETs a host keeps in flight to one storage endpoint (a local filesystem counts as one), all its ranks
# together. A host's GPUs take up to ~35,000 images/s (8 x 4,337 for ResNet-50 at 224 px on an H200,
# bench/RESULTS.md, "GPU"), which at 30-100 ms per GET is 1,000-3,500 GETs in flight (Little's law);
# counting validation's and the next epoch's at once, twice that. 8,192 leaves that room and stays well
# below the 28,232 ephemeral ports (Linux's default ip_local_port_range) a host has towards one address,
# so that an on-premises S3 (MinIO) behind one IP is not starved of ports, with room left for its
# connections in TIME_WAIT. training.fetch_threads sets the images fetched at once per batch past this
# budget, for a store that takes more.
CONNECTIONS_PER_ENDPOINT = 8192
# A loader process's threads besides its reads: its own, fetch-ahead's (one per batch in flight), its
# s3fs instance's event loop and obstore's runtime. Each read in flight takes one more, from the
# process's read threads (object_reads' `_read_pool`), which stay once started.
LOADER_PROCESS_THREADS = 1 + BATCHES_AT_ONCE + 1 + OBSTORE_RUNTIME_THREADS
# The share of the threads the host still allows that its ranks' counted threads (Budget.threads: torch's,
# the loader processes', a read thread per GET) may take. The rest is for threads not counted there (the
# Dask worker's and its nanny's, the process group's, CUDA's and NCCL's, those libraries start on first
# use), and for what the rest of the host starts after the rank read its limits: the reading is a
# snapshot, and a sweep's next trial or another user's job starts threads of its own.
THREADS_SHARE = 0.5
SHARED_MEMORY = "/dev/shm"
# Where /dev/shm holds fewer loader processes' batches than this share of the processes the other limits
# leave (or than training.num_workers sets), their batches cross the processes' pipes instead
# (pipe_handover.py): cutting a rank's loaders below half would cost it more than the copies out of
# the pipes do.
PIPE_BELOW_SHARE = 0.5
# The rank's CPU per MiB of batch handed over through a loader process's pipe: its reads out of the
# pipe and the unpickling copy (1.3-1.9 ms measured, 0.4-0.6 through /dev/shm: bench/RESULTS.md,
# "Batches through pipes").
PIPE_RANK_MS_PER_MIB = 1.5
RAISE_OPEN_FILES = "raise the limit (ulimit -n, LimitNOFILE= of a systemd unit, docker run --ulimit nofile=) for more"
RAISE_PIDS = ("raise the cgroup's pids.max (TasksMax= of a systemd unit, docker run --pids-limit, a Kubernetes "
              "pod's podPidsLimit) for more")
RAISE_NPROC = "raise the limit (ulimit -u, LimitNPROC= of a systemd unit, nproc in limits.conf) for more"


@dataclass(frozen=True)
class ThreadsLeft:
    """The threads one limit of the host still allows new work, and which limit: `threads_left` reads them."""

    count: int
    limit: str  # the limit, its value and what it counts now
    fix: str  # how to allow more, a clause


@dataclass(frozen=True)
class HostLimits:
    """The limits a rank's loaders live within, as the host gives them: `of_this_host` reads them."""

    cpus: int  # the rank's share of the host's CPUs: its torch threads (the gang's plan.thread_shares)
    affinity: int  # the CPUs its process may run on
    ranks: int  # ranks sharing the host's memory, /dev/shm, connections and threads
    memory_bytes: int  # the host's memory, or its container's limit where lower
    shm_bytes: int | None  # the size of /dev/shm; None where there is none (not Linux)
    open_files: int  # RLIMIT_NOFILE's soft limit, per process (loader processes inherit it)
    connections: int = CONNECTIONS_PER_ENDPOINT  # GETs in flight per storage endpoint, the whole host
    threads: ThreadsLeft | None = None  # the host's tightest limit on threads; None: none limits them, or none was read

    @classmethod
    def of_this_host(cls, local_ranks: int = 1) -> HostLimits:
        """This process's host, for a rank of a gang with `local_ranks` ranks on it.

        Ranks sharing the host are the gang's there, or more where the gang's plan shared the CPUs
        among more workers (a sweep's other trials on the host): the CPUs over the rank's share.
        """
        affinity = len(cpu_set())
        share = torch.get_num_threads()
        soft = raise_open_files()
        return cls(cpus=share, affinity=affinity, ranks=max(1, local_ranks, affinity // share),
                   memory_bytes=memory_limit(), shm_bytes=shared_memory_size(),
                   open_files=sys.maxsize if soft == resource.RLIM_INFINITY else soft, threads=threads_left())


# The open files a rank raises its soft limit to where the hard limit is unlimited: Linux's default
# fs.nr_open, past which setrlimit fails.
OPEN_FILES_WANTED = 1_048_576


def raise_open_files() -> int:
    """This process's RLIMIT_NOFILE soft limit, first raised as far as its hard limit allows, as any
    process may: a soft limit of 256 or 1,024 (common defaults) would leave a rank's loaders a socket
    or two. Its loader processes, forked later, inherit it. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # the system allows less (fs.nr_open): keep what there is
            return soft
        return wanted
    return soft


def memory_limit(root: Path = Path("/")) -> int:
    """The host's memory (psutil), or the least of the cgroup limits over this process where lower:
    its own cgroup's and its ancestors' (a Slurm job's or a systemd unit's, below the root), and the
    root's (a container's own namespace), cgroup v2 and v1. `root`: where /proc and /sys are (tests)."""
    total: int = psutil.virtual_memory().total
    files = cgroup_files(root, "memory", "memory.max", "memory.limit_in_bytes")
    return min([total, *(limit for limit in map(read_number, files) if limit is not None)])


def cgroup_files(root: Path, controller: str, v2_name: str, v1_name: str) -> list[Path]:
    """The files of `controller` in this process's cgroups, their ancestors and the root (a container's
    own, in its cgroup namespace, or where Docker mounts its cgroup), from /proc/self/cgroup: v2's
    "0::/path" (`v2_name` below /sys/fs/cgroup), v1's "N:...controller...:/path" (`v1_name` below
    /sys/fs/cgroup/controller)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    # The root's, read whatever /proc/self/cgroup says: a container's own limits are there.
    files = [root / "sys/fs/cgroup" / v2_name, root / "sys/fs/cgroup" / controller / v1_name]
    for line in lines:
        if line.count(":") < 2:  # not "hierarchy:controllers:path" (a blank line)
            continue
        _, controllers, path = line.split(":", 2)
        folder, name = (("sys/fs/cgroup", v2_name) if controllers == "" else
                        (f"sys/fs/cgroup/{controller}", v1_name) if controller in controllers.split(",")
                        else (None, None))
        if folder is None or name is None:
            continue
        parts = [part for part in path.split("/") if part]
        files += [root / folder / Path(*parts[:depth]) / name for depth in range(len(parts) + 1)]
    return list(dict.fromkeys(files))


def read_number(path: Path) -> int | None:
    """The number a file of the kernel's holds; None where it is unreadable or not a number ("max":
    cgroup v2's where there is no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def threads_left(root: Path = Path("/")) -> ThreadsLeft | None:
    """The least of the threads this host's limits on them still allow new work; None where nothing
    read limits them. `threading.Thread.start` fails past any of them ("can't start new thread"), in a
    loader process deep in a batch. Each is a limit less what it counts now: the cgroup's (a systemd
    unit's TasksMax=, a container's or a pod's pid limit), RLIMIT_NPROC's soft limit (per real user,
    from which the kernel exempts root), and the host's. A few files and a read per process of the
    host, once per rank. `root`: where /proc and /sys are (tests)."""
    soft, uid = resource.getrlimit(resource.RLIMIT_NPROC)[0], os.getuid()
    exempt = uid == 0 and initial_root(root)
    user = None if exempt or soft == resource.RLIM_INFINITY else user_threads_left(root, uid, soft)
    found = [*cgroup_threads_left(root), *(left for left in (user, host_threads_left(root)) if left is not None)]
    return min(found, key=lambda left: left.count, default=None)


def initial_root(root: Path) -> bool:
    """Whether this process's uid 0 is the host's root, whom the kernel exempts from RLIMIT_NPROC: its
    user namespace maps uid 0 to 0 (/proc/self/uid_map). Root in a rootless container is not; where the
    map cannot be read, the process is taken to be in the host's namespace."""
    try:
        first = (root / "proc/self/uid_map").read_text().split()
    except OSError:
        return True
    return first[:2] == ["0", "0"]


def cgroup_threads_left(root: Path) -> list[ThreadsLeft]:
    """pids.max less pids.current (threads, the kernel's tasks) of this process's cgroup and each
    ancestor that has them, cgroup v2 and v1; none where they say "max"."""
    found = []
    for limit in cgroup_files(root, "pids", "pids.max", "pids.max"):
        most_threads, current = read_number(limit), read_number(limit.with_name("pids.current"))
        if most_threads is not None and current is not None:
            found.append(ThreadsLeft(max(0, most_threads - current),
                                     f"the cgroup {Path('/') / limit.parent.relative_to(root)} allows {most_threads} "
                                     f"threads (pids.max) and runs {current}", RAISE_PIDS))
    return found


def user_threads_left(root: Path, uid: int, soft: int) -> ThreadsLeft | None:
    """RLIMIT_NPROC's `soft` limit less the threads user `uid` runs, counted from each process's
    /proc/PID/status (its real uid, which the kernel counts by, and its threads): a read per process.
    None where /proc cannot be listed (not Linux: macOS' RLIMIT_NPROC counts processes, not threads)."""
    try:
        processes = [entry.path for entry in os.scandir(root / "proc") if entry.name.isdigit()]
    except OSError:
        return None
    running = 0
    for process in processes:
        try:  # bytes: a process's name is the kernel's, in no encoding
            status = dict(line.split(b":", 1) for line in Path(process, "status").read_bytes().splitlines()
                          if b":" in line)
            if int(status[b"Uid"].split()[0]) == uid:
                running += int(status[b"Threads"])
        except (OSError, KeyError, ValueError, IndexError):  # ended since it was listed, or unlike a status
            continue
    return ThreadsLeft(max(0, soft - running),
                       f"user {uid} may run {soft} threads (RLIMIT_NPROC) and runs {running}", RAISE_NPROC)


def host_threads_left(root: Path) -> ThreadsLeft | None:
    """The least of kernel.threads-max and kernel.pid_max (each thread takes a pid) less the threads
    the host runs (the total of /proc/loadavg's "running/total"); None where they cannot be read."""
    try:
        running = int((root / "proc/loadavg").read_text().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        return None
    limits = {name: limit for name in ("threads-max", "pid_max")
              if (limit := read_number(root / "proc/sys/kernel" / name)) is not None}
    if not limits:
        return None
    name = min(limits, key=limits.__getitem__)
    return ThreadsLeft(max(0, limits[name] - running),
                       f"the host may run {limits[name]} threads (kernel.{name}) and runs {running}",
                       f"raise kernel.{name} (sysctl -w kernel.{name}=) for more")


def shared_memory_size() -> int | None:
    """The size of /dev/shm, where DataLoader's processes hand their batches over; None where there is none."""
    try:
        found = os.statvfs(SHARED_MEMORY)
    except OSError:
        return None
    return found.f_frsize * found.f_blocks


@dataclass(frozen=True)
class LoaderLoad:
    """What the rank's loaders carry, as the limits count it."""

    batch_size: int
    image_bytes: int  # one image as a loader hands it over: its transformed tensor, or the encoded bytes
    tensors_per_batch: int  # tensors of a batch handed over: each is a file the rank holds while it lives
    stored_image_bytes: int  # an image as fetched, on average: fetched ahead, held until decoded
    indexed_images: int  # the manifest's images, whose index each loader process holds a copy of
    pinned: bool  # batches copied to pinned memory for a CUDA device

    @classmethod
    def of(cls, cfg: TrainingConfig, stored_sizes: Sequence[int], handed_over: int | None, pinned: bool) -> LoaderLoad:
        """Batches of `cfg.batch_size` images of `stored_sizes` (the manifest's): each handed over as
        `handed_over` bytes in one collated tensor, or, with None, encoded, a tensor per image."""
        stored = sum(stored_sizes) // max(1, len(stored_sizes))
        return cls(batch_size=cfg.batch_size, image_bytes=stored if handed_over is None else handed_over,
                   tensors_per_batch=2 if handed_over is not None else cfg.batch_size + 2,
                   stored_image_bytes=stored, indexed_images=len(stored_sizes), pinned=pinned)

    @property
    def batch_bytes(self) -> int:
        return self.batch_size * self.image_bytes

    @property
    def process_bytes(self) -> int:
        """A loader process's own memory: the process, its copy of the index, the batches it fetches
        ahead (encoded) and the one it decodes before collating it into shared memory."""
        return (LOADER_PROCESS_BYTES + INDEX_BYTES_PER_IMAGE * self.indexed_images
                + BATCHES_AT_ONCE * self.batch_size * self.stored_image_bytes + self.batch_bytes)


def handed_over_bytes(transform: Callable[[torch.Tensor], torch.Tensor], side: int) -> int:
    """Bytes of one image as `transform` hands it over, measured on a blank decoded `side`-px image
    (uint8, CHW): so the count follows whatever the transform makes, float32 or uint8.

    >>> from torchvision.transforms import v2
    >>> handed_over_bytes(v2.ToDtype(torch.float32), 4), handed_over_bytes(v2.CenterCrop(2), 4)
    (192, 12)
    """
    return int(transform(torch.zeros(3, side, side, dtype=torch.uint8)).nbytes)


@dataclass(frozen=True)
class Bound:
    """The most of a number that a limit leaves, and the sentence that says so."""

    most: int
    limit: str  # the limit and its value, and what one more of the number costs against it
    fix: str  # how to allow more, a clause


@dataclass(frozen=True)
class Budget:
    """A rank's numbers, and why: `rank_budget`'s choice. Counts are the rank's; a host's is `limits.ranks` times."""

    loader_processes: int  # per loader; the rank has LOADERS of them
    fetches_in_flight: int  # images a batch fetches at once (S3ImageFolder's fetch_threads)
    shm_bytes: int  # batches in /dev/shm, both loaders' at once
    handover: str  # how loader processes hand batches over: "shm" (DataLoader's way) or "pipe" (pipe_handover.py)
    pinned_bytes: int  # batches in pinned memory
    memory_bytes: int  # the loader processes' own memory, their batches in /dev/shm and pinned memory
    loader_open_files: int  # a loader process's: its sockets and the rest
    rank_open_files: int  # the rank process's: its own, and its loader processes' pipes and batches
    gets_in_flight: int  # both loaders' at once, as the next epoch starts during validation
    threads: int  # the rank's torch threads, its loader processes' threads and a thread per read in flight
    cpus: int  # the rank's share of its host's CPUs, which the loader processes' default follows
    why: str  # how the cores-only default came about, or that the run set it
    cuts: tuple[str, ...]  # one sentence per limit that cut a number below its cores-only value, or moved batches to pipes
    warnings: tuple[str, ...]  # one sentence per limit a number the run set is past


def rank_budget(cfg: TrainingConfig, limits: HostLimits, load: LoaderLoad) -> Budget:
    """A rank's loader processes and images fetched at once per batch, within its share of `limits`.

    Loader processes first (their cores-only default, cut by /dev/shm, memory, open files and, at one
    image fetched at once, connections and threads), then the images each batch fetches at once (the
    batch size, cut by open files, connections and threads), each never below what its limits leave.
    Where /dev/shm would hold fewer than PIPE_BELOW_SHARE of the loader processes the other limits leave
    (or fewer than the run set), batches cross the processes' pipes instead, and /dev/shm cuts nothing.
    Numbers the run set are kept; a warning names each limit they are past.

    >>> host = HostLimits(cpus=8, affinity=64, ranks=8, memory_bytes=512 * 2**30, shm_bytes=64 * 2**20,
    ...                   open_files=1024)
    >>> load = LoaderLoad.of(TrainingConfig(batch_size=256), [110_000] * 1000, 3 * 224 * 224 * 4, pinned=True)
    >>> budget = rank_budget(TrainingConfig(batch_size=256), host, load)
    >>> budget.loader_processes, budget.handover, budget.cuts[0][:60]
    (7, 'pipe', "Batches cross the loader processes' pipes, not /dev/shm: /de")
    """
    processes, processes_why = cores_only_processes(limits)
    bounds = process_bounds(limits, load)
    shm = shm_bound(limits, load)
    if cfg.num_workers is None:
        piped = shm is not None and shm.most < PIPE_BELOW_SHARE * least(processes, bounds)
        workers, cuts = cut("Loader processes", processes, bounds if piped or shm is None else [shm, *bounds])
        warnings = []
    else:
        workers, cuts, processes_why = cfg.num_workers, [], f"training.num_workers={cfg.num_workers}, as set"
        piped = shm is not None and workers > shm.most
        warnings = past(f"training.num_workers={cfg.num_workers}", workers, bounds)
    piped = piped and workers > 0
    if piped:
        assert shm is not None  # piped only where /dev/shm bounds the processes
        cuts.insert(0, piped_sentence(shm, workers, load))
    fetch_bounds = fetch_bounds_for(limits, load, workers)
    if cfg.fetch_threads is None:
        fetches, fetch_cuts = cut("Images fetched at once per batch", cfg.batch_size, fetch_bounds)
        cuts += fetch_cuts
    else:
        fetches = cfg.fetch_threads
        warnings += past(f"training.fetch_threads={cfg.fetch_threads}", fetches, fetch_bounds)
    threads = rank_threads(limits, load, workers, fetches)
    if limits.threads is not None and not warnings and threads > threads_share(limits.threads, limits.ranks):
        warnings.append(f"This rank runs {threads} threads at the fewest loader processes and images at once it "
                        f"takes, past its share: {threads_limit(limits.threads, limits.ranks)}. Starting more may "
                        f"fail (\"can't start new thread\"); {limits.threads.fix}.")
    batches = live_batches(workers) * load.batch_bytes
    handed, pinned = (batches if workers else 0), (batches if load.pinned else 0)  # in /dev/shm, or the loaders' memory
    gets = reads_in_flight(workers, fetches)
    return Budget(
        loader_processes=workers, fetches_in_flight=fetches, shm_bytes=0 if piped else handed,
        handover="pipe" if piped else "shm", pinned_bytes=pinned,
        memory_bytes=LOADERS * workers * load.process_bytes + handed + pinned,
        loader_open_files=loader_files(load, fetches) if workers else 0,
        rank_open_files=RANK_FILES_MARGIN + (LOADERS * (workers * rank_files_per_process(load) + load.tensors_per_batch)
                                             if workers else BATCHES_AT_ONCE * fetches),
        gets_in_flight=gets,
        threads=threads, cpus=limits.cpus,
        why=processes_why + ("" if workers else ": the rank loads its batches itself"),
        cuts=tuple(cuts), warnings=tuple(warnings),
    )


def cores_only_processes(limits: HostLimits) -> tuple[int, str]:
    """One loader process per CPU of the rank's share of its host, less one for the rank itself, at
    most MAX_DEFAULT_LOADER_WORKERS; and why.

    The share is the CPUs its worker may run on (its affinity: dask-cuda pins each GPU's worker to the
    cores near that GPU, and the loader processes inherit it) over the workers of the cluster that may
    run on the same CPUs, which the gang sets as each rank's torch threads
    (prefect_ddp.tasks.gang.plan.thread_shares). A constant would starve a GPU host's ranks (2 loader
    processes fed an H200 at a tenth of its ceiling, bench/RESULTS.md) or crowd a small host's.

    >>> cores_only_processes(HostLimits(4, 16, 4, 2**34, 2**33, 1024))[0]
    3
    """
    workers = min(MAX_DEFAULT_LOADER_WORKERS, max(0, limits.cpus - 1))
    why = (f"training.num_workers empty: this rank's share of its host is {limits.cpus} CPU(s) of the "
           f"{limits.affinity} its worker may run on (shared among the cluster's workers that may run on them), "
           "less one for the rank itself")
    if limits.cpus - 1 > MAX_DEFAULT_LOADER_WORKERS:
        why += f", at most {MAX_DEFAULT_LOADER_WORKERS} by default"
    return workers, why


def shm_bound(limits: HostLimits, load: LoaderLoad) -> Bound | None:
    """The most loader processes per loader whose ready batches /dev/shm holds; None without a /dev/shm."""
    if limits.shm_bytes is None:
        return None
    batch = load.batch_bytes
    share = SHM_SHARE * limits.shm_bytes / limits.ranks
    return Bound(
        most=most(share - LOADERS * batch, LOADERS * PREFETCH_FACTOR * batch),
        limit=(f"/dev/shm holds {size(limits.shm_bytes)} for the {limits.ranks} rank(s) on this host, and loaders "
               f"may fill {SHM_SHARE:.0%} of it ({size(share)} per rank), where each loader process keeps "
               f"{PREFETCH_FACTOR} batches of {size(batch)} ready, train's and validation's at once"),
        fix="give the host (a container: docker run --shm-size) a larger /dev/shm for more")


def piped_sentence(shm: Bound, workers: int, load: LoaderLoad) -> str:
    """What rank 0 logs where the batches cross the loader processes' pipes: why, and what it costs."""
    mib = load.batch_bytes / 2**20
    return (f"Batches cross the loader processes' pipes, not /dev/shm: {shm.limit}, room for {shm.most} loader "
            f"process(es), not {workers}; through a pipe the rank copies each batch of {size(load.batch_bytes)} "
            f"out, about {PIPE_RANK_MS_PER_MIB * mib:.3g} ms of its CPU; {shm.fix.removesuffix(' for more')} "
            "to hand them over there")


def process_bounds(limits: HostLimits, load: LoaderLoad) -> list[Bound]:
    """The most loader processes per loader each limit but /dev/shm (`shm_bound`) leaves the rank (0
    always fits: the rank then loads its batches itself)."""
    ranks = f"for the {limits.ranks} rank(s) on this host"
    batch = load.batch_bytes
    bounds = []
    pinned = 1 + load.pinned  # a batch is held in /dev/shm (or a loader process's memory), then in pinned memory too
    share = MEMORY_SHARE * limits.memory_bytes / limits.ranks
    bounds.append(Bound(
        most=most(share - LOADERS * batch * pinned, LOADERS * (load.process_bytes + PREFETCH_FACTOR * batch * pinned)),
        limit=(f"the host's memory is {size(limits.memory_bytes)} {ranks}, and loaders may use {MEMORY_SHARE:.0%} "
               f"of it ({size(share)} per rank), where each loader process takes {size(load.process_bytes)} of "
               f"its own (its index, the batches it fetches ahead) and its ready batches {size(batch)} each"
               + (" in /dev/shm and again in pinned memory" if load.pinned else "")),
        fix="run fewer ranks per host, or on hosts with more memory, for more"))
    per_process = rank_files_per_process(load)
    # (Where the rank's files leave room for a loader process, its own, fewer, fit too.)
    bounds.append(Bound(
        most=most(limits.open_files - RANK_FILES_MARGIN - LOADERS * load.tensors_per_batch, LOADERS * per_process),
        limit=(f"a process may open {limits.open_files} files (RLIMIT_NOFILE), and the rank holds {per_process} per "
               f"loader process (its pipes, and each ready batch's {load.tensors_per_batch} tensor(s) in /dev/shm) "
               f"besides {RANK_FILES_MARGIN} of its own"),
        fix=RAISE_OPEN_FILES))
    bounds.append(Bound(
        most=most(limits.connections // limits.ranks, LOADERS * BATCHES_AT_ONCE),
        limit=(f"{connections_limit(limits)}, and each loader process, train's and validation's, keeps "
               f"{BATCHES_AT_ONCE} batches in flight, at least one image of each"),
        fix="run fewer ranks per host for more"))
    if (left := limits.threads) is not None:
        own = rank_threads(limits, load, workers=0, fetches=0)
        bounds.append(Bound(
            most=most(threads_share(left, limits.ranks) - own, LOADERS * (LOADER_PROCESS_THREADS + BATCHES_AT_ONCE)),
            limit=(f"{threads_limit(left, limits.ranks)}, where the rank runs {own} of its own and each loader "
                   f"process, train's and validation's, {LOADER_PROCESS_THREADS} besides a read thread per image in "
                   f"flight, {BATCHES_AT_ONCE} batches at a time, at least one image of each"),
            fix=left.fix))
    return bounds


def fetch_bounds_for(limits: HostLimits, load: LoaderLoad, workers: int) -> list[Bound]:
    """The most images fetched at once per batch each limit leaves `workers` loader processes per loader
    (or the rank itself, without any), at least one."""
    others = loader_files(load, fetches=0) if workers else RANK_FILES_MARGIN
    readers = reading_processes(workers)
    reading = f"the rank's {readers} loader processes (train's and validation's)" if workers else "the rank"
    bounds = [
        Bound(most=max(1, (limits.open_files - others) // BATCHES_AT_ONCE),
              limit=(f"a process may open {limits.open_files} files (RLIMIT_NOFILE), and "
                     f"{'each loader process' if workers else 'the rank'} holds a socket per image in flight, "
                     f"{BATCHES_AT_ONCE} batches at a time, besides {others} other files"),
              fix=RAISE_OPEN_FILES),
        Bound(most=max(1, limits.connections // limits.ranks // (readers * BATCHES_AT_ONCE)),
              limit=f"{connections_limit(limits)}, which {reading} share, {BATCHES_AT_ONCE} batches in flight each",
              fix="training.fetch_threads sets the number for a store that takes more at once"),
    ]
    if (left := limits.threads) is not None:
        running = rank_threads(limits, load, workers, fetches=0)
        who = (f"the rank and its {readers} loader processes (train's and validation's) run" if workers
               else "the rank runs")
        bounds.append(Bound(
            most=max(1, most(threads_share(left, limits.ranks) - running, readers * BATCHES_AT_ONCE)),
            limit=(f"{threads_limit(left, limits.ranks)}, where {who} {running} besides a read thread per image in "
                   f"flight, {BATCHES_AT_ONCE} batches at a time{' each' if workers else ''}"),
            fix=left.fix))
    return bounds


def connections_limit(limits: HostLimits) -> str:
    return (f"this host keeps at most {limits.connections} GETs in flight per storage endpoint "
            f"(host_budget.CONNECTIONS_PER_ENDPOINT), {limits.connections // limits.ranks} for each of its "
            f"{limits.ranks} rank(s)")


def rank_threads(limits: HostLimits, load: LoaderLoad, workers: int, fetches: int) -> int:
    """The rank's threads with `workers` loader processes per loader fetching `fetches` images of each
    batch at once: its torch threads, its pin thread for CUDA, each loader process's own and a read
    thread per GET in flight."""
    return limits.cpus + load.pinned + LOADERS * workers * LOADER_PROCESS_THREADS + reads_in_flight(workers, fetches)


def threads_share(left: ThreadsLeft, ranks: int) -> float:
    """The threads a rank may run: THREADS_SHARE of what the host's tightest limit leaves, over its `ranks`."""
    return THREADS_SHARE * left.count / ranks


def threads_limit(left: ThreadsLeft, ranks: int) -> str:
    """The limit on threads that binds, and each rank's share of it, as the sentences on it say it."""
    return (f"{left.limit}, which leaves {left.count} threads, of which the ranks may start {THREADS_SHARE:.0%} "
            f"({int(threads_share(left, ranks))} for each of the host's {ranks} rank(s))")


def cut(what: str, cores_only: int, bounds: list[Bound]) -> tuple[int, list[str]]:
    """The cores-only value, or the least a limit leaves; a sentence for each limit below the former."""
    chosen = least(cores_only, bounds)
    return chosen, [f"{what} {chosen}, not {cores_only}: {bound.limit}, room for {bound.most}; {bound.fix}"
                    for bound in bounds if bound.most < cores_only]


def least(value: int, bounds: list[Bound]) -> int:
    """`value`, or the least a bound leaves where that is less."""
    return min([value, *(bound.most for bound in bounds)])


def past(setting: str, value: int, bounds: list[Bound]) -> list[str]:
    """A warning for each limit `value`, as the run set it, is past."""
    return [f"{setting} is past a limit of this host: {bound.limit}, room for {bound.most}. Lower it, or leave it "
            f"empty to have it sized; or {bound.fix}." for bound in bounds if value > bound.most]


def live_batches(workers: int) -> int:
    """Batches the rank's loaders hold at once: each process's ready ones and the one the rank takes,
    in both loaders; the rank's own one without loader processes."""
    return LOADERS * (workers * PREFETCH_FACTOR + 1) if workers else 1


def reading_processes(workers: int) -> int:
    """Processes that fetch at once: both loaders' as the next epoch starts during validation; the rank
    alone without any."""
    return LOADERS * workers if workers else 1


def reads_in_flight(workers: int, fetches: int) -> int:
    """The rank's GETs in flight with `workers` loader processes per loader fetching `fetches` images of
    each batch at once: both loaders' processes (or the rank), each with BATCHES_AT_ONCE batches in flight."""
    return reading_processes(workers) * BATCHES_AT_ONCE * fetches


def rank_files_per_process(load: LoaderLoad) -> int:
    """The rank's files per loader process: its pipes, and the tensors of the batches it has ready."""
    return RANK_FILES_PER_LOADER_PROCESS + PREFETCH_FACTOR * load.tensors_per_batch


def loader_files(load: LoaderLoad, fetches: int) -> int:
    """A loader process's files: a socket per image in flight, its ready batches' tensors (each a file
    until the rank has taken it) and the rest."""
    return BATCHES_AT_ONCE * fetches + PREFETCH_FACTOR * load.tensors_per_batch + FILES_MARGIN


def most(room: float, each: float) -> int:
    """How many of `each` fit in `room`, at least none.

    >>> most(10, 3), most(-1, 3)
    (3, 0)
    """
    return max(0, int(room // each))


def size(count: float) -> str:
    """Bytes in binary units, as `df -h` says them.

    >>> size(64 * 2**20), size(1.5 * 2**40)
    ('64 MiB', '1.5 TiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.3g} {unit}"
        count /= 1024
    return f"{count:.3g} TiB"

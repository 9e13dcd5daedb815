"""A local Dask cluster kept warm between flow runs by the process that starts them.

A flow run that starts its own cluster pays about 5 s for it here: the scheduler, then
worker processes that import torch (bench/RESULTS.md, "Launch tax"). `prefect-ddp worker`
and `prefect-ddp serve` start one cluster when they start, and each flow run they start
uses it instead, where it fits:

    holder (prefect-ddp worker)            flow run (a child process of the holder)
    warm_cluster(spec): a TLS cluster,      claim_warm_cluster(spec) -> WarmClaim | None:
      a ticket, PREFECT_DDP_WARM_CLUSTER      do the run's spec, API, folder and environment
                                              match the ticket's? does no other run hold it?
                                            claim.prepare(client): every worker up, none of
                                              them one an earlier run used
    replace_used_workers (a thread) <------ claim.release(client): names the workers it used
      new workers in place of those named     and lets go, without waiting for the new ones

What this decides for a user, and how it stays what a cluster of its own would be:

- Which workers run the ranks. The holder replaces the workers after every run that used
  them, while that run writes its report and exits, so no run sees what an earlier run
  left in a worker: modules it imported (code changed since), a rank thread that never
  stopped, memory. A run that arrives before the new workers are up waits for them (the
  cluster's start, still beside its listing); a run whose process died before it named
  its workers leaves a mark, and the next run has them replaced before it uses them.
- One run at a time. A run that finds the warm cluster in use by another run starts a
  cluster of its own, as it would without one; it never waits behind
  another run's training.
- Only where the ranks would see no difference: the same cluster shape (workers, threads,
  GPUs), the same Prefect API, the same working folder, and the same environment apart
  from Prefect's per-run settings and Dask's configuration. The run's log says which
  cluster it used, and why not the warm one.
- No one else's code on it. The scheduler and workers speak TLS with a certificate made
  for this cluster (`LocalCluster(security=True)`), and the ticket that holds the client's
  key is a 0600 file in a 0700 folder: other users of the host cannot connect, where a
  plain tcp:// scheduler on loopback would run anyone's tasks as this user.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from distributed import Client, Scheduler, SpecCluster
from distributed.security import Security
from prefect_dask import DaskTaskRunner

from prefect_ddp.blocks.cluster import DaskCluster, worker_environment
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.tracking import TRACKING_VARIABLES

logger = logging.getLogger(__name__)

WARM_CLUSTER_ENV = "PREFECT_DDP_WARM_CLUSTER"
TICKET = "ticket.json"
LOCK = "lock"
# Left by a run while it uses the workers; replaced by REPLACING once it named them for replacement.
IN_USE = "in-use"
# The workers the last run used, which the holder replaces and the next run waits to see gone.
REPLACING = "replacing.json"
# Why the holder could not replace them, while it could not: runs start their own cluster meanwhile,
# and the holder tries again every REPLACE_RETRY_S, removing the note once it has.
REPLACE_FAILED = "replace-failed"
REPLACE_RETRY_S = 5.0
# Variables a run's process may differ in from the holder's without its ranks seeing it:
# Prefect's own settings (the run's id, its API: compared on its own), Dask's configuration
# (the holder sets the training configuration itself, blocks/cluster.py), buffering,
# PYTHONPATH (which Prefect's process worker sets for each run; what it does, the run's
# sys.path, is compared on its own), the inductor cache folder torch sets in a process
# that imports parts of it (each worker computes the same one), what MLflow tracking sets
# in the run's process (the import's telemetry id, an open session's settings: rank 0 sets
# its own) and the ticket's own variable, which the holder sets after it wrote the ticket.
# This project's own settings (PREFECT_DDP_*: the byte cache's folder, ...) are compared:
# the ranks read them.
IGNORED_PREFIXES = ("PREFECT_", "DASK_")
OWN_PREFIX = "PREFECT_DDP_"
IGNORED_VARIABLES = frozenset({"PYTHONUNBUFFERED", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR", WARM_CLUSTER_ENV}
                              | TRACKING_VARIABLES)
WORKERS_TIMEOUT_S = 120.0
REPLACER_POLL_S = 0.05


def ranks_would_see(key: str) -> bool:
    """Whether a run's ranks would read this variable, so that it must be the workers' too."""
    if key in IGNORED_VARIABLES:
        return False
    return key.startswith(OWN_PREFIX) or not key.startswith(IGNORED_PREFIXES)


def environment_digest(environ: dict[str, str]) -> dict[str, str]:
    """Each variable the ranks could see, as a hash: the ticket may name a variable, never its value."""
    return {key: hashlib.sha256(value.encode()).hexdigest()[:16] for key, value in sorted(environ.items())
            if ranks_would_see(key)}


@dataclass(frozen=True)
class Ticket:
    """What a run needs to use the warm cluster, and what it must match."""

    address: str
    tls_ca: str
    tls_cert: str
    tls_key: str
    holder_pid: int
    gpu: bool
    n_workers: int
    threads_per_worker: int
    api_url: str
    cwd: str
    sys_path: list[str]
    environment: dict[str, str]

    def security(self) -> Security:
        return Security(tls_ca_file=self.tls_ca, tls_client_cert=self.tls_cert, tls_client_key=self.tls_key,
                        require_encryption=True)

    def mismatch(self, spec: DaskCluster) -> str | None:
        """Why a run with `spec`, in this process, must not use the cluster; None where it may."""
        if spec.address:
            return f"the run asks for the cluster at {spec.address}"
        if spec.uses_gpu() != self.gpu:
            return f"the run {'asks for' if spec.uses_gpu() else 'does not ask for'} GPUs and the warm cluster " \
                   f"{'has' if self.gpu else 'has none'}"
        if not self.gpu and (spec.n_workers, spec.threads_per_worker) != (self.n_workers, self.threads_per_worker):
            return (f"the run asks for {spec.n_workers} workers of {spec.threads_per_worker} thread(s) and the warm "
                    f"cluster has {self.n_workers} of {self.threads_per_worker}")
        if (api_url := worker_environment()["PREFECT_API_URL"]) != self.api_url:
            return f"its workers report to the Prefect API at {self.api_url}, and this run to {api_url}"
        if os.getcwd() != self.cwd:
            return f"its workers run in {self.cwd}, and this run in {os.getcwd()}"
        if missing := [entry for entry in sys.path if os.path.isdir(entry) and entry not in self.sys_path]:
            return f"its workers cannot import from {', '.join(missing)}, which this run's sys.path has"
        mine = environment_digest(dict(os.environ))
        if differ := sorted(key for key in mine.keys() | self.environment.keys()
                            if mine.get(key) != self.environment.get(key)):
            return f"its workers' environment differs from this run's in {', '.join(differ)}"
        return None


def read_ticket(path: Path) -> Ticket:
    return Ticket(**json.loads(path.read_text()))


def write_private(path: Path, text: str) -> None:
    """A file only this user can read, from its first byte (it holds the cluster's client key)."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(text)


@contextlib.contextmanager
def warm_cluster(spec: DaskCluster) -> Iterator[Path]:
    """Start `spec`'s local cluster and offer it to the flow runs this process starts until the block ends.

    Child processes started inside the block find the ticket through PREFECT_DDP_WARM_CLUSTER.
    """
    if spec.address:
        raise ValueError(f"The dask-cluster spec names an existing cluster ({spec.address}); only a local "
                         "cluster can be kept warm. Leave address empty, or let runs connect to that one.")
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        raise ValueError("PREFECT_API_URL is not set, so the warm cluster's workers would report to a temporary "
                         "Prefect server of their own. Set it to the server the flow runs use, e.g. "
                         "prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api")
    folder = Path(tempfile.mkdtemp(prefix="prefect-ddp-warm-"))  # 0700, a name no one can take first
    cwd = os.getcwd()
    # A flow run imports its own modules from the folder it runs in; spawned workers get this sys.path.
    sys.path.insert(0, cwd)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, folder, ignore_errors=True)
        cleanup.callback(sys.path.remove, cwd)
        create, kwargs = spec.local_cluster()
        began = time.monotonic()
        cluster = cleanup.enter_context(create(**kwargs))  # TLS: DaskCluster.local_cluster
        client = cleanup.enter_context(Client(cluster))
        ticket = Ticket(
            address=cluster.scheduler_address, tls_ca=cluster.security.tls_ca_file,
            tls_cert=cluster.security.tls_client_cert, tls_key=cluster.security.tls_client_key,
            holder_pid=os.getpid(), gpu=spec.uses_gpu(), n_workers=len(cluster.workers),
            threads_per_worker=spec.threads_per_worker, api_url=worker_environment()["PREFECT_API_URL"],
            cwd=cwd, sys_path=list(sys.path), environment=environment_digest(dict(os.environ)))
        write_private(folder / TICKET, json.dumps(asdict(ticket)))
        (folder / LOCK).touch(mode=0o600)
        os.environ[WARM_CLUSTER_ENV] = str(folder / TICKET)
        cleanup.callback(os.environ.pop, WARM_CLUSTER_ENV, None)
        stop = threading.Event()
        replacer = threading.Thread(target=replace_used_workers, args=(cluster, client, folder, ticket.n_workers, stop),
                                    name="warm-cluster-replacer", daemon=True)
        replacer.start()
        cleanup.callback(replacer.join)
        cleanup.callback(stop.set)
        logger.info("Warm Dask cluster up in %.1f s at %s (%d workers); flow runs started from here use it",
                    time.monotonic() - began, ticket.address, ticket.n_workers)
        yield folder / TICKET


def worker_addresses(dask_scheduler: Scheduler) -> list[str]:
    return list(dask_scheduler.workers)


def ask_for_replacement(client: Client, folder: Path) -> list[str]:
    """Name every worker for the holder to replace, without waiting for it; the workers named."""
    used = client.run_on_scheduler(worker_addresses)
    staged = folder / f"{REPLACING}.{os.getpid()}"
    staged.write_text(json.dumps(used))
    staged.replace(folder / REPLACING)  # whole, or not at all, for the holder that reads it
    return used


class WarmClusterUnavailable(RuntimeError):
    """The warm cluster cannot give this run fresh workers now: the run starts a cluster of its own."""


def replace_used_workers(cluster: SpecCluster, client: Client, folder: Path, n_workers: int,
                         stop: threading.Event) -> None:
    """The holder's thread: whenever a run names the workers it used, replace them with new ones.

    New workers under new names, started by the cluster (`scale`): a new nanny as well as a
    new process, and no timer of an earlier worker's name can close them. Workers restarted
    by their nannies (`client.restart`) now and then came back and were closed at once here
    (0 of 2 up after 120 s, in 2 of 4 runs of tests/test_warm_cluster.py), before the
    cluster's `lost-worker-timeout` was lifted (blocks/cluster.py).

    A set counts as replaced only once it is: where a replacement fails, the note
    REPLACE_FAILED says why (runs start their own cluster meanwhile) and it is tried again
    REPLACE_RETRY_S later, on a new client where the old one closed (a client that lost its
    scheduler closes for good), until it succeeds.
    """
    replaced: set[str] = set()
    retry_at = 0.0
    while not stop.wait(REPLACER_POLL_S):
        try:
            used = set(json.loads((folder / REPLACING).read_text()))
        except FileNotFoundError:
            continue
        if used == replaced or time.monotonic() < retry_at:
            continue  # replaced already (the next run removes the note), or not yet time to try again
        try:
            if retry_at and client.status != "running":
                client = Client(cluster)
            replace_workers(cluster, client, used, n_workers)
        except Exception as exc:
            logger.exception("Could not replace the warm cluster's workers; trying again in %.0f s", REPLACE_RETRY_S)
            (folder / REPLACE_FAILED).write_text(f"{type(exc).__name__}: {exc}")
            retry_at = time.monotonic() + REPLACE_RETRY_S
            continue
        replaced, retry_at = used, 0.0
        (folder / REPLACE_FAILED).unlink(missing_ok=True)


def replace_workers(cluster: SpecCluster, client: Client, used: set[str], n_workers: int) -> None:
    """Close the workers `used` names and start `n_workers` new ones; raises where they did not close."""
    cluster.scale(0)
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    while still := used & set(client.run_on_scheduler(worker_addresses)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the workers {sorted(still)} were still up {WORKERS_TIMEOUT_S:.0f} s after the "
                               "cluster was asked to close them")
        time.sleep(REPLACER_POLL_S)
    cluster.scale(n_workers)


def replace_failure(folder: Path) -> str | None:
    """Why the holder could not replace the last run's workers, while it could not; None otherwise."""
    try:
        failure = (folder / REPLACE_FAILED).read_text()
    except FileNotFoundError:
        return None
    return f"its holder could not replace the last run's workers ({failure}); it tries again every " \
           f"{REPLACE_RETRY_S:.0f} s"


def fresh_workers(client: Client, folder: Path, n_workers: int, replace_first: bool) -> None:
    """Wait until every worker is up and none is one an earlier run used (having them replaced first where
    the run that used them died before it named them). Raises WarmClusterUnavailable where the holder
    could not replace them, or they did not come within WORKERS_TIMEOUT_S."""
    replacing = folder / REPLACING
    if replace_first:
        run_logger().info("The last run on the warm cluster ended before naming its workers for replacement; replacing them")
        used = set(ask_for_replacement(client, folder))
    else:
        used = set(json.loads(replacing.read_text())) if replacing.exists() else set()
    deadline = time.monotonic() + WORKERS_TIMEOUT_S
    while used & set(workers := client.run_on_scheduler(worker_addresses)) or len(workers) < n_workers:
        if failure := replace_failure(folder):
            raise WarmClusterUnavailable(failure)
        if time.monotonic() > deadline:
            raise WarmClusterUnavailable(
                f"its workers were not replaced within {WORKERS_TIMEOUT_S:.0f} s of the last run (still up of "
                f"those it used: {sorted(used & set(workers))}; up in all: {len(workers)} of {n_workers})")
        time.sleep(REPLACER_POLL_S)
    replacing.unlink(missing_ok=True)


@dataclass
class WarmClaim:
    """One run's hold on the warm cluster, from its claim to its release."""

    ticket: Ticket
    folder: Path
    lock: IO[str]
    replace_first: bool

    def task_runner(self) -> DaskTaskRunner:
        return DaskTaskRunner(address=self.ticket.address, client_kwargs={"security": self.ticket.security()})

    def prepare(self, client: Client) -> None:
        """Before the run's first task: every worker up, and none that an earlier run used."""
        fresh_workers(client, self.folder, self.ticket.n_workers, self.replace_first)

    def withdraw(self) -> None:
        """The run uses no warm worker after all: let go, leaving the in-use mark of a run that died
        before this one (its workers may still need replacing) and removing this run's own."""
        if not self.replace_first:
            (self.folder / IN_USE).unlink(missing_ok=True)
        self.unlock()

    def release(self, client: Client | None) -> None:
        """Ask the holder to replace the workers for the next run, without waiting for it: the next run
        waits instead, beside its listing. The in-use mark stays where that failed (or never connected)."""
        if client is None:
            return
        try:
            ask_for_replacement(client, self.folder)
            (self.folder / IN_USE).unlink(missing_ok=True)
        except Exception as exc:  # the next run has them replaced first
            run_logger().warning("Could not name this run's workers for replacement on the warm cluster (%s: %s); "
                                 "the next run has them replaced before it uses them", type(exc).__name__, exc)

    def unlock(self) -> None:
        """Let the next run claim the cluster: closing the file releases its lock."""
        self.lock.close()


def wait_until_free(ticket_path: Path, timeout_s: float = WORKERS_TIMEOUT_S) -> None:
    """Block until no run holds the warm cluster and all its workers are fresh: what a run that arrives then finds."""
    ticket = read_ticket(ticket_path)
    with open(ticket_path.parent / LOCK) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with Client(ticket.address, security=ticket.security(), timeout=timeout_s) as client:
            fresh_workers(client, ticket_path.parent, ticket.n_workers, (ticket_path.parent / IN_USE).exists())


def claim_warm_cluster(spec: DaskCluster) -> WarmClaim | None:
    """The warm cluster of the process that started this one, for this run alone; None where the run must
    start its own (the run's log says why, where there is a warm cluster)."""
    ticket_path = os.environ.get(WARM_CLUSTER_ENV)
    if not ticket_path:
        return None
    path = Path(ticket_path)
    try:
        ticket = read_ticket(path)
        os.kill(ticket.holder_pid, 0)  # raises ProcessLookupError where the holder is gone
        lock = open(path.parent / LOCK)
    except (OSError, ValueError, TypeError) as exc:
        run_logger().info("Not using the warm Dask cluster of %s (%s); starting a cluster for this run",
                          ticket_path, exc)
        return None
    if reason := ticket.mismatch(spec) or replace_failure(path.parent):
        lock.close()
        run_logger().info("Not using the warm Dask cluster of process %d: %s. Starting a cluster for this run.",
                          ticket.holder_pid, reason)
        return None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        run_logger().info("The warm Dask cluster of process %d is in use by another run; starting a cluster for "
                          "this run", ticket.holder_pid)
        return None
    in_use = path.parent / IN_USE
    replace_first = in_use.exists()
    in_use.write_text(json.dumps({"pid": os.getpid(), "since": time.time()}))
    run_logger().info("Using the warm Dask cluster of process %d at %s (%d workers)", ticket.holder_pid,
                      ticket.address, ticket.n_workers)
    return WarmClaim(ticket, path.parent, lock, replace_first)


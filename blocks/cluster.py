"""Which Dask cluster runs the ranks: an existing one by address, or one made per flow run.

Clusters this module creates are set up for training, which Dask's defaults are not:

- Worker processes are not daemonic (`distributed.worker.daemon=False`), so a rank can
  start DataLoader worker processes. The nanny reads this setting each time it (re)starts
  a worker, so it is set for the whole process, not inside a `with`.
- The nanny's `MALLOC_TRIM_THRESHOLD_=65536` is dropped: it made a 2-rank resnet18 loop
  1.5x slower here (system CPU 5 s -> 24 s; docs/architecture.md,
  "Facts: Dask").
- The worker's profiler is off: sampling every thread's stack every 10 ms cost a rank's
  loop 4 % here (the dashboard's profile page stays empty).
- The cluster never gives up on a worker its nanny is restarting (`lost-worker-timeout`).
- Workers import torch, torchvision and the modules of the decode-check and the recipe as
  they start (`PRELOADED_MODULES`): started beside the flow's listing
  (blocks/cluster_lifetime.py), that import no longer holds up the first decode check.
- Workers of a CPU cluster are forked from a forkserver that imported torch and torchvision
  once (blocks/worker_forkserver.py), so that import is not paid again by each worker and
  each restart: 1.3 s to start two workers instead of 5.2 s here.
- Workers get the Prefect API URL this process uses, so rank task runs, logs and artifacts
  land in the flow's run. Without PREFECT_API_URL that is the temporary server Prefect
  started for this process: workers not told its URL would each start their own (three
  servers for two workers, "database is locked", rank artifacts lost;
  docs/architecture.md, "Facts: Prefect").

Owners of an existing cluster (`address=`) set up their workers the same way; the gang
checks each worker before any rank starts (tasks/gang/worker_checks.py) and names what
is missing. A worker set up for training starts as:

    DASK_DISTRIBUTED__WORKER__DAEMON=False \
    DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON='{"MALLOC_TRIM_THRESHOLD_": None}' \
    DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False \
    PREFECT_API_URL=http://<prefect-host>:4200/api dask worker tcp://<scheduler>:8786 --nthreads 1

(`DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON__MALLOC_TRIM_THRESHOLD_=None` does not work:
Dask lower-cases the last key of an environment variable, and the nanny keeps its own
upper-case one.) `dask worker --no-nanny` workers are not daemonic and get no
MALLOC_TRIM_THRESHOLD_ of Dask's; they still need the profiler off.
A cluster started from Python (`LocalCluster`, dask-jobqueue, any `SpecCluster`) also
needs `dask.config.set({"distributed.deploy.lost-worker-timeout": "3650 days"})` in the
process that holds it, or a worker the gang restarts twice within 15 s can be lost.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import dask
from distributed import Client, LocalCluster
from distributed.comm import parse_address
from distributed.comm.addressing import parse_host_port
from distributed.security import Security
from prefect.blocks.core import Block
from prefect_dask import DaskTaskRunner
from pydantic import Field

from prefect_ddp.blocks import nanny_environment, worker_forkserver
from prefect_ddp.blocks.nanny_environment import CurrentEnvironmentNanny
from prefect_ddp.blocks.worker_forkserver import (
    FORKSERVER_CONFIG,
    SPAWN_CONFIG,
    preload_forkserver,
)
from prefect_ddp.tasks.reporting import flow_api_url

TRAINING_DASK_CONFIG = {
    "distributed.worker.daemon": False,
    # None removes the variable from the nanny's pre-spawn environment.
    "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
    # The worker's profiler samples every thread's stack every 10 ms: 7 % more CPU in a
    # rank's loop here (loop 1.068x torchrun's with it, 1.024x without; bench/RESULTS.md).
    "distributed.worker.profile.enabled": False,
    # 15 s after the scheduler loses a worker, the cluster object closes that worker's nanny
    # for good unless a worker of the same name is up at that moment, even if it came back
    # and is only restarting again. Nannies restart their own workers, so that timer only
    # lost workers here: the ones the gang restarted twice within 15 s (docs/architecture.md,
    # "Facts: Dask").
    "distributed.deploy.lost-worker-timeout": "3650 days",
}


def worker_environment() -> dict[str, str]:
    """Environment that rank processes need from the flow's process: its Prefect API URL."""
    return {"PREFECT_API_URL": flow_api_url()}


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


# Modules every run's tasks import on a worker: torch and torchvision (4-5 s here), then the
# decode-check's and the recipe's own (Prefect's task engine, s3fs, PIL: 1.2 s more, paid by
# the first decode-check on each fresh worker). A worker imports them as it starts, while
# the flow lists its data (blocks/cluster_lifetime.py), instead of when its first task arrives.
PRELOADED_MODULES = ["torch", "torchvision", "prefect_ddp.tasks.data.validation", "prefect_ddp.tasks.training.recipe"]
# A CPU cluster's workers first drop the variables their nanny did not give (nanny_environment),
# and set spawn back as their default start method (worker_forkserver).
LOCAL_CLUSTER_PRELOAD = [nanny_environment.__name__, *PRELOADED_MODULES, worker_forkserver.__name__]


# The dashboard shows the cluster's tasks and workers to whoever connects: this host's users
# only, and on a port of its own, so clusters side by side never collide.
LOOPBACK_DASHBOARD = "127.0.0.1:0"


def create_local_cluster(**kwargs: Any) -> LocalCluster:
    """A LocalCluster of non-daemonic worker processes, one thread each, forked from a forkserver."""
    dask.config.set({**TRAINING_DASK_CONFIG, **FORKSERVER_CONFIG})
    preload_forkserver()
    kwargs.setdefault("preload", LOCAL_CLUSTER_PRELOAD)
    kwargs.setdefault("processes", True)
    kwargs.setdefault("threads_per_worker", 1)
    kwargs.setdefault("dashboard_address", LOOPBACK_DASHBOARD)
    # A forked worker's own environment is the forkserver's, from this process's first cluster: each
    # nanny hands its worker this process's environment as it starts it (blocks/nanny_environment.py).
    kwargs.setdefault("worker_class", CurrentEnvironmentNanny)
    kwargs["env"] = {**worker_environment(), **kwargs.get("env", {})}
    return LocalCluster(**kwargs)


def create_cuda_cluster(**kwargs: Any):
    """A dask-cuda LocalCUDACluster: one worker per GPU, each seeing its GPU as cuda:0."""
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError as exc:
        raise RuntimeError(
            "This machine has CUDA GPUs but dask-cuda is not installed: "
            "pip install 'prefect-ddp[gpu]', or set the dask-cluster block's gpu=false."
        ) from exc
    dask.config.set({**TRAINING_DASK_CONFIG, **SPAWN_CONFIG})
    kwargs.setdefault("preload", PRELOADED_MODULES)
    kwargs.pop("processes", None)
    kwargs.setdefault("dashboard_address", LOOPBACK_DASHBOARD)
    kwargs["env"] = {**worker_environment(), **kwargs.get("env", {})}
    return LocalCUDACluster(**kwargs)


SCHEDULER_CONNECT_TIMEOUT_S = 10.0


def check_scheduler_reachable(address: str, timeout_s: float = SCHEDULER_CONNECT_TIMEOUT_S) -> None:
    """Fail in seconds, naming the address, where Dask's client would retry for its whole connect timeout."""
    try:
        scheme, location = parse_address(address)
        host, port = parse_host_port(location)
    except ValueError as exc:
        raise ValueError(
            f"Dask scheduler address {address!r} is not valid ({exc}); expected tcp://HOST:PORT, "
            "e.g. tcp://10.0.0.5:8786."
        ) from exc
    if scheme not in ("tcp", "tls"):
        return  # inproc:// and other transports have no socket to try
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"Cannot reach the Dask scheduler at {address} ({exc}). Check cluster.address (or the "
            "dask-cluster block's address), that the scheduler is running, and that this machine "
            "can reach that host and port; leave both empty to start a local cluster."
        ) from exc


# The TLS clusters this process holds, by scheduler address, with the security that reaches them
# (a sweep's cluster, for its trials: flows/sweep.py). Certificates never travel in a flow's
# parameters; a run in this process given only the address finds them here.
_held_security: dict[str, Security] = {}
_held_lock = threading.Lock()


@contextlib.contextmanager
def shared_in_process(client: Client) -> Iterator[str]:
    """Let runs in this process connect to `client`'s cluster by its address alone while the block runs.

    Yields the address to hand them. A plain tcp:// cluster needs nothing more, so only a
    TLS one is registered.

    Example:
        >>> with shared_in_process(runner.client) as address:       # doctest: +SKIP
        ...     DaskCluster(address=address).task_runner()            # connects with runner's certificate
    """
    address = client.scheduler.address
    tls = address.startswith("tls://")
    if tls:
        with _held_lock:
            _held_security[address] = client.security
    try:
        yield address
    finally:
        if tls:
            with _held_lock:
                _held_security.pop(address, None)


def client_security(address: str) -> dict[str, Any]:
    """The client_kwargs that reach `address`: the security of a cluster this process holds, else
    Dask's configured one (`distributed.comm.tls.*`), which a tls:// scheduler needs."""
    with _held_lock:
        held = _held_security.get(address)
    if held is not None:
        return {"security": held}
    if address.startswith("tls://") and not Security().get_tls_config_for_role("client")["cert"]:
        raise ValueError(
            f"cluster.address {address} is a TLS scheduler, and this process holds no certificate for it: "
            "neither a cluster it started (a sweep's, for its trials) nor Dask's configuration "
            "(distributed.comm.tls.client.cert / .key / .ca-file). Configure those for your scheduler, "
            "or give a tcp:// address, or leave the address empty to start a local cluster.")
    return {}


class DaskCluster(Block):
    """The Dask cluster a training run uses.

    With `address`, the run connects to that scheduler. Without it, each flow run starts a
    local cluster and closes it at the end: LocalCUDACluster (one worker per GPU) when GPUs
    are present and `gpu` allows it, else a LocalCluster of `n_workers` processes.
    """

    _block_type_name = "Dask Cluster"
    _block_type_slug = "dask-cluster"
    _description = "An existing Dask scheduler address, or the spec of a local cluster."

    address: str | None = Field(default=None, description="tcp://host:8786 of a running scheduler.")
    n_workers: int = Field(default=2, ge=1, description="Workers of a local CPU cluster.")
    threads_per_worker: int = Field(default=1, ge=1, description="Threads per local worker.")
    gpu: bool | None = Field(
        default=None, description="Local cluster on GPUs: empty decides by torch.cuda.device_count()."
    )

    def uses_gpu(self) -> bool:
        """Whether a local cluster of this spec runs on GPUs: `gpu`, or else whether torch sees any."""
        return self.gpu if self.gpu is not None else cuda_device_count() > 0

    def local_cluster(self) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The function that starts this spec's local cluster, and its arguments.

        The cluster speaks TLS with a certificate made for it (`security=True`): a plain tcp://
        scheduler on this host would run any local user's tasks as the flow's user. Its client
        (the runner's) gets the certificate from the cluster; runs in this process that connect
        by address get it from `shared_in_process`.
        """
        if self.uses_gpu():
            return create_cuda_cluster, {"security": True}
        return create_local_cluster, {"n_workers": self.n_workers, "threads_per_worker": self.threads_per_worker,
                                      "security": True}

    def task_runner(self) -> DaskTaskRunner:
        """A DaskTaskRunner for this cluster; entering it starts (or connects to) the cluster."""
        if self.address:
            security = client_security(self.address)
            check_scheduler_reachable(self.address)
            return DaskTaskRunner(address=self.address, client_kwargs=security)
        cluster_class, cluster_kwargs = self.local_cluster()
        return DaskTaskRunner(cluster_class=cluster_class, cluster_kwargs=cluster_kwargs)

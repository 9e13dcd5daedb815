"""`prefect-ddp worker`: `prefect worker start` beside a Dask cluster kept warm between its flow runs.

    prefect-ddp worker --pool ddp-pool                        # 2 warm workers: cluster.n_workers' default
    prefect-ddp worker --pool ddp-pool --n-workers 4          # runs that ask for 4 workers
    prefect-ddp worker --pool ddp-pool --cluster-block NAME   # the local cluster a dask-cluster block describes
    prefect-ddp worker --pool ddp-pool --no-warm-cluster      # exactly `prefect worker start`

Every other option goes to `prefect worker start` unchanged. SIGTERM stops it gracefully
(Prefect's worker finishes its flow runs, for up to 30 s); a second SIGTERM or Ctrl-C stops
it at once. A terminal's Ctrl-C also reaches the warm cluster's workers, which share its
process group: a run on them loses its workers at the first one. The process worker runs each
flow run as its child; a run whose cluster settings match the warm cluster uses it and skips
the cluster's start (about 5 s here; bench/RESULTS.md, "Launch tax"), and the workers are
replaced after each run, beside its report (blocks/warm_cluster.py). Runs that ask for
another cluster, or that arrive while another run holds the warm one, start their own, as
under `prefect worker start`. Run it from the folder `prefect deploy` ran from, as that
command: runs use the warm cluster only where they run in the folder it runs in.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
from contextlib import ExitStack
from functools import partial
from types import FrameType

from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.saved import load_block
from prefect_ddp.blocks.warm_cluster import warm_cluster
from prefect_ddp.deployments.local_services import stop
from prefect_ddp.tasks.config import ClusterConfig

STOP_TIMEOUT_S = 30
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Looked up here, not in the forked child: with the warm cluster's threads about, the child
# may only make the call itself (a lookup could wait on a lock some thread held at the fork).
PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="prefect-ddp worker", description=__doc__.splitlines()[0],
                                     epilog="Other options go to `prefect worker start` (e.g. --pool NAME).")
    warm = parser.add_mutually_exclusive_group()
    warm.add_argument("--n-workers", type=int, default=ClusterConfig.model_fields["n_workers"].default,
                      help="workers of the warm local cluster (default: %(default)s)")
    warm.add_argument("--cluster-block", help="a saved dask-cluster block whose local cluster to keep warm")
    warm.add_argument("--no-warm-cluster", action="store_true", help="keep no cluster warm")
    return parser.parse_known_args(argv)


def stop_on_sigterm() -> None:
    """SIGTERM (a service manager's stop) unwinds like Ctrl-C: the worker stops, the cluster closes."""
    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


def die_with_parent(parent: int) -> None:
    """In the child, before it runs: the kernel kills it when the thread that started it dies
    (this process's main thread, so: when this process dies; Linux only).

    `prefect worker start` takes SIGTERM as a request to finish its flow runs and can stay up
    long after it (seen: over ten minutes, its server gone); a parent killed meanwhile, as a
    supervisor escalates to SIGKILL, used to leave it running on its own, polling for work.
    """
    if PRCTL is not None:
        PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # it died before the call
            os._exit(1)


def run_prefect_worker(args: list[str]) -> int:
    """`prefect worker start ARGS` as a child, which inherits the warm cluster's ticket and dies
    with this process; its exit code."""
    return run_child([sys.executable, "-m", "prefect", "worker", "start", *args])


def run_child(command: list[str]) -> int:
    """`command` as a child that dies with this process; its exit code once it ends.

    Asked to stop (SIGTERM, Ctrl-C), this asks the child in turn and waits up to
    STOP_TIMEOUT_S for it: Prefect's worker then finishes the flow runs it has. Asked again
    meanwhile, it kills the child at once, as `prefect worker start` does on a second
    interrupt: its graceful stop can hang (docs/architecture.md, "Facts: Prefect").
    """
    process = subprocess.Popen(command, preexec_fn=partial(die_with_parent, os.getpid()))
    try:
        return process.wait()
    finally:
        if process.poll() is None:
            try:
                stop(process, grace_s=STOP_TIMEOUT_S)
            except BaseException:  # asked again: SystemExit from stop_on_sigterm, or KeyboardInterrupt
                process.kill()
                raise


def main(argv: list[str] | None = None) -> None:
    args, worker_args = parse_args(sys.argv[1:] if argv is None else argv)
    stop_on_sigterm()
    with ExitStack() as stack:
        if not args.no_warm_cluster:
            spec = load_block(DaskCluster, args.cluster_block) if args.cluster_block \
                else DaskCluster(n_workers=args.n_workers)
            ticket = stack.enter_context(warm_cluster(spec))
            print(f"prefect-ddp worker: a warm Dask cluster is up (ticket {ticket}); flow runs of this worker "
                  "whose cluster settings match it use it", flush=True)
        code = run_prefect_worker(worker_args)
    raise SystemExit(code)


if __name__ == "__main__":
    main()

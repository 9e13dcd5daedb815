"""One attempt of a gang: plan the ranks, submit them pinned, supervise, and stop them on any way out.

"Any way out" includes more than the gang's own failures: a submit that fails half-way
through the ranks, a Dask future cancelled by someone else, an error in the supervisor,
and the flow run being cancelled (Prefect raises TerminationSignal on SIGTERM) or
interrupted (KeyboardInterrupt). Each of those once left ranks training on an external
cluster after the flow had ended.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import dask
import distributed
from prefect.settings import PREFECT_API_URL
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture

from prefect_ddp.tasks.gang.context import RankContext
from prefect_ddp.tasks.gang.errors import GangError, GangHung
from prefect_ddp.tasks.gang.grow_watch import GrowWatch
from prefect_ddp.tasks.gang.plan import bystander_cpu_sets, plan_ranks, thread_shares
from prefect_ddp.tasks.gang.ports import free_port
from prefect_ddp.tasks.gang.progress import HangWatch
from prefect_ddp.tasks.gang.rank import run_rank
from prefect_ddp.tasks.gang.states import STARTED_RECORDING_WAIT_S
from prefect_ddp.tasks.gang.stopping import stop_flag
from prefect_ddp.tasks.gang.supervise import Deadline, logged_failure, stop, supervise
from prefect_ddp.tasks.gang.trial import TrialLink
from prefect_ddp.tasks.gang.worker_checks import (
    check_workers,
    output_marker,
    probe_worker,
)
from prefect_ddp.tasks.reporting import flow_api_url, run_logger


@dataclass(frozen=True)
class GangSpec:
    """What every attempt of one run_gang call shares."""

    train_fn: Callable[[RankContext, Any], Any]
    config: Any
    output_url: str | None
    init_timeout_s: float
    trial: TrialLink | None
    deadline: Deadline
    needs_child_processes: bool = False
    shared_output: bool = False
    hang_timeout_s: float | None = None  # None: follows the run (tasks/gang/progress.py)
    hang_floor_s: float = 0.0  # the least silence a gang of live workers is allowed
    holder: str = "a gang"  # who the gang runs for, as its leases and its ranks say it (run.lease_holder)
    gang_id: str | None = None  # names the state its ranks park for its next formation (tasks/gang/handover.py)
    elastic: bool = False  # formed with a size range: asked to regroup larger once a worker is free
    max_world_size: int | None = None  # the top of the range (None: every worker of the cluster)
    regroups: int = 0  # attempts so far that ended in a regroup (run._until_one_completes counts them)
    not_growing: set[str] = field(default_factory=set)  # free workers a regroup did not get: not asked for again
    warned: set[str] = field(default_factory=set)  # worker-setup warnings already logged
    # Task runs of started ranks that the server had not recorded when their attempt stopped, and until
    # when to wait for them: crashed once recorded, at the gang's end (states.crash_when_recorded). Like
    # the sets above, one object for the run: `replace` hands it on to each regroup's spec.
    late_runs: dict[UUID, float] = field(default_factory=dict)


def run_attempt(runner: DaskTaskRunner, spec: GangSpec, leases: dict[str, str], attempt: int) -> list[Any]:
    """Run the gang once on the workers of `leases` ({address: lease id}); each rank's result,
    or GangError saying what went wrong."""
    client = runner.client
    addresses = list(leases)
    probes, threads, port = _prepare(client, addresses, spec)
    check_workers(probes, flow_api_url(), spec.needs_child_processes, spec.warned)
    with stop_flag(client) as flag:
        contexts = plan_ranks(addresses, probes, port, attempt, spec.output_url, spec.init_timeout_s,
                              spec.trial, stop_flag=flag.name, leases=leases, gang_id=spec.gang_id,
                              max_world_size=spec.max_world_size, elastic=spec.elastic,
                              regroups=spec.regroups)
        run_logger().info(
            "Gang attempt %d: %d ranks on %s, backend %s, master %s:%d",
            attempt + 1, len(contexts), addresses, contexts[0].backend, contexts[0].master_addr, port,
        )
        futures: list[PrefectDaskFuture[Any]] = []
        topic = contexts[0].progress_topic
        assert topic is not None  # every context got stop_flag=flag.name, and with it a topic
        hang = HangWatch(client, topic, {c.rank: c.worker_address for c in contexts},
                         spec.hang_timeout_s, spec.hang_floor_s, collective_timeout_s=spec.init_timeout_s)
        grow = (GrowWatch(client, flag.name, len(contexts), spec.max_world_size, spec.not_growing)
                if spec.elastic else None)
        try:
            for ctx in contexts:
                futures.append(_submit(runner, spec, ctx, threads[ctx.worker_address]))
            states = supervise(client, futures, contexts, spec.deadline, hang, grow=grow)
            # Synchronously in an async flow too, as PrefectDaskFuture.result reads a state.
            return [state.result(_sync=True) for state in states]  # type: ignore[call-overload]
        except BaseException as error:  # cancellation and Ctrl-C too: never leave ranks behind
            unrecorded = stop(client, flag, futures, contexts, hung=isinstance(error, GangHung), started=hang.reported())
            spec.late_runs.update(dict.fromkeys(unrecorded, time.monotonic() + STARTED_RECORDING_WAIT_S))
            raise
        finally:
            with logged_failure("forgetting the ranks' progress"):
                hang.forget()
            if grow is not None:
                with logged_failure("removing the grow flag"):
                    grow.close()


def _prepare(client: distributed.Client, addresses: list[str],
             spec: GangSpec) -> tuple[dict[str, dict[str, Any]], dict[str, int], int]:
    """What each worker has (and whether it sees a local output), each rank's torch threads,
    and a port free on rank 0's worker for the rendezvous."""
    try:
        # The flow's configured API URL travels with each rank's task (prefect_dask ships
        # the flow's settings); the probe checks the worker reaches it.
        with output_marker(spec.output_url, spec.shared_output) as marker:
            probes = client.run(probe_worker, PREFECT_API_URL.value(), marker=marker, workers=addresses)
        # Every worker's CPUs, not only the gang's: the threads are shared with the others'
        # ranks (plan.thread_shares).
        cpu_sets = bystander_cpu_sets(client, addresses) | {a: probes[a]["cpu_set"] for a in addresses}
        threads = thread_shares(cpu_sets, addresses)
        port = client.run(free_port, workers=[addresses[0]])[addresses[0]]
    except Exception as exc:  # a worker left between choosing and asking: form again
        raise GangError(f"Could not prepare workers {addresses} for a gang: {exc!r}") from exc
    return probes, threads, port


def _submit(runner: DaskTaskRunner, spec: GangSpec, ctx: RankContext, threads: int) -> PrefectDaskFuture[Any]:
    # Pinned with no escape: Dask must never run a rank elsewhere, alone, into a
    # rendezvous that the other ranks have already left.
    with dask.annotate(workers=[ctx.worker_address], allow_other_workers=False):
        return runner.submit(
            run_rank.with_options(task_run_name=f"rank-{ctx.rank}"),
            parameters={"train_fn": spec.train_fn, "config": spec.config, "ctx": ctx, "threads": threads,
                        "holder": spec.holder},
        )

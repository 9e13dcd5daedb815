"""The DDP gang: run one per-rank function on several Dask workers as one torch world.

A gang is one Prefect task run per rank, each pinned to its own leased Dask worker, that
agree on world size, ranks and a master address before `init_process_group`. A supervisor
in the flow watches them; when a rank fails, a worker leaves or the deadline passes, it
stops every rank, records a final state for each, and re-forms the gang on the workers
that are alive, on a new port (the training function resumes from its checkpoint).

Before, with dask-pytorch-ddp:

    from dask_pytorch_ddp import dispatch, results
    futures = dispatch.run(client, train, lr=0.1)       # fixed port 23456, no timeout
    outputs = client.gather(futures)                    # hangs forever if a worker dies

After:

    from prefect import flow
    from prefect_dask import DaskTaskRunner
    from prefect_ddp import RankContext, run_gang

    def train(ctx: RankContext, config: dict) -> float:
        for step in range(steps):  # torch.distributed is initialised; ctx.rank, ctx.device
            ...
            ctx.check_stop()  # leave cleanly when the flow run is cancelled
        return loss

    @flow(task_runner=DaskTaskRunner(cluster_kwargs={"n_workers": 2}))
    def my_flow():
        losses = run_gang(train, {"lr": 0.1})           # one result per rank, rank order
        losses.attempts                                 # how often the gang was formed, and why

One module per concern: `plan` (workers, probes, ports, ranks), `lease` (workers held by
one gang at a time), `gpu_claims` (each worker process's own GPU, across gangs), `rank` (the pinned task), `attempt` (one formation, stopped on any
way out), `supervise` (watch, deadline, stop), `stopping` (the flag ranks read between
steps), `states` (final states for every rank's task run), `sending` (functions from
scripts and notebooks), `trial` (reporting to a sweep), `results` and `errors` (what
comes back), and `run` with `run_gang` at the front.
"""

from prefect_ddp.tasks.gang.context import RankContext
from prefect_ddp.tasks.gang.errors import (
    GangError,
    GangRefused,
    GangRegroup,
    GangStopped,
    GangTimeout,
)
from prefect_ddp.tasks.gang.gpu_claims import GpuClaim, claim_gpu
from prefect_ddp.tasks.gang.plan import cluster_workers, cpu_set
from prefect_ddp.tasks.gang.ports import free_port
from prefect_ddp.tasks.gang.process_group import (
    all_gather_strings,
    all_reduce_sum,
    broadcast_bytes,
    process_group,
    sync_buffers,
    wrap_ddp,
)
from prefect_ddp.tasks.gang.results import GangAttempt, GangResults
from prefect_ddp.tasks.gang.run import current_dask_runner, run_gang
from prefect_ddp.tasks.gang.states import crash_unfinished_task_runs
from prefect_ddp.tasks.gang.stopping import stop_all_gangs, stop_scope
from prefect_ddp.tasks.gang.trial import (
    PRUNED_AT,
    REPORTED_AT,
    TrialLink,
    current_trial,
    scheduler_queue,
    training_trial,
)
from prefect_ddp.tasks.gang.worker_checks import OutputMarker, output_marker, visible_gpus

__all__ = [
    "PRUNED_AT", "REPORTED_AT", "GangAttempt", "GangError", "GangRefused", "GangRegroup", "GangResults", "GangStopped",
    "GangTimeout", "GpuClaim", "OutputMarker", "RankContext", "TrialLink", "all_gather_strings", "all_reduce_sum",
    "broadcast_bytes", "claim_gpu", "cluster_workers", "cpu_set", "crash_unfinished_task_runs", "current_dask_runner",
    "current_trial", "free_port", "output_marker", "process_group", "run_gang", "scheduler_queue", "stop_all_gangs",
    "stop_scope", "sync_buffers", "training_trial", "visible_gpus", "wrap_ddp",
]

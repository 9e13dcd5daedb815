"""Before any chunk is scored: every worker sees the run's folder and has a device of its own.

Dask sends a score-chunk task to whichever worker it picks, so each worker of the cluster
reads the run's model copy (`RUN/model/`) and writes its chunks (`RUN/predictions/`). Two
things training's gang checks before its ranks start (docs/architecture.md, "Gang: plan and
worker checks") matter here as much:

- A local output folder (a path or file://) must be one filesystem for the flow and every
  worker. A worker on another host, or in a container, would not find the model copy, or
  would write its chunks to its own disk, where the flow's summary never finds them. The
  flow writes the gang's marker file into the run's folder and every worker must read it
  back; an S3 output, or one declared shared (`output_shared`), is not checked.
- Each worker that sees GPUs scores on a GPU of its own: the one it claims, for its whole
  life, as a gang's worker does (docs/architecture.md, "Gang: GPU claims"). Loading every
  model on `cuda` put every worker of a multi-GPU host on GPU 0; a dask-cuda worker lists
  its own GPU first and claims its `cuda:0`, plain workers sharing a host claim one each, and
  a worker that trains later keeps the GPU it scored on.

`check_scoring_workers` probes every worker once, before the first chunk is submitted, and
refuses with every problem and its fix; `worker_device` is what a chunk scores on.
"""

from __future__ import annotations

import socket
from typing import Any

import distributed
import torch

from prefect_ddp.tasks.gang import (
    GpuClaim,
    OutputMarker,
    claim_gpu,
    cluster_workers,
    output_marker,
    visible_gpus,
)


class ScoringRefused(ValueError):
    """The cluster's workers cannot score this run as they are set up; nothing was scored.

    A ValueError, so Prefect does not retry it (prefect_ddp.tasks.retries): the same
    workers would be refused again.
    """


def scoring_device(claim: GpuClaim | None) -> torch.device:
    """The device a worker scores on: the CPU where it sees no GPU, else the GPU it claimed.

    Args:
        claim: the worker's GPU claim (`claim_gpu`), None where it sees no GPU.

    >>> scoring_device(None), scoring_device(GpuClaim("GPU-b", 1))
    (device(type='cpu'), device(type='cuda', index=1))
    """
    if claim is None:
        return torch.device("cpu")
    if claim.index is None:
        raise ScoringRefused(f"This worker has no GPU of its own to score on: {claim.why_none}")
    return torch.device(claim.device)


def worker_claim(holder: str) -> GpuClaim | None:
    """This process's GPU claim (made on the first call, then kept), or None where it sees no GPU."""
    gpus = visible_gpus()
    return claim_gpu(gpus, holder) if gpus else None


def worker_device() -> torch.device:
    """The device this worker process scores on, the same for every chunk it runs."""
    try:
        holder = f"worker {distributed.get_worker().address}"
    except ValueError:  # not in a Dask worker: a test calling a task's function
        holder = f"process on {socket.gethostname()}"
    return scoring_device(worker_claim(holder))


def probe_scoring_worker(marker: OutputMarker | None,
                         dask_worker: distributed.Worker | None = None) -> dict[str, Any]:
    """Run on each worker (`client.run`): whether it sees the run's folder, and its GPU claim."""
    holder = f"worker {dask_worker.address}" if dask_worker is not None else f"process on {socket.gethostname()}"
    return {"host": socket.gethostname(), "sees_output": marker.seen_here() if marker else True,
            "gpu_claim": worker_claim(holder)}


def scoring_problems(probes: dict[str, dict[str, Any]], output_url: str) -> list[str]:
    """What stops these workers from scoring a run whose folder is `output_url`, with the fix; [] when none.

    >>> probe = {"host": "gpu-2", "sees_output": False, "gpu_claim": None}
    >>> "worker(s) tcp://10.0.0.2:4001 on gpu-2 do not see" in scoring_problems({"tcp://10.0.0.2:4001": probe}, "/p")[0]
    True
    """
    problems = []
    blind = [f"{address} on {probe['host']}" for address, probe in probes.items() if not probe["sees_output"]]
    if blind:
        problems.append(
            f"The run folder {output_url} is local to the flow's host, and worker(s) {', '.join(blind)} do not see "
            "the flow's files there (another host, or a container with a filesystem of its own): they would not "
            "find the model copy in RUN/model/, or would write their predictions/chunk-*.parquet to their own "
            "disk, where the flow never reads them. Fix: give an s3:// output_url (with output_block for its "
            "credentials), or mount one shared filesystem at that path on every host and set output_shared=true."
        )
    for address, probe in probes.items():
        claim: GpuClaim | None = probe["gpu_claim"]
        if claim is not None and claim.index is None:
            problems.append(f"Worker {address} on {probe['host']} has no GPU of its own: {claim.why_none}")
    return problems


def check_scoring_workers(client: distributed.Client, output_url: str, shared: bool) -> None:
    """Refuse, before any chunk is scored, workers that cannot score into `output_url`.

    Args:
        client: the cluster's client.
        output_url: the run's folder; a local one is checked with a marker file unless `shared`.
        shared: the owner declared the local folder one filesystem mounted on every host
            (a shared mount's directory cache may hide a new file for a while).

    Raises ScoringRefused listing every problem with its fix.
    """
    with output_marker(output_url, shared) as marker:
        probes = client.run(probe_scoring_worker, marker, workers=cluster_workers(client))
    problems = scoring_problems(probes, output_url)
    if problems:
        raise ScoringRefused("The cluster's workers cannot score this run as they are set up, so nothing was "
                             "scored:\n- " + "\n- ".join(problems))

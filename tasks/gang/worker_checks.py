"""Before any rank starts: what each worker has, and what the gang refuses or warns about.

Clusters this project creates are set up for training (blocks/cluster.py). The workers of
an existing cluster are set up by their owner, with `dask worker` and Dask's defaults,
which used to show only once a rank ran: a daemonic worker failed in the DataLoader, a
nanny's `MALLOC_TRIM_THRESHOLD_` and the worker profiler made training quietly slower,
and a worker that could not reach the flow's Prefect API lost the ranks' task runs.
`probe_worker` runs on each leased worker (`client.run`) and `check_workers` turns what it
found into one refusal, naming each setting and its command-line fix, or warnings in the
run's log and a `worker-setup` artifact.

What is fatal, and why:
- a daemonic worker, when the training function starts processes (DataLoader workers):
  multiprocessing forbids it, and nothing in a running worker can change it;
- a Prefect API a rank would not report to, or cannot reach: its task runs, logs and
  artifacts would be lost, or land on another server (docs/architecture.md, "Facts: Prefect").
- a local output folder (a plain path or file://) that a rank's worker cannot see: it runs
  on another host, or in a container with a filesystem of its own. Its rank 0 would write
  checkpoints and the model to its own disk, and the flow would find no model after the
  whole training. The flow's process writes a marker file with a random token into the
  folder and each worker must read it back, so ranks on several hosts pass only where one
  filesystem really is mounted at that path on all of them (unless declared shared, which
  skips the check: a shared mount's directory cache may hide a new file for a while);
What is a warning (the run is right, only slower): the nanny's `MALLOC_TRIM_THRESHOLD_`
(glibc reads it once, at process start; undoing it inside a running worker would change
the memory behaviour the owner chose for all their tasks) and the worker profiler.

A worker without PREFECT_API_URL of its own is fine where the flow has one: Prefect ships
the flow's settings with each task (prefect_dask's `serialize_context`), and a setting
the flow left unset is read from the worker's environment.
"""

from __future__ import annotations

import http.client
import multiprocessing
import os
import socket
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import distributed

from prefect_ddp.tasks.gang.errors import GangRefused
from prefect_ddp.tasks.gang.gpu_claims import GpuClaim, claim_gpu
from prefect_ddp.tasks.gang.plan import cpu_set
from prefect_ddp.tasks.reporting import (
    in_prefect_run,
    markdown_table,
    markdown_text,
    run_logger,
)
from prefect_ddp.tasks.urls import is_local_url

API_CHECK_TIMEOUT_S = 5.0
# A server that took the connection but did not answer in API_CHECK_TIMEOUT_S is asked once
# more, this long: a busy one answers (SQLite under load, seen past 5 s), a silent one does not.
API_SLOW_TIMEOUT_S = 30.0

# The command line of a worker set up for training; the fixes below quote parts of it.
TRAINING_WORKER_COMMAND = (
    "DASK_DISTRIBUTED__WORKER__DAEMON=False "
    "DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON='{\"MALLOC_TRIM_THRESHOLD_\": None}' "
    "DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False "
    "PREFECT_API_URL=http://<prefect-host>:4200/api dask worker tcp://<scheduler>:8786 --nthreads 1"
)


@dataclass(frozen=True)
class Finding:
    """One problem shared by some workers: which setting, what it does, and its fix."""

    setting: str
    problem: str
    fix: str
    fatal: bool
    workers: tuple[str, ...]

    def message(self) -> str:
        return f"{self.setting} on {', '.join(self.workers)}: {self.problem} Fix: {self.fix}"


def api_error(api_url: str) -> str | None:
    """Why `api_url` cannot be reached from here, or None when its server answers.

    Any HTTP answer counts: Prefect Cloud answers 401 to a request without the key, and
    only a connection that cannot be made (refused, no route, timed out) loses task runs.
    A server that took the connection but is slow to answer (a busy SQLite server: seen
    past 5 s under load) is asked once more with API_SLOW_TIMEOUT_S: the ranks' clients
    wait that long too. One that never answers (a proxy whose upstream is down, a service
    of another kind) is not reached, nor one that answers something other than HTTP.
    """
    for timeout_s in (API_CHECK_TIMEOUT_S, API_SLOW_TIMEOUT_S):
        try:
            with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as response:
                response.read()
            return None
        except urllib.error.HTTPError:
            return None
        except urllib.error.URLError as exc:  # no connection: refused, no route, unknown host, connect timed out
            return repr(exc)
        except TimeoutError as exc:  # connected, then no answer in time (urllib wraps only the connect's errors)
            silent = exc
        except (OSError, http.client.HTTPException) as exc:  # reset, closed, or not HTTP
            return repr(exc)
    return f"connected, but no answer within {API_CHECK_TIMEOUT_S + API_SLOW_TIMEOUT_S:g} s ({silent!r})"


def visible_gpus() -> list[str]:
    """The UUIDs of the GPUs this process sees, in device order (cuda:0 first); none without CUDA."""
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


@dataclass(frozen=True)
class OutputMarker:
    """A file the flow's process wrote into a local output folder, and what it holds."""

    folder: str
    path: str
    token: str

    def seen_here(self) -> bool:
        try:
            with open(self.path) as file:
                return file.read() == self.token
        except OSError:
            return False


@contextmanager
def output_marker(output_url: str | None, shared: bool) -> Iterator[OutputMarker | None]:
    """A marker in the local output folder for the workers to read back, removed after the
    block; None where there is nothing to check (no output, not a local folder, or one its
    owner declared shared)."""
    if output_url is None or shared or not is_local_url(output_url):
        yield None
        return
    folder = output_url.removeprefix("file://")
    os.makedirs(folder, exist_ok=True)
    marker = OutputMarker(output_url, os.path.join(folder, f".gang-output-check-{uuid.uuid4().hex}"), uuid.uuid4().hex)
    with open(marker.path, "w") as file:
        file.write(marker.token)
    try:
        yield marker
    finally:
        os.remove(marker.path)


def probe_worker(flow_api: str | None = None, gpus: list[str] | None = None, claims: Path | None = None,
                 marker: OutputMarker | None = None, dask_worker: distributed.Worker | None = None) -> dict[str, Any]:
    """Run on each worker before a gang forms: what a rank there will have.

    Args:
        flow_api: the flow's configured PREFECT_API_URL (None when the flow has none): the
            URL a rank reports to is that one, else the worker's own, and the probe checks
            that the worker reaches it.
        gpus: the UUIDs of the GPUs the worker sees; default: those torch sees. Tests give
            made-up ones to stand for a multi-GPU host.
        claims: the folder of the GPU claims (gpu_claims); default: the user's own.
        marker: the flow's marker in a local output folder, which the worker must see
            (None: nothing to check).
        dask_worker: set by `client.run`; its address names the worker in its GPU claim.

    On its first probe the worker claims a GPU of its own for its whole life (gpu_claims).
    """
    import dask
    from prefect.settings import PREFECT_API_URL

    cpus = cpu_set()
    gpus = visible_gpus() if gpus is None else gpus
    holder = f"worker {dask_worker.address}" if dask_worker is not None else f"process on {socket.gethostname()}"
    # The environment first: a nanny sets its `env` after the worker process imported
    # Prefect, whose settings of this process then lack it; a task's settings read it.
    own_api = os.environ.get("PREFECT_API_URL") or PREFECT_API_URL.value()
    rank_api = (flow_api or own_api or "").rstrip("/") or None
    return {
        "host": socket.gethostname(),
        "cpus": len(cpus),
        "cpu_set": cpus,
        "cuda": bool(gpus),
        "gpus": gpus,
        "gpu_claim": claim_gpu(gpus, holder, claims) if gpus else None,
        "daemon": multiprocessing.current_process().daemon,
        "malloc_trim_threshold": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
        "profiler": bool(dask.config.get("distributed.worker.profile.enabled", True)),
        "prefect_api_url": own_api,
        "rank_api_url": rank_api,
        "api_error": api_error(rank_api) if rank_api else None,
        "output_folder": marker.folder if marker else None,
        "sees_output": marker.seen_here() if marker else None,
    }


def _api_finding(probe: dict[str, Any], flow_api: str) -> tuple[str, str] | None:
    """(problem, fix) with the Prefect API a rank on this worker would use, or None."""
    fix = (f"set PREFECT_API_URL, in the flow's environment and the workers', to one Prefect server "
           f"that the workers reach (e.g. `prefect server start --host 0.0.0.0`), as in: {TRAINING_WORKER_COMMAND}")
    rank_api = probe["rank_api_url"]
    if rank_api is None:
        return (f"neither the flow nor the worker sets it, so each rank would start a temporary Prefect "
                f"server of its own and its task runs would never reach this flow's ({flow_api}).", fix)
    if rank_api != flow_api:
        return (f"ranks there would report to {rank_api}, not to this flow's Prefect API {flow_api}.", fix)
    if probe["api_error"]:
        return f"the worker cannot reach {rank_api} ({probe['api_error']}).", fix
    return None


def find_problems(probes: dict[str, dict[str, Any]], flow_api: str, needs_child_processes: bool) -> list[Finding]:
    """Every setting that some of the workers get wrong, grouped by setting."""
    found: dict[tuple[str, str, str, bool], list[str]] = {}

    def add(address: str, setting: str, problem: str, fix: str, fatal: bool) -> None:
        found.setdefault((setting, problem, fix, fatal), []).append(address)

    for address, probe in probes.items():
        if probe["daemon"]:
            add(address, "distributed.worker.daemon=True",
                "its processes are daemonic, so a rank there cannot start DataLoader worker processes"
                + (", and this gang's ranks may start them (training.num_workers is not 0; empty starts one "
                   "per core a rank has, less one)." if needs_child_processes
                   else "; this gang's ranks start none, but training.num_workers > 0 would fail."),
                "start the workers with `DASK_DISTRIBUTED__WORKER__DAEMON=False dask worker ...` "
                "(or `dask worker --no-nanny ...`)", needs_child_processes)
        if probe["malloc_trim_threshold"] is not None:
            add(address, f"MALLOC_TRIM_THRESHOLD_={probe['malloc_trim_threshold']}",
                "Dask's nanny sets it by default; it made a training loop 1.5x slower here (memory given back "
                "to the system after every step).",
                "start the workers with `DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON='{\"MALLOC_TRIM_THRESHOLD_\": "
                "None}' dask worker ...` and without MALLOC_TRIM_THRESHOLD_ in their shell", False)
        if probe["profiler"]:
            add(address, "distributed.worker.profile.enabled=True",
                "the worker samples every thread's stack every 10 ms: 4 % of a rank's loop here.",
                "start the workers with `DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False dask worker ...`", False)
        if (api := _api_finding(probe, flow_api)) is not None:
            add(address, "PREFECT_API_URL", *api, True)
        if probe["sees_output"] is False:
            add(address, f"output {probe['output_folder']}",
                "it is a local folder of the flow's host, and this worker does not see the flow's files there (it "
                "runs on another host, or in a container with a filesystem of its own): its rank would write "
                "checkpoints and the model to its own disk, and the flow would find no model after training.",
                "give an s3:// output (the flow's output.url); or mount one shared filesystem at that path on every "
                "host and declare it (output.shared=true, run_gang(..., shared_output=True))", True)
    return [Finding(setting, problem, fix, fatal, tuple(workers))
            for (setting, problem, fix, fatal), workers in found.items()]


def gpu_cell(probe: dict[str, Any]) -> str:
    """The worker's own GPU among those it sees, as the `worker-setup` table shows it."""
    claim: GpuClaim | None = probe["gpu_claim"]
    if claim is None:
        return "none"
    if claim.uuid is None:
        return f"none of {len(probe['gpus'])}"
    return f"{claim.device} ({claim.uuid}) of {len(probe['gpus'])}"


def setup_table(probes: dict[str, dict[str, Any]]) -> str:
    """What each worker has, for the `worker-setup` artifact."""
    header = ["worker", "host", "daemonic", "MALLOC_TRIM_THRESHOLD_", "profiler", "ranks report to", "GPU", "CPUs"]
    rows = [[address, p["host"], p["daemon"], p["malloc_trim_threshold"] or "unset", p["profiler"],
             p["rank_api_url"] or "nowhere", gpu_cell(p), p["cpus"]] for address, p in probes.items()]
    return markdown_table(header, rows)


def check_workers(probes: dict[str, dict[str, Any]], flow_api: str, needs_child_processes: bool,
                  warned: set[str]) -> None:
    """Warn about slow settings and refuse broken ones, before any rank is submitted.

    Warnings go to the run's log once per run_gang call (`warned` remembers them across
    attempts) and, with what every worker has, to the `worker-setup` markdown artifact.
    Raises GangRefused listing every fatal setting with its fix.
    """
    problems = find_problems(probes, flow_api, needs_child_processes)
    new = [p for p in problems if p.message() not in warned]
    if new:
        warned.update(p.message() for p in new)
        publish_setup(probes, problems)
        for problem in new:
            if not problem.fatal:
                run_logger().warning("Worker setup: %s", problem.message())
    fatal = [p.message() for p in problems if p.fatal]
    if fatal:
        raise GangRefused("The gang's workers cannot train as they are set up, so no rank was started:\n- "
                          + "\n- ".join(fatal))


def publish_setup(probes: dict[str, dict[str, Any]], problems: list[Finding]) -> None:
    """The `worker-setup` artifact: what to fix on the workers, and what each has."""
    from prefect.artifacts import create_markdown_artifact

    if not in_prefect_run():
        return
    lines = ["# Worker setup", ""]
    lines += [f"- **{'fatal' if p.fatal else 'warning'}**: {markdown_text(p.message())}" for p in problems]
    lines += ["", "A worker set up for training starts as:", "", f"    {TRAINING_WORKER_COMMAND}", "",
              setup_table(probes)]
    create_markdown_artifact(key="worker-setup", markdown="\n".join(lines),
                             description="Settings of the gang's Dask workers that slow or break training")

"""Issue 33: many gangs on one warm cluster and one Prefect server, under seeded faults.

    .venv/bin/python -m bench.soak [--runs 100] [--seed 0] [--workers 3] [--external]

A night's life for the gang, compressed: runs of a 2-rank gang (a short training loop of
collectives that calls `ctx.check_stop()` after each step, `bench/soak_ranks.py`) one after
another on one cluster of nanny-backed workers (a LocalCluster in the soak's process, or with
`--external` `dask scheduler` and `dask worker` processes of their own, so that the scheduler's
memory is measured alone) and one Prefect server, while a seeded
injector gives about every other run one fault:

- kill-worker: SIGKILL a gang worker's process mid-run (an OOM kill); the gang re-forms
  (`max_restarts=1`) on the workers the nanny brings back;
- freeze-worker: SIGSTOP a gang worker mid-run, SIGCONT 20 s later; the hang limit (10 s
  here) finds it, or the run completes if it wakes first;
- kill-flow: SIGKILL the run's own flow process (a child process here) mid-run: its ranks
  run on, unsupervised, until the next run's gang finds them (`tasks/gang/stale.py`);
- ignore-stop: the ranks sleep in C past the gang's timeout (5 s), deaf to the stop flag:
  their workers must be restarted.

After every run it checks the invariants: the run completed, or failed with the error its
fault explains, within its limit (never hung); no worker lease held; no rank left running
on any worker; every worker back; none of its task runs left Running. Over the soak: the
scheduler's, the soak process's, the Prefect server's and each worker's memory and open files
at the start, after the first WARM_AFTER_RUNS runs, and at the end. It
prints a JSON line per run and a summary; record it in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextvars import copy_context
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import distributed
import psutil
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from bench import soak_ranks
from bench.overhead import quiet_dask, running_prefect_server
from prefect_ddp.blocks.cluster import create_local_cluster
from prefect_ddp.tasks.gang import cluster_workers
from prefect_ddp.tasks.gang.lease import _tidy
from prefect_ddp.tasks.gang.stale import running_rank
from tests.support.external_dask import TRAINING_ENV, dask_processes, owner_environment

REPO = Path(__file__).resolve().parents[1]
FAULTS = ["kill-worker", "freeze-worker", "kill-flow", "ignore-stop"]
RUN_LIMIT_S = 240  # a run that takes longer counts as hung
LEASE_TIMEOUT_S = 5
KILLED_RUN_STEPS = 1200  # about a minute and a half
FREEZE_S = 20
# Memory is compared from here on: the first gangs make the scheduler import torch and this
# package (tasks/gang/sending.py: 64 -> 615 MB on an external scheduler), once.
WARM_AFTER_RUNS = 10
# What a run that met each fault may end with, besides Completed.
EXPLAINED = {
    None: (),
    "kill-worker": ("left the cluster", "ended CRASHED", "closed by peer", "Connection"),
    "freeze-worker": ("hung", "made no progress", "left the cluster", "closed by peer", "Connection"),
    "kill-flow": ("killed",),
    "ignore-stop": ("did not finish within its timeout",),
}


class Launched:
    """One run: in a thread of this process, or (for kill-flow) in a flow process of its own."""

    def __init__(self, address: str, fn_name: str, marks: Path, work: Path, own_process: bool) -> None:
        self.began = time.monotonic()  # the run's limit counts from here, the fault's injection included
        self.process: subprocess.Popen[str] | None = None
        self.future: Future[dict[str, Any]] | None = None
        if own_process:
            # The killed client's leases are given back after this (production: 30 s), so that the
            # soak does not spend most of its time waiting on them; the next gang still finds the ranks.
            env = os.environ | {"DASK_DISTRIBUTED__SCHEDULER__LOCKS__LEASE_TIMEOUT": f"{LEASE_TIMEOUT_S}s"}
            # Long enough to outlive its leases: the next run's gang finds its ranks still running.
            self.process = subprocess.Popen([sys.executable, "-m", "bench.soak_ranks", address, fn_name, str(marks),
                                             str(KILLED_RUN_STEPS)],
                                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                                            stderr=open(work / "flows.log", "a"), text=True)
        else:
            # A thread of its own: a hung run's thread must not hold up the runs after it.
            threads = ThreadPoolExecutor(1)
            self.future = threads.submit(copy_context().run, soak_ranks.run, address, fn_name, str(marks))
            threads.shutdown(wait=False)

    def running(self) -> bool:
        return self.process.poll() is None if self.process else not self.future.done()

    def kill(self) -> None:
        if self.process:
            self.process.kill()

    def outcome(self, fault: str | None) -> dict[str, Any]:
        left_s = max(0.0, RUN_LIMIT_S - (time.monotonic() - self.began))
        if self.future is not None:
            try:
                return self.future.result(timeout=left_s)
            except FutureTimeout:
                return {"state": "HUNG"}
        try:
            out, _ = self.process.communicate(timeout=left_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return {"state": "HUNG"}
        if fault == "kill-flow" and self.process.returncode == -signal.SIGKILL:
            return {"state": "KILLED", "error": "killed"}
        lines = out.strip().splitlines()
        return json.loads(lines[-1]) if lines else {"state": "NO OUTPUT", "error": str(self.process.returncode)}


def wait_for_marks(marks: Path, count: int, run: Launched, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while len(list(marks.glob("running-*"))) < count:
        if not run.running() or time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def worker_pids(client: distributed.Client) -> dict[str, int]:
    return client.run(os.getpid)


def inject(fault: str | None, client: distributed.Client, run: Launched, marks: Path) -> None:
    """Give the running gang its fault, once its ranks run."""
    if fault is None or not wait_for_marks(marks, 2, run, 120):
        return
    time.sleep(random.uniform(0.5, 2.0))  # mid-run
    gang = [json.loads(m.read_text())["worker"] for m in marks.glob("running-*")]
    pids = worker_pids(client)
    victim = pids.get(random.choice(gang))
    # The victim may be gone meanwhile: the gang found it frozen and restarted it.
    with contextlib.suppress(ProcessLookupError):
        if fault == "kill-worker" and victim:
            os.kill(victim, signal.SIGKILL)
        elif fault == "freeze-worker" and victim:
            os.kill(victim, signal.SIGSTOP)
            time.sleep(FREEZE_S)
            os.kill(victim, signal.SIGCONT)
        elif fault == "kill-flow":
            run.kill()


def marked_flow_run(marks: Path) -> str | None:
    """The flow run its ranks marked: how a killed run, which printed nothing, is found."""
    for mark in marks.glob("running-*"):
        return str(json.loads(mark.read_text())["flow_run_id"])
    return None


def violations(client: distributed.Client, workers: int, result: dict[str, Any], fault: str | None,
               killed_before: str | None) -> list[str]:
    """The invariants one run must leave behind; what broke each. `killed_before`: the flow run
    of the run before, when it was killed: this run's gang must have ended its ranks' task runs."""
    found = []
    if result["state"] not in ("COMPLETED", "FAILED", "KILLED") or (
        result["state"] == "FAILED" and not any(word in result.get("error", "") for word in EXPLAINED[fault])
    ):
        found.append(f"outcome {result['state']}: {result.get('error', '')[:300]}")
    if fault != "kill-flow":  # a killed run's ranks are ended by the next gang, not before
        try:
            client.wait_for_workers(workers, timeout=90)
        except (TimeoutError, distributed.TimeoutError):
            found.append(f"only {len(cluster_workers(client))} of {workers} workers back")
        if held := _tidy(client):
            found.append(f"leases still held: {held}")
        if running := {a: r for a, r in client.run(running_rank, on_error="ignore").items() if r}:
            found.append(f"ranks left running: {running}")
        if left := left_running(result.get("flow_run_id")):
            found.append(f"task runs left Running: {left}")
        if killed_before and (left := left_running(killed_before)):
            found.append(f"task runs of the killed run before left Running: {left}")
    return found


def left_running(flow_run_id: str | None) -> list[str]:
    if not flow_run_id:
        return []
    deadline = time.monotonic() + 30  # states arrive as events, a moment late
    while True:
        with get_client(sync_client=True) as api:
            runs = api.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        left = [f"{r.name}: {r.state.type.value if r.state else None}" for r in runs
                if r.state is None or not r.state.is_final()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def footprint(client: distributed.Client) -> dict[str, Any]:
    """[RSS MB, open files] of the scheduler, of this process (the soak, whose flows run in its
    threads; the scheduler too without --external), the Prefect server and each worker now."""
    def of(process: psutil.Process) -> tuple[float, int]:
        return round(process.memory_info().rss / 1e6), process.num_fds()

    servers = [p for p in psutil.Process().children(recursive=True) if "server" in p.cmdline() and "prefect" in " ".join(p.cmdline())]
    return {"scheduler": of(psutil.Process(client.run_on_scheduler(os.getpid))), "soak": of(psutil.Process()),
            "prefect_server": [of(p) for p in servers],
            "workers": sorted(of(psutil.Process(pid)) for pid in worker_pids(client).values())}


@contextlib.contextmanager
def soak_cluster(workers: int, external: bool, work: Path) -> Iterator[str]:
    """The cluster's scheduler address: a LocalCluster in this process, or (`external`) `dask
    scheduler` and nanny-backed `dask worker` processes, as a team's long-lived cluster runs,
    whose scheduler's memory is then its own."""
    if not external:
        with create_local_cluster(n_workers=workers) as cluster:
            yield cluster.scheduler_address
        return
    env = owner_environment(work / "workers-home", TRAINING_ENV | {"PREFECT_API_URL": os.environ["PREFECT_API_URL"]})
    with dask_processes(work, workers, nanny=True, env=env) as address:
        yield address


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--fault-share", type=float, default=0.55, help="the share of runs given a fault")
    parser.add_argument("--external", action="store_true",
                        help="scheduler and workers as `dask` processes of their own, not a LocalCluster in this process")
    args = parser.parse_args()
    random.seed(args.seed)
    quiet_dask()
    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    started = time.time()
    with (running_prefect_server(work) as api_url,
          soak_cluster(args.workers, args.external, work) as address,
          distributed.Client(address) as client):
        print(json.dumps({"api": api_url, "scheduler": address, "external": args.external, "seed": args.seed,
                          "load_average": os.getloadavg()}), flush=True)
        start_footprint = warm_footprint = footprint(client)
        faults: Counter[str] = Counter()
        broken: list[dict[str, Any]] = []
        slowest: dict[str, float] = defaultdict(float)
        # Drawn before any run, so that the seed alone decides them (the injector's timing draws vary).
        draws = random.Random(args.seed)
        faulted = set(draws.sample(range(1, args.runs + 1), round(args.runs * args.fault_share)))
        plan = [draws.choice(FAULTS) if number in faulted else None for number in range(1, args.runs + 1)]
        killed_before: str | None = None
        for number, fault in enumerate([*plan, None], start=1):  # the last, without a fault, checks the one before
            marks = work / f"run-{number}"
            marks.mkdir()
            run = Launched(address, "asleep" if fault == "ignore-stop" else "loop", marks, work,
                           own_process=fault == "kill-flow")
            inject(fault, client, run, marks)
            result = run.outcome(fault)
            seconds = time.monotonic() - run.began
            found = violations(client, args.workers, result, fault, killed_before)
            killed_before = marked_flow_run(marks) if fault == "kill-flow" else None
            faults[fault or "none"] += 1
            slowest[fault or "none"] = max(slowest[fault or "none"], seconds)
            row = {"run": number, "fault": fault, "state": result["state"], "seconds": round(seconds, 1),
                   "attempts": result.get("attempts"), "violations": found}
            if found:
                broken.append(row)
            print(json.dumps(row), flush=True)
            if number == WARM_AFTER_RUNS:
                warm_footprint = footprint(client)
        end_footprint = footprint(client)
    print(json.dumps({
        "runs": args.runs + 1, "faults": dict(faults), "runs_with_violations": len(broken),
        "slowest_s_by_fault": {k: round(v, 1) for k, v in slowest.items()},
        "footprint_start": start_footprint, f"footprint_after_run_{WARM_AFTER_RUNS}": warm_footprint,
        "footprint_end": end_footprint,
        "minutes": round((time.time() - started) / 60, 1), "load_average_end": os.getloadavg(),
    }), flush=True)


if __name__ == "__main__":
    main()

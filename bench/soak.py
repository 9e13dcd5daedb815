"""Issue 33: many gangs on one warm cluster and one Prefect server, under seeded faults.

    .venv/bin/python -m bench.soak [--runs 100] [--seed 0] [--workers 3] [--external]
                                   [--fault-share 0.55] [--store-share 0.55] [--plan-only]
    .venv/bin/python -m bench.soak --recipe [--runs 100] [--seed 0] [--workers 3] [--plan-only]

With `--recipe` (issue 56) every run is the product's recipe on an elastic gang, under the
faults of bench/soak_recipe.py (a refused write of the best weights or a checkpoint crossed with
an elastic take-over, a stop crossed with a retry or a take-over, a worker restarted after the
environment changed, a killed worker), and after each the invariant "model.pt holds the weights
of the epoch the run reports" is checked with the others there. What follows is the gang soak's.

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

The gangs write what a training run writes (bench/soak_ranks.py, with the product's own code)
to a moto S3 server behind the fault-injecting front (tests/support/faulty_s3.py): rank 0's
checkpoint every 10 steps, from which a re-formed attempt resumes, and at the run's end its
model, kept through the product's promotion under `soak/` (a pointer, `soak/latest.json`,
and a version folder per run: model.pt, model.json, metrics.json). Drawn independently of
the process faults (so some runs meet both), about every other run (`--store-share`) gets one
store fault (issue 46), armed on the front before the run starts, on one PUT of the run's
writes (the checkpoint, the pointer, or the version's model.pt, model.json or metrics.json):

- lost-reply: the PUT is stored, its reply lost (the connection dropped): the client sends again;
- cut-file: the PUT is stored with half its bytes and answered 200.

After every run it checks the invariants: the run completed, or failed with the error its
process fault explains (a failure outside the gang, in the model's writing or promotion, is
never explained), within its limit (never hung); no worker lease held; no rank left running
on any worker; every worker back; none of its task runs left Running. After a run that
completed, on the store as moto holds it (not through the front): its store fault fired; the
pointer names this run's version; that version's model loads (`model_problem`) and its
metrics.json names the run; the run's checkpoint loads and says all steps were done; and the
loop's total is STEPS * 2 (each step's all-reduce of 1.0 over 2 ranks counted once: no step
counted twice after a resume). A store fault on a run that then fails or is killed may never
fire, and is not a violation: `--plan-only` counts those that fall on runs that can complete.

Over the soak: the scheduler's, the soak process's, the Prefect server's and each worker's
memory and open files at the start, after the first WARM_AFTER_RUNS runs, and at the end. It
prints a JSON line per run and a summary; record it in bench/RESULTS.md. The long soak of
issue 46 (65 store faults, 56 of them on runs that can complete):

    .venv/bin/python -m bench.soak --runs 100 --seed 29 --store-share 0.65
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
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextvars import copy_context
from pathlib import Path
from typing import Any, NamedTuple

import distributed
import psutil
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect_ddp.blocks.cluster import create_local_cluster
from prefect_ddp.deployments.local_services import create_bucket, moto_s3_server
from prefect_ddp.tasks.data.storage import read_json, remove_tree
from prefect_ddp.tasks.gang import cluster_workers
from prefect_ddp.tasks.gang.lease import _tidy
from prefect_ddp.tasks.gang.stale import running_rank
from prefect_ddp.tasks.results.promotion import (
    kept_location,
    read_pointer,
    version_location,
)
from prefect_ddp.tasks.training.checkpoints import read_committed, readable_checkpoint
from prefect_ddp.tasks.training.model import model_problem
from prefect_ddp.tasks.urls import child_url

from bench import soak_ranks
from bench.overhead import quiet_dask, running_prefect_server
from bench.soak_ranks import KEPT_NAME, Store, base_location, checkpoint_url, run_url
from bench.soak_recipe import (
    REMOVED_LATER,
    STOPPING,
    change_environment,
    environment_violations,
    injected,
    plan_recipe,
    recipe_violations,
)
from tests.support.image_folders import local_image_folder
from tests.support.external_dask import TRAINING_ENV, dask_processes, owner_environment
from tests.support.faulty_s3 import FaultyS3, faulty_s3

REPO = Path(__file__).resolve().parents[1]
FAULTS = ["kill-worker", "freeze-worker", "kill-flow", "ignore-stop"]
# Store faults (issue 46): what the front does to one PUT of the run's writes (tests/support/faulty_s3.py).
STORE_FAULTS = {"lost-reply": "drop reply", "cut-file": "cut"}
# The writes a store fault may hit: the checkpoint, the kept model's pointer, the version's files.
STORE_TARGETS = ["checkpoint", "pointer", "model.pt", "model.json", "metrics.json"]
# The process faults after which a run can complete (and so must have met its store fault).
COMPLETING = (None, "kill-worker", "freeze-worker")
BUCKET = "gangs"
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

    def __init__(self, address: str, fn_name: str, marks: Path, work: Path, own_process: bool,
                 store: Store | None = None) -> None:
        self.steps = KILLED_RUN_STEPS if own_process else soak_ranks.STEPS
        self.began = time.monotonic()  # the run's limit counts from here, the fault's injection included
        self.process: subprocess.Popen[str] | None = None
        self.future: Future[dict[str, Any]] | None = None
        if own_process:
            # The killed client's leases are given back after this (production: 30 s), so that the
            # soak does not spend most of its time waiting on them; the next gang still finds the ranks.
            env = os.environ | {"DASK_DISTRIBUTED__SCHEDULER__LOCKS__LEASE_TIMEOUT": f"{LEASE_TIMEOUT_S}s"}
            # Long enough to outlive its leases: the next run's gang finds its ranks still running.
            self.process = subprocess.Popen([sys.executable, "-m", "bench.soak_ranks", address, fn_name, str(marks),
                                             str(KILLED_RUN_STEPS), *([json.dumps(store)] if store else [])],
                                            cwd=REPO, env=env, stdout=subprocess.PIPE,
                                            stderr=open(work / "flows.log", "a"), text=True)
        else:
            # A thread of its own: a hung run's thread must not hold up the runs after it.
            threads = ThreadPoolExecutor(1)
            self.future = threads.submit(copy_context().run, soak_ranks.run, address, fn_name, str(marks),
                                         self.steps, store)
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
    ) or (result["state"] == "FAILED" and result.get("gang_failed") is False):  # not the gang's: never explained
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


class Planned(NamedTuple):
    """One run's faults: a process fault (FAULTS) and a store fault ((STORE_FAULTS key, STORE_TARGETS item)), or None."""

    fault: str | None
    store: tuple[str, str] | None


def plan(runs: int, seed: int, fault_share: float, store_share: float) -> list[Planned]:
    """Each run's faults, by the seed alone (the injector's timing draws vary). The process faults
    are drawn as before store faults were added (a seed's process faults are those it had); the store
    faults from a generator of their own, so that they fall on runs independently of them."""
    draws = random.Random(seed)
    faulted = set(draws.sample(range(1, runs + 1), round(runs * fault_share)))
    faults = [draws.choice(FAULTS) if number in faulted else None for number in range(1, runs + 1)]
    store_draws = random.Random(f"store-{seed}")
    stored = set(store_draws.sample(range(1, runs + 1), round(runs * store_share)))
    stores = [(store_draws.choice(list(STORE_FAULTS)), store_draws.choice(STORE_TARGETS)) if number in stored else None
              for number in range(1, runs + 1)]
    return [Planned(fault, store) for fault, store in zip(faults, stores)]


def plan_counts(planned: list[Planned]) -> dict[str, Any]:
    """What a plan holds: its process and store faults, and the store faults on runs that can
    complete (COMPLETING: those must meet theirs; a killed or timed-out run may never write)."""
    stores = [p.store for p in planned if p.store]
    return {
        "runs": len(planned),
        "faults": dict(Counter(p.fault or "none" for p in planned)),
        "store_faults": len(stores),
        "store_faults_by_kind": dict(Counter(kind for kind, _ in stores)),
        "store_faults_by_target": dict(Counter(target for _, target in stores)),
        "store_faults_on_completing_runs": sum(1 for p in planned if p.store and p.fault in COMPLETING),
        "store_and_process_fault": sum(1 for p in planned if p.store and p.fault),
    }


def target_pattern(store: Store, target: str) -> str:
    """The front's pattern ("bucket/key") for the PUT of `target` in this run."""
    if target == "checkpoint":
        url = checkpoint_url(store)
    elif target == "pointer":
        url = f"s3://{store['bucket']}/{KEPT_NAME}/latest.json"
    else:
        url = f"s3://{store['bucket']}/{KEPT_NAME}/versions/{store['run']}/{target}"
    return url.removeprefix("s3://")


def arm(front: FaultyS3, store: Store, store_fault: tuple[str, str] | None) -> None:
    """Break the run's one PUT of its target, once, before the run starts."""
    if store_fault:
        kind, target = store_fault
        front.fault("PUT", target_pattern(store, target), STORE_FAULTS[kind], times=1)  # type: ignore[arg-type]


def store_violations(front: FaultyS3, direct_endpoint: str, store: Store, result: dict[str, Any],
                     store_fault: tuple[str, str] | None, steps: int) -> tuple[list[str], dict[str, Any]]:
    """What a run left in the store that it must not have, read from moto itself (not through the
    front), and what was seen: whether its store fault fired (None: it had none) and the step its
    last attempt resumed from (by its checkpoint). The front's rules are cleared for the next run.
    Checked only for a run that completed: a failed or killed one keeps nothing."""
    seen: dict[str, Any] = {"fired": front.rules_left() == 0 if store_fault else None, "resumed_at": None}
    fired = seen["fired"]
    front.clear()
    if result["state"] != "COMPLETED":
        return [], seen
    found = []
    if store_fault and not fired:
        found.append(f"fault never fired: {store_fault[0]} on {store_fault[1]} ({target_pattern(store, store_fault[1])})")
    if (total := result.get("total")) != steps * 2:
        found.append(f"the loop's total is {total}, not {steps * 2}: a step counted twice, or not at all")
    promotion = result.get("promotion") or {}
    if not promotion.get("promoted"):
        found.append(f"not promoted: {promotion.get('reason')}")
    direct = base_location(store, direct_endpoint)
    kept = kept_location(direct, KEPT_NAME)
    version = version_location(kept, direct.with_url(run_url(store)))
    options = direct.storage_options()

    def pointer() -> str | None:
        named = (read_pointer(kept) or {}).get("version")
        return None if named == version.url else f"the pointer names {named}, not this run's {version.url}"

    def kept_model() -> str | None:
        problem = model_problem(version)
        return problem and f"the kept model does not load: {problem}"

    def metrics() -> str | None:
        named = read_json(child_url(version.url, "metrics.json"), options)["run"]["name"]
        return None if named == store["run"] else f"the version's metrics.json names run {named!r}, not {store['run']!r}"

    def checkpoint() -> str | None:
        url = checkpoint_url(store)
        saved = readable_checkpoint(url, read_committed(url, options))
        if saved is None:
            return f"the checkpoint {url} is missing or cannot be read"
        seen["resumed_at"] = saved.get("resumed_at")
        return None if saved["step"] == steps else f"the checkpoint says step {saved['step']}, not {steps}"

    for check in (pointer, kept_model, metrics, checkpoint):
        try:
            problem = check()
        except Exception as error:  # noqa: BLE001 -- a file missing, or one that does not parse: a violation, reported
            problem = f"{check.__name__}: {type(error).__name__}: {str(error)[:300]}"
        if problem:
            found.append(problem)
    return found, seen


def tidy_store(direct_endpoint: str, store: Store, kept_before: str | None) -> None:
    """Drop what later runs no longer need, so that moto (in memory) does not grow by two models a
    run: the run's own model.pt and the version the pointer named before this run, once it names another."""
    direct = base_location(store, direct_endpoint)
    options = direct.with_url(run_url(store)).storage_options()
    now = (read_pointer(kept_location(direct, KEPT_NAME)) or {}).get("version")
    with contextlib.suppress(OSError):
        remove_tree(child_url(run_url(store), "model.pt"), options)
        if kept_before and now and kept_before != now:
            remove_tree(kept_before, options)


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


def recipe_soak(runs: int, seed: int, workers: int, client: distributed.Client, address: str, front: FaultyS3,
                s3_endpoint: str, work: Path) -> list[dict[str, Any]]:
    """The recipe runs of `--recipe`, one after another; each run's row, as printed."""
    planned = plan_recipe(runs, seed)
    images = work / "images"
    manifest = local_image_folder(images, per_class=6)
    rows = []
    for number, (fault, every, scores) in enumerate(planned, start=1):
        marks = work / f"run-{number}"
        marks.mkdir()
        store: Store = {"endpoint": front.endpoint, "bucket": BUCKET, "run": f"run-{number}", "number": number}
        restarted = change_environment(client, number) if fault == "env-restart" else None
        began = time.monotonic()
        with injected(fault, client, front, s3_endpoint, store, marks) as seen:
            threads = ThreadPoolExecutor(1)  # a hung run must not hold up the runs after it
            future = threads.submit(copy_context().run, soak_ranks.run_recipe, address, str(marks), store, str(images),
                                    manifest, every, scores, fault in STOPPING)
            threads.shutdown(wait=False)
            try:
                result = future.result(timeout=RUN_LIMIT_S)
            except FutureTimeout:
                result = {"state": "HUNG", "calls": []}
        found = violations(client, workers, result, None, None)
        if result["state"] == "COMPLETED":
            try:
                found += recipe_violations(s3_endpoint, store, result, fault, marks, seen)
            except Exception as error:  # noqa: BLE001 -- a file missing, or one that does not load: a violation
                found.append(f"{type(error).__name__}: {str(error)[:300]}")
        if restarted:
            found += environment_violations(client, restarted, number)
        calls = result.get("calls") or []
        rows.append({"run": number, "fault": fault, "every": every, "scores": scores, "fired": seen["fired"],
                     "state": result["state"],
                     "seconds": round(time.monotonic() - began, 1), "attempts": result.get("attempts"),
                     "handed_over": any(any(call["handed_over"][1:]) for call in calls),
                     "best_epoch": calls[-1]["best_epoch"] if calls else None, "violations": found})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def recipe_summary(rows: list[dict[str, Any]], started: float) -> dict[str, Any]:
    return {"runs": len(rows), "faults": dict(Counter(row["fault"] or "none" for row in rows)),
            "faults_fired": dict(Counter(row["fault"] for row in rows if row["fired"])),
            "runs_handed_over": sum(row["handed_over"] for row in rows),
            "best_epochs": dict(Counter(str(row["best_epoch"]) for row in rows)),
            "runs_with_violations": sum(bool(row["violations"]) for row in rows),
            "slowest_s": max((row["seconds"] for row in rows), default=0.0),
            "minutes": round((time.time() - started) / 60, 1), "load_average_end": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--fault-share", type=float, default=0.55, help="the share of runs given a process fault")
    parser.add_argument("--store-share", type=float, default=0.55,
                        help="the share of runs given a store fault (lost-reply or cut-file), drawn independently")
    parser.add_argument("--external", action="store_true",
                        help="scheduler and workers as `dask` processes of their own, not a LocalCluster in this process")
    parser.add_argument("--plan-only", action="store_true", help="print the seed's plan's counts and run nothing")
    parser.add_argument("--recipe", action="store_true",
                        help="every run the product's recipe, under bench/soak_recipe.py's faults (issue 56)")
    args = parser.parse_args()
    if args.recipe and args.plan_only:
        print(json.dumps({"seed": args.seed, "faults": dict(Counter(
            p.fault or "none" for p in plan_recipe(args.runs, args.seed)))}))
        return
    # Drawn before any run, so that the seed alone decides them (the injector's timing draws vary).
    planned = plan(args.runs, args.seed, args.fault_share, args.store_share)
    if args.plan_only:
        print(json.dumps({"seed": args.seed, "fault_share": args.fault_share, "store_share": args.store_share}
                         | plan_counts(planned)))
        return
    random.seed(args.seed)
    quiet_dask()
    if args.recipe:  # inherited by the cluster's forkserver, then removed before an env-restart
        os.environ[REMOVED_LATER] = "set before the cluster started"
    work = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    started = time.time()
    with (running_prefect_server(work) as api_url,
          moto_s3_server(work) as s3_endpoint,
          faulty_s3(s3_endpoint) as front,
          soak_cluster(args.workers, args.external, work) as address,
          distributed.Client(address) as client):
        create_bucket(s3_endpoint, BUCKET)
        if args.recipe:
            rows = recipe_soak(args.runs, args.seed, args.workers, client, address, front, s3_endpoint, work)
            print(json.dumps(recipe_summary(rows, started)), flush=True)
            return
        print(json.dumps({"api": api_url, "scheduler": address, "s3": s3_endpoint, "front": front.endpoint,
                          "external": args.external, "seed": args.seed, "plan": plan_counts(planned),
                          "load_average": os.getloadavg()}), flush=True)
        start_footprint = warm_footprint = footprint(client)
        faults: Counter[str] = Counter()
        store_faults: Counter[str] = Counter()
        fired: Counter[str] = Counter()
        broken: list[dict[str, Any]] = []
        slowest: dict[str, float] = defaultdict(float)
        killed_before: str | None = None
        # The last, without a fault, checks the one before.
        for number, (fault, store_fault) in enumerate([*planned, Planned(None, None)], start=1):
            marks = work / f"run-{number}"
            marks.mkdir()
            store: Store = {"endpoint": front.endpoint, "bucket": BUCKET, "run": f"run-{number}", "number": number}
            kept_before = (read_pointer(kept_location(base_location(store, s3_endpoint), KEPT_NAME)) or {}).get("version")
            arm(front, store, store_fault)
            run = Launched(address, "asleep" if fault == "ignore-stop" else "loop", marks, work,
                           own_process=fault == "kill-flow", store=store)
            inject(fault, client, run, marks)
            result = run.outcome(fault)
            seconds = time.monotonic() - run.began
            found = violations(client, args.workers, result, fault, killed_before)
            in_store, seen = store_violations(front, s3_endpoint, store, result, store_fault, run.steps)
            met = seen["fired"]
            found += in_store
            tidy_store(s3_endpoint, store, kept_before)
            killed_before = marked_flow_run(marks) if fault == "kill-flow" else None
            faults[fault or "none"] += 1
            slowest[fault or "none"] = max(slowest[fault or "none"], seconds)
            store_name = f"{store_fault[0]}:{store_fault[1]}" if store_fault else None
            if store_name:
                store_faults[store_name] += 1
                fired[store_name] += bool(met)
            promotion = result.get("promotion") or {}
            row = {"run": number, "fault": fault, "store_fault": store_name, "fired": met, "state": result["state"],
                   "seconds": round(seconds, 1), "attempts": result.get("attempts"), "resumed_at": seen["resumed_at"], "total": result.get("total"),
                   "promoted": promotion.get("promoted"), "violations": found}
            if result["state"] != "COMPLETED":
                row["error"] = result.get("error", "")[:300]
            if found:
                broken.append(row)
            print(json.dumps(row), flush=True)
            if number == WARM_AFTER_RUNS:
                warm_footprint = footprint(client)
        end_footprint = footprint(client)
    print(json.dumps({
        "runs": args.runs + 1, "faults": dict(faults), "store_faults": sum(store_faults.values()),
        "store_faults_fired": sum(fired.values()),
        "store_faults_by_kind": {kind: sum(n for name, n in store_faults.items() if name.startswith(f"{kind}:"))
                                 for kind in STORE_FAULTS},
        "store_faults_fired_by_fault": {name: f"{fired[name]}/{n}" for name, n in sorted(store_faults.items())},
        "runs_with_violations": len(broken),
        "slowest_s_by_fault": {k: round(v, 1) for k, v in slowest.items()},
        "footprint_start": start_footprint, f"footprint_after_run_{WARM_AFTER_RUNS}": warm_footprint,
        "footprint_end": end_footprint,
        "minutes": round((time.time() - started) / 60, 1), "load_average_end": os.getloadavg(),
    }), flush=True)

if __name__ == "__main__":
    main()

"""Issue 33, the flows: the real flows on one warm cluster and one Prefect server, under seeded faults.

    .venv/bin/python -m bench.soak_flows [--runs 20] [--seed 0] [--workers 4] [--minutes 35]

bench/soak.py soaks the gang alone; this soaks what a night of the product runs. One
LocalCluster (this process holds its scheduler), one Prefect server, one moto S3 server
behind a fault-injecting front (tests/support/faulty_s3.py), one MLflow server, and an output
folder on a small tmpfs (as root; a plain folder otherwise, and no disk-full fault). Rounds
of one run, or two at once, of:

- train: transfer-learning (2 ranks, 2 epochs, a DataLoader worker process per rank, tiny
  images and mobilenet_v3_small), kept under one model name and tracked, so every run
  promotes against the champion and moves the registry's alias;
- predict: batch-predict of the kept model (`OUTPUT/NAME/latest`, checked against the registry);
- sweep: a 2-trial grid sweep of 1-rank trials that promotes its best under the same name;
- gang: bench/soak.py's 2-rank gang of collectives (bench/soak_ranks.py), in a thread here.

Each flow runs in a process of its own, as `prefect-ddp worker` starts one. About half the
rounds get one fault, drawn from the seed alone and logged as it is injected:
s3-503 (every S3 GET answers 503 SlowDown for a while), s3-slow (every GET stalls for a
while), mlflow-down (the MLflow server stops, then starts again on its port), prefect-restart
(the Prefect server stops and starts again on its port and database), disk-full (a file fills
the output filesystem for a while), kill-worker (SIGKILL a worker running a rank),
freeze-worker (SIGSTOP it, SIGCONT 20 s later) and kill-loader (SIGKILL a rank's DataLoader
worker process).

After every round it checks and records: each run Completed, or Failed with a message that
names its round's fault, within its limit (never hung); every image accounted for (a trained
run's split holds every readable class image, each epoch trained on all its training images
but for the ranks' padding and validated on all its validation images; a scored run scored
each image exactly once; the truncated JPEG alone left out, never an image the faults only
delayed); every worker back, no worker lease held, no rank left running (bench/soak.py's
checks); no task run or flow run left unfinished; no process, listening port or temp folder
left behind; the registry's `champion` and `latest.json` name the same version. Over the
soak: memory and open files of the scheduler, the workers and the Prefect server, at the start
and the end. It prints a JSON line per run and a summary; the work folder (logs, outputs) is
removed unless an invariant broke.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import distributed
import psutil

from bench import soak
from bench.overhead import quiet_dask
from prefect_ddp.deployments.local_services import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    create_bucket,
    moto_s3_server,
    prefect_server,
)
from prefect_ddp.deployments.sample_data import shapes_dataset
from prefect_ddp.tasks.gang import free_port
from prefect_ddp.tasks.gang.stale import running_rank
from tests.conftest import BUCKET, IMAGE_SIDE, PATIENT_CLIENT, PER_CLASS, truncated_jpeg
from tests.support.faulty_s3 import FaultyS3, faulty_s3
from tests.support.mlflow_server import mlflow_server

REPO = Path(__file__).resolve().parents[1]
KINDS = {"train": 0.45, "predict": 0.25, "sweep": 0.15, "gang": 0.15}  # how often each is drawn
FAULTS = ["s3-503", "s3-slow", "mlflow-down", "prefect-restart", "disk-full", "kill-worker", "freeze-worker",
          "kill-loader"]
# Words a Failed run's message must hold to be explained by its round's fault.
EXPLAINED: dict[str | None, tuple[str, ...]] = {
    None: (),
    "s3-503": ("503", "SlowDown", "reduce your request rate"),
    "s3-slow": ("timed out", "Timeout", "timeout", "hung", "made no progress"),
    "mlflow-down": ("MLflow", "mlflow", "registry", "champion"),
    "prefect-restart": ("Prefect", "API", "server", "Connect", "connect"),
    "disk-full": ("No space left", "Errno 28", "ENOSPC"),
    "kill-worker": soak.EXPLAINED["kill-worker"],
    "freeze-worker": soak.EXPLAINED["freeze-worker"],
    "kill-loader": ("DataLoader worker", "killed by signal", *soak.EXPLAINED["kill-worker"]),
}
MODEL_NAME, IMAGES_BLOCK, TRACKING_BLOCK = "soak", "soak-images", "soak-mlflow"
DATA = {"block": IMAGES_BLOCK, "val_fraction": 0.3, "seed": 5, "index_cache_minutes": 0}
EPOCHS = 2
CLASS_IMAGES = {f"{shape}/{n:04d}.jpg" for shape in ("circle", "square", "triangle") for n in range(PER_CLASS)}
SCORABLE = CLASS_IMAGES | {"stray.jpg"}  # an image in no class folder is scored, never trained on
UNREADABLE = {"broken.jpg"}
FLOW_LIMIT_S = 480  # a flow run that takes longer counts as hung
OUTPUT_SIZE = "2g"
FREEZE_S = soak.FREEZE_S
SETTLE_S = 30  # final states reach the server as events, a moment late


# -- a flow run in a process of its own ------------------------------------------------------

def flow_call(kind: str, output: str, address: str, number: int) -> Any:
    """The flow of `kind`, small, on the soak's cluster; its final state (run in the child process)."""
    from prefect_ddp.flows.batch_predict import batch_predict
    from prefect_ddp.flows.sweep import hyperparameter_sweep
    from prefect_ddp.flows.transfer_learning import transfer_learning
    from prefect_ddp.tasks.config import ClusterConfig, DataConfig, ModelConfig, OutputConfig, TrackingConfig, TrainingConfig
    from prefect_ddp.tasks.sweeps.settings import SweepSettings
    from tests.support.flow_runs import TINY_TRAINING

    common = {"data": DataConfig(**DATA), "model": ModelConfig(backbone="mobilenet_v3_small"),
              "output": OutputConfig(url=output, model_name=MODEL_NAME),
              "tracking": TrackingConfig(block=TRACKING_BLOCK, experiment="soak"), "return_state": True}
    if kind == "train":
        return transfer_learning(**common, training=TrainingConfig(**TINY_TRAINING | {"epochs": EPOCHS, "num_workers": 1}),
                                 cluster=ClusterConfig(address=address, world_size=2, init_timeout_s=60))
    if kind == "sweep":
        settings = SweepSettings(name=f"soak-sweep-{number}", n_trials=2, concurrency=2, ranks_per_trial=1,
                                 sampler="grid", promote=True)
        return hyperparameter_sweep(space={"training.lr": {"kind": "grid", "values": [0.01, 0.001]}},
                                    settings=settings, training=TrainingConfig(**TINY_TRAINING),
                                    cluster=ClusterConfig(address=address, init_timeout_s=60), **common)
    return batch_predict(model=f"{output}/{MODEL_NAME}/latest", data_block=IMAGES_BLOCK,
                         output_url=f"{output}/predictions", cluster=ClusterConfig(address=address),
                         tracking_block=TRACKING_BLOCK, chunk_size=8, return_state=True)


def run_one_flow(kind: str, output: str, address: str, number: int) -> dict[str, Any]:
    """The outcome the soak checks: state, message (with the error), flow run id, result. A flow
    whose call raised instead (Prefect's client, started while the server was down, fails at once
    with "Failed to reach API" and makes no flow run) failed with that error."""
    try:
        state = flow_call(kind, output, address, number)
    except Exception as exc:  # noqa: BLE001 - what the soak records, as a worker would its crashed run
        return {"state": "FAILED", "error": f"raised before any final state: {type(exc).__name__}: {exc}"[:3000]}
    result = state.result(raise_on_failure=False)
    failed = isinstance(result, BaseException)
    return {"state": state.type.value, "error": f"{state.message}: {result}"[:3000] if failed else "",
            "flow_run_id": str(state.state_details.flow_run_id), "result": None if failed else result}


class FlowProcess:
    """A flow run in a child process, as `prefect-ddp worker` starts one; bench/soak.py's
    `Launched` interface (running, outcome), so a round treats it and a gang run alike."""

    def __init__(self, kind: str, number: int, output: Path, address: str, log: Path) -> None:
        self.began = time.monotonic()
        with open(log, "a") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "bench.soak_flows", "--flow", kind, "--output", str(output),
                 "--address", address, "--number", str(number)],
                cwd=REPO, stdout=subprocess.PIPE, stderr=sink, text=True)

    def running(self) -> bool:
        return self.process.poll() is None

    def outcome(self, fault: str | None) -> dict[str, Any]:
        left_s = max(0.0, FLOW_LIMIT_S - (time.monotonic() - self.began))
        try:
            out, _ = self.process.communicate(timeout=left_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.communicate()
            return {"state": "HUNG"}
        lines = out.strip().splitlines()
        return json.loads(lines[-1]) if lines else {"state": "NO OUTPUT", "error": f"exit {self.process.returncode}"}


class Run(Protocol):
    began: float

    def running(self) -> bool: ...

    def outcome(self, fault: str | None) -> dict[str, Any]: ...


# -- the services, some of which a fault stops ------------------------------------------------

class Restartable:
    """A server that a fault stops and starts again, where clients found it before."""

    def __init__(self, start: Callable[[int], AbstractContextManager[str]]) -> None:
        self._start = start
        self._stack = ExitStack()
        self.starts = 0
        self.url = self.up()

    def up(self, attempts: int = 3) -> str:
        """Start it, again where a start timed out (a loaded host: the Prefect server took more
        than its 120 s here at a load average of 80); the last failure is raised."""
        for _ in range(attempts - 1):
            with contextlib.suppress(TimeoutError, RuntimeError):
                return self._start_once()
        return self._start_once()

    def _start_once(self) -> str:
        self.starts += 1  # a start that failed stopped its process (local_services.running)
        return self._stack.enter_context(self._start(self.starts))

    def down(self) -> None:
        self._stack.close()


@dataclass
class Services:
    """What the rounds share: the work folder, the servers, the S3 front, the cluster."""

    work: Path
    output: Path
    prefect: Restartable
    mlflow: Restartable
    front: FaultyS3
    cluster: distributed.LocalCluster
    client: distributed.Client
    workers: int
    disk_fault: bool


def images_on_s3(endpoint: str) -> None:
    """The tests' image folder (tests/conftest.py, `image_location`): shapes in 3 class folders, a
    truncated JPEG (left out, never trained on), a README (not an image) and an image in no class."""
    import s3fs

    create_bucket(endpoint, BUCKET)
    files = shapes_dataset(PER_CLASS, size=IMAGE_SIDE, seed=1)
    files["square/broken.jpg"] = truncated_jpeg()
    files["README.txt"] = b"not an image"
    files["stray.jpg"] = files["circle/0000.jpg"]
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key=MOTO_CREDENTIALS["aws_access_key_id"],
                           secret=MOTO_CREDENTIALS["aws_secret_access_key"], client_kwargs={"region_name": MOTO_REGION})
    fs.pipe({f"{BUCKET}/shapes/{key}": data for key, data in files.items()})


def save_blocks(front: FaultyS3, mlflow_uri: str) -> None:
    """The images, reached through the faulty front, and the tracking server, as blocks the flows name."""
    from prefect_ddp.blocks.data_location import DataLocation
    from prefect_ddp.blocks.tracking import MlflowTracking

    DataLocation(url=f"s3://{BUCKET}/shapes", endpoint_url=front.endpoint, region_name=MOTO_REGION,
                 **MOTO_CREDENTIALS).save(IMAGES_BLOCK, overwrite=True)
    MlflowTracking(tracking_uri=mlflow_uri).save(TRACKING_BLOCK, overwrite=True)


@contextmanager
def output_filesystem(folder: Path) -> Iterator[bool]:
    """A small tmpfs for the outputs, that disk-full can fill; True when it is one (root only)."""
    folder.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={OUTPUT_SIZE}", "tmpfs", str(folder)]).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "--lazy", str(folder)], check=False)


@contextmanager
def own_temp_folder(work: Path) -> Iterator[Path]:
    """TMPDIR for this process and every process it starts, so that a temp folder a run leaves
    behind is found among the soak's own, not among those of whatever else runs on the host."""
    tmp = work / "tmp"
    tmp.mkdir()
    before = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp)
    try:
        yield tmp
    finally:
        tempfile.tempdir = before[1]
        if before[0] is None:
            os.environ.pop("TMPDIR")
        else:
            os.environ["TMPDIR"] = before[0]


@contextmanager
def services(work: Path, workers: int) -> Iterator[Services]:
    """Every service the rounds share, started once, stopped at the end."""
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_REQUEST_TIMEOUT, PREFECT_API_URL, temporary_settings

    from prefect_ddp.blocks.cluster import create_local_cluster

    prefect_port, mlflow_port = free_port(), free_port()
    (work / "mlflow").mkdir()
    with ExitStack() as stack:
        stack.enter_context(own_temp_folder(work))
        endpoint = stack.enter_context(moto_s3_server(work))
        images_on_s3(endpoint)
        front = stack.enter_context(faulty_s3(endpoint))
        prefect = Restartable(lambda n: prefect_server(make(work / f"prefect-{n}"), database=work / "prefect.db",
                                                       port=prefect_port))
        stack.callback(prefect.down)
        os.environ.update({"PREFECT_API_URL": prefect.url, **PATIENT_CLIENT})  # the flows' processes, the workers
        stack.enter_context(temporary_settings({PREFECT_API_URL: prefect.url,
                                                PREFECT_API_REQUEST_TIMEOUT: float(PATIENT_CLIENT["PREFECT_API_REQUEST_TIMEOUT"])}))
        stack.callback(APILogWorker.drain_all, timeout=5)  # the gang runs' logs, before the server stops
        mlflow = Restartable(lambda n: mlflow_server(work / "mlflow", port=mlflow_port))
        stack.callback(mlflow.down)
        save_blocks(front, mlflow.url)
        disk_fault = stack.enter_context(output_filesystem(work / "output"))
        cluster = stack.enter_context(create_local_cluster(n_workers=workers))
        client = stack.enter_context(distributed.Client(cluster))
        yield Services(work, work / "output", prefect, mlflow, front, cluster, client, workers, disk_fault)


def make(folder: Path) -> Path:
    """`folder`, created: each start of a server logs to a folder of its own."""
    folder.mkdir(exist_ok=True)
    return folder


# -- the seeded plan ---------------------------------------------------------------------------

@dataclass
class Round:
    """Runs started together, and the fault (if any) injected while they run."""

    number: int
    kinds: list[str]
    fault: str | None


def fits(fault: str, kinds: list[str], disk_fault: bool) -> bool:
    """Whether a round of `kinds` can meet `fault`: a loader to kill, ranks on a worker, a tmpfs."""
    if fault == "kill-loader":
        return "train" in kinds
    if fault in ("kill-worker", "freeze-worker"):
        return any(kind != "predict" for kind in kinds)
    if fault == "prefect-restart":
        return True
    return any(kind != "gang" for kind in kinds) and (fault != "disk-full" or disk_fault)  # the gang reads no S3


def plan(runs: int, seed: int, fault_share: float, pair_share: float, faults: list[str], disk_fault: bool) -> list[Round]:
    """The rounds, drawn before any run so that the seed alone decides them: a first training run
    alone and unfaulted (later runs need a kept model), then one run or two at once, about
    `fault_share` of the rounds with a fault that fits them."""
    draws = random.Random(seed)
    rounds = [Round(1, ["train"], None)]
    left = runs - 1
    while left > 0:
        size = 2 if left >= 2 and draws.random() < pair_share else 1
        kinds = draws.choices(list(KINDS), weights=list(KINDS.values()), k=size)
        fitting = [f for f in faults if fits(f, kinds, disk_fault)]
        fault = draws.choice(fitting) if fitting and draws.random() < fault_share else None
        rounds.append(Round(len(rounds) + 1, kinds, fault))
        left -= size
    return rounds


# -- the injector ------------------------------------------------------------------------------

@dataclass
class Injected:
    """What the injector did, as logged: when (seconds into the round), to what, for how long."""

    kind: str
    at_s: float | None = None
    target: str = ""
    window_s: float = 0.0
    skipped: str = ""
    began: float = field(default=0.0, repr=False)  # monotonic: recovery counts from here

    def row(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v not in ("", None, 0.0) and k != "began"}


def any_running(runs: list[Run]) -> bool:
    return any(run.running() for run in runs)


def rank_workers(client: distributed.Client) -> list[str]:
    """The workers a rank runs on now."""
    return [address for address, rank in client.run(running_rank, on_error="ignore").items() if rank]


def victim_process(fault: str, services: Services, runs: list[Run], rng: random.Random) -> psutil.Process | None:
    """Once a rank runs: its worker's process, or for kill-loader a DataLoader process that worker forked."""
    while any_running(runs):
        pids = soak.worker_pids(services.client)
        choices = [psutil.Process(pids[a]) for a in rank_workers(services.client) if a in pids]
        if fault == "kill-loader":  # torch names its loader processes
            choices = [child for worker in choices for child in worker.children() if child.name() == "pt_data_worker"]
        if choices:
            time.sleep(rng.uniform(0.5, 2.0))  # mid-run
            return rng.choice(choices)
        time.sleep(0.3)
    return None


def hit_process(fault: str, victim: psutil.Process, record: Injected) -> None:
    record.target = f"pid {victim.pid}"
    with contextlib.suppress(psutil.NoSuchProcess):  # it may have ended meanwhile
        if fault == "freeze-worker":
            victim.suspend()
            record.window_s = FREEZE_S
            time.sleep(FREEZE_S)
            victim.resume()
        else:
            victim.kill()


def fill_disk(output: Path) -> Path:
    """A file as large as the output filesystem's free space."""
    filler = output / "filler"
    stats = os.statvfs(output)
    with open(filler, "wb") as sink:
        os.posix_fallocate(sink.fileno(), 0, stats.f_bavail * stats.f_frsize)
    return filler


def outage(fault: str, services: Services, window_s: float, record: Injected) -> None:
    """Hold a service's fault for `window_s`, then lift it."""
    if fault in ("s3-503", "s3-slow"):
        record.target = services.front.endpoint
        if fault == "s3-503":
            services.front.fail_gets("*", times=10**9, how="503")
        else:
            services.front.stall_gets("*", seconds=5)
        time.sleep(window_s)
        services.front.clear()
    elif fault == "disk-full":
        filler = fill_disk(services.output)
        record.target = str(services.output)
        time.sleep(window_s)
        filler.unlink()
    else:
        server = services.mlflow if fault == "mlflow-down" else services.prefect
        record.target = server.url
        server.down()
        time.sleep(window_s)
        server.up()  # returns once it answers: its start is part of the outage


def inject(fault: str | None, services: Services, runs: list[Run], rng: random.Random, began: float) -> Injected | None:
    """Give the round its fault while its runs run; return once the fault is lifted."""
    if fault is None:
        return None
    record = Injected(fault)
    victim = None
    if fault in ("kill-worker", "freeze-worker", "kill-loader"):
        victim = victim_process(fault, services, runs, rng)
    else:
        time.sleep(rng.uniform(1.0, 20.0))
    if not any_running(runs) or (fault in ("kill-worker", "freeze-worker", "kill-loader") and victim is None):
        record.skipped = "the runs ended before it"
        return record
    record.began, record.at_s = time.monotonic(), round(time.monotonic() - began, 1)
    if victim is not None:
        hit_process(fault, victim, record)
    else:
        record.window_s = round(rng.uniform(8.0, 20.0), 1)
        outage(fault, services, record.window_s, record)
    return record


# -- what a round must leave behind ------------------------------------------------------------

def outcome_violations(outcome: dict[str, Any], fault: str | None) -> list[str]:
    """Completed, or Failed naming the round's fault: never hung, never failed unexplained."""
    if outcome["state"] == "COMPLETED" or (
        outcome["state"] == "FAILED" and any(word in outcome.get("error", "") for word in EXPLAINED[fault])
    ):
        return []
    return [f"outcome {outcome['state']}: {outcome.get('error', '')[:400]}"]


def trained_violations(folder: Path) -> list[str]:
    """A trained run's images: its split holds every readable class image, once; each epoch
    trained its training images (less the ranks' padding) and validated every validation image;
    none left out as unreadable in training."""
    summary = json.loads((folder / "metrics.json").read_text())
    split = json.loads((folder / "split.json").read_text())
    train, val = set(split["train_keys"]), set(split["val_keys"])
    found = []
    if train & val or train | val != CLASS_IMAGES:
        found.append(f"{folder.name}: split is not the readable class images: {sorted((train | val) ^ CLASS_IMAGES)}")
    if len(summary["history"]) != summary.get("recipe", {}).get("epochs", len(summary["history"])):
        found.append(f"{folder.name}: {len(summary['history'])} epochs recorded")
    for epoch in summary["history"]:
        if epoch["train_samples"] < summary["train_size"] - summary["world_size"] or epoch["val_samples"] != summary["val_size"]:
            found.append(f"{folder.name}: epoch {epoch['epoch']} trained {epoch['train_samples']} of "
                         f"{summary['train_size']}, validated {epoch['val_samples']} of {summary['val_size']}")
    if summary["unreadable"].get("in_training"):
        found.append(f"{folder.name}: left out as unreadable in training: {summary['unreadable']}")
    return found


def scored_violations(summary: dict[str, Any]) -> list[str]:
    """A scored run's images: each scorable image scored exactly once; the truncated one alone unreadable."""
    import pyarrow.parquet as pq

    folder = Path(summary["files"]["summary.json"]).parent
    keys = [key.rsplit("shapes/", 1)[-1] for key in pq.read_table(folder / "predictions").column("key").to_pylist()]
    found = []
    if sorted(keys) != sorted(SCORABLE) or summary["rows"] != len(SCORABLE):
        twice = sorted(k for k, n in Counter(keys).items() if n > 1)
        found.append(f"scored {summary['rows']} rows; missing {sorted(SCORABLE - set(keys))}, more than once {twice}")
    if {Path(url).name for url in summary["unreadable"]} != UNREADABLE:
        found.append(f"unreadable: {summary['unreadable']}")
    return found


def images_violations(kind: str, outcome: dict[str, Any]) -> list[str]:
    """Every image of a completed run accounted for, by what its flow does with them."""
    result = outcome.get("result")
    if outcome["state"] != "COMPLETED" or kind == "gang":
        return []
    if kind == "train":
        return trained_violations(Path(result["files"]["model.pt"]).parent)
    if kind == "predict":
        return scored_violations(result)
    return [v for trial in result["trials"] if trial["state"] == "completed"
            for v in trained_violations(Path(trial["model_url"]).parent)]


def images_seen(kind: str, outcome: dict[str, Any]) -> str | None:
    """What a completed run did with the images, for its row."""
    result = outcome.get("result")
    if outcome["state"] != "COMPLETED" or kind == "gang":
        return None
    if kind == "predict":
        return f"scored {result['rows']}, unreadable {len(result['unreadable'])}"
    trained = [result] if kind == "train" else [t for t in result["trials"] if t["state"] == "completed"]
    return f"{len(trained)} trained, train samples per epoch " + ", ".join(
        str([h["train_samples"] for h in json.loads((Path(t["model_url"] if kind == "sweep" else t["files"]["model.pt"]).parent
                                                     / "metrics.json").read_text())["history"]]) for t in trained)


def run_ids(kind: str, outcome: dict[str, Any]) -> list[str]:
    """The flow runs a run made: itself, and a sweep's trials."""
    trials = outcome["result"]["trials"] if kind == "sweep" and outcome.get("result") else []
    return [i for i in [outcome.get("flow_run_id"), *(t.get("flow_run_id") for t in trials)] if i]


def gang_violations(services: Services, flow_run_ids: list[str]) -> list[str]:
    """bench/soak.py's checks after a run (every worker back, no lease held, no rank left running,
    none of its task runs left Running), for each flow run of the round; outcomes are judged above."""
    found: list[str] = []
    for flow_run_id in flow_run_ids or [None]:  # none: the cluster's checks alone
        judged: dict[str, Any] = {"state": "COMPLETED", "flow_run_id": flow_run_id}
        found += [v for v in soak.violations(services.client, services.workers, judged, None, None) if v not in found]
    return found


def unfinished_flow_runs() -> list[str]:
    """Flow runs the server still holds as not final (a sweep's trials too), once states settled."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    deadline = time.monotonic() + SETTLE_S
    while True:
        with get_client(sync_client=True) as api:
            runs = api.read_flow_runs(limit=200, sort=FlowRunSort.START_TIME_DESC)
        left = [f"{r.name} ({r.id}): {r.state.type.value}" for r in runs if r.state and not r.state.is_final()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def registry_violations(services: Services) -> tuple[list[str], str | None]:
    """The registry's champion is the version latest.json names (none where it names none);
    what it broke, and the champion's version."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from prefect_ddp.tasks.results.registry import ALIAS

    pointer_file = services.output / MODEL_NAME / "latest.json"
    if not pointer_file.exists():
        return [], None
    pointer = json.loads(pointer_file.read_text())
    named = (pointer.get("registered") or {}).get("version")
    try:
        champion = MlflowClient(services.mlflow.url).get_model_version_by_alias(MODEL_NAME, ALIAS).version
    except MlflowException:
        champion = None
    if str(named) != str(champion):
        return [f"registry's {ALIAS} is version {champion}, latest.json names {named} ({pointer.get('version')})"], champion
    return [], champion


@dataclass
class Snapshot:
    """What the soak's processes hold, to tell what a round left behind."""

    pids: set[int]
    ports: dict[int, set[int]]  # listening, by process: this one and the workers
    temp: set[str]  # top-level entries of the soak's TMPDIR

    @classmethod
    def take(cls, services: Services) -> Snapshot:
        holders = [psutil.Process(), *map(psutil.Process, soak.worker_pids(services.client).values())]
        return cls({p.pid for p in unserviced_processes()},
                   {p.pid: listening(p) for p in holders},
                   set(os.listdir(tempfile.gettempdir())))


def listening(process: psutil.Process) -> set[int]:
    with contextlib.suppress(psutil.Error):
        return {c.laddr.port for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    return set()


SERVICE_WORDS = ("prefect server", "mlflow server", "moto.server")


def unserviced_processes() -> list[psutil.Process]:
    """The soak's live processes, found by the TMPDIR they inherited (`own_temp_folder`), so that
    one a run orphaned is found too; less the servers' process trees, which outlive runs and
    restart with their faults."""
    tmp, found, services = tempfile.gettempdir(), [], set()
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.status() == psutil.STATUS_ZOMBIE or process.environ().get("TMPDIR") != tmp:
                continue
            if any(word in " ".join(process.cmdline()).replace(" -m ", " ") for word in SERVICE_WORDS):
                services |= {process.pid, *(p.pid for p in process.children(recursive=True))}
            found.append(process)
    return [p for p in found if p.pid not in services]


def leftover_violations(services: Services, before: Snapshot) -> list[str]:
    """Processes, listening ports and temp folders the round started and left behind: new since it
    began and still there, apart from workers the nannies brought back."""
    after = Snapshot.take(services)
    workers = set(soak.worker_pids(services.client).values())
    found = []
    if processes := sorted(after.pids - before.pids - workers):
        found.append(f"processes left: {[' '.join(psutil.Process(p).cmdline())[:150] for p in processes if psutil.pid_exists(p)]}")
    for pid, ports in after.ports.items():
        if pid in before.ports and (new := ports - before.ports[pid]):
            found.append(f"ports left listening by pid {pid}: {sorted(new)}")
    if temp := sorted(after.temp - before.temp):
        found.append(f"temp entries left: {temp}")
    return found


# -- rounds ------------------------------------------------------------------------------------

def launch(kind: str, number: int, services: Services) -> Run:
    """A run of `kind`: a flow in a process of its own, or bench/soak.py's gang in a thread here."""
    address = services.cluster.scheduler_address
    if kind == "gang":
        marks = services.work / f"gang-{number}"
        marks.mkdir()
        return soak.Launched(address, "loop", marks, services.work, own_process=False)
    return FlowProcess(kind, number, services.output, address, services.work / "flows.log")


def whole_again(services: Services) -> float:
    """When every worker is back (a killed one's nanny restarts it): where recovery ends."""
    with contextlib.suppress(TimeoutError, distributed.TimeoutError):
        services.client.wait_for_workers(services.workers, timeout=120)
    return time.monotonic()


def run_round(services: Services, plan_round: Round, first_number: int, rng: random.Random) -> list[dict[str, Any]]:
    """Start the round's runs together, inject its fault, check what they left; a row per run."""
    before = Snapshot.take(services)
    began = time.monotonic()
    numbers = range(first_number, first_number + len(plan_round.kinds))
    runs = [launch(kind, number, services) for kind, number in zip(plan_round.kinds, numbers)]
    injector = ThreadPoolExecutor(1)
    injected: Future[Injected | None] = injector.submit(inject, plan_round.fault, services, runs, rng, began)
    outcomes, ended = [], []
    for run in runs:  # waited for in turn: each end is an upper bound
        outcomes.append(run.outcome(plan_round.fault))
        ended.append(time.monotonic())
    fault = injected.result()  # lifted: the servers are up, the disk has room
    injector.shutdown()
    recovered = whole_again(services)
    found = []
    for kind, outcome in zip(plan_round.kinds, outcomes):
        found.append(outcome_violations(outcome, plan_round.fault) + images_violations(kind, outcome))
    ids = [i for kind, outcome in zip(plan_round.kinds, outcomes) for i in run_ids(kind, outcome)]
    registry, champion = registry_violations(services)
    shared = (gang_violations(services, ids) + [f"flow run left unfinished: {r}" for r in unfinished_flow_runs()]
              + registry + leftover_violations(services, before))
    fault_row = fault.row() if fault else None
    if fault and not fault.skipped:
        fault_row["recovered_s"] = round(recovered - fault.began, 1)
    return [{"round": plan_round.number, "run": number, "kind": kind, "fault": fault_row, "state": outcome["state"],
             "seconds": round(end - run.began, 1), "error": outcome.get("error", "")[:300] or None,
             "images": images_seen(kind, outcome), "champion": champion, "violations": own + shared}
            for number, kind, run, outcome, end, own in zip(numbers, plan_round.kinds, runs, outcomes, ended, found)]


def summary(rows: list[dict[str, Any]], footprints: tuple[dict[str, Any], dict[str, Any]], started: float,
            services: Services) -> dict[str, Any]:
    """The soak in one line: runs, faults by kind, what broke, the slowest recovery per fault kind."""
    faults = {(r["round"], r["fault"]["kind"]): r["fault"] for r in rows if r["fault"]}
    injected = Counter(kind for (_, kind), f in faults.items() if not f.get("skipped"))
    slowest: dict[str, float] = defaultdict(float)
    for (_, kind), f in faults.items():
        slowest[kind] = max(slowest[kind], f.get("recovered_s", 0.0))
    return {
        "runs": len(rows), "rounds": len({r["round"] for r in rows}),
        "runs_by_kind": dict(Counter(r["kind"] for r in rows)), "states": dict(Counter(r["state"] for r in rows)),
        "faults": dict(injected), "faults_skipped": dict(Counter(k for (_, k), f in faults.items() if f.get("skipped"))),
        "violations": [{"round": r["round"], "run": r["run"], "kind": r["kind"],
                        "fault": (r["fault"] or {}).get("kind"), "violations": r["violations"]}
                       for r in rows if r["violations"]],
        "slowest_recovery_s_by_fault": dict(slowest),
        "slowest_run_s_by_kind": {k: max(r["seconds"] for r in rows if r["kind"] == k) for k in KINDS
                                  if any(r["kind"] == k for r in rows)},
        "server_starts": {"prefect": services.prefect.starts, "mlflow": services.mlflow.starts},
        "footprint_start": footprints[0], "footprint_end": footprints[1],
        "minutes": round((time.time() - started) / 60, 1), "load_average_end": os.getloadavg(),
    }


def soak_flows(args: argparse.Namespace) -> dict[str, Any]:
    """Every round on one set of services; prints a row per run, returns the summary."""
    quiet_dask()
    work = Path(tempfile.mkdtemp(prefix="bench-soak-flows-"))
    started = time.time()
    rows: list[dict[str, Any]] = []
    with services(work, args.workers) as shared:
        faults = [f for f in args.fault_kinds.split(",") if f]
        rounds = plan(args.runs, args.seed, args.fault_share, args.pair_share, faults, shared.disk_fault)
        print(json.dumps({"work": str(work), "api": shared.prefect.url, "scheduler": shared.cluster.scheduler_address,
                          "seed": args.seed, "disk_fault": shared.disk_fault, "load_average": os.getloadavg(),
                          "plan": [[r.kinds, r.fault] for r in rounds]}), flush=True)
        start_footprint = soak.footprint(shared.client)
        timing = random.Random(f"{args.seed}-injector")  # the injector's own draws: when, how long, whom
        for plan_round in rounds:
            if args.minutes and time.time() - started > args.minutes * 60:
                break  # out of time: the summary says how many of the planned rounds ran
            for row in run_round(shared, plan_round, len(rows) + 1, timing):
                print(json.dumps(row), flush=True)
                rows.append(row)
        result = summary(rows, (start_footprint, soak.footprint(shared.client)), started, shared)
        result["rounds_planned"] = len(rounds)
    if not result["violations"]:
        shutil.rmtree(work, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs in all, over every round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--fault-share", type=float, default=0.55, help="the share of rounds given a fault")
    parser.add_argument("--pair-share", type=float, default=0.35, help="the share of rounds of two runs at once")
    parser.add_argument("--fault-kinds", default=",".join(FAULTS), help="the faults to draw from, comma-separated")
    parser.add_argument("--minutes", type=float, help="start no round after this long (a loaded host runs slower)")
    # A flow run's own process (FlowProcess): it runs one flow and prints its outcome.
    parser.add_argument("--flow", choices=[k for k in KINDS if k != "gang"], help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--number", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flow:
        print(json.dumps(run_one_flow(args.flow, args.output, args.address, args.number), default=str), flush=True)
        return
    print(json.dumps(soak_flows(args)), flush=True)


if __name__ == "__main__":
    main()

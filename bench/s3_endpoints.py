"""The S3 servers a benchmark reads through, as child processes that count requests.

Both yield an `S3Endpoint`: its URL, its process (so its CPU time is not charged to the
client being measured, and can be reported apart) and a request counter by kind (GET,
HEAD, LIST). moto's counts come from its request log, which it writes anyway, so counting
costs it nothing; the latency front counts in memory and answers /__front__/stats.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import boto3
import psutil
import torch

from bench.s3_front import STATS_PATH, request_kind
from prefect_ddp.deployments.local_services import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    child_process,
    create_bucket,
    moto_s3_server,
)
from prefect_ddp.tasks.gang import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
# werkzeug's access log line, e.g. `"GET /bench/small/a.jpg HTTP/1.1" 200 -`
LOGGED_REQUEST = re.compile(r'"([A-Z]+) (\S+) HTTP/1\.[01]"')


@dataclass
class S3Endpoint:
    """A running S3 server: where to reach it, its process, and its requests so far."""

    name: str
    url: str
    process: psutil.Process
    counts: Callable[[], Counter[str]]

    def cpu_s(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system


def leave_to_front(cpus: list[int]) -> None:
    """Run this process, with the ranks and loader processes it starts after this, on the CPUs it
    may use but `cpus`, which the S3 front is then given (`front.process.cpu_affinity(cpus)`): on a
    GPU host the front would otherwise serve every GET from the cores that feed the GPU, and the
    benchmark would charge its own server to the flow. Call it before the flow sizes its loaders
    (they follow this process's CPU affinity)."""
    allowed = os.sched_getaffinity(0)
    rest = allowed - set(cpus)
    if not set(cpus) <= allowed or not rest:
        raise ValueError(f"--front-cpus {cpus}: give CPUs this process may run on ({sorted(allowed)}), "
                         "leaving it at least one.")
    os.sched_setaffinity(0, rest)
    torch.set_num_threads(len(rest))  # as a gang sets a rank's threads to its share, which its loaders follow


def child_running(marker: str) -> psutil.Process:
    """This process's child whose command line contains `marker` (a server it started)."""
    for child in psutil.Process().children():
        if any(marker in part for part in child.cmdline()):
            return child
    raise RuntimeError(f"No child process of {os.getpid()} runs {marker!r}.")


def moto_log_counts(log: Path) -> Counter[str]:
    """Requests moto logged, by kind, leaving out its own /moto-api/ calls."""
    found = LOGGED_REQUEST.findall(log.read_text(errors="replace"))
    return Counter(request_kind(method, target) for method, target in found
                   if not target.startswith("/moto-api"))


def upload_folder(endpoint: str, bucket: str, folder: Path) -> None:
    """Put every file below `folder` into a new `bucket`, keyed by its relative path."""
    create_bucket(endpoint, bucket)
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=MOTO_REGION, **MOTO_CREDENTIALS)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        s3.put_object(Bucket=bucket, Key=path.relative_to(folder).as_posix(), Body=path.read_bytes())


@contextmanager
def moto_endpoint(log_dir: Path, bucket: str, folder: Path) -> Iterator[S3Endpoint]:
    """moto's S3 server on loopback holding the files below `folder` in `bucket`."""
    with moto_s3_server(log_dir) as url:
        upload_folder(url, bucket, folder)
        yield S3Endpoint("moto", url, child_running("moto.server"),
                         lambda: moto_log_counts(log_dir / "moto.log"))


@contextmanager
def latency_endpoint(log_dir: Path, bucket: str, folder: Path | None, latency_ms: float,
                     synthetic: tuple[str, int, int] | None = None) -> Iterator[S3Endpoint]:
    """bench.s3_front on loopback serving the files below `folder` (or `synthetic`'s
    prefix, classes and keys per class), `latency_ms` per response."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    source = ["--synthetic", *map(str, synthetic)] if synthetic else ["--dir", str(folder)]
    args = [sys.executable, "-m", "bench.s3_front", *source, "--bucket", bucket,
            "--port", str(port), "--latency-ms", str(latency_ms)]
    # The front is started as a module: it must find bench/ wherever the script was run from.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    with child_process(args, url + STATS_PATH, log_dir / "s3_front.log", timeout_s=60, env=env):
        yield S3Endpoint(f"front +{latency_ms:g} ms", url, child_running("bench.s3_front"),
                         lambda: front_counts(url))


def front_counts(url: str) -> Counter[str]:
    with urllib.request.urlopen(url + STATS_PATH, timeout=10) as answer:
        return Counter(json.load(answer))

"""S3 clients side by side (issue 12): GETs/s and client CPU per GET, a batch fetched at once.

bench.data_path found that s3fs / aiobotocore spends about 1.2 ms of CPU per GET, 2.5x the
decode of a 64 px JPEG, so the data path's speed on small images is the client's.
docs/architecture.md, "Data: per-image reads", left the client to measurement. Each client
here fetches the same objects the way the dataset would: a batch of `--batch` keys, all in
flight at once, one GET per object, whole objects only. The contenders:

- **s3fs**: the project's way, `prefect_ddp.tasks.data.object_reads.fetch_objects` on an s3fs built with
  `object_read_options` (no HEAD, connection pool sized to the batch);
- **obstore async**: `obstore.get_async` + `bytes_async` for every key, gathered on one
  event loop (its Rust client, reqwest on tokio, does the HTTP and signing);
- **obstore threads**: the sync `obstore.get(...).bytes()` from a thread per key in flight;
- **s3torchconnector**: `S3Client.get_object(...).read()` (the client its S3MapDataset
  uses) from a thread per key in flight, at its default `throughput_target_gbps` (10),
  which caps the GETs it keeps in flight, and at 100 (a p4d/p5 node's NIC). Starting every reader's stream first and reading
  after does not overlap them: the binding's `get_object` stream waits for the response's
  headers (8 GETs through the front: 247 ms that way, 36 ms from 8 threads). `read()` with
  no size never asks for the object's size, so no HEAD is sent.

Endpoints: moto on loopback, and bench.s3_front, which waits `--latency-ms` (30) before
each response. The AWS CRT sends every GET with a Range header (its first part,
`bytes=0-8388607`, however small the object): S3 and moto answer 206 with the whole
object, bench.s3_front refuses ranges (501). So the front runs here as `RangedFront`,
which answers such a range as S3 does and is otherwise the same front. No setting of
s3torchconnector 1.5 turns the range off.

obstore and s3torchconnector are installed into bench/.cache/s3-clients on first use
(`pip install --no-deps --target`), never into the project's environment, like
dask-pytorch-ddp in bench.data_path. Figures per row: GETs/s over `--repeats` passes of all
objects (the best pass), requests the server saw per object, CPU ms per GET of this
process (every thread: the CRT's and tokio's work in threads of their own), and of the
server, which runs on the same cores.

    .venv/bin/python -m bench.s3_clients          # 2-3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import numpy as np
import psutil

from bench.data_path import (
    CACHE,
    PIP_TIMEOUT_S,
    Measurement,
    boto_environment,
    cpu_now,
    machine,
    write_files,
)
from bench.s3_endpoints import S3Endpoint, child_running, front_counts, moto_endpoint
from bench.s3_front import (
    REASONS,
    STATS_PATH,
    Front,
    StoredObject,
    load_objects,
    response,
    serve,
)
from prefect_ddp.deployments.local_services import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    child_process,
)
from prefect_ddp.deployments.sample_data import shapes_dataset
from prefect_ddp.tasks.data.object_reads import fetch_objects, object_read_options
from prefect_ddp.tasks.data.storage import filesystem
from prefect_ddp.tasks.gang import free_port

BUCKET = "bench"
REQUIREMENTS = ["obstore==0.12.1", "s3torchconnector==1.5.0", "s3torchconnectorclient==1.5.0"]
CLIENTS_TARGET = CACHE / "s3-clients"
LARGE_BYTES = 60_000  # a photo-sized JPEG (bench.data_path's 500x375 ones weigh about 88 KB)
RANGE = re.compile(r"bytes=(\d+)-(\d*)")
SERVE_FRONT = "--serve-ranged-front"

# The keys of one batch -> their bytes (or any buffer), in the same order.
Fetch = Callable[[list[str]], Sequence[bytes | memoryview]]


# --- the ranged front ----------------------------------------------------------------------

class RangedFront(Front):
    """bench.s3_front's Front, answering `Range: bytes=a-b` with 206 and that part, as S3 does."""

    wanted: tuple[int, int | None] | None = None

    def respond(self, method: str, target: str, headers: dict[str, str]) -> bytes:
        # One asyncio thread answers every request, so the range can wait in `self` for
        # `object_response`, which the base class calls without the headers.
        match = RANGE.fullmatch(headers.get("range", ""))
        self.wanted = (int(match[1]), int(match[2]) if match[2] else None) if match else None
        return super().respond(method, target, {name: value for name, value in headers.items() if name != "range"})

    def object_response(self, stored: StoredObject, method: str) -> bytes:
        if self.wanted is None or method != "GET":
            return super().object_response(stored, method)
        size = len(stored.data)
        first, last = self.wanted[0], size - 1 if self.wanted[1] is None else min(size - 1, self.wanted[1])
        return response(206, {"Content-Type": "binary/octet-stream", "ETag": stored.etag,
                              "Content-Range": f"bytes {first}-{last}/{size}"}, stored.data[first:last + 1])


def serve_ranged_front(argv: list[str]) -> None:
    """The child process's main: `--serve-ranged-front DIR PORT LATENCY_MS`."""
    folder, port, latency_ms = argv
    REASONS[206] = "Partial Content"  # the front's status lines know only the codes it sends
    front = RangedFront(BUCKET, load_objects(Path(folder)), float(latency_ms) / 1000)
    asyncio.run(serve(front, "127.0.0.1", int(port)))


@contextmanager
def ranged_front_endpoint(log_dir: Path, folder: Path, latency_ms: float) -> Iterator[S3Endpoint]:
    """`RangedFront` as a child process (its CPU is the server's, not the client's)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "bench.s3_clients", SERVE_FRONT, str(folder), str(port), str(latency_ms)]
    with child_process(args, url + STATS_PATH, log_dir / "ranged_front.log", timeout_s=60):
        yield S3Endpoint(f"front +{latency_ms:g} ms", url, child_running(SERVE_FRONT), lambda: front_counts(url))


# --- the clients ---------------------------------------------------------------------------

def install_clients(target: Path) -> str | None:
    """Put obstore and s3torchconnector on sys.path from `target`; or say why they cannot be.

    --no-deps: their dependencies (torch, typing-extensions) are in the project's venv
    already and must not move.
    """
    if not (target / "obstore").is_dir() or not (target / "s3torchconnectorclient").is_dir():
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                   *REQUIREMENTS]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"`pip install {' '.join(REQUIREMENTS)}` took over {PIP_TIMEOUT_S} s"
        if done.returncode:
            return f"`pip install {' '.join(REQUIREMENTS)}` failed: {(done.stderr or done.stdout).strip()[-300:]}"
    sys.path.insert(0, str(target))
    return None


def s3fs_client(endpoint: str, batch: int, stack: ExitStack) -> Fetch:
    url = f"s3://{BUCKET}"
    options = {"endpoint_url": endpoint, "key": MOTO_CREDENTIALS["aws_access_key_id"],
               "secret": MOTO_CREDENTIALS["aws_secret_access_key"], "client_kwargs": {"region_name": MOTO_REGION},
               "skip_instance_cache": True}  # a fresh client per endpoint, as a forked loader worker has
    fs, _ = filesystem(url, object_read_options(url, options, batch))

    def fetch(keys: list[str]) -> list[bytes]:
        paths = [f"{BUCKET}/{key}" for key in keys]
        got = fetch_objects(fs, paths, batch_size=batch)
        return [raise_error(got[path]) for path in paths]

    return fetch


def obstore_store(endpoint: str):  # noqa: ANN201 - obstore is importable only once installed
    from obstore.store import S3Store  # noqa: PLC0415

    return S3Store(BUCKET, endpoint=endpoint, region=MOTO_REGION,
                   access_key_id=MOTO_CREDENTIALS["aws_access_key_id"],
                   secret_access_key=MOTO_CREDENTIALS["aws_secret_access_key"],
                   client_options={"allow_http": True})  # loopback endpoints are plain HTTP


def obstore_async_client(endpoint: str, batch: int, stack: ExitStack) -> Fetch:
    import obstore  # noqa: PLC0415

    store = obstore_store(endpoint)
    loop = asyncio.new_event_loop()
    stack.callback(loop.close)

    async def one(key: str) -> memoryview:
        # obstore's Bytes is a buffer (no copy); PIL and io.BytesIO take it as it is.
        return memoryview(await (await obstore.get_async(store, key)).bytes_async())

    async def batch_of(keys: list[str]) -> list[memoryview]:
        return await asyncio.gather(*(one(key) for key in keys))

    return lambda keys: loop.run_until_complete(batch_of(keys))


def obstore_threads_client(endpoint: str, batch: int, stack: ExitStack) -> Fetch:
    import obstore  # noqa: PLC0415

    store = obstore_store(endpoint)
    return in_threads(lambda key: memoryview(obstore.get(store, key).bytes()), batch, stack)


def s3torchconnector_client(endpoint: str, batch: int, stack: ExitStack, gbps: float) -> Fetch:
    from s3torchconnector import S3ClientConfig  # noqa: PLC0415
    from s3torchconnector._s3client import S3Client  # noqa: PLC0415 - what S3MapDataset uses

    # Credentials come from the environment (`boto_environment`); path style, as the
    # endpoint is an address, not a bucket's host name. The CRT sizes its connection pool
    # from `throughput_target_gbps`: at the default 10 it kept about 16 GETs in flight here
    # (491 GETs/s of 32 at a time through the front), at 100 all 32 (886 GETs/s).
    config = S3ClientConfig(force_path_style=True, throughput_target_gbps=gbps)
    client = S3Client(MOTO_REGION, endpoint=endpoint, s3client_config=config)
    return in_threads(lambda key: client.get_object(BUCKET, key).read(), batch, stack)


def in_threads(one: Callable[[str], bytes | memoryview], batch: int, stack: ExitStack) -> Fetch:
    """Fetch a batch with `one` per key, each in a thread of its own: the GETs overlap."""
    pool = stack.enter_context(ThreadPoolExecutor(max_workers=batch))
    return lambda keys: list(pool.map(one, keys))


def raise_error(result: bytes | Exception) -> bytes:
    if isinstance(result, Exception):
        raise result
    return result


CLIENTS: dict[str, Callable[[str, int, ExitStack], Fetch]] = {
    "s3fs (fetch_objects)": s3fs_client,
    "obstore async": obstore_async_client,
    "obstore threads": obstore_threads_client,
    "s3torchconnector (10 Gbps target, its default)": partial(s3torchconnector_client, gbps=10),
    "s3torchconnector (100 Gbps target)": partial(s3torchconnector_client, gbps=100),
}


# --- measuring -----------------------------------------------------------------------------

@dataclass
class Row:
    objects: str
    client: str
    source: str
    result: Measurement


def timed_pass(fetch: Fetch, objects: dict[str, bytes], batch: int, server: S3Endpoint) -> Measurement:
    """Fetch every object, `batch` at a time; check each came back whole and in one GET."""
    keys = list(objects)
    me = [psutil.Process()]
    requests_before = server.counts()
    before = cpu_now(me, server)
    start = time.perf_counter()
    got = [data for first in range(0, len(keys), batch) for data in fetch(keys[first:first + batch])]
    seconds = time.perf_counter() - start
    client, served, busy = (now - then for now, then in zip(cpu_now(me, server), before))
    wrong = [key for key, data in zip(keys, got) if bytes(data) != objects[key]]
    if wrong:
        raise RuntimeError(f"{len(wrong)} objects came back different from what was stored, first {wrong[0]!r}")
    time.sleep(0.2)  # moto logs a request after answering it
    return Measurement(len(keys), seconds, client, busy - client - served, served, server.counts() - requests_before)


def measure(client: str, server: S3Endpoint, objects: dict[str, bytes], batch: int, repeats: int) -> Measurement:
    """The fastest of `repeats` passes, after a warm-up batch that opens the connections."""
    with ExitStack() as stack:
        stack.enter_context(boto_environment(server.url))
        fetch = CLIENTS[client](server.url, batch, stack)
        fetch(list(objects)[:batch])
        return max((timed_pass(fetch, objects, batch, server) for _ in range(repeats)),
                   key=lambda m: m.images_per_s)


def object_sets(count: int) -> dict[str, dict[str, bytes]]:
    """`count` 64 px JPEGs (about 1.2 KB) and `count` incompressible 60 KB objects, by key."""
    small = shapes_dataset(-(-count // 3), size=64)
    rng = np.random.default_rng(0)
    return {"64 px JPEG": {f"small/{key}": data for key, data in list(small.items())[:count]},
            "60 KB": {f"large/{n:05d}.bin": rng.bytes(LARGE_BYTES) for n in range(count)}}


def table(rows: list[Row]) -> str:
    columns = ["objects", "client", "source", "GETs/s", "x s3fs", "requests/object",
               "client CPU ms/GET", "server CPU ms/GET"]
    lines = [f"| {' | '.join(columns)} |", "|---" * len(columns) + "|"]
    for row in rows:
        m = row.result
        s3fs = next(r.result for r in rows if (r.objects, r.source) == (row.objects, row.source)
                    and r.client == next(iter(CLIENTS)))
        kinds = " + ".join(f"{kind} {n / m.images:.2f}" for kind, n in sorted(m.requests.items()))
        lines.append(f"| {row.objects} | {row.client} | {row.source} | {m.images_per_s:.0f}{'*' if m.disturbed else ''}"
                     f" | {m.images_per_s / s3fs.images_per_s:.2f} | {kinds} | "
                     f"{1000 * m.client_cpu_s / m.images:.2f} | {1000 * (m.server_cpu_s or 0) / m.images:.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=512, help="Objects of each size.")
    parser.add_argument("--batch", type=int, default=32, help="Objects fetched at once (a batch).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed passes per row; the fastest counts.")
    parser.add_argument("--latency-ms", type=float, default=30.0, help="The front's wait before each response.")
    parser.add_argument("--clients", nargs="+", choices=list(CLIENTS), default=list(CLIENTS),
                        help="Clients to measure; s3fs is always measured, as the baseline.")
    parser.add_argument("--no-moto", action="store_true", help="Only the latency front.")
    args = parser.parse_args(argv)
    if min(args.objects, args.batch, args.repeats) < 1:
        parser.error("--objects, --batch and --repeats must be at least 1.")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [SERVE_FRONT]:
        serve_ranged_front(argv[1:])
        return
    args = parse_args(argv)
    missing = install_clients(CLIENTS_TARGET)
    clients = [next(iter(CLIENTS))] + [name for name in args.clients if name != next(iter(CLIENTS))]
    if missing:
        clients = clients[:1]
    sets = object_sets(args.objects)
    load = os.getloadavg()
    started = time.perf_counter()
    rows = []
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-s3-clients-")))
        for objects in sets.values():
            write_files(work / "objects", objects)
        servers = [] if args.no_moto else [stack.enter_context(moto_endpoint(work, BUCKET, work / "objects"))]
        servers.append(stack.enter_context(ranged_front_endpoint(work, work / "objects", args.latency_ms)))
        for server in servers:
            for name, objects in sets.items():
                for client in clients:
                    rows.append(Row(name, client, server.name, measure(client, server, objects, args.batch,
                                                                       args.repeats)))
                    print(f"  {name}, {client} via {server.name}: {rows[-1].result.images_per_s:.0f} GETs/s",
                          file=sys.stderr, flush=True)
    report(args, rows, missing, load, time.perf_counter() - started)


def report(args: argparse.Namespace, rows: list[Row], missing: str | None, load: tuple[float, ...],
           seconds: float) -> None:
    """The run as markdown on stdout: when, where, the load on the shared machine, the table."""
    command = " ".join([os.path.relpath(sys.executable), "-m", "bench.s3_clients", *sys.argv[1:]])
    loads = [" ".join(f"{value:.2f}" for value in values) for values in (load, os.getloadavg())]
    noise = [r.result.other_cpu_s / r.result.seconds for r in rows if r.result.disturbed]
    lines = [f"# S3 clients, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             f"Machine: {machine()}; load average {loads[0]} at the start, {loads[1]} at the end",
             f"Command: {command}",
             f"{args.objects} objects of each size, {args.batch} in flight at once, best of {args.repeats} "
             f"passes; total run {seconds:.0f} s",
             *([f"Only s3fs measured: {missing}"] if missing else []), "", table(rows)]
    if noise:
        lines += ["", f"* {len(noise)} row(s) ran while other processes used up to {max(noise):.2f} cores."]
    print("\n".join(lines))


if __name__ == "__main__":
    main()

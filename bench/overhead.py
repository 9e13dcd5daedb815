"""Issue 12: what a gang in a Prefect flow on Dask costs over torchrun, for the same training.

The same 2-rank gloo training (bench/overhead_rank.py: resnet18 at 64 px, in-memory
synthetic tensors, 2 epochs) is launched, alternately:

- torchrun: `python -m torch.distributed.run --standalone --nproc_per_node 2 -m bench.overhead_rank`;
- flow: `python -m bench.overhead_flow`, a fresh process (as a user's flow file or a
  deployment's flow-run process is) running `run_gang` inside a Prefect flow on the
  2-worker LocalCluster a `DaskCluster` block makes, against a Prefect server started
  beforehand (as in production: the server is up before any flow runs). With
  `--warm-cluster` this process keeps that cluster warm, as `prefect-ddp worker` does for
  the runs it starts (blocks/warm_cluster.py), and each flow run uses it; each pair waits
  first until the warm cluster has replaced the workers the last flow run used (about 5 s
  of two cores' time), so that neither launch shares the machine with that.

Each rank records when its first step starts, when its last step ends, and its peak RSS;
the launcher records launch and return. Fixed cost = launch to first step + last step to
return; fixed cost = wall - loop. The flow also records when its imports end, its body
starts, its cluster is up, run_gang returns and the flow returns, to say where its fixed
cost goes. Run from the repository root:

    .venv/bin/python -m bench.overhead                  # 1 warm-up, then median of 3 pairs
    .venv/bin/python -m bench.overhead --no-check-stop  # gang ranks skip ctx.check_stop()
    .venv/bin/python -m bench.overhead --warm-cluster   # flows use a cluster this process keeps warm
    DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False .venv/bin/python -m bench.overhead  # no worker profiler
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.overhead_rank import RankTimes, TrainConfig
from prefect_ddp.blocks.cluster import DaskCluster
from prefect_ddp.blocks.warm_cluster import wait_until_free, warm_cluster
from prefect_ddp.deployments.local_services import prefect_server

WORLD_SIZE = 2
REPO = Path(__file__).resolve().parents[1]


@dataclass
class Launch:
    """One launch of the training: the launcher's clock, each rank's report, flow marks."""

    launcher: str
    started: float
    ended: float
    ranks: list[RankTimes]
    marks: dict[str, float] = field(default_factory=dict)  # flow only: body start, gang return

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    @property
    def startup_s(self) -> float:
        return min(r.first_step_start for r in self.ranks) - self.started

    @property
    def teardown_s(self) -> float:
        return self.ended - max(r.last_step_end for r in self.ranks)

    @property
    def loop_s(self) -> float:
        return max(r.loop_s for r in self.ranks)

    @property
    def fixed_s(self) -> float:
        return self.wall_s - self.loop_s

    @property
    def loop_cpu_s(self) -> float:
        return sum(r.loop_cpu_s for r in self.ranks)


def torchrun_once(config: TrainConfig, out: Path) -> Launch:
    """The training under torchrun; ranks write their times as JSON into `out`."""
    out.mkdir(parents=True)
    args = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD_SIZE),
        "-m", "bench.overhead_rank", "--out", str(out), "--config", json.dumps(asdict(config)),
    ]
    started = time.time()
    subprocess.run(args, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    ended = time.time()
    ranks = [RankTimes(**json.loads(path.read_text())) for path in sorted(out.glob("rank*.json"))]
    return Launch("torchrun", started, ended, ranks)


def flow_once(config: TrainConfig, out: Path) -> Launch:
    """The training as a gang in a flow run in a fresh process (bench/overhead_flow.py)."""
    out.mkdir(parents=True)
    args = [sys.executable, "-m", "bench.overhead_flow", "--out", str(out), "--config", json.dumps(asdict(config))]
    started = time.time()
    subprocess.run(args, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    ended = time.time()
    result = json.loads((out / "flow.json").read_text())
    return Launch("flow", started, ended, [RankTimes(**r) for r in result["ranks"]], result["marks"])


@contextmanager
def running_prefect_server(log_dir: Path) -> Iterator[str]:
    """A Prefect server that this process and the Dask workers it starts report to."""
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with prefect_server(log_dir, database=log_dir / "prefect.db") as api_url:
        os.environ["PREFECT_API_URL"] = api_url  # read by create_local_cluster for the workers
        with temporary_settings({PREFECT_API_URL: api_url}):
            try:
                yield api_url
            finally:
                APILogWorker.drain_all(timeout=5)  # before the server stops, not at exit when it is gone


def quiet_dask() -> None:
    """Dask's info logs (every worker's start and close) would bury the results."""
    # Workers are spawned and read their logging config from the environment they inherit.
    os.environ["DASK_LOGGING__DISTRIBUTED"] = "warning"
    logging.getLogger("distributed").setLevel(logging.WARNING)


def median_of(launches: list[Launch], value: str) -> float:
    return statistics.median(getattr(launch, value) for launch in launches)


def flow_breakdown(launches: list[Launch]) -> list[str]:
    """Where the flow's fixed cost goes, median seconds."""
    parts = {
        "launch -> imports done (interpreter, prefect, torch, the flow's module)":
            [l.marks["imported"] - l.started for l in launches],
        "imports done -> flow body starts (flow run created on the server)":
            [l.marks["body_start"] - l.marks["imported"] for l in launches],
        "flow body -> cluster up (a new cluster: scheduler, 2 workers that import torch; a warm one: connect)":
            [l.marks["cluster_ready"] - l.marks["body_start"] for l in launches],
        "cluster up -> first step (lease, probe, rank task runs, process group, model)":
            [min(r.first_step_start for r in l.ranks) - l.marks["cluster_ready"] for l in launches],
        "last step -> run_gang returns (rank results, final states)":
            [l.marks["gang_returned"] - max(r.last_step_end for r in l.ranks) for l in launches],
        "run_gang returns -> flow returns (cluster closed or warm workers named for replacement, flow run completed)":
            [l.marks["flow_returned"] - l.marks["gang_returned"] for l in launches],
        "flow returns -> process exits (Prefect's log and event workers drain)":
            [l.ended - l.marks["flow_returned"] for l in launches],
    }
    return [f"| {name} | {statistics.median(values):.2f} |" for name, values in parts.items()]


def report(pairs: list[tuple[Launch, Launch]]) -> str:
    """Markdown: medians per launcher, ratios per pair, peak RSS per rank, flow breakdown."""
    by = {"torchrun": [t for t, _ in pairs], "flow": [f for _, f in pairs]}
    values = ["wall_s", "fixed_s", "startup_s", "teardown_s", "loop_s", "loop_cpu_s"]
    rows = [
        f"| {name} | " + " | ".join(f"{median_of(launches, v):.2f}" for v in values) + " | "
        + ", ".join(f"{statistics.median(l.ranks[rank].peak_rss_mb for l in launches):.0f}" for rank in range(WORLD_SIZE))
        + " |"
        for name, launches in by.items()
    ]
    wall_ratios = [f.wall_s / t.wall_s for t, f in pairs]
    loop_ratios = [f.loop_s / t.loop_s for t, f in pairs]
    fixed_gaps = [f.fixed_s - t.fixed_s for t, f in pairs]
    threads = {name: sorted({r.threads for l in launches for r in l.ranks}) for name, launches in by.items()}
    warm = sorted({bool(f.marks.get("warm")) for _, f in pairs})
    return "\n".join([
        f"Median of {len(pairs)} pairs (torchrun then flow, alternately); torch threads per rank: {threads}; "
        f"flow runs on a warm cluster: {warm}.", "",
        "| launcher | wall s | fixed s | launch -> first step s | last step -> exit s | loop s | loop CPU s, ranks together | peak RSS MB per rank |",
        "|---|---|---|---|---|---|---|---|", *rows, "",
        f"- flow / torchrun wall: median {statistics.median(wall_ratios):.2f}x "
        f"(pairs: {', '.join(f'{r:.2f}' for r in wall_ratios)})",
        f"- flow's fixed cost - torchrun's: median {statistics.median(fixed_gaps):+.2f} s "
        f"(pairs: {', '.join(f'{g:+.2f}' for g in fixed_gaps)}); target <= +1.5 s",
        f"- loop in a Dask worker / torchrun loop: median {statistics.median(loop_ratios):.3f}x "
        f"(pairs: {', '.join(f'{r:.3f}' for r in loop_ratios)}); target <= 1.02x", "",
        "| flow fixed cost, median | s |", "|---|---|", *flow_breakdown(by["flow"]),
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmups", type=int, default=1, help="untimed pairs first (imports, first flow run)")
    parser.add_argument("--samples", type=int, default=TrainConfig.samples)
    parser.add_argument("--no-check-stop", action="store_true", help="gang ranks skip ctx.check_stop()")
    parser.add_argument("--warm-cluster", action="store_true", help="flows use a cluster this process keeps warm")
    args = parser.parse_args()
    config = TrainConfig(samples=args.samples, check_stop=not args.no_check_stop)
    quiet_dask()
    work = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    with running_prefect_server(work) as api_url, \
            warm_cluster(DaskCluster(n_workers=WORLD_SIZE)) if args.warm_cluster else nullcontext() as ticket:
        print(f"Prefect server at {api_url}; {config}; warm cluster: {ticket}", flush=True)
        pairs = []
        for number in range(args.warmups + args.repeats):
            # Both launches start on a settled machine: not while the warm cluster replaces the
            # workers the last flow run used (two processes importing torch, on these 2 cores).
            if ticket:
                wait_until_free(ticket)
            torchrun = torchrun_once(config, work / f"torchrun-{number}")
            pair = (torchrun, flow_once(config, work / f"flow-{number}"))
            print(f"pair {number}{' (warm-up)' if number < args.warmups else ''}: "
                  + ", ".join(f"{l.launcher} wall {l.wall_s:.1f} s loop {l.loop_s:.1f} s" for l in pair), flush=True)
            if number >= args.warmups:
                pairs.append(pair)
    print(report(pairs))


if __name__ == "__main__":
    main()

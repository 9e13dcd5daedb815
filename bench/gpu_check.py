"""The GPU check in one command (issue 45): the flow against the GPU's ceiling, bench.gpu's table and the
gpu-marked tests, in under 8 minutes.

A lent GPU machine gives a session 15 minutes, start-up included, so everything that needs
the GPU runs from one command, each part in a process group of its own under its own time
limit, and all of them under one budget (`--budget-s`, 8 minutes): a part that hangs is
killed (its loader workers and S3 front with it) and the next part still runs. It prints
each part's output as it comes, then a summary: every part's result and time, bench.gpu's
table and pytest's summary, at the end of the output where the device tool's tail shows them.

On the GPU machine, from the project's root, with `.gpu/` built here beforehand by
../shared/tools/gpu-bundle and carried with the checkout (the machine has Python 3.12 with
torch, torchvision and pytest, and reaches no package index):

    source .gpu/setup.sh && python -m bench.gpu_check

On a machine without a GPU, to check this script itself (tiny settings; the gpu tests are
collected and skip):

    .venv/bin/python -m bench.gpu_check --device cpu

Parts are `PARTS` below, in order; a further measurement is one more `Part` appended there.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 480  # 8 minutes of the GPU machine's 15; the rest is its start, set-up and a rerun
KILL_GRACE_S = 10


@dataclass(frozen=True)
class Part:
    """One step of the check: a command run with this Python, and what of its output to show again.

    `argv(device)` is the command after `python` for `--device cuda` (the measurement) or
    `cpu` (a check of the code with tiny settings); `limit_s` its own time limit, cut to
    what is left of the budget; `keep(output)` the lines the summary repeats."""

    name: str
    argv: Callable[[str], list[str]]
    limit_s: int
    keep: Callable[[str], str]


@dataclass
class Outcome:
    part: Part
    result: str  # "ok", "failed (exit N)", "timed out after N s", "not run: ..."
    seconds: float
    output: str


def front_apart() -> list[str]:
    """`--front-cpus` with an eighth of this host's CPUs (none below 4): the S3 front serves from cores the rank and its
    loaders do not use, so the flow is not charged for the benchmark's own server (bench.s3_endpoints)."""
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[-max(1, len(allowed) // 8):] if len(allowed) >= 4 else []
    return ["--front-cpus", *map(str, cpus)] if cpus else []


def bench_gpu_argv(device: str) -> list[str]:
    """bench.gpu's three rows: the synthetic ceiling, the bare loader, decoding on the device."""
    if device == "cuda":  # its defaults: ResNet-50, batch 128, 30 timed steps, 1,536 JPEGs; the front apart
        return ["-m", "bench.gpu", *front_apart()]
    # Two epochs of 3 batches: the warm-up and timed steps cross an epoch's start.
    return ["-m", "bench.gpu", "--device", "cpu", "--model", "mobilenet_v3_small", "--per-class", "4",
            "--steps", "2", "--batch-size", "4", "--workers", "1"]


def input_pipeline_argv(device: str) -> list[str]:
    """bench.input_pipeline's rows: the ceiling, the bare loader and the flow's recipe with its defaults."""
    if device == "cuda":
        # ResNet-50, 224 px, batch 128: 8 epochs of 15 steps and 3 of 100, inside the part's limit.
        return ["-m", "bench.input_pipeline", "--device", "cuda", "--short-epochs", "8", *front_apart()]
    return ["-m", "bench.input_pipeline", "--short-steps", "3", "--short-epochs", "2", "--long-steps", "0",
            "--batch-size", "4"]


def gpu_test_files() -> list[str]:
    """Every test file that marks a test `gpu` (pyproject's markers), found by its text so a new
    one is run without editing this list; collecting the whole suite would import test modules
    whose dependencies (a browser, MLflow, mypy) the GPU bundle leaves out."""
    return sorted(str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py")
                  if "pytest.mark.gpu" in path.read_text(encoding="utf-8"))


def gpu_tests_argv(device: str) -> list[str]:
    # One process (-n 0): a few tests, and one Prefect server and moto instead of one per xdist
    # worker. --timeout: one hung test fails alone, well inside the part's limit.
    return ["-m", "pytest", "-m", "gpu", "-n", "0", "--timeout", "100", "-p", "no:cacheprovider", "-q",
            "-rfEs", *gpu_test_files()]


def from_line(start: str) -> Callable[[str], str]:
    """The output from the last line that starts with `start`, or its last 20 lines."""
    def keep(output: str) -> str:
        lines = output.splitlines()
        found = [i for i, line in enumerate(lines) if line.startswith(start)]
        return "\n".join(lines[found[-1]:] if found else lines[-20:])
    return keep


def pytest_summary(output: str) -> str:
    """pytest's short summary (failures, errors, skips with their reasons) and its last line."""
    lines = output.splitlines()
    found = [i for i, line in enumerate(lines) if "short test summary info" in line]
    return "\n".join(lines[found[-1]:] if found else lines[-5:])


# The check's parts, run in this order, the flow's first (what issue 48 measures above all). Append
# a measurement here as one more Part; the budget keeps the whole check under 8 minutes.
PARTS: list[Part] = [
    Part("bench.input_pipeline: ceiling, bare loader, the flow with its defaults", input_pipeline_argv, 210,
         from_line("# The flow's input pipeline")),
    Part("bench.gpu: synthetic ceiling, bare loader, decoded on the device", bench_gpu_argv, 150,
         from_line("# GPU data path")),
    Part("gpu-marked tests", gpu_tests_argv, 120, pytest_summary),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda: the measurement, on the GPU machine; cpu: a check of this script with tiny settings.")
    parser.add_argument("--budget-s", type=int, default=BUDGET_S,
                        help="All parts together stop within this many seconds (default: 8 minutes).")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("prefect_ddp") is None:
        parser.error(f"prefect_ddp is not importable with {sys.executable}: on the GPU machine run "
                     "`source .gpu/setup.sh && python -m bench.gpu_check` (.gpu/ from ../shared/tools/gpu-bundle); "
                     "here, use .venv/bin/python.")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device cuda, but torch {torch.__version__} sees no CUDA device here; "
                         "use --device cpu to check this script on a machine without a GPU.")
    return args


def run_part(part: Part, device: str, limit_s: float) -> Outcome:
    """Runs one part in its own process group, echoing its output; kills the group at `limit_s`."""
    command = [sys.executable, *part.argv(device)]
    print(f"\n=== {part.name} (limit {limit_s:.0f} s): {' '.join(command)}", flush=True)
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               bufsize=1, start_new_session=True)
    lines: list[str] = []

    def echo() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            print(line, end="", flush=True)

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    try:
        code = process.wait(timeout=limit_s)
        result = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        stop_group(process)
        result = f"timed out after {limit_s:.0f} s (killed with its children)"
    reader.join(timeout=KILL_GRACE_S)
    return Outcome(part, result, time.monotonic() - started, "".join(lines))


def stop_group(process: subprocess.Popen[str]) -> None:
    """SIGTERM to the part's process group (the part, its loader workers, its S3 front), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def report(outcomes: list[Outcome], device: str, budget_s: int) -> None:
    print(f"\n# GPU check ({device}), budget {budget_s} s\n")
    print("| part | result | seconds |\n|---|---|---:|")
    for outcome in outcomes:
        print(f"| {outcome.part.name} | {outcome.result} | {outcome.seconds:.0f} |")
    for outcome in outcomes:
        if outcome.output:
            print(f"\n## {outcome.part.name}\n\n{outcome.part.keep(outcome.output)}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    outcomes = []
    for part in PARTS:
        left = deadline - time.monotonic()
        if left < 10:
            outcomes.append(Outcome(part, f"not run: the {args.budget_s} s budget was spent", 0.0, ""))
            continue
        outcomes.append(run_part(part, args.device, min(part.limit_s, left)))
    report(outcomes, args.device, args.budget_s)
    return 0 if all(outcome.result == "ok" for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

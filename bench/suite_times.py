"""Where the test suite's time goes: seconds per test file, written to tests/DURATIONS.md.

Runs the suite as the README's test command does (pytest's own options from pyproject,
two xdist workers on this 2-core machine) with a JUnit report, or reads a report an earlier
run wrote, and writes one table: per file, its tests, the seconds its tests took (set-up,
call and tear-down, summed), and its share. Under xdist the files' seconds add up to about
twice the wall time, since two files run at once; both are written down.

    .venv/bin/python -m bench.suite_times                  # run everything, then write the table
    .venv/bin/python -m bench.suite_times -m "not slow"    # other arguments go to pytest
    .venv/bin/python -m bench.suite_times --junit report.xml --wall 791 \\
        --about "the README's test command in a fresh clone of 760c000" --load "0.55 before the clone"
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TABLE = REPO / "tests" / "DURATIONS.md"


def test_file(classname: str) -> str:
    """The file of a JUnit test case: 'tests.sub.test_x.TestY' -> 'tests/sub/test_x.py'.

    The longest leading part of the dotted name that is a file of this repository; a case
    with no such part (a collection error) is named as it came.
    """
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (REPO / path).is_file():
            return path
    return classname or "(collection error)"


def per_file(junit: Path) -> dict[str, tuple[int, float]]:
    """(tests, seconds) per test file of a JUnit report, as pytest writes it."""
    files: dict[str, list[float]] = defaultdict(list)
    for case in ET.parse(junit).iter("testcase"):
        files[test_file(case.get("classname", ""))].append(float(case.get("time") or 0))
    return {name: (len(times), sum(times)) for name, times in files.items()}


def run_suite(pytest_args: list[str], junit: Path) -> tuple[float, int]:
    """Run pytest with a JUnit report; its wall seconds and exit code."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", f"--junitxml={junit}", *pytest_args], cwd=REPO)
    return time.monotonic() - started, done.returncode


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def table(files: dict[str, tuple[int, float]], wall_s: float, source: str, load: str) -> str:
    total = sum(seconds for _, seconds in files.values()) or 1.0  # a run stopped at collection took none
    rows = sorted(files.items(), key=lambda item: -item[1][1])
    lines = [
        "# Where the suite's time goes",
        "",
        f"Written by `bench/suite_times.py` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC from {source}.",
        f"Machine: {os.cpu_count()} cores ({platform.machine()}), load average {load}.",
        f"Wall time {wall_s / 60:.1f} min; the files' seconds add up to {total / 60:.1f} min (two xdist workers "
        "run two files at once, each file on one worker).",
        "",
        "| file | tests | seconds | share |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {count} | {seconds:.1f} | {seconds / total:.1%} |" for name, (count, seconds) in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, help="read this JUnit report instead of running the suite")
    parser.add_argument("--wall", type=float, help="with --junit: the run's wall seconds, as pytest printed them")
    parser.add_argument("--about", help="with --junit: the run that wrote the report, for the table's header")
    parser.add_argument("--load", help="with --junit: the load average around that run, as measured then")
    args, pytest_args = parser.parse_known_args()  # the rest goes to pytest
    if args.junit:
        if args.wall is None:
            parser.error("--junit needs --wall: the report does not hold the run's wall time")
        junit, wall_s, code = args.junit, args.wall, 0
        source = f"the JUnit report of {args.about or args.junit.name}"
        load = args.load or "not recorded with the report"
    else:
        if args.about or args.load:
            parser.error("--about and --load describe a report read with --junit; a run of the suite records its own")
        load = f"{load_average()} before the run"
        junit = Path(tempfile.mkdtemp(prefix="suite-times-")) / "junit.xml"
        wall_s, code = run_suite(pytest_args, junit)
        source = "`" + " ".join([".venv/bin/python -m pytest", *pytest_args]) + "`"
    TABLE.write_text(table(per_file(junit), wall_s, source, load))
    print(f"{TABLE.relative_to(REPO)}: {wall_s / 60:.1f} min, pytest exited {code}")
    return code


if __name__ == "__main__":
    raise SystemExit(main())

"""The package as a user installs it: a wheel, in a project that has its own `flows` and `tasks`.

Prefect projects very often hold `flows/` and `tasks/` packages of their own. The wheel
must own one top-level name, `prefect_ddp`, so that theirs never shadows ours (or ours
theirs). The import runs without `site` (`python -S`), so the editable install of this
checkout is not in the way: only the wheel's files and the dependencies are on the path.

The `gpu` extra must install with the README's constraints (`pip install -c constraints.txt
'.[gpu]'`): dask-cuda pins dask through rapids-dask-dependency, so a dask pin that moves alone
makes that command fail with ResolutionImpossible (docs/running.md, "Existing clusters, or a
GPU box"). pip resolves it here without installing anything, so no GPU is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds.
    source = folder / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "build", "*.egg-info", "__pycache__", "*-output", "outputs", "docs", "bench"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(folder), str(source)], check=True, capture_output=True, text=True)
    (built,) = folder.glob("prefect_ddp-*.whl")
    return built


def test_the_wheel_installs_one_top_level_name_and_no_dev_tooling(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert archive.read(top_level).decode().split() == ["prefect_ddp"]
        modules = [n for n in names if n.endswith(".py")]
        assert {n.split("/")[0] for n in modules} == {"prefect_ddp"}
        assert "prefect_ddp/tasks/gang/run.py" in modules and "prefect_ddp/flows/transfer_learning.py" in modules
        assert not [n for n in modules if b"playwright" in archive.read(n)]  # a dev extra: not installed
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "prefect-ddp = prefect_ddp.cli:main" in archive.read(entry_points).decode()


def test_a_users_own_flows_and_tasks_packages_do_not_shadow_ours(wheel, tmp_path):
    installed = tmp_path / "installed"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(installed),
                    str(wheel)], check=True, capture_output=True, text=True)
    project = tmp_path / "their-project"
    for package in ("flows", "tasks"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(f"OWNER = 'user {package}'\n")
    check = textwrap.dedent(f"""
        import prefect_ddp, tasks, flows
        from prefect_ddp import load_model, run_gang, transfer_learning
        from prefect_ddp.flows.sweep import hyperparameter_sweep
        assert prefect_ddp.__file__.startswith({str(installed)!r}), prefect_ddp.__file__
        assert tasks.OWNER == 'user tasks' and flows.OWNER == 'user flows'
        print(transfer_learning.name, hyperparameter_sweep.name, callable(load_model) and callable(run_gang))
    """)
    path = f"{installed}:{sysconfig.get_paths()['purelib']}:{sysconfig.get_paths()['platlib']}"
    done = subprocess.run([sys.executable, "-S", "-c", check], cwd=project, capture_output=True, text=True,
                          env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["transfer-learning", "hyperparameter-sweep", "True"]


def pins(constraints: Path) -> dict[str, str]:
    """`name==version` lines of a constraints file, names normalised as pip compares them."""
    found = {}
    for line in constraints.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("#")[0].strip().split("==")
            found[name.lower().replace("_", "-").replace(".", "-")] = version
    return found


# Not `unit` (a pip process) and not `slow`: it asks the package index, 30-80 s on this machine.
def test_the_gpu_extra_resolves_with_the_constraints(wheel, tmp_path):
    report = tmp_path / "report.json"
    # The wheel carries the same metadata as `.` (its `gpu` extra); resolving it builds nothing
    # in the checkout. --ignore-installed: resolve as a fresh venv would, not around what this
    # venv already holds. Not --quiet: pip names the conflicting requirements on stdout, at its
    # info level.
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
               "--report", str(report), "-c", str(ROOT / "constraints.txt"), f"{wheel}[gpu]"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    said = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith("WARNING: Location")]
    if done.returncode != 0:
        pytest.fail(
            f"pip could not resolve the gpu extra with constraints.txt (exit {done.returncode}); choose "
            "dask-cuda, rapids-dask-dependency and dask/distributed pins that agree (read the Requires-Dist "
            "of `pip download --no-deps dask-cuda==X rapids-dask-dependency==X`). pip said, at its end:\n"
            + "\n".join(said[-25:]), pytrace=False)
    chosen = {item["metadata"]["name"].lower().replace("_", "-").replace(".", "-"): item["metadata"]["version"]
              for item in json.loads(report.read_text())["install"]}
    pinned = pins(ROOT / "constraints.txt")
    for name in ("dask-cuda", "rapids-dask-dependency", "dask", "distributed"):
        assert name in chosen, f"the gpu extra did not bring {name}; it brought {sorted(chosen)}"
        assert chosen[name] == pinned.get(name), (
            f"{name} {chosen[name]} was chosen but constraints.txt pins {pinned.get(name)}: pin it there")

"""The package as a user installs it: a wheel, in a project that has its own `flows` and `tasks`.

Prefect projects very often hold `flows/` and `tasks/` packages of their own. The wheel
must own one top-level name, `prefect_ddp`, so that theirs never shadows ours (or ours
theirs). The import runs without `site` (`python -S`), so the editable install of this
checkout is not in the way: only the wheel's files and the dependencies are on the path.
"""

from __future__ import annotations

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

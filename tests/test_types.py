"""The type checker over the installed package, as a contributor's tools see it.

The README installs in setuptools' strict editable mode: a tree of links on `sys.path`
that static tools follow (docs/architecture.md, "Layout"). mypy runs as a child process
of this environment's Python, from a folder outside the repository, so it finds
`prefect_ddp` only where the install put it; its cache is kept in the repository's
`.mypy_cache`, so a second run checks only what changed.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

import prefect_ddp

REPOSITORY = Path(__file__).resolve().parents[1]
CHECK_TIMEOUT_S = 600


def mypy(arguments: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """mypy with the repository's configuration, run by this environment's Python from `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPOSITORY / "pyproject.toml"),
         "--cache-dir", str(REPOSITORY / ".mypy_cache"), *arguments],
        cwd=cwd, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)


def test_the_installed_package_type_checks_with_no_errors(tmp_path: Path) -> None:
    checked = mypy(["-p", "prefect_ddp"], tmp_path)
    assert checked.returncode == 0, f"mypy found errors (pyproject's [tool.mypy]):\n{checked.stdout}{checked.stderr}"
    assert "Success: no issues found" in checked.stdout


def test_a_project_name_resolves_to_its_real_type_not_any(tmp_path: Path) -> None:
    """With the default editable mode (an import hook that static tools never run), every name
    from the project was Any and mypy said "Cannot find implementation or library stub"."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text("from prefect_ddp.tasks.config import TrainingConfig\n"
                       "from prefect_ddp import run_gang\n"
                       "reveal_type(TrainingConfig())\n"
                       "reveal_type(TrainingConfig().epochs)\n"
                       "reveal_type(run_gang)\n"
                       "TrainingConfig().no_such_field\n"
                       "from prefect_ddp import run_gangg\n")
    checked = mypy([str(snippet)], tmp_path)
    output = checked.stdout
    assert 'Revealed type is "prefect_ddp.tasks.config.TrainingConfig"' in output, output
    assert re.search(r'Revealed type is "(builtins\.)?int"', output), output
    # the public name (imported on first use at run time): its signature, not Any
    assert "(train_fn: def (prefect_ddp.tasks.gang.context.RankContext" in output, output
    assert 'Revealed type is "Any"' not in output, output
    assert '"TrainingConfig" has no attribute "no_such_field"' in output, output
    assert 'Module "prefect_ddp" has no attribute "run_gangg"' in output, output  # not Any
    assert "Cannot find implementation or library stub" not in output, output


@pytest.mark.unit
def test_the_public_names_static_tools_see_are_the_ones_python_imports() -> None:
    """prefect_ddp imports its public names on first use (`_HOMES`); its `if TYPE_CHECKING:`
    imports are what editors and mypy see. A name added to one and not the other would be
    Any to the checker, or missing at run time."""
    tree = ast.parse(Path(prefect_ddp.__file__).read_text())
    checked = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    static = {(node.module, alias.asname or alias.name) for node in checked.body if isinstance(node, ast.ImportFrom)
              for alias in node.names}
    assert static == {(module, name) for name, module in prefect_ddp._HOMES.items()}


# A user's script after the README's install, as their editor checks it: every public config
# and block built with only some fields, secrets as the docs write them (docs/running.md).
USER_SCRIPT = '''
from pydantic import SecretStr

from prefect_ddp import (ClusterConfig, DaskCluster, DataConfig, DataLocation, Dimension, MlflowTracking, ModelConfig,
                         OutputConfig, StudyStorage, SweepSettings, TrackingConfig, TrainingConfig)

epochs: int = TrainingConfig().epochs + TrainingConfig(epochs=3).epochs
data = DataConfig(url="s3://bucket/images", val_fraction=0.25)
model = ModelConfig(backbone="resnet18")
cluster = ClusterConfig(n_workers=2)
output = OutputConfig(url="s3://bucket/out")
tracking = TrackingConfig()
sweep = SweepSettings(n_trials=4)
location = DataLocation(url="s3://bucket/images", aws_access_key_id="AKIA...", aws_secret_access_key=SecretStr("..."))
dask = DaskCluster(n_workers=2)
mlflow = MlflowTracking(tracking_uri="http://127.0.0.1:5000")
study = StudyStorage(url=SecretStr("postgresql://user:password@host/db"))
lr = Dimension(kind="log_uniform", low=1e-4, high=1e-1)
'''


def test_a_users_script_type_checks_with_plain_mypy_and_no_pydantic_plugin(tmp_path: Path) -> None:
    """Issue 47: `TrainingConfig().epochs` read as `Missing named argument "epochs"` to a checker
    that follows PEP 681 without pydantic's plugin (mypy alone, pyright): a positional default in
    `Field(10, ...)` is not one it sees; `Field(default=10, ...)` is."""
    (tmp_path / "user_script.py").write_text(USER_SCRIPT)
    checked = subprocess.run(  # no configuration file: the folder is the user's, outside the repository
        [sys.executable, "-m", "mypy", "--cache-dir", str(REPOSITORY / ".mypy_cache" / "plain"), "user_script.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "Success: no issues found in 1 source file" in checked.stdout

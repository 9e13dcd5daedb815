"""Every code block of README.md and docs/ runs as written, or says it is a template (issue 57).

A block is `python`, `bash` or `text` (a diagram, a transcript). A code block whose first line
is `# template: ...` names what the reader replaces, and is not run. Otherwise:

- `python` blocks run as a script, `python block.py` in a folder of their own (no main guard:
  that is how a reader runs them), against the session's Prefect server and Dask cluster. The
  one placeholder they may hold is the scheduler's address (`HOSTS`).
- `bash` blocks are commands a reader types: each program and subcommand must exist and take
  every option the line gives (its `--help`), and each `prefect deployment run` must name a
  deployment of prefect.yaml with parameters its flow accepts. The servers and workers they start
  (`prefect server start`, `prefect-ddp worker`, `dask worker`) run for real in
  tests/test_deployments.py, tests/test_cli.py and tests/test_external_cluster.py.
- The README's two commands are the ones CI runs (tests/test_docs.py, .ci/run).

The claims that drifted before are read from one place here: the suite's time
(tests/DURATIONS.md), pytest's options (pyproject.toml) and the CLI's commands (cli.py).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from prefect import Flow

from prefect_ddp.cli import COMMANDS
from prefect_ddp.tasks.sweeps.settings import SweepSettings
from tests.conftest import DOCS_BLOCK
from tests.test_docs import TWO_COMMANDS

REPOSITORY = Path(__file__).resolve().parents[1]
PAGES = [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]
# A fence may be indented (a block inside a list item); its text is dedented by the same.
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
TEMPLATE = "# template:"
LANGUAGES = {"python", "bash", "text"}
BLOCK_TIMEOUT_S = 300
HELP_TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    text: str

    @property
    def name(self) -> str:
        page = self.page.relative_to(REPOSITORY) if self.page.is_relative_to(REPOSITORY) else self.page.name
        return f"{page}:{self.line}"

    @property
    def kind(self) -> str:
        """text, ci (the README's two commands), template, or the language it runs in."""
        if self.language == "text":
            return "text"
        if self.text.splitlines() == TWO_COMMANDS:
            return "ci"
        if self.text.startswith(TEMPLATE):
            return "template"
        return self.language


def blocks(pages: list[Path] = PAGES) -> list[Block]:
    found = []
    for page in pages:
        markdown = page.read_text(encoding="utf-8")
        for match in FENCE.finditer(markdown):
            indent, language, text = match.groups()
            text = "".join(line.removeprefix(indent) for line in text.splitlines(keepends=True))
            found.append(Block(page, markdown.count("\n", 0, match.start()) + 1, language, text))
    return found


def of_kind(kind: str) -> list[Block]:
    return [block for block in blocks() if block.kind == kind]


@pytest.mark.unit
def test_every_block_says_its_language_and_every_template_what_to_replace(record_property):
    assert len(blocks()) >= 20, "the fence pattern found too few blocks"
    untyped = [block.name for block in blocks() if block.language not in LANGUAGES]
    assert not untyped, f"blocks without python, bash or text after their fence: {untyped}"
    vague = [block.name for block in of_kind("template") if len(block.text.splitlines()[0]) < len(TEMPLATE) + 10]
    assert not vague, f"templates that do not say what to replace: {vague}"
    for block in of_kind("template") + of_kind("ci") + of_kind("text"):
        record_property(DOCS_BLOCK, f"{block.name}: {block.kind}, not run here")


def command_lines(text: str) -> list[list[str]]:
    """A bash block's commands, continued and quoted lines joined, comments and `export`s left out."""
    commands, pending = [], ""
    for line in text.replace("\\\n", " ").splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        pending = ""
        while words and re.fullmatch(r"\w+=.*", words[0]):  # VAR=value before a command
            words = words[1:]
        if words and words[0] != "export":
            commands.append(words)
    assert not pending, f"a quote is never closed in:\n{text}"
    return commands


def program_and_subcommand(words: list[str]) -> tuple[list[str], list[str]]:
    """(the command that takes --help, the options the line gives it)."""
    program = Path(words[0]).name
    rest = [word for word in words[1:] if word != "--no-prompt"]  # prefect's own option, before the subcommand
    positional = [word for word in rest if not word.startswith("-")]
    depth = {"prefect": 2, "prefect-ddp": 1, "dask": 1}.get(program, 0)
    options = sorted({word.split("=")[0] for word in rest if re.match(r"--?[A-Za-z]", word)})
    return [program, *positional[:depth]], options


def deployment_parameters() -> dict[str, tuple[Flow, dict]]:
    """prefect.yaml's deployments: 'flow-name/deployment' -> (its flow, its parameters)."""
    config = yaml.safe_load((REPOSITORY / "prefect.yaml").read_text())
    found = {}
    for deployment in config["deployments"]:
        module, function = deployment["entrypoint"].split(":")
        flow_object = getattr(importlib.import_module(module), function)
        found[f"{flow_object.name}/{deployment['name']}"] = (flow_object, deployment.get("parameters") or {})
    return found


def cli_value(text: str):
    """A `--param` value as Prefect's CLI reads it: JSON where it parses, else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parameter_options(words: list[str]) -> list[tuple[str, str]]:
    """(`--param` or `--params`, its value) for each `--param X`, `--param=X`, `-p X`, `-pX`,
    `--params X` and `--params=X` of a command line."""
    found = []
    for index, word in enumerate(words):
        for flag, spellings in (("--param", ("--param", "-p")), ("--params", ("--params",))):
            for spelling in spellings:
                if word == spelling and index + 1 < len(words):
                    found.append((flag, words[index + 1]))
                elif word.startswith(spelling + "=") or (spelling == "-p" and word.startswith("-p")
                                                          and len(word) > 2 and word[2] != "="):
                    found.append((flag, word[len(spelling):].removeprefix("=")))
    return found


def check_deployment_run(words: list[str], deployments: dict[str, tuple[Flow, dict]]) -> None:
    """The deployment exists, and its flow takes its parameters with the line's over them."""
    name = words[3]
    assert name in deployments, f"{name} is no deployment of prefect.yaml: {sorted(deployments)}"
    flow_object, parameters = deployments[name]
    given = dict(parameters)
    for flag, value in parameter_options(words):
        if flag == "--params":
            given.update(json.loads(value))
        else:
            key, _, text = value.partition("=")
            given[key] = cli_value(text)
    flow_object.validate_parameters(given)


def bash_failures(bash_blocks: list[Block], env: dict[str, str]) -> list[str]:
    """What is wrong with the commands of `bash_blocks`: a deployment or parameter prefect.yaml's
    flows refuse, a program or subcommand without `--help`, an option its help does not name."""
    failures = []
    deployments = deployment_parameters()
    helps: dict[tuple[str, ...], set[str]] = {}
    for block in bash_blocks:
        for words in command_lines(block.text):
            if words[:3] == ["prefect", "deployment", "run"]:
                try:
                    check_deployment_run(words, deployments)
                except Exception as exc:
                    failures.append(f"{block.name}: {' '.join(words[:4])}: {exc}")
            command, options = program_and_subcommand(words)
            helps.setdefault(tuple(command), set()).update(options)
    bin_dir = Path(sys.executable).parent
    started = {command: subprocess.Popen([str(bin_dir / command[0]), *command[1:], "--help"], env=env, text=True,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for command in helps}
    for command, process in started.items():
        output, _ = process.communicate(timeout=HELP_TIMEOUT_S)
        if process.returncode != 0:
            failures.append(f"{' '.join(command)} --help exited {process.returncode}: {output[-1000:]}")
            continue
        missing = [option for option in helps[command]
                   if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", output)]
        if missing:
            failures.append(f"{' '.join(command)} takes no {missing}")
    return failures


def python_failures(python_blocks: list[Block], folder: Path, env: dict[str, str],
                    hosts: dict[str, str]) -> dict[str, str]:
    """Run each block as `python block.py` in a folder of its own, all at once; the output of each
    that failed, by block."""
    running = {}
    for number, block in enumerate(python_blocks):
        (folder / str(number)).mkdir()
        text = block.text
        for placeholder, address in hosts.items():
            text = text.replace(placeholder, address)
        (folder / str(number) / "block.py").write_text(text)
        running[block.name] = subprocess.Popen([sys.executable, "block.py"], cwd=folder / str(number), env=env,
                                               text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    failures = {}
    for name, process in running.items():
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT_S)
        if process.returncode != 0:
            failures[name] = f"exited {process.returncode}:\n{output[-3000:]}"
    return failures


def cli_environment(prefect_api: str) -> dict[str, str]:
    return dict(os.environ, PREFECT_API_URL=prefect_api, COLUMNS="300", NO_COLOR="1")


def test_every_command_of_a_bash_block_exists_and_takes_its_options(prefect_api, record_property):
    assert of_kind("bash"), "no bash block found"
    failures = bash_failures(of_kind("bash"), cli_environment(prefect_api))
    assert not failures, "\n".join(failures)
    for block in of_kind("bash"):
        record_property(DOCS_BLOCK, f"{block.name}: bash, each command checked against its --help and prefect.yaml")


def test_every_python_block_runs_as_a_script(prefect_api, dask_cluster, tmp_path, record_property):
    ran = of_kind("python")
    assert len(ran) >= 4, f"too few python blocks run: {[block.name for block in ran]}"
    failures = python_failures(ran, tmp_path, cli_environment(prefect_api),
                               {"tcp://scheduler:8786": dask_cluster.scheduler_address})
    assert not failures, "\n".join(f"{name} {output}" for name, output in failures.items())
    for block in ran:
        record_property(DOCS_BLOCK, f"{block.name}: python, ran as a script")


def test_a_page_whose_blocks_break_fails_the_checks(prefect_api, tmp_path):
    page = tmp_path / "broken.md"
    page.write_text("""```python
def train(ctx, config):
    return {"loss": loss}

print(train(None, {}))
```

```bash
prefect deployment run transfer-learning/on-demand --param training='{"epoch": 2}'
prefect deployment run transfer-learning/nowhere
prefect-ddp worker --pools ddp-pool
prefect-ddp work --pool ddp-pool
prefect deployment run transfer-learning/on-demand -p epochz=3
prefect deployment run transfer-learning/on-demand --params '{"lrate": 0.1}'
prefect deployment run transfer-learning/on-demand --param=epocha=3 --params='{"lrateb": 0.1}'
dask worker -z tcp://scheduler:8786
```

- in a list item:

  ```python
  print(undefined_in_a_list)
  ```
""")
    python, bash, indented = blocks([page])
    failures = python_failures([python, indented], tmp_path, cli_environment(prefect_api), {})
    assert "NameError: name 'loss' is not defined" in failures[f"{page.name}:1"]
    assert "NameError: name 'undefined_in_a_list'" in failures[f"{page.name}:{indented.line}"]
    found = "\n".join(bash_failures([bash], cli_environment(prefect_api)))
    assert "transfer-learning/on-demand: " in found and "epoch" in found
    assert "transfer-learning/nowhere is no deployment of prefect.yaml" in found
    assert "prefect-ddp worker takes no ['--pools']" in found
    assert "prefect-ddp work --help exited" in found
    assert all(name in found for name in ("epochz", "lrate", "epocha", "lrateb"))
    assert "dask worker takes no ['-z']" in found


def suite_minutes() -> int:
    """The suite's wall time as tests/DURATIONS.md records it, in whole minutes up."""
    wall = re.search(r"Wall time ([\d.]+) min", (REPOSITORY / "tests" / "DURATIONS.md").read_text())
    assert wall, "tests/DURATIONS.md names no wall time"
    return math.ceil(float(wall.group(1)))


@pytest.mark.unit
def test_the_pages_say_the_suite_s_time_options_and_commands_as_the_repository_has_them():
    minutes = suite_minutes()
    addopts = " ".join(tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
                       ["addopts"])
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for said in re.findall(r"about (\d+) minutes on 2 cores", text):
            assert int(said) == minutes, f"{page.name} says the suite takes {said} minutes; tests/DURATIONS.md: {minutes}"
        for said in re.findall(r"pyproject's `addopts`: `([^`]*)`", text):
            assert said == addopts, f"{page.name} gives addopts `{said}`; pyproject.toml: `{addopts}`"
    commands = "\\|".join(COMMANDS)  # a | inside a table cell is escaped
    assert f"`prefect-ddp {commands}`" in (REPOSITORY / "docs" / "architecture.md").read_text(), (
        f"docs/architecture.md's layout names other commands than cli.py's {list(COMMANDS)}")
    sweeps = (REPOSITORY / "docs" / "sweeps.md").read_text()
    unnamed = [name for name in SweepSettings.model_fields if f"`{name}`" not in sweeps]
    assert not unnamed, f"docs/sweeps.md's settings list leaves out {unnamed}"

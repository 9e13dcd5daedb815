"""The import layers of docs/architecture.md, read from the source: they point one way.

Each module of the installed package belongs to a layer by its folder; a layer may import
only the layers named for it in ALLOWED. Besides: every project import is spelled
`prefect_ddp.…` (one installed name), sits at the top of its module (no import hidden in
a function to dodge a cycle), code outside the gang enters it through its front door
(`prefect_ddp.tasks.gang`), and no modules import each other, directly or round a loop.
The checks are plain functions, each also run on a graph made to break it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
# pyproject's package-dir: folder -> installed name
PACKAGES = {"src/prefect_ddp": "prefect_ddp", "tasks": "prefect_ddp.tasks", "flows": "prefect_ddp.flows",
            "blocks": "prefect_ddp.blocks", "deployments": "prefect_ddp.deployments"}
FOUNDATION = "foundation"  # modules directly in tasks/: settings and helpers every layer may use
GANG = "prefect_ddp.tasks.gang"
ALLOWED = {
    FOUNDATION: {FOUNDATION},
    "gang": {FOUNDATION, "gang"},
    "data": {FOUNDATION, "gang", "data"},
    "training": {FOUNDATION, "gang", "data", "training"},
    "results": {FOUNDATION, "data", "training", "results"},
    "blocks": {FOUNDATION, "blocks"},
    "sweeps": {FOUNDATION, "gang", "data", "training", "results", "blocks", "sweeps"},
    "prediction": {FOUNDATION, "gang", "data", "training", "results", "prediction"},
    "flows": {FOUNDATION, "gang", "data", "training", "results", "blocks", "sweeps", "prediction", "flows"},
    "deployments": {FOUNDATION, "gang", "data", "training", "results", "blocks", "sweeps", "prediction", "flows",
                    "deployments"},
    # prefect_ddp/: the public names, imported lazily by name, and the CLI; and the one foundation
    # module that acts on import, so that a script's Dask workers never run its call again (tasks/script_main.py)
    "package": {FOUNDATION},
}
BARE_NAMES = ("tasks", "flows", "blocks", "deployments")


def layer_of(module: str) -> str:
    parts = module.split(".")
    if parts[:2] != ["prefect_ddp", "tasks"]:
        return parts[1] if len(parts) > 1 and parts[1] in ALLOWED else "package"
    if len(parts) > 3 or (len(parts) == 3 and parts[2] in ALLOWED):
        return parts[2]
    return FOUNDATION


def source_modules() -> dict[str, Path]:
    """Installed module name -> its file, for every module of the package."""
    modules = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT / folder).with_suffix("").parts
            parts = [name, *relative]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


class Import:
    def __init__(self, module: str, names: tuple[str, ...], line: int, top_level: bool) -> None:
        self.module, self.names, self.line, self.top_level = module, names, line, top_level


def imports_of(path: Path) -> list[Import]:
    """Every project import in `path` (also those in functions), as written; not those under a
    top-level `if TYPE_CHECKING:`, which only type checkers read (src/prefect_ddp/__init__.py's)."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    type_only = {id(node) for block in tree.body
                 if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
                 for statement in block.body for node in ast.walk(statement)}  # its `else:` runs
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(Import(node.module, tuple(a.name for a in node.names), node.lineno, id(node) in top))
        elif isinstance(node, ast.Import):
            found += [Import(a.name, (), node.lineno, id(node) in top) for a in node.names]
    return [i for i in found if i.module.split(".")[0] in ("prefect_ddp", *BARE_NAMES)]


def import_graph(modules: dict[str, Path]) -> dict[str, list[tuple[str, Import]]]:
    """module -> the project modules it imports (a `from package import submodule` counts the submodule)."""
    graph = {}
    for module, path in modules.items():
        edges = []
        for imp in imports_of(path):
            targets = [f"{imp.module}.{name}" for name in imp.names if f"{imp.module}.{name}" in modules]
            edges += [(target, imp) for target in targets or [imp.module]]
        graph[module] = edges
    return graph


def layer_violations(graph: dict[str, list[tuple[str, Import]]]) -> list[str]:
    found = []
    for module, edges in graph.items():
        for target, imp in edges:
            if target.split(".")[0] in BARE_NAMES:
                found.append(f"{module}:{imp.line} imports {target!r}: spell it prefect_ddp.{target}")
            elif not imp.top_level:
                found.append(f"{module}:{imp.line} imports {target} inside a function: move it to the top")
            elif layer_of(target) not in ALLOWED[layer_of(module)] | {layer_of(module)}:
                found.append(f"{module}:{imp.line} ({layer_of(module)}) imports {target} ({layer_of(target)})")
            elif layer_of(target) == "gang" and layer_of(module) != "gang" and target != GANG:
                found.append(f"{module}:{imp.line} imports {target}: use the gang's front door, {GANG}")
    return found


def cycles(graph: dict[str, list[tuple[str, Import]]]) -> list[list[str]]:
    """Groups of modules that reach each other by imports (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target, _ in graph.get(module, []):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1 or any(t == module for t, _ in graph[module]):
                groups.append(sorted(group))

    for module in graph:
        if module not in index:
            visit(module)
    return groups


def test_every_module_imports_only_the_layers_below_it():
    assert layer_violations(import_graph(source_modules())) == []


def test_no_modules_import_each_other():
    assert cycles(import_graph(source_modules())) == []


def test_the_layers_are_what_the_architecture_says():
    modules = source_modules()
    assert {layer_of(m) for m in modules} == set(ALLOWED)
    assert layer_of("prefect_ddp.tasks.gang.rank") == "gang" and layer_of(GANG) == "gang"
    assert layer_of("prefect_ddp.tasks.urls") == FOUNDATION
    assert layer_of("prefect_ddp.tasks.training.recipe") == "training"
    assert "prefect_ddp.tasks.gang.process_group" in modules  # the checks read the real tree


def test_nothing_in_the_checkout_imports_the_folders_by_their_bare_names():
    """`import tasks` from the repository root would load a second copy of every module."""
    offenders = [f"{path.relative_to(ROOT)}:{imp.line}: {imp.module}"
                 for folder in (*PACKAGES, "tests", "bench", "examples")
                 for path in (ROOT / folder).rglob("*.py")
                 for imp in imports_of(path) if imp.module.split(".")[0] in BARE_NAMES]
    assert offenders == []


def edge(module: str, *names: str, top_level: bool = True) -> Import:
    return Import(module, names, 1, top_level)


@pytest.mark.parametrize("module, target, problem", [
    ("prefect_ddp.tasks.gang.run", "prefect_ddp.tasks.training.recipe", "(gang) imports prefect_ddp.tasks.training.recipe"),
    ("prefect_ddp.tasks.gang.run", "prefect_ddp.blocks.cluster", "(gang) imports prefect_ddp.blocks.cluster"),
    ("prefect_ddp.tasks.gang.run", "prefect_ddp.flows.transfer_learning", "(gang) imports prefect_ddp.flows"),
    ("prefect_ddp.blocks.cluster", "prefect_ddp.tasks.gang", "(blocks) imports prefect_ddp.tasks.gang"),
    ("prefect_ddp.tasks.training.recipe", "prefect_ddp.tasks.gang.rank", "use the gang's front door"),
    ("prefect_ddp.flows.sweep", "tasks.config", "spell it prefect_ddp.tasks.config"),
])
def test_the_layer_check_finds_an_import_that_points_the_wrong_way(module, target, problem):
    found = layer_violations({module: [(target, edge(target))]})
    assert len(found) == 1 and problem in found[0]


def test_the_layer_check_finds_an_import_hidden_in_a_function():
    found = layer_violations({"prefect_ddp.tasks.sweeps.sweep": [
        ("prefect_ddp.tasks.sweeps.sweep_report", edge("prefect_ddp.tasks.sweeps.sweep_report", top_level=False))]})
    assert len(found) == 1 and "inside a function" in found[0]


def test_imports_for_type_checkers_only_are_not_counted_but_their_else_and_a_function_s_are(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("from typing import TYPE_CHECKING\n"
                      "if TYPE_CHECKING:\n    from prefect_ddp.flows.sweep import hyperparameter_sweep\n"
                      "else:\n    from prefect_ddp.flows.batch_predict import batch_predict\n"
                      "def later():\n    from prefect_ddp.tasks.urls import join\n")
    assert sorted((imp.module, imp.top_level) for imp in imports_of(module)) == [
        ("prefect_ddp.flows.batch_predict", False), ("prefect_ddp.tasks.urls", False)]


def test_the_cycle_check_finds_two_modules_that_import_each_other_and_longer_loops():
    a, b, c = "prefect_ddp.tasks.sweeps.sweep", "prefect_ddp.tasks.sweeps.sweep_report", "prefect_ddp.tasks.urls"
    assert cycles({a: [(b, edge(b))], b: [(a, edge(a))], c: []}) == [sorted([a, b])]
    assert cycles({a: [(b, edge(b))], b: [(c, edge(c))], c: [(a, edge(a))]}) == [sorted([a, b, c])]
    assert cycles({a: [(b, edge(b))], b: [(c, edge(c))], c: []}) == []

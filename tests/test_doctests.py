"""The examples in the package's docstrings (and the benches') run, so none of them goes stale.

Each module's `>>>` examples are one parametrised test; `prefect_ddp.__main__` is left out
(importing it runs the CLI).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import prefect_ddp

pytestmark = pytest.mark.unit

MODULES = sorted(info.name for info in pkgutil.walk_packages(prefect_ddp.__path__, "prefect_ddp.")
                 if not info.name.endswith("__main__")) + ["bench.digits"]


def test_the_modules_are_found() -> None:
    assert {"prefect_ddp.tasks.config", "prefect_ddp.tasks.gang.plan", "prefect_ddp.tasks.data.dataset"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(importlib.import_module(name)):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples in {name} failed (printed above)"

"""A script that calls a flow without `if __name__ == "__main__":` runs as written: Dask workers
it starts do not run it again.

A worker process that Python starts by spawn or from a forkserver first re-imports the script
that started it (as `__mp_main__`), as multiprocessing does for every such child. A script
whose top level calls `batch_predict`, `transfer_learning`, `sweep` or `run_gang` without the
guard then ran that call again in every worker: each started a flow run and a cluster of its
own, which multiprocessing refuses while a child is still starting, so every nanny failed and the
script waited for workers that never came (docs/deployments.md, "Runs from a plain script").
Code piped on stdin failed at once: there is no file `<stdin>` to import.

So when a Dask nanny starts its worker while this process's main thread is running the script's
top level outside the guard (or the script is no file), the worker starts as it does from a
notebook, whose `__main__` has no file: without the script's path or module name in what
multiprocessing hands it. It needs nothing of the script: Dask sends what it runs with
cloudpickle, which sends functions and classes defined in `__main__` by value
(tasks/gang/sending.py). A guarded script is imported by its workers as before, so what its top
level sets up (a torch setting, logging) applies there too; every other process (a user's own
pool, a DataLoader's loaders) starts as Python starts it.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import threading
from collections.abc import Callable
from multiprocessing import spawn
from types import FrameType, ModuleType
from typing import Any

# The name a Dask nanny gives the process of its worker (distributed/nanny.py, WorkerProcess.start).
DASK_WORKER_PROCESS = "Dask Worker process (from Nanny)"
# What multiprocessing's preparation data holds of the parent's `__main__` (multiprocessing/spawn.py).
MAIN_ENTRIES = ("init_main_from_path", "init_main_from_name")


def script_path(main: ModuleType) -> str | None:
    """The file a child would import as `__mp_main__` (`python -m` names a module); None where
    multiprocessing imports none (`python -c`, a notebook)."""
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.origin
    return getattr(main, "__file__", None)


def is_main_guard(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, either way round, alone or in an `and`."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(is_main_guard(value) for value in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(side, ast.Name) and side.id == "__name__" for side in sides)
            and any(isinstance(side, ast.Constant) and side.value == "__main__" for side in sides))


def inside_main_guard(source: str, line: int) -> bool:
    """Whether `line` of the module `source` lies in the body of an `if __name__ == "__main__":`."""
    return any(isinstance(node, ast.If) and is_main_guard(node.test)
               and node.body[0].lineno <= line <= (node.body[-1].end_lineno or node.body[-1].lineno)
               for node in ast.walk(ast.parse(source)))


def top_level_line(frame: FrameType | None, main: ModuleType) -> int | None:
    """The line of `main`'s top level that `frame`'s thread is running, or None where it runs none."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main.__dict__:
            return frame.f_lineno
        frame = frame.f_back
    return None


def runs_unguarded() -> bool:
    """Whether a child that imports this process's `__main__` would run the call now being made
    again: the main thread is in the script's top level outside the guard, or the script is no
    file to import (stdin)."""
    main = sys.modules.get("__main__")
    path = script_path(main) if main is not None else None
    if main is None or path is None:
        return False
    if not os.path.isfile(path):
        return True
    line = top_level_line(sys._current_frames().get(threading.main_thread().ident or 0), main)
    if line is None:
        return False
    with open(path, encoding="utf-8") as file:
        return not inside_main_guard(file.read(), line)


def without_unguarded_main(get_preparation_data: Callable[[str], dict[str, Any]]) -> Callable[[str], dict[str, Any]]:
    """`get_preparation_data`, leaving an unguarded script out of a Dask worker process's."""

    @functools.wraps(get_preparation_data)
    def preparation_data(name: str) -> dict[str, Any]:
        data = get_preparation_data(name)
        if name == DASK_WORKER_PROCESS and runs_unguarded():
            for entry in MAIN_ENTRIES:
                data.pop(entry, None)
        return data

    preparation_data.leaves_main_out = True  # type: ignore[attr-defined]
    return preparation_data


def start_workers_without_unguarded_main() -> None:
    """From now on, worker processes Dask nannies start in this process never run an unguarded script again.

    Idempotent. Both spawn and forkserver children read `spawn.get_preparation_data` from the
    module as they start, so replacing it there is enough.
    """
    if not getattr(spawn.get_preparation_data, "leaves_main_out", False):
        spawn.get_preparation_data = without_unguarded_main(spawn.get_preparation_data)  # type: ignore[assignment]

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
pool, a DataLoader's loaders) starts as Python starts it. The check reads the script as it is
on disk at that moment, and looks at the main thread: a call from a thread that the script's
unguarded top level started, while the main thread waits inside the guard, is not recognised.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import threading
import tokenize
from collections.abc import Callable, Iterable
from multiprocessing import spawn
from types import FrameType, ModuleType
from typing import Any

# The name a Dask nanny gives the process of its worker (distributed/nanny.py, WorkerProcess.start).
DASK_WORKER_PROCESS = "Dask Worker process (from Nanny)"
# What multiprocessing's preparation data holds of the parent's `__main__` (multiprocessing/spawn.py).
MAIN_ENTRIES = ("init_main_from_path", "init_main_from_name")
# A cluster starts its nannies together, each starting its worker in a thread of its own, and
# Python 3.11's `ast.parse` run in two threads at once can fail with "SystemError: AST constructor
# recursion depth mismatch" (docs/architecture.md, "Facts: Python"). So a script is parsed once
# per version of its file, under this lock.
PARSE_LOCK = threading.Lock()


def new_parse_lock() -> None:
    """A child forked while another thread held the lock would wait for it forever: it gets its own."""
    global PARSE_LOCK
    PARSE_LOCK = threading.Lock()


os.register_at_fork(after_in_child=new_parse_lock)


def script_path(main: ModuleType) -> str | None:
    """The file a child would import as `__mp_main__` (`python -m` names a module); None where
    multiprocessing imports none (`python -c`, a notebook)."""
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.origin
    return getattr(main, "__file__", None)


def guard_truth(test: ast.expr) -> bool | None:
    """True where `test` holds only in the script run as `__main__` (`__name__ == "__main__"`, either
    way round, `in ("__main__",)`, in an `and`), False where it holds only elsewhere (`!=`, `not`),
    None where it says neither."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = guard_truth(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return True if any(guard_truth(value) is True for value in test.values) else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    left, right, op = test.left, test.comparators[0], test.ops[0]
    names = [side for side in (left, right) if isinstance(side, ast.Name) and side.id == "__name__"]
    if not names:
        return None
    other = right if names[0] is left else left
    if isinstance(op, (ast.Eq, ast.NotEq)) and isinstance(other, ast.Constant) and other.value == "__main__":
        return isinstance(op, ast.Eq)
    if (isinstance(op, (ast.In, ast.NotIn)) and isinstance(other, (ast.Tuple, ast.List, ast.Set))
            and any(isinstance(item, ast.Constant) and item.value == "__main__" for item in other.elts)):
        return isinstance(op, ast.In)
    return None


def guarded_spans(tree: ast.AST) -> list[tuple[int, int]]:
    """The line spans that run only in the script run as `__main__`: an `if`'s body under a guard,
    its `else` under the guard's negation, and the same of a conditional expression."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)):
            truth = guard_truth(node.test)
            if truth is None:
                continue
            branch = node.body if truth else node.orelse
            parts = branch if isinstance(branch, list) else [branch]
            if parts:
                spans.append((parts[0].lineno, max(part.end_lineno or part.lineno for part in parts)))
    return spans


def inside_main_guard(spans: Iterable[tuple[int, int]], line: int) -> bool:
    """Whether `line` of a module whose `guarded_spans` are `spans` runs only in the script run as `__main__`."""
    return any(first <= line <= last for first, last in spans)


@functools.lru_cache(maxsize=8)
def file_guarded_spans(path: str, version: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """`guarded_spans` of the script at `path`, read in the encoding Python read it in (a BOM, a
    coding line); `version` keys the cache, so an edited script is read again."""
    with tokenize.open(path) as file:
        return tuple(guarded_spans(ast.parse(file.read())))


def script_guarded_spans(path: str) -> tuple[tuple[int, int], ...]:
    """The guarded spans of the script at `path` as it is on disk now, parsed by one thread at a time."""
    stat = os.stat(path)
    # The change time too: a copy that puts the old modification time back (`cp -p`, `rsync -t`)
    # cannot set it, and a file renamed over the script has another inode.
    version = (stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    with PARSE_LOCK:
        return file_guarded_spans(path, version)


def top_level_line(frame: FrameType | None, main: ModuleType) -> int | None:
    """The line of `main`'s top level that `frame`'s thread is running, or None where it runs none.

    The outermost such frame: code the script runs with `exec` in its own globals is a `<module>`
    frame too, whose lines are not the file's.
    """
    line = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main.__dict__:
            line = frame.f_lineno
        frame = frame.f_back
    return line


def runs_unguarded() -> bool:
    """Whether a child that imports this process's `__main__` would run the call now being made
    again: the main thread is in the script's top level outside the guard, or the script is no
    file to import (stdin), or no source this can read. Never raises, as it runs inside a process
    start: a nanny whose start fails leaves its cluster waiting (docs/architecture.md, "Facts: Python")."""
    main = sys.modules.get("__main__")
    try:
        path = script_path(main) if main is not None else None
        if main is None or path is None:
            return False
        line = top_level_line(sys._current_frames().get(threading.main_thread().ident or 0), main)
        spans = script_guarded_spans(path)
    except Exception:  # noqa: BLE001 - unreadable, not Python, or a parser's own failure: leave it out
        return True
    return line is not None and not inside_main_guard(spans, line)


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

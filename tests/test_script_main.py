"""A user's script without `if __name__ == "__main__":` runs as written (issue 57).

Before, the local cluster's workers imported the script again and ran its call again: each started
a flow run and a cluster of its own, every nanny failed, and the script waited for more than 10
minutes; piped on stdin it failed with `FileNotFoundError: '<stdin>'`. Dask workers started from a
process that imported prefect_ddp now never run its `__main__` (tasks/script_main.py), and a worker
that does not start is killed after its nanny's deadline (blocks/nanny_environment.py).
"""

from __future__ import annotations

import ast
import gc
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import spawn
from pathlib import Path
from types import ModuleType

import psutil
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from prefect_ddp.blocks.cluster import LOCAL_CLUSTER_PRELOAD, create_local_cluster
from prefect_ddp.blocks.nanny_environment import WorkerStartTimeout
from prefect_ddp.tasks import script_main
from prefect_ddp.tasks.script_main import (
    DASK_WORKER_PROCESS,
    guarded_spans,
    inside_main_guard,
    runs_unguarded,
    without_unguarded_main,
)

REPO = Path(__file__).resolve().parents[1]
# Generous: the script ends in about 15 s here; before the fix it never ended.
SCRIPT_DEADLINE_S = 300

UNGUARDED = '''
import os
import torch
from prefect import flow
from prefect_ddp import DaskCluster, run_gang

torch.set_float32_matmul_precision("medium")  # a setting of the script's top level

def rank(ctx, config):
    return torch.get_float32_matmul_precision()

@flow(name=os.environ["SCRIPT_FLOW_NAME"])
def script_flow():
    with DaskCluster(n_workers=1).task_runner() as runner:
        return run_gang(rank, {}, task_runner=runner)

print("ranks", list(script_flow()))
'''
# The same script with the guard: its workers import it as before, so its top-level setting holds there.
GUARDED = UNGUARDED.replace('print("ranks"', 'if __name__ == "__main__":\n    print("ranks"')


@pytest.mark.unit
def test_a_call_is_unguarded_where_the_script_s_top_level_runs_it_outside_the_main_guard():
    source = """import os
setting = 1
run()
if __name__ == "__main__":
    try:
        run()
    finally:
        pass
if "__main__" == __name__ and os.environ.get("X"):
    run()
if __name__ != "__main__":
    run()
else:
    run()
if __name__ in ("__main__",):
    run()
if not __name__ != "__main__":
    run()
run() if __name__ == "__main__" else None
if __name__ == "__main__" or os.environ.get("X"):
    run()
"""
    runs = [number for number, line in enumerate(source.splitlines(), 1) if line.strip() == "run()"]
    spans = guarded_spans(ast.parse(source))
    assert [inside_main_guard(spans, line) for line in runs] == [False, True, True, False, True, True, True,
                                                                   False]
    assert inside_main_guard(spans, source.splitlines().index('run() if __name__ == "__main__" else None') + 1)


@pytest.fixture
def script_as_main(monkeypatch):
    """Makes a file this process's `__main__` script, its main thread at a line of the file's top level."""

    def as_main(script: Path, line: int) -> None:
        monkeypatch.setattr(sys.modules["__main__"], "__spec__", None, raising=False)
        monkeypatch.setattr(sys.modules["__main__"], "__file__", str(script), raising=False)
        monkeypatch.setattr(script_main, "top_level_line", lambda frame, main: line)

    return as_main


@pytest.mark.unit
def test_a_script_python_reads_but_this_check_cannot_leaves_the_script_out(tmp_path, script_as_main):
    """A BOM (Notepad's UTF-8) once failed the check inside multiprocessing's start: the nanny hung."""
    script = tmp_path / "bom.py"
    script.write_bytes(b"\xef\xbb\xbfimport sys\nif __name__ == '__main__':\n    pass\n")
    for line, unguarded in ((3, False), (1, True)):
        script_as_main(script, line)
        assert runs_unguarded() is unguarded  # read in the encoding Python read it in
    script.write_bytes(b"def broken(:\n")
    assert runs_unguarded() is True


@pytest.fixture
def gil_yielding_collections():
    """Garbage collections that often hand the GIL to another thread, as a busy Dask process's do."""
    threshold = gc.get_threshold()

    def yield_gil(phase: str, info: dict) -> None:
        if phase == "start":
            time.sleep(0.00001)

    gc.set_threshold(50)
    gc.callbacks.append(yield_gil)
    yield
    gc.callbacks.remove(yield_gil)
    gc.set_threshold(*threshold)


@pytest.mark.unit
def test_workers_started_together_read_a_guarded_script_right_and_parse_it_once(tmp_path, monkeypatch, script_as_main,
                                                                                gil_yielding_collections):
    """A cluster's nannies start their workers in threads at once. Parsed in each, Python 3.11 failed
    "AST constructor recursion depth mismatch": the nanny's start failed and the soak's cluster hung."""
    script = tmp_path / "guarded.py"
    script.write_text("import os\n" + "x = [1, (2, {3: [4]})]\n" * 400 + "if __name__ == '__main__':\n    main()\n")
    script_as_main(script, 403)  # main() under the guard
    parses = []
    real_parse = ast.parse
    monkeypatch.setattr(ast, "parse", lambda *args, **kwargs: parses.append(1) or real_parse(*args, **kwargs))
    script_main.file_guarded_spans.cache_clear()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: runs_unguarded(), range(64)))
    assert answers == [False] * 64 and len(parses) == 1
    script.write_text(script.read_text().replace("if __name__ == '__main__':", "if True:"))
    assert runs_unguarded() is True and len(parses) == 2  # the edited script is read again


@pytest.mark.unit
def test_a_script_edited_to_the_same_size_with_its_old_modification_time_put_back_is_read_again(tmp_path,
                                                                                                 script_as_main):
    """`cp -p` and `rsync -t` put the old modification time back: the cached answer of the guarded
    version would have had workers import the unguarded one, which runs the call again."""
    script = tmp_path / "edited.py"
    script.write_text("if __name__ == '__main__':\n    main()\n")
    script_as_main(script, 2)
    assert runs_unguarded() is False
    before = script.stat()
    script.write_text("if __name__ != '__main__':\n    main()\n")
    assert script.stat().st_size == before.st_size
    os.utime(script, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert runs_unguarded() is True


@pytest.mark.unit
def test_the_script_s_line_is_its_top_level_s_not_that_of_code_it_runs_with_exec():
    main = ModuleType("script")
    exec(compile("import sys\nx = 1\nexec('\\n\\n\\n\\nframe = sys._getframe()')\n", "script.py", "exec"),
         main.__dict__)
    assert main.frame.f_lineno == 5 and script_main.top_level_line(main.frame, main) == 3


def test_a_process_forked_while_another_thread_parses_a_script_can_still_check_its_own():
    """A fork copies a held lock held forever: the child's nannies would wait for it in every worker start."""
    child = """
import os, sys
from prefect_ddp.tasks import script_main
with script_main.PARSE_LOCK:
    pid = os.fork()
    if pid == 0:
        os._exit(0 if script_main.PARSE_LOCK.acquire(timeout=20) else 3)
    _, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
    assert subprocess.run([sys.executable, "-c", child], timeout=120).returncode == 0


@pytest.mark.unit
def test_only_a_dask_worker_process_started_by_an_unguarded_call_is_prepared_without_the_script(monkeypatch):
    import prefect_ddp  # noqa: F401  (importing the package installs the wrapper, once)

    assert spawn.get_preparation_data.leaves_main_out  # type: ignore[attr-defined]
    prepared = without_unguarded_main(lambda name: {"name": name, "init_main_from_path": "/s.py", "dir": "/"})
    for unguarded in (True, False):
        monkeypatch.setattr(script_main, "runs_unguarded", lambda: unguarded)
        worker, other = prepared(DASK_WORKER_PROCESS), prepared("SomeProcess")
        assert ("init_main_from_path" in worker) is not unguarded and "init_main_from_path" in other
        assert worker["dir"] == other["dir"] == "/"


def flow_runs_named(name: str) -> list:
    with get_client(sync_client=True) as api:
        return api.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))


def test_a_script_without_the_main_guard_runs_as_a_file_and_on_stdin_and_a_guarded_one_as_before(prefect_api,
                                                                                                tmp_path):
    (tmp_path / "unguarded.py").write_text(UNGUARDED)
    (tmp_path / "guarded.py").write_text(GUARDED)
    runs = {}
    for how, script, stdin in (("file", "unguarded.py", None), ("stdin", "-", "unguarded.py"),
                               ("guarded", "guarded.py", None)):
        env = dict(os.environ, PREFECT_API_URL=prefect_api, SCRIPT_FLOW_NAME=f"script-{how}-{tmp_path.name}")
        runs[how] = subprocess.Popen([sys.executable, script], stdin=(tmp_path / stdin).open() if stdin else None,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                                     env=env, start_new_session=True)
    for how, process in runs.items():
        try:
            output, _ = process.communicate(timeout=SCRIPT_DEADLINE_S)
        finally:
            process.kill()
        assert process.returncode == 0, f"{how}: exited {process.returncode}:\n{output[-3000:]}"
        # The unguarded script's top level never ran in the worker; the guarded one's did, as before.
        assert f"ranks ['{'medium' if how == 'guarded' else 'highest'}']" in output, output[-3000:]
        # One flow run, the script's own: no worker ran the script's call again.
        (run,) = flow_runs_named(f"script-{how}-{tmp_path.name}")
        assert run.state.is_completed()
        left = left_in_session(process.pid)
        assert not left, f"{how}: processes left behind: {left}"


def left_in_session(session: int, deadline_s: float = 60) -> list[list[str]]:
    """The command lines of live processes of `session` once they are gone or the deadline passed
    (the forkserver and the resource tracker leave a moment after the script)."""
    end = time.monotonic() + deadline_s
    while True:
        left = []
        for process in psutil.process_iter():
            try:
                if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                    left.append(process.cmdline())
            except (OSError, psutil.Error):
                continue  # gone meanwhile
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.5)


def test_a_worker_that_never_starts_is_killed_and_the_cluster_s_start_fails_naming_it(prefect_api):
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to start") as failed:
        create_local_cluster(n_workers=1, preload=[*LOCAL_CLUSTER_PRELOAD, "tests.support.hanging_preload"],
                             start_timeout_s=3)
    cause = failed.value.__cause__
    assert isinstance(cause, WorkerStartTimeout), repr(cause)
    assert "did not start within 3 s, and was killed" in str(cause) and "preload" in str(cause)
    assert time.monotonic() - started < SCRIPT_DEADLINE_S
    hung = [p for p in psutil.Process().children(recursive=True) if "hanging_preload" in " ".join(p.cmdline())]
    assert not hung


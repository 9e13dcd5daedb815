"""A function run in a child process, its answer sent back: for what must start from a process of
its own (a fresh interpreter where obstore's runtime has not started, a fork of one where it has)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

ANSWER_TIMEOUT_S = 120


def in_child(method: str, main: Callable[..., Any], *args: Any) -> Any:
    """`main(*args)` in a child process started with `method`; its answer, or why there is none
    (its traceback, its exit, or that it hangs). The child leads a process group of its own, killed
    whole at the end, so no loader process it forked outlives it.

    Not a multiprocessing Pool: its processes are daemons, which may not fork children.
    """
    context = multiprocessing.get_context(method)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=answer_to, args=(send, main, *args))
    child.start()
    send.close()  # the child's end alone: its exit then ends the wait
    ended = bool(wait([receive, child.sentinel], ANSWER_TIMEOUT_S))
    try:
        if not ended:
            return f"no answer within {ANSWER_TIMEOUT_S} s: the child hangs"
        try:
            return receive.recv()
        except EOFError:
            child.join(10)
            return f"the child exited with {child.exitcode} and no answer"
    finally:
        if ended:
            child.join(10)  # its own exit first: a child that answered shuts its loaders down itself
        try:
            os.killpg(child.pid, signal.SIGKILL)  # then what it left, or it, still hanging
        except (ProcessLookupError, PermissionError):
            pass  # gone already, with all it started
        child.join(10)


def answer_to(send: Any, main: Callable[..., Any], *args: Any) -> None:
    os.setpgrp()
    try:
        answer = main(*args)
    except Exception:
        answer = f"the child raised:\n{traceback.format_exc()}"
    send.send(answer)


class PausePoint:
    """A point in a child's run where it waits while the parent looks at something (an S3 front's
    counts between two epochs): the child calls the point; `looking` runs the parent's `look` at each.

    A multiprocessing Barrier of two, crossed twice a pause: once when both are there, once when the
    parent has looked. Passed to the child as an argument of `in_child` (made with its `method`).
    """

    def __init__(self, method: str) -> None:
        self._barrier = multiprocessing.get_context(method).Barrier(2, timeout=ANSWER_TIMEOUT_S)

    def __call__(self) -> None:
        self._barrier.wait()
        self._barrier.wait()

    def looking(self, look: Callable[[], None], pauses: int) -> None:
        """Start a thread of the parent's that runs `look` at each of `pauses` pauses of the child's.
        A child that stops short breaks the barrier after its timeout; the thread then ends. A `look`
        that raises breaks it at once: the child's answer is then its BrokenBarrierError, not a hang."""
        def meet() -> None:
            try:
                for _ in range(pauses):
                    self._barrier.wait()
                    try:
                        look()
                    except BaseException:
                        self._barrier.abort()
                        raise
                    self._barrier.wait()
            except threading.BrokenBarrierError:
                pass  # the child never came: its own answer says why

        threading.Thread(target=meet, name="pause-point", daemon=True).start()

"""A function run in a child process, its answer sent back: for what must start from a process of
its own (a fresh interpreter where obstore's runtime has not started, a fork of one where it has)."""

from __future__ import annotations

import multiprocessing
import os
import signal
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

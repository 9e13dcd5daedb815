"""A function run in a child process, its answer sent back: for what must start from a process of
its own (a fresh interpreter where obstore's runtime has not started, a fork of one where it has)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any


def in_child(method: str, main: Callable[..., Any], *args: Any) -> Any:
    """`main(*args)` in a child process started with `method`; its answer, or why there is none.

    Not a multiprocessing Pool: its processes are daemons, which may not fork children.
    """
    context = multiprocessing.get_context(method)
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=answer_to, args=(send, main, *args))
    child.start()
    answer = receive.recv() if receive.poll(120) else "no answer within 120 s: the child hangs"
    child.join(10)
    if child.is_alive():
        child.kill()
    return answer


def answer_to(send: Any, main: Callable[..., Any], *args: Any) -> None:
    send.send(main(*args))

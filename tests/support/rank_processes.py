"""Rank processes for the tests of real gloo gangs, started as the project's workers start:
forked from a forkserver that imported torch and torchvision once (blocks/worker_forkserver.py),
instead of each spawned rank importing them again (about 5 s of CPU a rank here)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from typing import Any

import torch.multiprocessing as mp

from prefect_ddp.blocks.worker_forkserver import preload_forkserver


def rank_context() -> ForkServerContext:
    """The multiprocessing context to start rank processes in."""
    preload_forkserver()
    return multiprocessing.get_context("forkserver")


def start_ranks(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int) -> None:
    """torch's `start_processes(fn, args, nprocs)` in `rank_context`: `fn(rank, *args)` in each, joined."""
    preload_forkserver()
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")

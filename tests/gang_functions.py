"""Per-rank functions for the gang tests; in a module of their own so workers can import them."""

from __future__ import annotations

import json
import os
import signal
import time

import torch.distributed as dist

from tasks.gang import RankContext
from tasks.process_group import all_reduce_sum


def report_rank(ctx: RankContext, config: dict) -> dict:
    """Who am I, and does a collective over the whole gang work?"""
    return {
        "ctx": ctx,
        "pid": os.getpid(),
        "initialized": dist.is_initialized(),
        "dist_world": dist.get_world_size() if dist.is_initialized() else 1,
        "rank_sum": all_reduce_sum([float(ctx.rank)])[0],
        "config": config,
    }


def fail_on_rank_1(ctx: RankContext, config: dict) -> dict:
    if ctx.rank == 1 and ctx.attempt < config.get("fail_attempts", 99):
        raise RuntimeError(f"boom on rank {ctx.rank}, attempt {ctx.attempt}")
    return report_rank(ctx, config)


def kill_worker_on_rank_1(ctx: RankContext, config: dict) -> dict:
    """The first attempt loses rank 1's whole worker process, as an OOM kill would."""
    if ctx.rank == 1 and ctx.attempt == 0:
        # Mid-training, as in life: long enough for the RUNNING state to reach the server
        # (a process killed within milliseconds of starting never reports its task run).
        time.sleep(3)
        os.kill(os.getpid(), signal.SIGKILL)
    return report_rank(ctx, config)


def sleep_past_the_deadline(ctx: RankContext, config: dict) -> dict:
    """A rank that will not stop by itself (as one blocked in a collective would not)."""
    time.sleep(config["seconds"])
    return report_rank(ctx, config)


def hold_worker(ctx: RankContext, config: dict) -> dict:
    """Keep the gang's workers busy for a while; say where and when."""
    started = time.time()
    time.sleep(config["seconds"])
    return {"worker": ctx.worker_address, "started": started, "ended": time.time()}


def report_every_epoch(ctx: RankContext, config: dict) -> dict:
    """A sweep trainable: the loss falls with epochs, faster with a larger lr; stops when told."""
    losses = []
    for epoch in range(1, config["epochs"] + 1):
        loss = all_reduce_sum([1.0 / (1.0 + config["lr"] * epoch)])[0] / ctx.world_size
        losses.append(loss)
        if ctx.report(epoch, {"loss": loss}):
            break
    model_url = f"{ctx.output_url}/losses.json"  # each trial has a folder of its own
    if ctx.is_main:
        os.makedirs(ctx.output_url, exist_ok=True)
        with open(model_url, "w") as file:
            json.dump(losses, file)
    return {"losses": losses, "rank": ctx.rank, "model_url": model_url}

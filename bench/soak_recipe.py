"""The soak's recipe runs (bench/soak.py --recipe, issue 56): the product's recipe on an elastic
gang, each run given one of RECIPE_FAULTS, and what each run must leave behind.

- refuse-best: once epoch 1 is recorded, the store answers 503 to every PUT of the run's
  model.pt until the gang has re-formed (its attempts.json lists a second attempt): the first
  formation fails on a write of a best epoch's weights, and the next takes the run over;
- refuse-checkpoint: the same for the run's checkpoint;
- stop-retry: a part stops the run after epoch 2 of 4, then the flow runs the gang again, as a
  flow retry does: the retry trains nothing;
- refuse-stop: the same stop, its checkpoint refused until the gang re-formed (the stop crossed
  with an elastic take-over);
- env-restart: before the run, a variable of the soak's process changes, one set before the
  cluster started is removed, and one worker is restarted: it must see both;
- kill-worker: SIGKILL a worker running a rank once the first epoch is recorded.

After each run, read from moto itself: the run completed; model.json names the epoch the run
reports; model.pt holds that epoch's weights (rank 0 kept each epoch's, bench/soak_ranks.py
`scored_recipe`); the checkpoint loads and records the stop where there was one; a stopped
run's retry trained nothing.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, NamedTuple

import distributed
import torch

from prefect_ddp.tasks.data.storage import read_json, read_bytes, torch_from_bytes
from prefect_ddp.tasks.gang.stale import running_rank
from prefect_ddp.tasks.training.checkpoints import read_committed, readable_checkpoint

from bench.soak_ranks import RECIPE_EPOCHS, STOP_AFTER, Store, base_location, checkpoint_url, run_url
from tests.support.faulty_s3 import FaultyS3

RECIPE_FAULTS = [None, "refuse-best", "refuse-checkpoint", "stop-retry", "refuse-stop", "env-restart", "kill-worker"]
STOPPING = ("stop-retry", "refuse-stop")
# Set before the cluster starts, so that its forkserver (and every worker forked from it) inherits it.
REMOVED_LATER = "SOAK_SET_BEFORE_THE_CLUSTER"
CHANGED = "SOAK_CHANGED_PER_RUN"
WAIT_S = 240


class RecipePlanned(NamedTuple):
    fault: str | None
    every: str  # training.checkpoint_every
    scores: list[float]  # each epoch's val_acc: which epoch is best, and whether later ones beat it


def plan_recipe(runs: int, seed: int) -> list[RecipePlanned]:
    """Each run's fault, checkpoint setting and epochs' scores, by the seed alone."""
    draws = random.Random(f"recipe-{seed}")
    return [RecipePlanned(draws.choice(RECIPE_FAULTS), draws.choice(["epoch", "auto"]),
                          [draws.choice([0.5, 0.6, 0.7, 0.9]) for _ in range(RECIPE_EPOCHS)]) for _ in range(runs)]


def wait_for(condition: Any, done: threading.Event, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if done.is_set() or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def attempts_recorded(direct_endpoint: str, store: Store) -> int:
    url = f"{run_url(store)}/checkpoints/attempts.json"
    with suppress(FileNotFoundError, ValueError):
        return len(read_json(url, base_location(store, direct_endpoint).storage_options()))
    return 0


@contextmanager
def injected(fault: str | None, client: distributed.Client, front: FaultyS3, direct_endpoint: str, store: Store,
             marks: Path) -> Iterator[dict[str, Any]]:
    """The run's fault, injected from a thread of its own while the block runs the run; yields what
    was seen of it ("fired": the refusal met a write, or the worker was killed)."""
    seen: dict[str, Any] = {"fired": None}
    done = threading.Event()

    def refuse(target: str, after: Path | None) -> None:
        if after is not None and not wait_for(after.exists, done):
            return
        front.fault("PUT", f"{run_url(store).removeprefix('s3://')}/{target}", "503", times=None)
        seen["fired"] = wait_for(lambda: attempts_recorded(direct_endpoint, store) >= 2, done)
        front.clear()

    def kill() -> None:
        if not wait_for((marks / "epoch1.pt").exists, done):
            return
        ranks = [address for address, rank in client.run(running_rank, on_error="ignore").items() if rank]
        pids = client.run(os.getpid)
        if ranks:
            with suppress(ProcessLookupError):
                os.kill(pids[random.choice(ranks)], signal.SIGKILL)
                seen["fired"] = True

    # After epoch 1's weights: the refused write is most often a later best's (scores are seeded).
    action = {"refuse-best": lambda: refuse("model.pt", marks / "epoch1.pt"),
              "refuse-checkpoint": lambda: refuse("checkpoints/checkpoint.pt", None),
              "refuse-stop": lambda: refuse("checkpoints/checkpoint.pt", marks / f"epoch{STOP_AFTER}.pt"),
              "kill-worker": kill}.get(fault or "")
    thread = threading.Thread(target=action, daemon=True) if action else None
    if thread:
        thread.start()
    try:
        yield seen
    finally:
        done.set()
        if thread:
            thread.join(30)
        front.clear()


def change_environment(client: distributed.Client, number: int) -> str:
    """Change one variable, remove one the forkserver inherited, restart one worker; its name (a
    restarted worker comes back at another address)."""
    os.environ[CHANGED] = f"run-{number}"
    os.environ.pop(REMOVED_LATER, None)
    address, worker = sorted(client.scheduler_info()["workers"].items())[0]
    client.restart_workers([address])
    return str(worker["name"])


def environment_violations(client: distributed.Client, restarted: str, number: int) -> list[str]:
    """What the restarted worker (by name) sees of the variables changed and removed before its restart."""
    address = next(a for a, w in client.scheduler_info()["workers"].items() if str(w["name"]) == restarted)
    changed, removed = client.run(lambda: (os.environ.get(CHANGED), os.environ.get(REMOVED_LATER)),
                                  workers=[address])[address]
    if (changed, removed) == (f"run-{number}", None):
        return []
    return [f"the restarted worker {restarted} sees {CHANGED}={changed!r}, {REMOVED_LATER}={removed!r}"]


def recipe_violations(direct_endpoint: str, store: Store, result: dict[str, Any], fault: str | None,
                      marks: Path, seen: dict[str, Any]) -> list[str]:
    """What a recipe run left in the store that it must not have (read from moto, not the front)."""
    if result["state"] != "COMPLETED":
        return [f"outcome {result['state']}: {result.get('error', '')[:300]}"]
    found = []
    calls = result["calls"]
    last = calls[-1]
    if fault in ("refuse-best", "refuse-checkpoint", "refuse-stop", "kill-worker") and not seen["fired"]:
        found.append(f"the fault {fault} never met the run")
    options = base_location(store, direct_endpoint).storage_options()
    card = read_json(f"{run_url(store)}/model.json", options)
    if card["epoch"] != last["best_epoch"]:
        found.append(f"model.json says epoch {card['epoch']}, the run reports {last['best_epoch']}")
    kept = torch_from_bytes(read_bytes(f"{run_url(store)}/model.pt", options))
    best = torch.load(marks / f"epoch{last['best_epoch']}.pt", weights_only=True)
    if not all(torch.equal(kept[name], best[name]) for name in best):
        found.append(f"model.pt does not hold the weights of epoch {last['best_epoch']}, the run's best")
    checkpoint = readable_checkpoint(checkpoint_url(store), read_committed(checkpoint_url(store), options))
    stopped = (checkpoint or {}).get("stopped")
    expected = list(range(1, (STOP_AFTER if fault in STOPPING else RECIPE_EPOCHS) + 1))
    if any(call["history"] != expected for call in calls):
        found.append(f"histories {[call['history'] for call in calls]}, not {expected}")
    if fault in STOPPING and (not stopped or stopped["epoch"] != STOP_AFTER):
        found.append(f"the checkpoint records the stop as {stopped}")
    if fault == "stop-retry" and calls[-1]["trained"]:
        found.append(f"the retry trained {calls[-1]['trained']} epochs after the stop")
    return found

"""The soak's gang (bench/soak.py): its rank functions, its flows, and a flow process to run one.

    python -m bench.soak_ranks SCHEDULER_ADDRESS FN_NAME MARKS_FOLDER STEPS [STORE_JSON]

runs one gang of FN_NAME ("loop" of STEPS steps, or "asleep") on the cluster and prints its
outcome as one JSON line: state, error, flow run id, attempts, the loop's total.

With a store (STORE_JSON, `Store`: an S3 endpoint, a bucket and the run's folder name) the
gang writes what a training run writes, with the product's own code: rank 0 saves a
checkpoint every CHECKPOINT_EVERY steps (`save_torch`) to `RUN/checkpoints/checkpoint.pt`,
and a re-formed attempt resumes from it (`read_committed`, `readable_checkpoint`, the bytes
broadcast from rank 0 as the recipe does), so that each step is counted once; at its end the
flow writes a tiny real model into the run's folder (model.pt, model.json) and keeps it
through the product's promotion (`promote`) under `soak/`, with a val accuracy that rises
with the run's number, so that every completed run is promoted.

`soak_recipe` (bench/soak.py --recipe) runs the product's recipe itself (`train_classifier`, a
tiny mobilenet on 32-px shapes) on an elastic gang of 1 to 2 ranks, writing its checkpoints
and model.pt to the run's folder; rank 0 keeps each epoch's weights in the marks folder as the
epoch is recorded, before any boundary part may fail (`scored_recipe`), so that the soak can
check that model.pt holds the weights of the epoch the run reports. With `stop`, a part stops the run after STOP_AFTER epochs, and the flow runs the
gang again as a flow retry would: the retry must train nothing.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, TypedDict, cast

import torch
from prefect import flow
from prefect.runtime import flow_run
from prefect_dask import DaskTaskRunner
from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.local_services import MOTO_CREDENTIALS, MOTO_REGION
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.data.storage import save_torch, write_json
from prefect_ddp.tasks.gang import (
    GangError,
    RankContext,
    all_reduce_sum,
    broadcast_bytes,
    run_gang,
)
from prefect_ddp.tasks.results.promotion import kept_location, promote, read_pointer
from prefect_ddp.tasks.results.records import TrainingSummary
from prefect_ddp.tasks.training.checkpoints import read_committed, readable_checkpoint
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.model import build_model, model_card
from prefect_ddp.tasks.training.recipe import train_classifier
from tests.support.two_ranks import StopAfterEpochsSeen, scored_epochs

STEPS = 60
STEP_PAUSE_S = 0.05
ASLEEP_S = 600
CHECKPOINT_EVERY = 10  # steps; the last step always saves one
KEPT_NAME = "soak"  # the kept model's name: <bucket>/soak/latest.json, <bucket>/soak/versions/<run>/
CLASSES = ["a", "b"]
IMAGE_SIZE = 32
RECIPE_EPOCHS = 4
STOP_AFTER = 2  # epochs: StopAfterEpochsSeen's default


class Store(TypedDict):
    """Where a run's gang writes: the S3 endpoint (the fault front's), the bucket, the run's folder."""

    endpoint: str
    bucket: str
    run: str  # "run-K": its folder under the bucket, and the run's name in the kept model's records
    number: int  # K: the val accuracy the run reports rises with it


def base_location(store: Store, endpoint: str | None = None) -> DataLocation:
    """The bucket as a DataLocation (through `endpoint`, by default the store's)."""
    return DataLocation(url=f"s3://{store['bucket']}", endpoint_url=endpoint or store["endpoint"],
                        region_name=MOTO_REGION, **MOTO_CREDENTIALS)


def run_url(store: Store) -> str:
    return f"s3://{store['bucket']}/{store['run']}"


def checkpoint_url(store: Store) -> str:
    return f"{run_url(store)}/checkpoints/checkpoint.pt"


def val_acc(number: int) -> float:
    """The run's reported best val accuracy: rises with its number, so each run beats the one kept."""
    return number / (number + 1)


def mark(ctx: RankContext, marks: str) -> None:
    """Say that this rank runs, on which worker (the soak's injector picks its victim by it) and
    for which flow run (a killed run prints none: the soak reads its task runs by this)."""
    (Path(marks) / f"running-{ctx.rank}").write_text(json.dumps({"worker": ctx.worker_address,
                                                                  "flow_run_id": flow_run.get_id()}))


def resumed(ctx: RankContext, config: dict[str, Any]) -> tuple[int, float]:
    """(steps done, running total) from the run's checkpoint: rank 0 reads it and every rank loads
    the bytes it read, as `TrainingState.resume` does; (0, 0.0) without a store or a checkpoint."""
    if not config.get("checkpoint"):
        return 0, 0.0
    url, options = config["checkpoint"], config["location"].storage_options()
    data = broadcast_bytes(read_committed(url, options) if ctx.rank == 0 else None)
    checkpoint = readable_checkpoint(url, data)
    if checkpoint is None:
        return 0, 0.0
    return int(checkpoint["step"]), float(checkpoint["total"])


def save_checkpoint(ctx: RankContext, config: dict[str, Any], step: int, total: float, resumed_at: int) -> None:
    """Rank 0 saves the loop's state after `step` steps, fenced as the recipe's checkpoints are;
    `resumed_at`: the step this attempt resumed from (what the soak reports of a re-formed run)."""
    if ctx.rank != 0 or not config.get("checkpoint"):
        return
    ctx.progress("checkpoint", step=step)
    ctx.check_lease()  # a rank of a gang that lost its worker must not write beside the new one
    save_torch(config["checkpoint"], {"step": step, "total": total, "tensor": torch.full((4,), float(step)),
                                      "attempt": ctx.attempt, "resumed_at": resumed_at},
               config["location"].storage_options())
    ctx.progress("step", step=step)


def loop(ctx: RankContext, config: dict[str, Any]) -> float:
    """A short training loop: a collective per step, the stop flag read after each; with a store,
    a checkpoint every CHECKPOINT_EVERY steps and at the end, and a resume from it."""
    mark(ctx, config["marks"])
    done, total = resumed(ctx, config)
    for step in range(done + 1, config["steps"] + 1):
        total += all_reduce_sum([1.0])[0]
        ctx.check_stop()
        if step % CHECKPOINT_EVERY == 0 or step == config["steps"]:
            save_checkpoint(ctx, config, step, total, done)
        time.sleep(STEP_PAUSE_S)
    return total


def asleep(ctx: RankContext, config: dict[str, Any]) -> float:
    """A rank deaf to its stop flag: asleep in C (libc's sleep)."""
    mark(ctx, config["marks"])
    ctypes.CDLL(None).sleep(ASLEEP_S)
    return 0.0


FUNCTIONS = {"loop": loop, "asleep": asleep}


def model_files(store: Store) -> None:
    """What training leaves in the run's folder for promotion: a tiny real model and its card."""
    options = base_location(store).with_url(run_url(store)).storage_options()
    config = ModelConfig(backbone="mobilenet_v3_small")
    save_torch(f"{run_url(store)}/model.pt", build_model(config, len(CLASSES)).state_dict(), options)
    write_json(f"{run_url(store)}/model.json", model_card(config, CLASSES, IMAGE_SIZE), options)


def summary(acc: float) -> TrainingSummary:
    """A run's TrainingSummary with `acc` as its best (and only) epoch's val accuracy."""
    history = [{"epoch": 1, "val_acc": acc, "val_loss": 1 - acc}]
    return TrainingSummary(
        world_size=2, ranks=[], split_digests=[], train_size=0, val_size=0, history=history, best_epoch=1,
        best_val_acc=acc, selected_by="highest val_acc", final_val_acc=acc, final_val_loss=1 - acc, time=None,
        pruned_at=None, attempts=[], unreadable={}, recipe=None, comparison=None, files={})


def kept_version_now(store: Store) -> str | None:
    """The version the kept model's pointer names now (None before the first promotion)."""
    pointer = read_pointer(kept_location(base_location(store), KEPT_NAME))
    return pointer["version"] if pointer else None


def keep_model(store: Store, kept_at_start: str | None) -> dict[str, Any]:
    """Write the run's model and keep it through the product's promotion; what it decided."""
    model_files(store)
    base = base_location(store)
    promotion = promote.fn(summary(val_acc(store["number"])), base.with_url(run_url(store)),
                           kept_location(base, KEPT_NAME), {"name": store["run"], "flow_run_id": str(flow_run.get_id())},
                           kept_at_start=kept_at_start)
    return {"promoted": promotion.promoted, "reason": promotion.reason, "kept_url": promotion.kept_url}


def recipe_job(store: Store, images: str, manifest: Manifest, every: str) -> TrainJob:
    """The run's job: the shapes under `images`, its output in the run's folder through the store's
    endpoint. Its client sends each request once, so that a write the store refuses fails in
    seconds (6.6 s here), not after botocore's and the product's retries (132 s for model.pt)."""
    output = base_location(store).with_url(run_url(store)).model_copy(update={"max_attempts": 1})
    return TrainJob(
        source=DataLocation(url=images), output=output, manifest=manifest,
        split=stratified_split(manifest, 0.25, 0), model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=RECIPE_EPOCHS, batch_size=4, image_size=IMAGE_SIZE, num_workers=0,
                                optimizer="adamw", lr=1e-3, checkpoint_every=every),
    )


def scored_recipe(ctx: RankContext, job: TrainJob, scores: list[float], marks: str, parts: list[Any]) -> Any:
    """The recipe, its epochs scoring `scores` (so that the soak's seed chooses the best epoch); rank
    0 keeps each epoch's weights in `marks` as `epoch{n}.pt` (an epoch trained again replaces its file)."""
    scored_epochs(scores, keep_weights=Path(marks) if ctx.is_main else None)
    return train_classifier(ctx, job, parts=parts)


@flow(name="soak-recipe")
def soak_recipe(address: str, marks: str, store: dict[str, Any], images: str, manifest: Manifest, every: str,
                scores: list[float], stop: bool = False) -> dict[str, Any]:
    """The recipe on an elastic gang of 1 to 2 ranks, epoch n scoring scores[n - 1] (with `stop`,
    stopped by a part after STOP_AFTER epochs and run again as a retry would); what each call
    returned, as the soak checks it."""
    job = recipe_job(cast(Store, store), images, manifest, every)
    parts = [StopAfterEpochsSeen] if stop else []
    calls = []
    with DaskTaskRunner(address=address) as runner:
        for _ in range(2 if stop else 1):
            results = run_gang(partial(scored_recipe, scores=scores, marks=marks, parts=parts), job,
                               task_runner=runner, world_size=2, min_world_size=1, max_restarts=3, output_url=job.output.url,
                               init_timeout=timedelta(seconds=60), lease_timeout=timedelta(seconds=180),
                               timeout=timedelta(seconds=180), hang_timeout=timedelta(seconds=60))
            first = results[0]
            calls.append({"best_epoch": first.best_epoch, "history": [h["epoch"] for h in first.history],
                          "trained": len(first.local_train_samples), "attempts": len(results.attempts),
                          "handed_over": [a["handed_over"] for a in first.attempts]})
    return {"calls": calls}


def run_recipe(address: str, marks: str, store: Store, images: str, manifest: Manifest, every: str,
               scores: list[float], stop: bool) -> dict[str, Any]:
    """The recipe run's outcome, as the soak checks it (`run`'s keys, and `calls`)."""
    state = soak_recipe(address, marks, dict(store), images, manifest, every, scores, stop, return_state=True)
    result = state.result(raise_on_failure=False)
    outcome: dict[str, Any] = result if isinstance(result, dict) else {}
    return {"state": state.type.value, "error": "" if outcome else f"{type(result).__name__}: {result}"[:2000],
            "flow_run_id": str(state.state_details.flow_run_id), "gang_failed": isinstance(result, GangError),
            "calls": outcome.get("calls", []),
            "attempts": sum(call["attempts"] for call in outcome.get("calls", [])) or None}


@flow(name="soak-gang")
def soak_gang(address: str, fn_name: str, marks: str, steps: int = STEPS,
              store: dict[str, Any] | None = None) -> dict[str, Any]:
    """One gang of FUNCTIONS[fn_name] on 2 of the cluster's workers, then (with a store) the run's
    model kept; the attempts it took, the loop's total and the promotion."""
    config: dict[str, Any] = {"marks": marks, "steps": steps}
    kept_at_start = None
    given = cast("Store | None", store)  # a plain dict parameter: Prefect validates no TypedDict on 3.11
    if given:
        config |= {"checkpoint": checkpoint_url(given), "location": base_location(given).with_url(run_url(given)).plain()}
        kept_at_start = kept_version_now(given)
    with DaskTaskRunner(address=address) as runner:
        results = run_gang(
            FUNCTIONS[fn_name], config, task_runner=runner, world_size=2, max_restarts=1,
            init_timeout=timedelta(seconds=60), lease_timeout=timedelta(seconds=180),
            timeout=timedelta(seconds=5 if fn_name == "asleep" else 180), hang_timeout=timedelta(seconds=10),
        )
    outcome: dict[str, Any] = {"attempts": len(results.attempts), "total": results[0]}
    if given:
        outcome["promotion"] = keep_model(given, kept_at_start)
    return outcome


def run(address: str, fn_name: str, marks: str, steps: int = STEPS, store: Store | None = None) -> dict[str, Any]:
    """The gang's outcome, as the soak checks it. `gang_failed`: the failure was the gang's
    (a GangError), not the promotion's or the model files' after it."""
    state = soak_gang(address, fn_name, marks, steps, dict(store) if store else None, return_state=True)
    result = state.result(raise_on_failure=False)
    outcome: dict[str, Any] = result if isinstance(result, dict) else {}
    attempts = len(result.attempts) if isinstance(result, GangError) else outcome.get("attempts")
    return {"state": state.type.value, "error": "" if outcome else f"{type(result).__name__}: {result}"[:2000],
            "flow_run_id": str(state.state_details.flow_run_id), "attempts": attempts,
            "gang_failed": isinstance(result, GangError), "total": outcome.get("total"),
            "promotion": outcome.get("promotion")}


if __name__ == "__main__":
    address, fn_name, marks, steps = sys.argv[1:5]
    given = json.loads(sys.argv[5]) if len(sys.argv) > 5 else None
    print(json.dumps(run(address, fn_name, marks, int(steps), given)), flush=True)

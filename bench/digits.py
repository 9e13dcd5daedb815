"""The recipe's defaults against the old ones, on real images: scikit-learn's bundled digits.

    .venv/bin/python -m bench.digits [--epochs 6] [--world-size 2] [--seeds 3] [--random-init]
    .venv/bin/python -m bench.digits --knob label_smoothing=0.1 [--knob mixup_alpha=0.2 ...] [--epochs 5] [--seeds 5]

Writes the 1,797 8x8 digits as 32-px PNGs in class folders. Transfer learning needs a
pretrained backbone, and this machine cannot download torchvision's: so resnet18 is first
trained (the new recipe, `--pretrain-epochs`) on the digits 0-4, and its state_dict is the
starting weights (`model.weights`, a local .pt) of the runs compared, which learn the digits
5-9, none of whose images the backbone saw. `--random-init` compares from random weights on
all ten digits instead. Each run is the project's own recipe (`train_classifier`) on real
gloo ranks, the same epochs, seed and starting weights per pair:

- new: the defaults (SGD's lr scaled by the world size and warmed up over the first epoch;
  no weight decay on norm and bias parameters; a frozen backbone's BatchNorm in eval mode);
- old: what the recipe did before (lr scaled, no warmup, weight decay on every parameter,
  BatchNorm statistics updated under a frozen backbone), by giving `parameter_groups` and
  `frozen_batchnorm` their old behaviour inside each rank.

Each for a fine-tuned (`freeze_backbone=false`) and a frozen-backbone resnet18, printing the
best val accuracy of each and whether the frozen backbone's BatchNorm statistics changed.

`--knob NAME=VALUE` (a `training` field, given as often as there are knobs to try) compares
instead today's defaults against the defaults with that one field changed, fine-tuned, each
seed's runs paired as above (one run of the defaults per seed serves every knob).
Record results in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from PIL import Image

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.indexing import build_manifest
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.gang import RankContext, free_port
from prefect_ddp.tasks.gang.process_group import process_group
from prefect_ddp.tasks.training import optimization
from prefect_ddp.tasks.training.model import build_model
from prefect_ddp.tasks.training.rank_result import RankResult
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.recipe import train_classifier

SIDE = 32


def write_digits(root: Path, labels: range) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    for n, (image, label) in enumerate(zip(digits.images, digits.target)):
        if label not in labels:
            continue
        pixels = (image * 255 / 16).astype("uint8")
        buffer = io.BytesIO()
        Image.fromarray(pixels).convert("RGB").resize((SIDE, SIDE), Image.BILINEAR).save(buffer, format="PNG")
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        (root / str(label) / f"{n:04d}.png").write_bytes(buffer.getvalue())


def old_recipe() -> None:
    """The recipe as it was: one parameter group, all decayed; no BatchNorm kept in eval mode."""
    import prefect_ddp.tasks.training.rank_setup as rank_setup

    optimization.parameter_groups = lambda model, decay: [
        {"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": decay}]
    rank_setup.frozen_batchnorm = optimization.frozen_batchnorm = lambda model: []


def rank(rank_: int, world_size: int, port: int, job: dict, setup: Callable[[], None] | None, results) -> None:
    if setup:
        setup()  # in the rank's own process: a spawned rank imports the project afresh
    torch.set_num_threads(1)
    torch.manual_seed(job["split"]["seed"])  # the same initial weights for the old and the new recipe
    ctx = RankContext(rank=rank_, local_rank=rank_, world_size=world_size, local_world_size=world_size,
                      backend="gloo", device="cpu", worker_address="local", master_addr="127.0.0.1",
                      master_port=port)
    with process_group(backend="gloo", rank=rank_, world_size=world_size, master_addr="127.0.0.1",
                       master_port=port, timeout=timedelta(seconds=300)):
        result = train_classifier(ctx, TrainJob.model_validate(job))
    if rank_ == 0:
        results.put(result)


def train(job: TrainJob, world_size: int, setup: Callable[[], None] | None = None) -> RankResult:
    """Rank 0's result of `train_classifier` on `world_size` spawned gloo ranks, each calling `setup` first."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=rank, args=(r, world_size, port, job.model_dump(), setup, results))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    result = results.get(timeout=3600)
    for process in processes:
        process.join()
    return result


def manifest_of(root: Path):
    listing = {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*.png")}
    return build_manifest(str(root), listing)


# The old recipe's fields: it scaled every optimizer's lr and warmed up never.
OLD_RECIPE = {"scale_lr_by_world_size": True, "warmup_epochs": 0}


def job_for(images: Path, output: Path, seed: int, model: ModelConfig, epochs: int,
            changed: dict[str, Any]) -> TrainJob:
    """The run of `seed` on `images`: the defaults, with the `training` fields in `changed`."""
    manifest = manifest_of(images)
    return TrainJob(
        source=DataLocation(url=str(images)), output=DataLocation(url=str(output)),
        manifest=manifest, split=stratified_split(manifest, 0.2, seed), model=model,
        training=TrainingConfig(epochs=epochs, batch_size=32, image_size=SIDE, num_workers=0, **changed),
    )


def pretrained_backbone(work: Path, epochs: int, world_size: int) -> str:
    """A resnet18 trained on the digits 0-4 by the new recipe: the starting weights' path."""
    write_digits(work / "pretrain", range(5))
    job = job_for(work / "pretrain", work / "pretrain-run", 0, ModelConfig(backbone="resnet18"), epochs, {})
    result = train(job, world_size)
    print(json.dumps({"pretrained_on": "digits 0-4", "best_val_acc": max(h["val_acc"] for h in result.history)}),
          flush=True)
    return str(work / "pretrain-run" / "model.pt")


def batchnorm_changed(job: TrainJob) -> bool:
    """Whether model.pt's BatchNorm statistics differ from those the run started with."""
    trained = torch.load(Path(job.output.url) / "model.pt", weights_only=True)
    start = build_model(job.model, len(job.manifest.classes)).state_dict()
    keys = [k for k in trained if k.endswith(("running_mean", "running_var"))]
    return any(not torch.equal(trained[k], start[k]) for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--pretrain-epochs", type=int, default=6)
    parser.add_argument("--random-init", action="store_true", help="from random weights, on all ten digits")
    parser.add_argument("--knob", type=knob, action="append", default=[], metavar="NAME=VALUE",
                        help="compare the defaults against them with this training field changed (repeatable)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="digits-"))
    weights = None if args.random_init else pretrained_backbone(work, args.pretrain_epochs, args.world_size)
    write_digits(work / "images", range(10) if args.random_init else range(5, 10))
    if args.knob:
        compare_knobs(args, work, ModelConfig(backbone="resnet18", weights=weights))
    else:
        compare_recipes(args, work, weights)


def knob(text: str) -> dict[str, Any]:
    """`--knob NAME=VALUE` as the training field takes it (`label_smoothing=0.1` -> {"label_smoothing": 0.1})."""
    name, _, value = text.partition("=")
    if name not in TrainingConfig.model_fields or not value:
        raise argparse.ArgumentTypeError(f"--knob {text!r}: give NAME=VALUE with NAME a training field, such as "
                                         "label_smoothing=0.1 or mixup_alpha=0.2.")
    return {name: getattr(TrainingConfig.model_validate({name: value}), name)}


def compare_knobs(args: argparse.Namespace, work: Path, model: ModelConfig) -> None:
    """The defaults against each of `args.knob`, fine-tuned, paired per seed: each seed's best val acc
    and the mean paired difference with its standard error."""
    arms = {"defaults": {}} | {",".join(f"{k}={v}" for k, v in changed.items()): changed for changed in args.knob}
    best: dict[tuple[str, int], float] = {}
    for seed in range(args.seeds):
        for number, (name, changed) in enumerate(arms.items()):
            job = job_for(work / "images", work / f"knob-{number}-{seed}", seed, model, args.epochs, changed)
            result = train(job, args.world_size)
            best[name, seed] = round(max(h["val_acc"] for h in result.history), 4)
            print(json.dumps({"arm": name, "seed": seed, "best_val_acc": best[name, seed],
                              "recipe_as_run": asdict(result.recipe)}), flush=True)
    for name in list(arms)[1:]:
        print(f"\n| seed | defaults best val acc | {name} best val acc | difference (points) |")
        print("|---|---|---|---|")
        for seed in range(args.seeds):
            print(f"| {seed} | {best['defaults', seed]} | {best[name, seed]} | "
                  f"{100 * (best[name, seed] - best['defaults', seed]):+.2f} |")
        differences = [best[name, seed] - best["defaults", seed] for seed in range(args.seeds)]
        print(f"| mean of {args.seeds} | | | {name} - defaults: {paired_summary(differences)} |")


def compare_recipes(args: argparse.Namespace, work: Path, weights: str | None) -> None:
    """The old recipe against the new, fine-tuned and frozen, paired per seed."""
    rows = []
    for frozen in (False, True):
        for seed in range(args.seeds):
            for old in (True, False):
                job = job_for(work / "images", work / f"run-{frozen}-{seed}-{old}", seed,
                              ModelConfig(backbone="resnet18", weights=weights, freeze_backbone=frozen),
                              args.epochs, OLD_RECIPE if old else {})
                result = train(job, args.world_size, old_recipe if old else None)
                best = max(h["val_acc"] for h in result.history)
                rows.append({"backbone": "frozen" if frozen else "fine-tuned", "seed": seed,
                             "recipe": "old" if old else "new", "best_val_acc": round(best, 4),
                             "batchnorm_changed": batchnorm_changed(job), "recipe_as_run": asdict(result.recipe)})
                print(json.dumps(rows[-1]), flush=True)
    print("\n| backbone | seed | old best val acc | new best val acc | BatchNorm changed (old / new) |")
    print("|---|---|---|---|---|")
    for frozen in ("fine-tuned", "frozen"):
        differences = []
        for seed in range(args.seeds):
            old_row, new_row = ([r for r in rows if (r["backbone"], r["seed"], r["recipe"]) == (frozen, seed, which)][0]
                                for which in ("old", "new"))
            differences.append(new_row["best_val_acc"] - old_row["best_val_acc"])
            print(f"| {frozen} | {seed} | {old_row['best_val_acc']} | {new_row['best_val_acc']} | "
                  f"{old_row['batchnorm_changed']} / {new_row['batchnorm_changed']} |")
        print(f"| {frozen} | mean of {args.seeds} | new - old: {paired_summary(differences)} | | |")


def paired_summary(differences: list[float]) -> str:
    """The mean paired difference in points, with its standard error (the seeds' spread over sqrt(n)).

    >>> paired_summary([0.01, 0.03])
    '+2.00 points (standard error 1.00)'
    """
    n = len(differences)
    mean = sum(differences) / n
    spread = (sum((d - mean) ** 2 for d in differences) / (n - 1)) ** 0.5 if n > 1 else float("nan")
    return f"{100 * mean:+.2f} points (standard error {100 * spread / n ** 0.5:.2f})"


if __name__ == "__main__":
    main()

"""Score the kept model (the champion) and this run's best epoch on the same images, on every rank.

What is compared and why is prefect_ddp.tasks.results.comparison's: the ranks already hold the
validation images, so the two extra passes over those the champion never trained on are
sharded and all-reduced as validation is. Image by image, so that promotion can weigh the
images only one of the two gets right (`better`, `worse`).
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel

from prefect_ddp.tasks.data.dataset import eval_transform
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.fetch_ahead import FetchAheadLoader
from prefect_ddp.tasks.data.loaders import ManifestImages, RankData
from prefect_ddp.tasks.data.storage import read_bytes_reporting, read_json, torch_from_bytes
from prefect_ddp.tasks.gang import RankContext, all_reduce_sum
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.training.model import load_model
from prefect_ddp.tasks.urls import child_url


class Champion(BaseModel):
    """The kept model a run is compared with, and the run's validation images it never trained on."""

    folder: Location  # the kept version folder (model.pt, model.json), with the output's credentials
    version: str  # its URL, as latest.json names it: promotion compares only if the pointer still does
    run: str  # the run that trained it, for the report
    positions: list[int]  # into the run's manifest: validation images the champion never trained on
    left_out: int  # the run's validation images the champion trained on (another seed or val_fraction)
    split_known: bool  # False: its training keys were not found, so none could be left out


def score_against_champion(ctx: RankContext, champion: Champion, output_url: str, data: RankData,
                           device: torch.device, best_epoch: int) -> dict[str, Any]:
    """Both models' right answers on this rank's share of the champion's positions, summed over the
    gang; this run's model is the best epoch's, in `output_url`, read with the options the rank's
    data path derived for it (prefect_ddp.tasks.data.loaders)."""
    all_reduce_sum([0.0], device)  # rank 0 wrote the best epoch's model.pt (the recipe waited) before any rank reads it
    shard = champion.positions[ctx.rank :: ctx.world_size]
    ours = right_per_image(ctx, output_url, data.output_options, data.images, shard, device)
    theirs = right_per_image(ctx, champion.folder.url, champion.folder.storage_options(), data.images, shard, device)
    paired = [(a, b) for a, b in zip(ours, theirs) if a is not None and b is not None]
    compared, new, old, better, worse = all_reduce_sum([
        len(paired), sum(a for a, _ in paired), sum(b for _, b in paired),
        sum(a and not b for a, b in paired), sum(b and not a for a, b in paired)], device)
    return {
        "images": int(compared), "challenger_acc": new / max(compared, 1), "champion_acc": old / max(compared, 1),
        "better": int(better), "worse": int(worse), "challenger_epoch": best_epoch,
        "champion_version": champion.version, "champion_run": champion.run,
        "left_out": champion.left_out, "split_known": champion.split_known,
    }


@torch.inference_mode()
def right_per_image(ctx: RankContext, folder: str, options: dict[str, Any], images: ManifestImages,
                    positions: list[int], device: torch.device) -> list[bool | None]:
    """Whether the model in `folder` (model.pt, model.json) classifies each image right; None
    for an image that could not be read."""
    card = read_json(child_url(folder, "model.json"), options)
    weights = read_bytes_reporting(child_url(folder, "model.pt"), options, lambda: ctx.progress("download"))
    model = load_model(card, torch_from_bytes(weights)).to(device)
    # Preprocessed as its card says: a champion of another image size is scored as it was validated.
    dataset = images.dataset(positions, eval_transform(card["image_size"], Preprocessing.of_card(card)))
    right: list[bool | None] = []
    for done, (batch, labels) in enumerate(FetchAheadLoader(dataset, list(range(len(dataset))),
                                                            images.training.batch_size), 1):
        hits = model(batch.to(device)).argmax(1).cpu() == labels
        right += [bool(hit) if label >= 0 else None for hit, label in zip(hits.tolist(), labels.tolist())]
        ctx.progress("validation", step=done)  # a long pass is not a hang (tasks/training/epoch.py, validate)
        ctx.check_stop()
    return right

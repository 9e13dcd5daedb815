"""The run's final report: what a person reads first in the UI and in `report.md`.

It says how good the model is (with curves), what it was trained on, where its files are,
and what became of it: promoted to the deployment's kept model or not, and why.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact

from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.storage import write_bytes
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.reporting import epoch_table, markdown_table
from prefect_ddp.tasks.results.comparison import comparison_markdown
from prefect_ddp.tasks.results.plots import markdown_image, training_curves_png
from prefect_ddp.tasks.results.promotion import Promotion
from prefect_ddp.tasks.results.records import AttemptRow, TrainingSummary
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.training.model import WarmStart
from prefect_ddp.tasks.training.optimization import EffectiveRecipe
from prefect_ddp.tasks.training.step_times import PARTS, EpochTiming
from prefect_ddp.tasks.urls import child_url


def promotion_markdown(promotion: Promotion | None, warm: WarmStart | None, pruned_at: int | None = None,
                       in_sweep: bool = False) -> str:
    started = f"Warm-started from the kept model of {warm.origin}" + (
        " (all weights).\n\n" if warm.with_head else " (backbone only: the classes changed).\n\n"
    ) if warm else ""
    if pruned_at:
        return started + f"**Pruned** by the sweep after epoch {pruned_at}: not promoted.\n"
    if in_sweep:
        return started + ("Not promoted: a sweep's trials never promote on their own; the sweep promotes "
                          "its best trial at its end when its settings ask it to.\n")
    if promotion is None:
        return started + ("Not promoted: the run is outside a deployment and sets no "
                          "output.model_name, so no model is kept for it.\n")
    registry = f"\n**Registry disagrees**: {promotion.registry_disagrees}.\n" if promotion.registry_disagrees else ""
    compared = comparison_markdown(promotion.comparison)
    if warm and promotion.comparison and promotion.comparison["left_out"]:
        started += (f"The kept model trained on {promotion.comparison['left_out']} of this run's validation images "
                    "(its split differs), and this run started from it: the val accuracies above count those "
                    "images, the comparison below does not.\n\n")
    if promotion.promoted:
        outcome = f"**Promoted**: `{promotion.pointer_url}` now points to `{promotion.kept_url}`"
    else:
        outcome = f"**Not promoted**: `{promotion.pointer_url}` still points to `{promotion.kept_url}`"
    return started + f"{outcome}: {promotion.reason}.\n" + (f"\n{compared}" if compared else "") + registry


def started_text(started_at: float) -> str:
    """When an attempt started, as the run's log shows times; empty for a record without it."""
    return datetime.fromtimestamp(started_at, timezone.utc).strftime("%H:%M:%S") if started_at else ""


def resumed_text(attempt: AttemptRow) -> str:
    if attempt.resumed_after_epoch is None:
        return "did not reach training"
    where = (f"in epoch {attempt.resumed_after_epoch + 1} at sample {attempt.at_sample}" if attempt.at_sample
             else f"after epoch {attempt.resumed_after_epoch}" if attempt.resumed_after_epoch else "from the start")
    return where + (", handed over in memory" if attempt.handed_over else "")


def attempts_markdown(attempts: list[AttemptRow]) -> str:
    """How the gang got there: one line when it trained in one go, else every attempt, with the
    changes of its size: when, from which to which, why (how the one before ended), and the
    seconds between the two formations."""
    if len(attempts) <= 1:
        return "Trained in one gang attempt, without a restart.\n\n"
    rows = [[a.number, started_text(a.started_at), a.world_size, ", ".join(a.workers), resumed_text(a),
             "" if a.reformed_s is None else f"{a.reformed_s:g}", f"{a.seconds:.0f}", a.ended] for a in attempts]
    changes = [f"{before.world_size} -> {after.world_size} ranks" for before, after in zip(attempts, attempts[1:])
               if before.world_size != after.world_size]
    sizes = f" Its size changed: {', '.join(changes)}." if changes else ""
    return (
        f"**The gang was re-formed: {len(attempts)} attempts.**{sizes} Each went on from the state a rank of "
        "the one before kept in memory, or from its last checkpoint.\n\n"
        + markdown_table(["attempt", "started (UTC)", "ranks", "workers", "went on", "re-formed in s", "seconds",
                          "ended"], rows) + "\n"
    )


def trained_images_text(history: list[dict[str, Any]], train_size: int) -> str:
    """Images trained per epoch beside the training set's size, so that a shortfall shows.

    Ranks take equal steps, so an epoch may train on a few images fewer (shard mode: fewer
    than world size x batch size, docs/parameters.md: training.images_per_shard) or repeat a few
    (per-image mode pads the ranks); a range shows when epochs differ (a gang re-formed on
    fewer ranks).

    >>> trained_images_text([{"train_samples": 1008}, {"train_samples": 1006}], 1010)
    'Images trained per epoch: 1,006 to 1,008 of 1,010 training images.'
    """
    fewest, most = min(h["train_samples"] for h in history), max(h["train_samples"] for h in history)
    trained = f"{fewest:,}" if fewest == most else f"{fewest:,} to {most:,}"
    return f"Images trained per epoch: {trained} of {train_size:,} training images."


def unreadable_text(unreadable: dict[str, Any]) -> str:
    """Images left out as unreadable, by decode-check and during training; empty when none were.

    >>> unreadable_text({"decode_check": 2, "in_training": 0, "keys": []})
    'Unreadable images left out: 2 by decode-check, none during training.'
    """
    decode_check, in_training, keys = unreadable["decode_check"], unreadable["in_training"], unreadable["keys"]
    if not decode_check and not in_training:
        return ""
    if not in_training:
        return f"Unreadable images left out: {decode_check} by decode-check, none during training."
    named = ", ".join(f"`{key}`" for key in keys) + (f" (the first {len(keys)})" if len(keys) < in_training else "")
    return (f"Unreadable images left out: {decode_check} by decode-check, {in_training} more during training "
            f"(missing or not decodable when read): {named}.")


def time_markdown(timing: EpochTiming | None, epoch: int) -> str:
    """Where the last epoch's time went, rank by rank, under its verdict; empty for a run
    recorded before the accounting (prefect_ddp.tasks.training.step_times)."""
    if not timing:
        return ""
    header = ["rank", "step s", *(f"{p} %" for p in PARTS), "validation s", "images"]
    rows = [[r.rank, r.step_s, *(round(100 * getattr(r, p) / max(r.step_s, 1e-9), 1) for p in PARTS),
             r.validation, r.images] for r in timing.per_rank]
    checkpoint = (f"; checkpoints: training waited {timing.checkpoint_s} s per epoch for rank 0's, "
                  f"{100 * (timing.checkpoint_share or 0):.1f} % of its time ({timing.checkpoints})"
                  if timing.checkpoint_s is not None else "")
    return (
        f"## Where the time went (epoch {epoch})\n\n**{timing.verdict}**\n\n"
        f"{timing.images_per_s} images/s; slowest rank {timing.slowest_rank} "
        f"({timing.slower_by}x the median of the others' own work){checkpoint}.\n\n"
        + markdown_table(header, rows) + "\n"
    )


def recipe_text(recipe: EffectiveRecipe | None) -> str:
    """The recipe as it ran, with what its empty fields were left to and the fine-tuning knobs
    set; empty for a run recorded before.

    >>> recipe_text(EffectiveRecipe(lr=0.04, lr_scaled_by=4, warmup_epochs=1, weight_decay=0.0001,
    ...                             frozen_batchnorm=0, sync_batchnorm=False))
    'Recipe as run: lr 0.04 per step (4x the per-rank lr: the world size), warmed up over 1 epoch(s); weight decay 0.0001 on weights, none on norm and bias parameters; BatchNorm per rank.'
    >>> recipe_text(EffectiveRecipe(lr=0.01, lr_scaled_by=1, warmup_epochs=0, weight_decay=0.0,
    ...                             frozen_batchnorm=0, sync_batchnorm=False,
    ...                             knobs={"label_smoothing": 0.1, "trivial_augment": True}))
    'Recipe as run: lr 0.01 per step, no warmup; weight decay 0 on weights, none on norm and bias parameters; BatchNorm per rank; label_smoothing 0.1; trivial_augment.'
    """
    if not recipe:
        return ""
    scaled = f" ({recipe.lr_scaled_by}x the per-rank lr: the world size)" if recipe.lr_scaled_by > 1 else ""
    warmup = f", warmed up over {recipe.warmup_epochs} epoch(s)" if recipe.warmup_epochs else ", no warmup"
    norms = ("BatchNorm synchronised across ranks" if recipe.sync_batchnorm else "BatchNorm per rank") + (
        f", {recipe.frozen_batchnorm} frozen layer(s) in eval mode" if recipe.frozen_batchnorm else "")
    knobs = "".join(f"; {name} {value:g}" if not isinstance(value, bool) else f"; {name}"
                    for name, value in recipe.knobs.items())
    return (f"Recipe as run: lr {recipe.lr:g} per step{scaled}{warmup}; weight decay {recipe.weight_decay:g} "
            f"on weights, none on norm and bias parameters; {norms}{knobs}.")


def report_markdown(summary: TrainingSummary, manifest: Manifest, curves: str, outcome: str) -> str:
    workers = ", ".join(f"rank {r.rank}: `{r.worker_address}`" for r in summary.ranks)
    unreadable = unreadable_text(summary.unreadable)
    return (
        f"# Transfer learning report\n\n"
        f"**Model: the weights of epoch {summary.best_epoch}, val accuracy {summary.best_val_acc:.4f}** "
        f"(the epoch with the {summary.selected_by}); the last epoch's val accuracy was "
        f"{summary.final_val_acc:.4f}.\n\n"
        + outcome
        + f"\nData: `{manifest.root}`, {len(manifest.classes)} classes, {summary.train_size} train / "
        f"{summary.val_size} val images. World size {summary.world_size} ({workers}).\n\n"
        + trained_images_text(summary.history, summary.train_size) + "\n\n"
        + (f"{recipe}\n\n" if (recipe := recipe_text(summary.recipe)) else "")
        + (f"{unreadable}\n\n" if unreadable else "")
        + attempts_markdown(summary.attempts)
        + "## Curves\n\n" + curves + "\n\n"
        + time_markdown(summary.time, summary.history[-1]["epoch"])
        + "## Per epoch (all ranks)\n\n"
        + epoch_table(summary.history)
        + "\n## Files\n\n"
        + "".join(f"- {name}: `{url}`\n" for name, url in summary.files.items())
    )


@task(name="report", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def publish_report(summary: TrainingSummary, manifest: Manifest, output: Location,
                   promotion: Promotion | None, warm: WarmStart | None, in_sweep: bool = False) -> str:
    """Write `curves.png` and `report.md` beside the model and leave the `training-report` artifact."""
    options = output.storage_options()
    png = training_curves_png(summary.history)
    write_bytes(child_url(output.url, "curves.png"), png, options)
    report = report_markdown(summary, manifest, markdown_image(png, "loss and accuracy per epoch"),
                             promotion_markdown(promotion, warm, summary.pruned_at, in_sweep))
    write_bytes(child_url(output.url, "report.md"), report.encode(), options)
    create_markdown_artifact(key="training-report", markdown=report, description="Final report")
    return report

"""Turn the ranks' results into the run's record: metrics, manifest and split under the output.

Every rank reports the same all-reduced metrics; a disagreement means the ranks did not
train one model together, and is an error rather than something to average away.
"""

from __future__ import annotations

import math
from typing import Any

from prefect import task
from pydantic import ValidationError

from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.data.storage import exists, read_json, write_json
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.results.records import AttemptRow, RankPlace, TrainingSummary
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.training.rank_result import RankResult
from prefect_ddp.tasks.training.step_times import EpochTiming
from prefect_ddp.tasks.urls import child_url

GLOBAL_METRICS = ("epoch", "train_loss", "train_acc", "val_loss", "val_acc", "train_samples", "val_samples",
                  "unreadable")


def check_stopped(results: list[RankResult]) -> None:
    """Fail the run when its ranks stopped because too many images were unreadable (prefect_ddp.tasks.training.unreadable).

    The ranks stop together and return the reason rather than raise it: a rank that raised
    would be taken for a failed one, and the gang re-formed only to meet the same images.
    """
    stopped = results[0].stopped if results else None
    if stopped:
        raise ValueError(stopped)


class EpochsDisagree(RuntimeError):
    """The files of a run name different epochs as its best: the model shipped is not the one reported."""


def check_one_best_epoch(summary: TrainingSummary, card: dict[str, Any]) -> None:
    """Fail loudly unless the ranks' result, model.json (the card of model.pt's weights) and the
    champion comparison name one best epoch; metrics.json and the pointer are written from the result.

    The recipe writes model.pt and its card together, and forgets the best weights only once both
    landed (tasks/training/best_weights.py): a disagreement is a defect of this project, never
    something to report around.
    """
    named = {"the ranks' result": summary.best_epoch, "model.json": card.get("epoch")}
    if summary.comparison:
        named["the champion comparison"] = summary.comparison.get("challenger_epoch")
    if len(set(named.values())) > 1:
        said = ", ".join(f"{where} says epoch {epoch}" for where, epoch in named.items())
        raise EpochsDisagree(
            f"The run's files disagree on which epoch model.pt holds ({said}), so the model shipped may not "
            "be the one the metrics describe. Nothing was written or promoted; please report this with the "
            "run's log. Retrying the flow run resumes from its last checkpoint and writes model.pt again."
        )


def global_history(results: list[RankResult]) -> list[dict[str, Any]]:
    """Rank 0's per-epoch history, after checking that every rank saw the same numbers.

    A loss that diverged to NaN is the same on every rank, yet NaN != NaN: compared as is,
    a 2-rank run whose loss went NaN in one epoch failed here with "the ranks did not train
    together" (seen in the suite), hiding the divergence the report would have shown.
    """
    if not results:
        raise ValueError("No rank results to aggregate: the gang returned nothing.")
    reference = global_metrics(results[0].history)
    for result in results[1:]:
        theirs = global_metrics(result.history)
        if theirs != reference:
            epoch = next((i for i, (a, b) in enumerate(zip(theirs, reference)) if a != b), min(len(theirs), len(reference)))
            raise ValueError(
                f"Rank {result.rank} reports other global metrics than rank 0 from epoch {epoch + 1} on "
                f"({theirs[epoch:epoch + 1]} vs {reference[epoch:epoch + 1]}; {len(theirs)} against {len(reference)} "
                "epochs): the ranks did not train together."
            )
    return results[0].history


def global_metrics(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The all-reduced metrics of each epoch, NaN as a string so that equal histories compare equal."""
    return [{k: "nan" if isinstance(h[k], float) and math.isnan(h[k]) else h[k] for k in GLOBAL_METRICS}
            for h in history]


def last_epoch_time(history: list[dict[str, Any]], checkpoint_s: list[float],
                    checkpoints: list[dict[str, Any]] | None = None) -> EpochTiming | None:
    """Where the last epoch's time went (prefect_ddp.tasks.training.step_times), with what rank
    0's checkpoints cost over the epochs this attempt trained (`checkpoint_s`, one per epoch, 0
    where none was taken; `checkpoints`, its decisions); None for an epoch recorded before the
    timing was, or in another shape (a checkpoint from an older release, resumed by this one)."""
    recorded = history[-1].get("time")
    try:
        timing = EpochTiming.model_validate(recorded)
    except ValidationError:
        return None
    if not checkpoint_s:
        return timing
    trained_s = sum(float(h.get("seconds", 0.0)) for h in history[-len(checkpoint_s):])
    waited_s = sum(checkpoint_s)
    return timing.model_copy(update={
        "checkpoint_s": round(waited_s / len(checkpoint_s), 3),
        "checkpoint_share": round(waited_s / max(trained_s + waited_s, 1e-9), 4),
        "checkpoints": checkpoint_plan(checkpoints or []),
    })


def checkpoint_plan(decisions: list[dict[str, Any]]) -> str | None:
    """Rank 0's checkpoint decisions in words: which epochs it saved, at what interval."""
    if not decisions:
        return None
    saved = sum(d["saved"] for d in decisions)
    chosen = [d for d in decisions if d["interval_s"]]
    how = ("every epoch" if not decisions[-1]["auto"] else "auto: the first saves" if not chosen else
           f"auto: interval {chosen[-1]['interval_s']:g} s, "
           f"{'capped at training.max_lost_min' if chosen[-1].get('capped') else 'by Young/Daly'}")
    return f"{saved} of {len(decisions)} epochs checkpointed, {how}"


def attempt_rows(gang_attempts: list[dict[str, Any]], resumes: list[dict[str, Any]]) -> list[AttemptRow]:
    """One row per gang attempt: the supervisor's view (workers, how it ended, when) joined with
    rank 0's (where it went on from; None when it never got that far)."""
    resumed = {r["attempt"]: r for r in resumes}
    rows = []
    for before, attempt in zip([None, *gang_attempts], gang_attempts):
        start = resumed.get(attempt["number"], {})
        ended_before = before["started_at"] + before["seconds"] if before and before.get("started_at") else None
        rows.append(AttemptRow(
            **attempt, resumed_after_epoch=start.get("resumed_after_epoch"), at_sample=start.get("at_sample", 0),
            handed_over=start.get("handed_over", False),
            reformed_s=round(attempt["started_at"] - ended_before, 1) if ended_before else None))
    return rows


def summarize(results: list[RankResult], split: Split, files: dict[str, str],
              gang_attempts: list[dict[str, Any]] | None = None) -> TrainingSummary:
    """The run's record. `best_epoch` is the epoch whose weights rank 0 kept in model.pt (by
    prefect_ddp.tasks.selection's rule), so the summary, the report and promotion name that model."""
    history = global_history(results)
    first = results[0]
    best = next(h for h in history if h["epoch"] == first.best_epoch)
    return TrainingSummary(
        world_size=len(results),
        ranks=[RankPlace(rank=r.rank, worker_address=r.worker_address) for r in results],
        split_digests=sorted({r.split_digest for r in results}),
        train_size=len(split.train),
        val_size=len(split.val),
        history=history,
        best_epoch=best["epoch"],
        best_val_acc=best["val_acc"],
        selected_by=first.selected_by,
        final_val_acc=history[-1]["val_acc"],
        final_val_loss=history[-1]["val_loss"],
        time=last_epoch_time(history, first.checkpoint_s, first.checkpoints),
        pruned_at=first.pruned_at,
        attempts=attempt_rows(gang_attempts or [], first.attempts),
        # Left out as unreadable: by decode-check, and in training (the first keys; each epoch's record holds all).
        unreadable=first.unreadable,
        recipe=first.recipe,  # as it ran: the defaults that empty fields left (optimization.py)
        comparison=first.comparison,  # with the kept model, on the same images (comparison.py)
        files=files,
    )


@task(name="aggregate", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def aggregate(
    results: list[RankResult], manifest: Manifest, split: Split, output: Location,
    gang_attempts: list[dict[str, Any]] | None = None,
) -> TrainingSummary:
    """Write metrics, manifest and split under the run's output; return the summary.

    `gang_attempts` are run_gang's attempts as dicts (GangAttempt's fields).
    Fails, writing nothing, when the ranks stopped for too many unreadable images (`check_stopped`),
    or the run's files name different best epochs (`check_one_best_epoch`).
    """
    check_stopped(results)
    options = output.storage_options()
    files = {name: child_url(output.url, name) for name in
             ("model.pt", "model.json", "metrics.json", "manifest.json", "split.json", "report.md", "curves.png")}
    if not exists(files["model.pt"], options):
        raise FileNotFoundError(f"Rank 0 reported success but wrote no model at {files['model.pt']}.")
    summary = summarize(results, split, files, gang_attempts)
    check_one_best_epoch(summary, read_json(files["model.json"], options))
    write_json(files["metrics.json"], summary.model_dump(), options)
    write_json(files["manifest.json"], manifest.model_dump(), options)
    write_json(files["split.json"], split.model_dump() | {
        "train_keys": [manifest.paths[i] for i in split.train],
        "val_keys": [manifest.paths[i] for i in split.val],
    }, options)
    return summary

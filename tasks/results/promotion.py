"""Keep the best model of a deployment's runs: promote a run's model only when it is no worse.

A scheduled deployment retrains every night on whatever is in the bucket; a bad night (a
broken upload, an unlucky seed) must not replace a good model. Each run's model is
compared with the model kept under `<output>/<name>/` on the same images, those of the run's
validation set the kept model never trained on, and takes its place only when it is right
more often by more than the noise of that comparison (prefect_ddp.tasks.results.comparison).
`name` is the deployment's name, or `output.model_name`. Sweep trials never promote; a
sweep may promote its best trial once, at its end (`SweepSettings.promote`).

What is kept is versioned, so two runs promoting at once can neither both win nor leave a
model beside another model's card:

    <output>/<name>/versions/<run folder>/   model.pt, model.json, split.json, metrics.json: written
                                             whole before anything points at them, then
                                             never changed
    <output>/<name>/latest.json              the pointer: which version is kept, its metric
                                             and run; swapped by compare-and-swap
                                             (prefect_ddp.tasks.results.pointer), so the rule is applied to
                                             the model actually kept, never to a stale read

A reader reads the pointer once and then only the version it names, which never changes.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from prefect import task
from pydantic import BaseModel

from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.storage import (
    exists,
    read_bytes,
    read_json,
    remove_tree,
    write_bytes,
    write_json,
)
from prefect_ddp.tasks.location import Location, LocationT
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.results.comparison import SPLIT_FILE, UnusableChampion, decide_on_comparison
from prefect_ddp.tasks.results.pointer import Document, read_json_document, update_json
from prefect_ddp.tasks.results.records import TrainingSummary
from prefect_ddp.tasks.results.registry import ALIAS, Registration, align_champion, drop_version, register_version
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.training.model import SAVED_MODEL_FILES, WarmStart, model_problem
from prefect_ddp.tasks.urls import child_url, safe_segment

METRIC = "best_val_acc"
POINTER = "latest.json"
VERSIONS = "versions"


class Promotion(BaseModel):
    """What happened to a run's model, for the report and the flow's result."""

    promoted: bool
    reason: str
    pointer_url: str  # NAME/latest.json
    kept_url: str | None  # the version folder kept now (this run's when promoted)
    previous_run: str | None = None
    previous_metric: float | None = None
    comparison: dict[str, Any] | None = None  # both models' accuracy on the same images (comparison.py)
    registered: dict[str, str] | None = None  # the MLflow model version made for this run, when kept
    champion: str | None = None  # the version the registry's alias names after this promotion
    registry_disagrees: str | None = None  # how the alias and the pointer disagree, when they still do


def kept_location(output_base: LocationT, name: str) -> LocationT:
    """`<output>/<name>`, with the output's credentials; `name` becomes one safe segment."""
    return output_base.with_url(child_url(output_base.url, safe_segment(name)))


# `kept_at_start` of a promotion that does not know which model was kept when its run began.
NOT_RECORDED = "not recorded"
ALREADY_KEPT = "kept already: the pointer names this run's version (a retry after its pointer write landed)"


def decide(new_metric: float, current: Document | None, comparison: dict[str, Any] | None = None,
           min_improvement: float | None = None, kept_at_start: str | None = NOT_RECORDED,
           unusable: UnusableChampion | None = None) -> tuple[bool, str]:
    """The promotion rule: promote when there is no kept model, or the kept one cannot be used
    (`unusable`: its files missing or unreadable when the run began, and still the one kept), or
    the new one beats it on the same images (prefect_ddp.tasks.results.comparison); without such a
    comparison (the kept model predicts other classes), when the new one's val accuracy is at
    least as good. A model kept while the run trained (`kept_at_start`: the version kept when
    it began) was compared with nothing: it stays."""
    if current is None:
        return True, f"first model kept under this name, {METRIC} {new_metric:.4f}"
    if unusable and unusable.version == current["version"]:
        return True, unusable.why_replaced()
    run = current.get("run", {}).get("name", "an earlier run")
    if comparison:  # the champion it was scored against was the one kept when the run began
        kept_at_start = comparison["champion_version"]
    if kept_at_start != NOT_RECORDED and kept_at_start != current["version"]:
        return False, (f"the kept model changed while this run trained (now {run}'s), so this run was not compared "
                       "with it; run again to compare")
    if comparison:
        return decide_on_comparison(comparison, current, min_improvement)
    old = current[METRIC]
    if new_metric >= old:
        return True, f"{METRIC} {new_metric:.4f} is at least as good as {old:.4f} of {run}"
    return False, f"{METRIC} {new_metric:.4f} is worse than {old:.4f} of {run}, which stays"


def pointer_fields(summary: TrainingSummary) -> dict[str, Any]:
    """What latest.json says of the kept model's scores besides its own val accuracy: the comparison
    that promoted it, when there was one."""
    return {"comparison": summary.comparison} if summary.comparison else {}


def read_pointer(kept: Location) -> Document | None:
    """Which version is kept now (with its metric and run), or None before the first promotion."""
    return read_json_document(child_url(kept.url, POINTER), kept.storage_options())


def write_version(summary: TrainingSummary, run_output: Location, version: Location,
                  record: dict[str, Any]) -> None:
    """Copy the run's model and card into its version folder, metrics.json last."""
    source, target = run_output.storage_options(), version.storage_options()
    for name in SAVED_MODEL_FILES:
        write_bytes(child_url(version.url, name), read_bytes(child_url(run_output.url, name), source), target)
    kept = {METRIC: summary.best_val_acc, "best_epoch": summary.best_epoch, "final_val_acc": summary.final_val_acc,
            "final_val_loss": summary.final_val_loss, "history": summary.history}
    # The split beside the model: a later run leaves its training images out of the comparison.
    if exists(split := child_url(run_output.url, SPLIT_FILE), source):
        write_bytes(child_url(version.url, SPLIT_FILE), read_bytes(split, source), target)
    write_json(child_url(version.url, "metrics.json"), kept | pointer_fields(summary) | {"run": record}, target)


@task(name="promote", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def promote(summary: TrainingSummary, run_output: Location, kept: Location,
            run: dict[str, str], registry: Registration | None = None,
            min_improvement: float | None = None, kept_at_start: str | None = NOT_RECORDED,
            unusable: UnusableChampion | None = None) -> Promotion:
    """Keep this run's model under `kept` when it beats the one kept there (`decide`).

    The decision is taken again inside the pointer's compare-and-swap, against the model
    kept at that moment: a better model promoted meanwhile by another run stays. With
    `registry`, the registered model and its `champion` alias follow the pointer
    (prefect_ddp.tasks.results.registry).
    """
    metric = summary.best_val_acc
    version = version_location(kept, run_output)
    pointer_url = child_url(kept.url, POINTER)
    seen = read_pointer(kept)
    comparison = summary.comparison
    retried = names_version(seen, version)  # a retry of this task after its pointer write landed
    if retried:
        promoted, reason, registered, seen = True, ALREADY_KEPT, (seen or {}).get("registered"), None
    else:
        registered = None
        promoted, reason = decide(metric, seen, comparison, min_improvement, kept_at_start, unusable)
    if promoted and not retried:  # write the candidate whole, then point at it if it still wins
        record = run | {"url": run_output.url, "promoted_at": datetime.now(timezone.utc).isoformat()}
        write_version(summary, run_output, version, record)
        registered = (register_version(registry.model, registry.name, version.url, pointer_url, comparison)
                      if registry and registry.model else None)
        wrote = False
        last_read = seen  # the newest pointer this promotion could read

        def swap(current: Document | None) -> Document | None:
            nonlocal promoted, reason, seen, wrote, last_read
            # There but cut short or garbled (another writer's, since it was read): decided against the last read.
            unreadable = current is None and exists(pointer_url, kept.storage_options())
            seen = last_read if unreadable else current
            last_read = seen
            promoted, reason = decide(metric, seen, comparison, min_improvement, kept_at_start, unusable)
            if unreadable:
                reason = unreadable_pointer_reason(seen, reason, promoted)
            pointer = {METRIC: metric, "version": version.url, "run": record} | pointer_fields(summary)
            wrote = wrote or promoted
            if not promoted:  # a pointer it could not read names again the model that stays
                return seen if unreadable else None
            return pointer | ({"registered": registered} if registered else {})

        update_json(pointer_url, kept.storage_options(), swap)
        if not promoted and not wrote:  # overtaken by a better model: nothing ever pointed at this version
            remove_tree(version.url, version.storage_options())
            if registered:
                drop_version(registry.model, registered)
                registered = None
        elif not promoted:  # a pointer to it may have landed and been read before a rival's replaced it
            run_logger().info("Left %s in place: this run's pointer to it may have been read before "
                              "another run's replaced it.", version.url)
    run_logger().info("Model %s: %s.", "promoted" if promoted else "not promoted", reason)
    # Kept or not, the alias follows the pointer: this also repairs an earlier promotion's
    # registry failure (docs/architecture.md, "Tracking and the registry").
    check = (align_champion(registry.tracking, registry.name, lambda: read_pointer(kept), remove_unregistered=True)
             if registry else None)
    if check and check.now:
        run_logger().info("Registered model %r: alias %r names version %s.", check.name, ALIAS, check.now)
    if promoted:
        kept_url = version.url
    else:
        assert seen is not None, "decide() promotes where no model is kept"
        kept_url = seen["version"]
    return Promotion(
        promoted=promoted, reason=reason, pointer_url=pointer_url,
        kept_url=kept_url,
        previous_run=seen["run"].get("name") if seen else None,
        previous_metric=seen[METRIC] if seen else None,
        comparison=comparison, registered=registered, champion=check.now if check else None,
        registry_disagrees=check.disagreement() if check and not check.agrees else None,
    )


def unreadable_pointer_reason(last_read: Document | None, reason: str, promoted: bool) -> str:
    """The reason of a promotion that found the pointer there but unreadable when it came to write it."""
    if last_read is None:
        return f"{POINTER} was there but could not be read (the run's log says why), so it was replaced: {reason}"
    run = last_read.get("run", {}).get("name", "an earlier run")
    then = "this run's pointer replaced it" if promoted else "it names that model again"
    return (f"{POINTER} could not be read when this run came to write it (cut short or garbled since it was read), "
            f"so this run was decided against the last one read, {run}'s, and {then}: {reason}")


def names_version(pointer: Document | None, version: Location) -> bool:
    """Whether `pointer` names `version`: only this run's promotion writes a pointer to its own
    version, so it is this run's success however the write's reply was lost (issue 46)."""
    return pointer is not None and pointer.get("version") == version.url


def version_location(kept: Location, run_output: Location) -> Location:
    """`<kept>/versions/<run folder>`: one per flow run, so no two runs ever share one."""
    run_folder = run_output.url.rstrip("/").rsplit("/", 1)[-1]
    return kept.with_url(child_url(kept.url, VERSIONS, safe_segment(run_folder)))


def find_warm_start(kept: Location, backbone: str, classes: list[str]) -> WarmStart | None:
    """The kept model to start from, or None when there is none or it is another backbone."""
    pointer = read_pointer(kept)
    if pointer is None:
        run_logger().info("No model kept at %s yet: training starts from model.weights.", kept.url)
        return None
    folder = kept.with_url(pointer["version"])
    if problem := model_problem(folder):
        run_logger().warning("Not warm-starting from the kept model of run `%s` in %s: %s. Training starts from "
                             "model.weights, and this run's model replaces it when the run completes.",
                             pointer["run"]["name"], folder.url, problem)
        return None
    return warm_start_from(folder, backbone, classes, f"run `{pointer['run']['name']}`")


def warm_start_from(folder: Location, backbone: str, classes: list[str], origin: str) -> WarmStart | None:
    """Start from the model in `folder` (model.pt, model.json), or None when it is another backbone."""
    card = read_json(child_url(folder.url, "model.json"), folder.storage_options())
    if card["backbone"] != backbone:
        run_logger().warning("The model of %s is a %s, not a %s: not warm-starting from it.",
                             origin, card["backbone"], backbone)
        return None
    return WarmStart(
        model=folder.with_url(child_url(folder.url, "model.pt")),
        with_head=card["classes"] == classes,
        origin=origin,
        preprocessing=Preprocessing.of_card(card),
    )

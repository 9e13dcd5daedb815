"""Keep the best model of a deployment's runs: promote a run's model only when it is no worse.

A scheduled deployment retrains every night on whatever is in the bucket; a bad night (a
broken upload, an unlucky seed) must not replace a good model. Each run's final val
accuracy is compared with the model kept under `<output>/<name>/latest/`, and the new one
takes its place only when it is at least as good. `name` is the deployment's name, or
`output.model_name`.

`latest/` holds `model.pt`, `model.json` (the card) and `metrics.json`, which names the run
that made the model. `metrics.json` is written last: it is the commit marker, so a reader
that finds it finds the model beside it. A later run can warm-start from `latest/`.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from prefect import task
from pydantic import BaseModel
from torch import nn

from blocks.data_location import DataLocation
from tasks.model import load_backbone_state
from tasks.reporting import run_logger
from tasks.retries import retry_transient
from tasks.storage import child_url, exists, load_torch, read_bytes, read_json, safe_segment, write_bytes, write_json

METRIC = "final_val_acc"
KEPT_FILES = ("model.pt", "model.json")


class Promotion(BaseModel):
    """What happened to a run's model, for the report and the flow's result."""

    promoted: bool
    reason: str
    latest_url: str
    previous_run: str | None = None
    previous_metric: float | None = None


class WarmStart(BaseModel):
    """The kept model a run starts from: where its weights are and whether its head fits."""

    model: DataLocation  # url: latest/model.pt, with the output's credentials
    with_head: bool
    run: str


def latest_location(output_base: DataLocation, name: str) -> DataLocation:
    """`<output>/<name>/latest`, with the output's credentials; `name` becomes one safe segment."""
    return output_base.with_url(child_url(output_base.url, safe_segment(name), "latest"))


def decide(new_metric: float, current: dict[str, Any] | None) -> tuple[bool, str]:
    """The promotion rule: promote when there is no kept model or the new one is as good."""
    if current is None:
        return True, f"first model kept under this name, {METRIC} {new_metric:.4f}"
    old = current[METRIC]
    run = current.get("run", {}).get("name", "an earlier run")
    if new_metric >= old:
        return True, f"{METRIC} {new_metric:.4f} is at least as good as {old:.4f} of {run}"
    return False, f"{METRIC} {new_metric:.4f} is worse than {old:.4f} of {run}, which stays"


def read_kept_metrics(latest: DataLocation) -> dict[str, Any] | None:
    url = child_url(latest.url, "metrics.json")
    options = latest.storage_options()
    return read_json(url, options) if exists(url, options) else None


@task(name="promote", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def promote(summary: dict[str, Any], run_output: DataLocation, latest: DataLocation,
            run: dict[str, str]) -> Promotion:
    """Copy this run's model to `latest` when it is at least as good as the one kept there."""
    current = read_kept_metrics(latest)
    promoted, reason = decide(summary[METRIC], current)
    if promoted:
        source, target = run_output.storage_options(), latest.storage_options()
        for name in KEPT_FILES:
            write_bytes(child_url(latest.url, name), read_bytes(child_url(run_output.url, name), source), target)
        kept = {key: summary[key] for key in (METRIC, "best_val_acc", "best_epoch", "final_val_loss", "history")}
        record = run | {"url": run_output.url, "promoted_at": datetime.now(timezone.utc).isoformat()}
        write_json(child_url(latest.url, "metrics.json"), kept | {"run": record}, target)
    run_logger().info("Model %s: %s.", "promoted" if promoted else "not promoted", reason)
    return Promotion(
        promoted=promoted, reason=reason, latest_url=latest.url,
        previous_run=current["run"].get("name") if current else None,
        previous_metric=current[METRIC] if current else None,
    )


def find_warm_start(latest: DataLocation, backbone: str, classes: list[str]) -> WarmStart | None:
    """The kept model to start from, or None when there is none or it is another backbone."""
    log = run_logger()
    kept = read_kept_metrics(latest)
    if kept is None:
        log.info("No model kept at %s yet: training starts from model.weights.", latest.url)
        return None
    card = read_json(child_url(latest.url, "model.json"), latest.storage_options())
    if card["backbone"] != backbone:
        log.warning("The model kept at %s is a %s, not a %s: not warm-starting from it.",
                    latest.url, card["backbone"], backbone)
        return None
    return WarmStart(
        model=latest.with_url(child_url(latest.url, "model.pt")),
        with_head=card["classes"] == classes,
        run=kept["run"]["name"],
    )


def load_warm_start(model: nn.Module, warm: WarmStart) -> None:
    """Load the kept weights: all of them when the classes match, else all but the head."""
    state = load_torch(warm.model.url, warm.model.storage_options())
    if warm.with_head:
        model.load_state_dict(state)
    else:
        load_backbone_state(model, state, warm.model.url)

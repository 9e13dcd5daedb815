"""What a person compares after a sweep: a table sorted by the metric, and the two plots of
the Dask tutorial this project grew from (the metric per epoch, and against wall time),
for every trial; Optuna's parameter importances when there are enough trials; the best
trial's model. Everything is read back from the study, so a resumed sweep reports the
trials of every earlier attempt too.
"""

from __future__ import annotations

from typing import Any

import optuna
from matplotlib.figure import Figure
from optuna.trial import TrialState
from prefect import task
from prefect.artifacts import create_markdown_artifact

from prefect_ddp.tasks.data.storage import write_bytes, write_json
from prefect_ddp.tasks.gang import REPORTED_AT
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.reporting import markdown_table, run_logger
from prefect_ddp.tasks.results.plots import markdown_image, png_bytes
from prefect_ddp.tasks.selection import best_index
from prefect_ddp.tasks.sweeps.search_space import describe
from prefect_ddp.tasks.sweeps.settings import (
    INTERRUPTED,
    OUTCOME,
    RETRIED,
    SweepSettings,
    TrialOutcome,
    direction_of,
)
from prefect_ddp.tasks.urls import child_url, safe_segment

MIN_TRIALS_FOR_IMPORTANCE = 3


def trial_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """One record per trial the sweep ran (not those a crash interrupted), best first."""
    maximize = study.direction.name == "MAXIMIZE"
    retried = set(study.user_attrs.get(RETRIED, []))
    rows = []
    for trial in study.get_trials(deepcopy=False):
        if trial.user_attrs.get(INTERRUPTED) or not trial.state.is_finished():
            continue
        curve = sorted(trial.intermediate_values.items())
        outcome = TrialOutcome.model_validate(trial.user_attrs.get(OUTCOME, {}))
        # The epoch whose weights the trial kept (prefect_ddp.tasks.selection): the one its model holds.
        best_epoch = curve[best_index([v for _, v in curve], direction_of(study))][0] if curve else None
        start = trial.datetime_start.timestamp() if trial.datetime_start else 0.0
        rows.append({
            "trial": trial.number,
            "params": trial.params,
            "state": state_text(trial.state.name, outcome, curve, trial.number in retried),
            "value": trial.value if trial.value is not None else (dict(curve).get(best_epoch) if best_epoch is not None else None),
            "best_epoch": best_epoch,
            "seconds": outcome.seconds,
            "run": outcome.run,
            "model_url": outcome.model_url,
            "mlflow_model": outcome.mlflow_model,  # the trial's logged model, when tracked
            "flow_run_id": outcome.flow_run_id,
            "workers": outcome.workers,
            "curve": [{"epoch": e, "value": v, "elapsed_s": trial.user_attrs.get(f"{REPORTED_AT}{e}", start) - start}
                      for e, v in curve],
        })
    missing = float("-inf") if maximize else float("inf")
    return sorted(rows, key=lambda r: r["value"] if r["value"] is not None else missing, reverse=maximize)


def state_text(state: str, outcome: TrialOutcome, curve: list, retried: bool = False) -> str:
    if state == "PRUNED":
        return f"pruned at epoch {curve[-1][0]}" if curve else "pruned"
    if state == "FAIL":
        again = " (its parameters queued again by a later run)" if retried else ""
        return f"failed: {outcome.message or 'no metric reported'}{again}"
    return "completed"


def curves_png(rows: list[dict[str, Any]], metric: str) -> bytes:
    """The tutorial's two plots side by side: metric per epoch, metric against wall time."""
    figure = Figure(figsize=(10, 3.6), dpi=90, layout="constrained")
    per_epoch, per_second = figure.subplots(1, 2)
    for row in sorted(rows, key=lambda r: r["trial"]):
        label = f"trial {row['trial']}"
        per_epoch.plot([p["epoch"] for p in row["curve"]], [p["value"] for p in row["curve"]], "o-", label=label)
        per_second.plot([p["elapsed_s"] for p in row["curve"]], [p["value"] for p in row["curve"]], "o-", label=label)
    for axes, xlabel in ((per_epoch, "epoch"), (per_second, "wall time (s)")):
        axes.set_xlabel(xlabel)
        axes.set_ylabel(metric)
        axes.grid(alpha=0.3)
    per_epoch.legend(fontsize="small")
    return png_bytes(figure)


def importances(study: optuna.Study) -> dict[str, float] | None:
    """Optuna's parameter importances, when enough trials completed to say anything."""
    completed = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(completed) < MIN_TRIALS_FOR_IMPORTANCE or len(study.best_trial.params) < 2:
        return None
    try:
        return optuna.importance.get_param_importances(study)
    except Exception as exc:  # too little variation for the evaluator: say so, keep the report
        run_logger().info("No parameter importances: %s", exc)
        return None


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best completed trial (rows come best first); pruned and failed ones never win."""
    return next((r for r in rows if r["state"] == "completed"), None)


def sweep_markdown(settings: SweepSettings, rows: list[dict[str, Any]], best: dict[str, Any] | None,
                   plot: str, weights: dict[str, float] | None) -> str:
    table = markdown_table(
        ["trial", "parameters", "best epoch", settings.metric, "seconds", "state", "run"],
        [[r["trial"], describe(r["params"], digits=4, separator=", "),
          r["best_epoch"], r["value"], r["seconds"], r["state"], r["run"]] for r in rows],
    )
    lines = [f"# Sweep {settings.name}: {len(rows)} trials, {settings.direction} {settings.metric}\n"]
    if best:
        lines.append(f"**Best: trial {best['trial']}**, {settings.metric} {best['value']:.4g} at epoch "
                     f"{best['best_epoch']}; model `{best['model_url']}`.\n")
    lines += ["## Trials\n", table, "## Curves\n", plot, ""]
    if weights:
        lines += ["## Parameter importances\n",
                  markdown_table(["parameter", "importance"], [[k, v] for k, v in weights.items()])]
    return "\n".join(lines)


@task(name="sweep-report")
def publish_sweep_report(study: optuna.Study, settings: SweepSettings, output: Location) -> dict[str, Any]:
    """The comparison artifact and `<output>/<name>/sweep.json`; returns what sweep.json holds."""
    rows = trial_rows(study)
    weights = importances(study)
    folder, options = child_url(output.url, safe_segment(settings.name)), output.storage_options()
    png = curves_png(rows, settings.metric)
    write_bytes(child_url(folder, "curves.png"), png, options)
    best = best_row(rows)
    markdown = sweep_markdown(settings, rows, best, markdown_image(png, f"{settings.metric} per epoch and against wall time"),
                              weights)
    record = {"name": settings.name, "metric": settings.metric, "direction": settings.direction,
              "best": best, "trials": rows, "importances": weights}
    write_json(child_url(folder, "sweep.json"), record, options)
    write_bytes(child_url(folder, "report.md"), markdown.encode(), options)
    create_markdown_artifact(key="sweep-comparison", markdown=markdown, description=f"Sweep {settings.name}")
    return record

"""A sweep's settings and the words its trials leave on the study, shared by the sweep and its report."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

import optuna
from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefect_ddp.tasks.selection import Direction
from prefect_ddp.tasks.sweeps.search_space import Value

# Trial outcomes, kept on the Optuna trial as user attributes.
OUTCOME = "outcome"
INTERRUPTED = "interrupted"
# On the study: the numbers of failed trials whose parameters a later run of the sweep trained again
# (a finished trial's own attributes can no longer be changed).
RETRIED = "retried_trials"


class TrialOutcome(BaseModel):
    """What the sweep keeps of a finished trial: the OUTCOME user attribute, without its empty fields.

    Attributes:
        state: "completed" when the trial's training returned (a pruned trial's too), "failed"
            when it raised; None in a trial recorded without an outcome.
        message: why it failed; None when it did not.
        model_url: the trial's model.pt; None when it failed, or a trainable's rank 0 named none.
        mlflow_model: the trial's logged model (prefect_ddp.tasks.results.tracking_run.ModelReference),
            when tracked; None otherwise.
        flow_run_id: the trial's `transfer-learning` flow run; None for another trainable.
        workers: its ranks' Dask workers, in rank order; None for another trainable.
        run: the name of its flow run; None for another trainable.
        seconds: from the trial's start to its end, as the sweep measured it.
    """

    state: Literal["completed", "failed"] | None = None
    message: str | None = None
    model_url: str | None = None
    mlflow_model: dict[str, Any] | None = None
    flow_run_id: str | None = None
    workers: list[str] | None = None
    run: str | None = None
    seconds: float | None = None


class SweepSettings(BaseModel):
    """How a sweep searches: how many trials, how many at once, what it optimises and how."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="sweep", description="Names the study; running the same name again continues it.")
    n_trials: int = Field(default=8, ge=1, le=1000, description="Trials in the study, counting finished ones.")
    concurrency: int = Field(default=2, ge=1, le=64, description="Trials training at the same time, each on its own workers.")
    ranks_per_trial: int = Field(default=1, ge=1, le=256, description="Workers (DDP ranks) each trial trains on.")
    min_ranks_per_trial: int | None = Field(
        default=None, ge=1, le=256, description="Make each trial's gang elastic: it starts once this many workers are "
        "free, shrinks to its survivors when one is lost, and grows back to ranks_per_trial onto workers "
        "that no gang holds (never another trial's). Empty: every trial has ranks_per_trial ranks."
    )
    metric: str = Field(default="val_acc", description="The per-epoch metric to optimise, as the trials report it.")
    direction: Literal["maximize", "minimize"] = Field(default="maximize", description="Whether more of the metric is better.")
    sampler: Literal["grid", "random", "tpe"] = Field(
        default="tpe", description="grid: every combination (every dimension kind grid); random; tpe: Optuna's TPE."
    )
    pruner: Literal["none", "median", "hyperband"] = Field(
        default="median", description="Stops trials early: median (worse than the median so far), hyperband, or none."
    )
    startup_trials: int = Field(
        default=2, ge=0, le=100, description="Trials that must finish before the median pruner stops others."
    )
    seed: int = Field(default=0, ge=0, description="Seed of the sampler.")
    first_trials: list[dict[str, Value]] = Field(
        default_factory=list, description="Parameter sets to try first, e.g. a configuration known to work."
    )
    storage: str | None = Field(
        default=None, description="Optuna storage URL without a password (sqlite:///PATH, or a database that needs "
        "none); a URL with a password belongs in storage_block. Empty: SQLite on the sweep's host, in "
        "OUTPUT/NAME/study.db for a local output, else in the user's data folder."
    )
    storage_block: str | None = Field(
        default=None, description="Name of a saved study-storage block: a database URL with its password, kept secret."
    )
    retry_failed: bool = Field(
        default=True, description="Run again under the same name, the sweep trains the trials that failed before "
        "again, with the same parameters (their failures stay in the study and the report). False: a failed "
        "trial counts as finished."
    )
    lease_timeout_s: int = Field(
        default=1800, ge=0, description="How long a trial waits for free workers before it fails."
    )
    promote: bool = Field(
        default=False, description="At the end, keep the best trial's model under output.model_name (or the "
        "deployment's name) when it is at least as good as the model kept there. Trials never promote on their own."
    )

    @model_validator(mode="after")
    def _no_password_in_parameters(self) -> SweepSettings:
        if self.min_ranks_per_trial and self.min_ranks_per_trial > self.ranks_per_trial:
            raise ValueError(
                f"settings got min_ranks_per_trial={self.min_ranks_per_trial} above ranks_per_trial="
                f"{self.ranks_per_trial}; give min_ranks_per_trial <= ranks_per_trial (each trial's size range), "
                "or leave it empty for a fixed size."
            )
        if self.storage and self.storage_block:
            raise ValueError(f"settings got both storage={self.storage!r} and storage_block={self.storage_block!r}; "
                             "give one of them (or neither, for SQLite on the sweep's host).")
        if self.storage and urlsplit(self.storage).password:
            raise ValueError(
                "settings.storage holds a password: as a parameter it would be shown in the UI and stored with "
                "every run. Save the URL in a study-storage block (StudyStorage(url=...).save('NAME')) and set "
                "settings.storage_block='NAME' instead."
            )
        return self


def direction_of(study: optuna.Study) -> Direction:
    return "maximize" if study.direction == optuna.study.StudyDirection.MAXIMIZE else "minimize"

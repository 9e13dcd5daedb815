"""What a rank of the recipe is given: the job, as plain values, and the files it writes.

The flow builds one `TrainJob` and `run_gang` hands it to every rank (tasks/training/recipe.py,
`train_classifier`); it travels pickled, so it holds settings, never clients or blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, field_validator

from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.splitting import Split
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.tracking import TrackedRun
from prefect_ddp.tasks.training.champion import Champion
from prefect_ddp.tasks.training.model import WarmStart, model_card, preprocessing_for
from prefect_ddp.tasks.training.unreadable import UnreadableLimit
from prefect_ddp.tasks.urls import child_url


class TrainJob(BaseModel):
    """Everything a rank needs, as plain values: data, split, model and recipe."""

    source: Location
    output: Location  # url: this run's output folder
    manifest: Manifest
    split: Split
    model: ModelConfig
    training: TrainingConfig
    warm_start: WarmStart | None = None  # the deployment's kept model, resolved by the flow
    unreadable: UnreadableLimit = UnreadableLimit()  # decode-check's exclusions and data.max_unreadable_fraction
    tracked: TrackedRun | None = None  # the MLflow run rank 0 logs each epoch's metrics to
    champion: Champion | None = None  # the kept model to score beside this run's at the end

    @property
    def preprocessing(self) -> Preprocessing:
        """What training, validation and model.json apply: a warm start's kept model's, as its card
        records it, else the starting weights' (`model.weights`)."""
        return self.warm_start.preprocessing if self.warm_start else preprocessing_for(self.model)

    @field_validator("source", "output")
    @classmethod
    def _plain_settings(cls, location: Location) -> Location:
        """A `DataLocation` block given here travels to the ranks as its plain settings only."""
        return location.plain()


@dataclass(frozen=True)
class RunFiles:
    """The files rank 0 writes in the run's output folder, named once for every part that writes,
    and the storage options to write them with."""

    folder: str  # the run's output folder
    checkpoint: str  # checkpoints/checkpoint.pt: the state a re-formed gang resumes from
    attempts: str  # checkpoints/attempts.json: each gang attempt that reached training
    model: str  # model.pt: the best epoch's weights (tasks/training/best_weights.py)
    card: str  # model.json: what model.pt is, for whoever loads it
    card_fields: dict[str, Any]  # model.json's fields that do not change from epoch to epoch
    options: dict[str, Any]  # the output's storage options, as rank_data derived them

    @classmethod
    def of(cls, job: TrainJob, options: dict[str, Any]) -> RunFiles:
        out = job.output.url
        card = model_card(job.model, job.manifest.classes, job.training.image_size, job.preprocessing)
        return cls(folder=out, checkpoint=child_url(out, "checkpoints", "checkpoint.pt"),
                   attempts=child_url(out, "checkpoints", "attempts.json"),
                   model=child_url(out, "model.pt"), card=child_url(out, "model.json"),
                   card_fields=card | {"split": job.split.record(job.manifest)}, options=options)

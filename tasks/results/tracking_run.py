"""A transfer-learning run as an MLflow run: opened before training, completed with its files.

The flow's process opens the run (its typed config as params, tags that lead back to the
Prefect flow run and deployment), rank 0 adds each epoch's metrics as the epoch ends
(prefect_ddp.tasks.tracking.log_epoch), and the flow's process closes it with the run's
files as artifacts and the kept model as an MLflow PyTorch model. Every call here warns
and gives up when the server fails: tracking never fails or holds up the training
(docs/architecture.md, "Tracking and the registry").
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from pydantic import BaseModel

from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.storage import exists, load_torch, read_bytes, read_json, write_bytes
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.tracking import TrackedRun, Tracking, mlflow_session
from prefect_ddp.tasks.training.model import SAVED_MODEL_FILES, load_model
from prefect_ddp.tasks.urls import child_url

# The run's files that become artifacts; report.md and curves.png are written by the report.
RUN_FILES = ("report.md", "curves.png", "metrics.json", "manifest.json", "split.json", "model.json")
MODEL_ARTIFACT = "model"
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: the UI nests a sweep's trials under it
PARENT_RUN: ContextVar[str | None] = ContextVar("prefect_ddp_parent_mlflow_run", default=None)


class ModelReference(BaseModel):
    """Which logged model: what a flow's result and a sweep's study keep (no credentials)."""

    run_id: str
    model_uri: str  # models:/m-...
    model_id: str  # MLflow's own id for the logged model (m-...), which a version must name


class LoggedModel(ModelReference):
    """A model logged to a run, with the server it is on: what the registry needs to make a version of it."""

    tracking: Tracking

    def reference(self) -> ModelReference:
        return ModelReference.model_validate(self.model_dump(include=set(ModelReference.model_fields)))


def warn(what: str, error: Exception) -> None:
    run_logger().warning("MLflow tracking: could not %s (%s: %s); the training goes on without it.",
                         what, type(error).__name__, error)


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The flow's typed config as MLflow params: one per field, by dotted path.

    >>> flat_params({"training": {"lr": 0.01, "epochs": 2}, "data": {"url": None}})
    {'training.lr': '0.01', 'training.epochs': '2', 'data.url': 'None'}
    """
    params: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            params |= flat_params(value, f"{prefix}{key}.")
        else:
            params[f"{prefix}{key}"] = str(value)
    return params


def start_run(tracking: Tracking, run_name: str, params: dict[str, str], tags: dict[str, str],
              parent_run_id: str | None = None) -> TrackedRun | None:
    """Open the run (in the experiment, created when missing); None, with a warning, when it fails."""
    try:
        with mlflow_session(tracking) as client:
            experiment = client.get_experiment_by_name(tracking.experiment)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(tracking.experiment)
            run = client.create_run(experiment_id, run_name=run_name,
                                    tags=tags | ({PARENT_TAG: parent_run_id} if parent_run_id else {}))
            client.log_batch(run.info.run_id, params=[_param(k, v) for k, v in params.items()])
    except Exception as error:  # a server down or refusing must not cost the training
        warn(f"open a run in experiment {tracking.experiment!r} at {tracking.tracking_uri}", error)
        return None
    run_logger().info("MLflow run %s in experiment %r at %s.", run.info.run_id, tracking.experiment,
                      tracking.tracking_uri)
    return TrackedRun(tracking=tracking, run_id=run.info.run_id)


def _param(key: str, value: str) -> Any:
    from mlflow.entities import Param  # mlflow is there: mlflow_session imported it

    return Param(key, value[:6000])  # MLflow's limit on a param's value


def log_model(run: TrackedRun, out: Location) -> LoggedModel | None:
    """The run's model (`<out>/model.pt` and its card) logged to the run; None, warned, when that failed."""
    try:
        with mlflow_session(run.tracking), _private_folder() as folder:
            return _log_model(run, out, folder)
    except Exception as error:
        warn(f"log the model to run {run.run_id}", error)
        return None


def complete_run(run: TrackedRun, out: Location, tags: dict[str, str], files: tuple[str, ...] = RUN_FILES) -> None:
    """Attach the run's files (by default report, curves, metrics, manifest, split, model card) and end it."""
    try:
        with mlflow_session(run.tracking) as client, _private_folder() as folder:
            for name in files:
                path = _download(out, name, folder)
                if path:
                    client.log_artifact(run.run_id, path)
            for key, value in tags.items():
                client.set_tag(run.run_id, key, value)
            client.set_terminated(run.run_id, "FINISHED")
    except Exception as error:
        warn(f"complete run {run.run_id}", error)


@contextmanager
def tracking_run(tracking: Tracking | None, run_name: str, params: dict[str, str],
                 tags: dict[str, str]) -> Iterator[TrackedRun | None]:
    """The flow run's MLflow run (None without tracking, or when the server failed), marked
    failed when the flow fails; inside a sweep's trial, a child of the sweep's run."""
    run = start_run(tracking, run_name, params, tags, PARENT_RUN.get()) if tracking else None
    try:
        yield run
    except BaseException as error:
        if run:
            fail_run(run, error)
        raise


@contextmanager
def child_runs_of(parent: TrackedRun | None) -> Iterator[None]:
    """Runs opened meanwhile in this context (a sweep's trials) become children of `parent`."""
    token = PARENT_RUN.set(parent.run_id if parent else None)
    try:
        yield
    finally:
        PARENT_RUN.reset(token)


def fail_run(run: TrackedRun, error: BaseException) -> None:
    """End the run as failed, with why, when the flow fails."""
    try:
        with mlflow_session(run.tracking) as client:
            client.set_tag(run.run_id, "failure", f"{type(error).__name__}: {error}"[:5000])
            client.set_terminated(run.run_id, "FAILED")
    except Exception as problem:
        warn(f"mark run {run.run_id} failed", problem)


@contextmanager
def _private_folder() -> Iterator[str]:
    """A temporary folder only this user can read (mkdtemp makes it 0700)."""
    with tempfile.TemporaryDirectory(prefix="prefect-ddp-mlflow-") as folder:
        yield folder


def _download(out: Location, name: str, folder: str) -> str | None:
    url, options = child_url(out.url, name), out.storage_options()
    if not exists(url, options):
        return None
    path = os.path.join(folder, name)
    write_bytes(path, read_bytes(url, options), {})
    return path


def _download_model_file(out: Location, name: str, folder: str) -> str:
    """`_download` of a file the logged model cannot do without: its absence is the error."""
    path = _download(out, name, folder)
    if path is None:
        raise FileNotFoundError(f"{child_url(out.url, name)} does not exist: the run wrote no model to log.")
    return path


def _log_model(run: TrackedRun, out: Location, folder: str) -> LoggedModel:
    """The run's model as an MLflow PyTorch model (torch.export's pt2, no pickle), with prefect-ddp's
    own model.pt and model.json beside it, which `fetch_registered_model` loads with weights_only=True."""
    import mlflow

    card = read_json(_download_model_file(out, "model.json", folder), {})
    state_path = _download_model_file(out, "model.pt", folder)
    model = load_model(card, load_torch(state_path, {}))
    example = torch.zeros(2, 3, card["image_size"], card["image_size"]).numpy()
    with mlflow.start_run(run_id=run.run_id):
        info = mlflow.pytorch.log_model(
            model, name=MODEL_ARTIFACT, input_example=example,
            extra_files=[os.path.join(folder, name) for name in SAVED_MODEL_FILES],
            metadata={"classes": card["classes"], "preprocessing": preprocessing(card)},
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        )
    return LoggedModel(tracking=run.tracking, run_id=run.run_id, model_uri=info.model_uri, model_id=info.model_id)


def preprocessing(card: dict[str, Any]) -> dict[str, Any]:
    """How an image becomes the model's input, as its card records it: the MLflow model's metadata."""
    made = Preprocessing.of_card(card)
    resize = made.resize(card["image_size"])
    return {"image_size": card["image_size"], "resize": resize, "interpolation": made.interpolation,
            "mean": list(made.mean), "std": list(made.std),  # lists, as JSON and MLflow give them back
            "steps": f"shorter side resized to {resize} px ({made.interpolation}, antialiased), centre crop of "
                     f"{card['image_size']} px; RGB scaled to [0, 1], normalised by mean and std"}


def fetch_registered_model(tracking: Tracking, uri: str, into: Location) -> Location:
    """Copy a registered model's model.pt and model.json (models:/NAME@ALIAS) into the folder `into`.

    Ranks and prediction workers read it from there, through the output's credentials, as
    they read a kept model's version folder; nothing from MLflow is unpickled.
    """
    import mlflow

    with mlflow_session(tracking), _private_folder() as folder:
        try:
            local = mlflow.artifacts.download_artifacts(uri, dst_path=folder)
        except Exception as error:
            raise ValueError(f"Could not read the registered model {uri} from {tracking.tracking_uri}: {error}. "
                             "Check that the name and alias (or version) exist in the registry.") from error
        for name in SAVED_MODEL_FILES:
            path = os.path.join(local, "extra_files", name)
            if not os.path.exists(path):
                raise ValueError(f"{uri} holds no extra_files/{name}: it was not logged by prefect-ddp's "
                                 "transfer-learning flow, so its classes and preprocessing are unknown. "
                                 "Name a model that flow registered.")
            with open(path, "rb") as file:
                write_bytes(child_url(into.url, name), file.read(), into.storage_options())
    return into

"""Where runs are tracked (an MLflow server) and how to reach it: plain settings and a session.

Tracking is optional (the `mlflow` extra). The flow's process and rank 0 get these
settings, never the Prefect block they were saved in (`blocks/tracking.py`), as with
`tasks.location.Location`. The secrets stay SecretStr until a request needs them.

MLflow reads credentials and request settings from environment variables at each request,
and the fluent API (`mlflow.pytorch.log_model`) from a process-wide tracking URI. A
session sets both for its duration under one lock, so two runs in one process (a sweep's
trials) never send one another's credentials, and restores them afterwards. Requests give
up after two retries (MLflow's default retries for minutes): tracking that fails warns and
never holds up or fails the training (docs/architecture.md, "Tracking and the registry").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

# Per request: at most two retries, 1 s apart growing, 30 s each; no progress bars in logs.
REQUEST_SETTINGS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "30",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}
_SESSION = threading.Lock()


class Tracking(BaseModel):
    """An MLflow tracking server, the experiment runs go to, and the credentials to reach it."""

    model_config = ConfigDict(hide_input_in_errors=True)  # a refused tracking_uri may hold a password

    tracking_uri: str = Field(description="The MLflow server, e.g. http://mlflow.internal:5000.")
    experiment: str = Field("transfer-learning", description="Experiment the runs are recorded in.")
    username: str | None = Field(None, description="Basic-auth user, when the server asks for one.")
    password: SecretStr | None = Field(None, description="Basic-auth password.")
    token: SecretStr | None = Field(None, description="Bearer token, instead of a user and password.")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str) -> str:
        """Refuse `https://user:pass@host`: the URI is written into latest.json, results, reports
        and logs, where only the SecretStr fields are kept out (docs/architecture.md, "Tracking and
        the registry")."""
        return without_credentials(uri)

    def plain(self) -> Tracking:
        """These settings alone: what a subclass (a Prefect block) adds stays behind."""
        return Tracking.model_validate(self.model_dump(include=set(Tracking.model_fields)))

    def environment(self) -> dict[str, str]:
        """The variables MLflow reads at each request; holds the plain secrets, so never log it."""
        env = dict(REQUEST_SETTINGS)
        if self.username:
            env["MLFLOW_TRACKING_USERNAME"] = self.username
        if self.password:
            env["MLFLOW_TRACKING_PASSWORD"] = self.password.get_secret_value()
        if self.token:
            env["MLFLOW_TRACKING_TOKEN"] = self.token.get_secret_value()
        return env


def without_credentials(uri: str) -> str:
    """`uri` when it holds no user or password; ValueError, with them masked, otherwise.

    >>> without_credentials("https://mlflow.internal:5000")
    'https://mlflow.internal:5000'
    """
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    masked = parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}").geturl()
    raise ValueError(
        f"tracking_uri={masked!r} holds credentials (shown as ***). The URI is recorded in latest.json, "
        "results, reports and logs, so it must name only the server: give tracking_uri without them and put "
        "them in the MLflow Tracking block's username and password fields (basic auth) or its token field."
    )


class TrackedRun(BaseModel):
    """An MLflow run in progress: where it is, so rank 0 can add each epoch's metrics to it."""

    tracking: Tracking
    run_id: str


def import_mlflow() -> Any:
    """MLflow, or an error that says how to install it."""
    try:
        import mlflow
    except ImportError:
        raise ImportError(
            "tracking.block is set, but MLflow is not installed in this environment. Install the "
            "extra (pip install 'prefect-ddp[mlflow]') on the flow's machine and the workers, or "
            "leave tracking.block empty."
        ) from None
    return mlflow


@contextmanager
def mlflow_session(tracking: Tracking) -> Iterator[Any]:
    """An MlflowClient for `tracking`, with its credentials and request limits set meanwhile."""
    mlflow = import_mlflow()
    env = tracking.environment()
    with _SESSION:
        saved = {name: os.environ.get(name) for name in env}
        previous_uri = mlflow.get_tracking_uri()
        os.environ.update(env)
        mlflow.set_tracking_uri(tracking.tracking_uri)
        try:
            yield mlflow.MlflowClient(tracking.tracking_uri)
        finally:
            mlflow.set_tracking_uri(previous_uri)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def epoch_metrics(record: dict[str, Any]) -> dict[str, float]:
    """An epoch's record as MLflow metrics: the numbers, and the step-time shares where there are.

    >>> epoch_metrics({"epoch": 2, "val_acc": 0.5, "lr": 0.01, "unreadable": [],
    ...                "time": {"images_per_s": 80.0, "shares": {"data": 0.6}, "verdict": "input-bound"}})
    {'val_acc': 0.5, 'lr': 0.01, 'images_per_s': 80.0, 'share_data': 0.6}
    """
    metrics = {k: float(v) for k, v in record.items()
               if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    timing = record.get("time") or {}
    if "images_per_s" in timing:
        metrics["images_per_s"] = float(timing["images_per_s"])
    metrics |= {f"share_{part}": float(share) for part, share in timing.get("shares", {}).items()}
    return metrics


def log_epoch(run: TrackedRun, record: dict[str, Any]) -> None:
    """Add one epoch's metrics to the run, at step = the epoch's number."""
    metric = import_mlflow().entities.Metric
    stamp = int(time.time() * 1000)
    metrics = [metric(key, value, stamp, record["epoch"]) for key, value in epoch_metrics(record).items()]
    with mlflow_session(run.tracking) as client:
        client.log_batch(run.run_id, metrics=metrics)

"""The MLflow model registry kept in step with promotion: the alias `champion` names the kept model.

Promotion (prefect_ddp.tasks.results.promotion) decides which model is kept by a
compare-and-swap on `<output>/<name>/latest.json`. The registry follows that document
rather than deciding again, so it can never disagree with it:

1. Before the swap, a candidate's logged model becomes a new version of the registered
   model `<name>` (created whole: MLflow returns it READY), and the pointer the candidate
   writes names that version.
2. A candidate overtaken in the swap deletes its version; nothing points at it.
3. After a swap it won, the promoter moves `champion` to the version the pointer names
   *now*, then reads the pointer again, and repeats until the pointer did not change in
   between. Whoever changes the pointer later also moves the alias later, so the last
   alias move always names the last pointer's version: a slow promoter cannot move the
   alias back to a model that was since beaten.

A registry that fails is warned about and leaves the alias where it was; the next
promotion moves it (docs/architecture.md, "Tracking and the registry").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.results.pointer import MAX_ROUNDS
from prefect_ddp.tasks.results.tracking_run import LoggedModel, warn
from prefect_ddp.tasks.tracking import mlflow_session

ALIAS = "champion"


class Registration(BaseModel):
    """Register a run's logged model under `name` when it is promoted."""

    model: LoggedModel
    name: str


def register_version(model: LoggedModel, name: str) -> dict[str, Any] | None:
    """A new version of the registered model `name` holding `model`, as the pointer records it."""
    try:
        with mlflow_session(model.tracking) as client:
            _create_registered_model(client, name)
            version = client.create_model_version(name, source=model.model_uri, run_id=model.run_id,
                                                  model_id=model.model_id)
    except Exception as error:
        warn(f"register the model as a version of {name!r}", error)
        return None
    run_logger().info("Registered model %r version %s (run %s).", name, version.version, model.run_id)
    return {"name": name, "version": str(version.version), "tracking_uri": model.tracking.tracking_uri}


def drop_version(model: LoggedModel, registered: dict[str, Any]) -> None:
    """Delete a version nothing points at (its candidate lost the swap)."""
    try:
        with mlflow_session(model.tracking) as client:
            client.delete_model_version(registered["name"], registered["version"])
    except Exception as error:
        warn(f"delete version {registered['version']} of {registered['name']!r}, which was not promoted", error)


def move_champion(model: LoggedModel, read_pointer: Callable[[], dict[str, Any] | None]) -> str | None:
    """Point `champion` at the version the kept model's pointer names, until the pointer holds still.

    Returns that version, or None when the kept model has none (it was kept before tracking
    was on, or its registration failed) or the registry failed.
    """
    try:
        with mlflow_session(model.tracking) as client:
            pointer = read_pointer()
            for _ in range(MAX_ROUNDS):
                registered = (pointer or {}).get("registered")
                if not registered:
                    return None
                client.set_registered_model_alias(registered["name"], ALIAS, registered["version"])
                now = read_pointer()
                if now == pointer:
                    return registered["version"]
                pointer = now
    except Exception as error:
        warn(f"move the alias {ALIAS!r}", error)
        return None
    warn(f"move the alias {ALIAS!r}", RuntimeError(f"the kept model changed {MAX_ROUNDS} times meanwhile"))
    return None


def _create_registered_model(client: Any, name: str) -> None:
    """Create the registered model unless it exists; two first promotions may race to create it."""
    from mlflow.exceptions import MlflowException  # mlflow is there: mlflow_session imported it

    try:
        client.create_registered_model(name)
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise

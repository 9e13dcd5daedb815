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

Every promotion, kept or not, and every batch-predict run given the tracking block and a
model that names the pointer or the alias, first checks the alias against the pointer and
moves it where they disagree: a registry that failed between the swap and the alias move
(or a kept model whose logging or registration failed, for which `champion` is removed:
no registered version holds it) is repaired by the next of them, and reported until then
(docs/architecture.md, "Tracking and the registry").

A promote task retried after it registered a version finds that version again, by its run
and the version folder it was made for, rather than registering another.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.results.pointer import MAX_ROUNDS
from prefect_ddp.tasks.results.tracking_run import LoggedModel, warn
from prefect_ddp.tasks.tracking import Tracking, mlflow_session, same_server

ALIAS = "champion"
KEPT_VERSION_TAG = "prefect_ddp.kept_version"  # on a model version: the version folder it holds
POINTER_TAG = "prefect_ddp.pointer"  # on a registered model: the latest.json its champion follows


class Registration(BaseModel):
    """The registry of `tracking` keeps `name`'s champion in step with promotion; `model` is the
    run's logged model, to register when it is kept (None: logging it failed)."""

    tracking: Tracking
    name: str
    model: LoggedModel | None = None


class ChampionCheck(BaseModel):
    """The alias against the pointer: the version each named, and whether they agree now."""

    name: str
    pointer_version: str | None  # the registered version latest.json names; None: it names none
    was: str | None  # the version champion named when checked
    now: str | None  # the version it names after the check (None: no alias)
    error: str | None = None  # why it could not be checked or moved
    unchecked: str | None = None  # why the alias was left as it was, unchecked (the pointer is not this server's)
    kept_unregistered: bool = False  # latest.json's model has no registered version, and a reader left the alias

    @property
    def agrees(self) -> bool:
        return self.error is None and self.unchecked is None and self.now == self.pointer_version

    @property
    def repaired(self) -> bool:
        return self.agrees and self.was != self.now

    def disagreement(self) -> str:
        """What is wrong, for the promotion's result, the report and batch-predict's record."""
        if self.unchecked:
            return (f"the registry's alias {ALIAS!r} of {self.name!r} (on {_version(self.now)}) could not be "
                    f"checked against latest.json and was left as it was: {self.unchecked}")
        if self.kept_unregistered:
            return (f"latest.json's model has no registered version of {self.name!r}, while the registry's alias "
                    f"{ALIAS!r} names {_version(self.now)}: models:/{self.name}@{ALIAS} is not the kept model until "
                    f"the next promotion of {self.name!r} registers one (or removes the alias)")
        return (f"the registry's alias {ALIAS!r} of {self.name!r} names {_version(self.now)}, but latest.json "
                f"names {_version(self.pointer_version)} ({self.error}): models:/{self.name}@{ALIAS} and the kept "
                "model are different models until the next promotion, or a batch-predict run given this "
                "tracking block and either of them, moves the alias")


def _version(version: str | None) -> str:
    return f"version {version}" if version else "no registered version"


def register_version(model: LoggedModel, name: str, kept_version: str, pointer_url: str,
                     comparison: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The version of the registered model `name` holding `model` for the version folder
    `kept_version`, as the pointer records it: the one a failed attempt of this promotion
    registered, else a new one, tagged with the comparison that promoted it."""
    try:
        with mlflow_session(model.tracking) as client:
            _create_registered_model(client, name, pointer_url)
            version = _registered_before(client, name, model.run_id, kept_version) or client.create_model_version(
                name, source=model.model_uri, run_id=model.run_id, model_id=model.model_id,
                tags={KEPT_VERSION_TAG: kept_version} | comparison_tags(comparison))
    except Exception as error:
        warn(f"register the model as a version of {name!r}", error)
        return None
    run_logger().info("Registered model %r version %s (run %s).", name, version.version, model.run_id)
    return {"name": name, "version": str(version.version), "tracking_uri": model.tracking.tracking_uri}


def comparison_tags(comparison: dict[str, Any] | None) -> dict[str, str]:
    """Both models' scores on the same images, as tags of the registered version.

    >>> comparison_tags({"challenger_acc": 0.9, "champion_acc": 0.8, "images": 50, "champion_run": "old"})
    {'prefect_ddp.challenger_acc': '0.9', 'prefect_ddp.champion_acc': '0.8', 'prefect_ddp.compared_on': '50 validation images neither trained on; champion: old'}
    """
    if not comparison:
        return {}
    return {"prefect_ddp.challenger_acc": f"{comparison['challenger_acc']:.4g}",
            "prefect_ddp.champion_acc": f"{comparison['champion_acc']:.4g}",
            "prefect_ddp.compared_on": f"{comparison['images']} validation images neither trained on; "
                                       f"champion: {comparison['champion_run']}"}


def _registered_before(client: Any, name: str, run_id: str, kept_version: str) -> Any | None:
    """The version an earlier attempt registered for this run's model and version folder."""
    for version in client.search_model_versions(f"run_id = '{run_id}'"):
        if version.name == name and version.tags.get(KEPT_VERSION_TAG) == kept_version:
            return version
    return None


def drop_version(model: LoggedModel, registered: dict[str, Any]) -> None:
    """Delete a version nothing points at (its candidate lost the swap)."""
    try:
        with mlflow_session(model.tracking) as client:
            client.delete_model_version(registered["name"], registered["version"])
    except Exception as error:
        warn(f"delete version {registered['version']} of {registered['name']!r}, which was not promoted", error)


def align_champion(tracking: Tracking, name: str, read_pointer: Callable[[], dict[str, Any] | None],
                   remove_unregistered: bool) -> ChampionCheck:
    """Point `champion` at the version the kept model's pointer names, until the pointer holds still.

    What the pointer names decides. A version of `name` on this server: the alias is moved
    to it (the repair). A version registered on another server, or no pointer readable here
    (a reader elsewhere than the training's output): the alias is left, unchecked, since
    nothing here says which version holds the kept model. No registered version (kept before
    tracking was on, or its logging or registration failed): a promotion, which wrote that
    pointer (`remove_unregistered`), removes the alias, as no version holds the kept model;
    a reader leaves it and tells the disagreement. Never raises: a registry that fails is
    told in the check's `error` and warned about.
    """
    check = ChampionCheck(name=name, pointer_version=None, was=None, now=None)
    try:
        pointer = read_pointer()
    except Exception as error:
        pointer, check.unchecked = None, f"latest.json could not be read here ({type(error).__name__}: {error})"
    try:
        with mlflow_session(tracking) as client:
            check.was = check.now = _alias_version(client, name)
            for _ in range(MAX_ROUNDS):
                check.unchecked = check.unchecked or why_unchecked(pointer, tracking)
                if check.unchecked:
                    return _told(check)
                check.pointer_version = registered_version(pointer, tracking, name)
                if check.pointer_version is None and not remove_unregistered:
                    check.kept_unregistered = True
                    check.error = "the kept model has no registered version"
                    return _told(check)
                if check.now != check.pointer_version:
                    _point_alias(client, name, check.pointer_version)
                    check.now = check.pointer_version
                now = read_pointer()
                if now == pointer:
                    return _told(check)
                pointer = now
            check.error = f"the kept model changed {MAX_ROUNDS} times meanwhile"
    except Exception as error:
        check.error = f"{type(error).__name__}: {error}"
    return _told(check)


def registered_version(pointer: dict[str, Any] | None, tracking: Tracking, name: str) -> str | None:
    """The version of `name` on `tracking`'s server that the pointer names; None when it names
    none there (a pointer written with another server, or none, holds no version of this one)."""
    registered = (pointer or {}).get("registered") or {}
    if registered.get("name") == name and same_server(registered.get("tracking_uri") or "", tracking.tracking_uri):
        return registered.get("version")
    return None


def why_unchecked(pointer: dict[str, Any] | None, tracking: Tracking) -> str | None:
    """Why the pointer says nothing of this server's versions: there is none here (not readable
    where this runs, or gone meanwhile), or its version is registered on another server."""
    if pointer is None:
        return "there is no latest.json here to check it against"
    uri = (pointer.get("registered") or {}).get("tracking_uri")
    if uri and not same_server(uri, tracking.tracking_uri):
        return f"latest.json's version is registered on {uri}, not {tracking.tracking_uri}"
    return None


def _told(check: ChampionCheck) -> ChampionCheck:
    """Log a repair, and warn about a disagreement left."""
    if check.repaired:
        run_logger().warning("Registered model %r: alias %r named %s while latest.json names %s; moved it.",
                             check.name, ALIAS, _version(check.was), _version(check.now))
    elif not check.agrees:
        run_logger().warning("MLflow registry: %s.", check.disagreement())
    return check


def _alias_version(client: Any, name: str) -> str | None:
    """The version `champion` names, None when there is no such alias (or registered model)."""
    from mlflow.exceptions import MlflowException  # mlflow is there: mlflow_session imported it

    try:
        return str(client.get_model_version_by_alias(name, ALIAS).version)
    except MlflowException as error:
        if error.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            return None
        raise


def _point_alias(client: Any, name: str, version: str | None) -> None:
    if version is None:
        client.delete_registered_model_alias(name, ALIAS)
    else:
        client.set_registered_model_alias(name, ALIAS, version)


def pointer_of(tracking: Tracking, name: str) -> str | None:
    """The latest.json that `name`'s champion follows, as its registration recorded it; None when
    none is recorded or `name` cannot be read (reading the model itself then says why)."""
    try:
        with mlflow_session(tracking) as client:
            return client.get_registered_model(name).tags.get(POINTER_TAG)
    except Exception:
        return None


def _create_registered_model(client: Any, name: str, pointer_url: str) -> None:
    """Create the registered model unless it exists (two first promotions may race to create
    it), tagged with the pointer its champion follows, for batch-predict's check."""
    from mlflow.exceptions import MlflowException  # mlflow is there: mlflow_session imported it

    try:
        client.create_registered_model(name, tags={POINTER_TAG: pointer_url})
    except MlflowException as error:
        if error.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        client.set_registered_model_tag(name, POINTER_TAG, pointer_url)

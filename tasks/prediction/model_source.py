"""Which model a batch-predict run scores with, copied once into the run's own folder.

A user names the model four ways: the model kept under a name (`OUTPUT/NAME/latest`, which
reads the pointer `OUTPUT/NAME/latest.json` once and then the version folder it names), a
run folder or a version folder (both hold `model.pt` and `model.json`), or a registered
model (`models:/NAME@ALIAS`, read from the MLflow registry of the run's tracking block). Each
becomes the run's copy; from there on nothing cares which.

Given the tracking block, a run named the pointer or `models:/NAME@champion` first checks
that the two name the same model, and moves the alias where they do not (the pointer
decides which model is kept: prefect_ddp.tasks.results.registry); what it found goes into
`source.json`. A champion that still disagrees is refused, rather than scored as if it were
the kept model.

The run copies that folder's model into `RUN/model/` before it scores anything, and a
rerun of the same flow run scores with that copy: the pointer may have moved to a newer
model meanwhile, and one run's predictions must all come from one model.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

from prefect import task

from prefect_ddp.tasks.data.storage import exists, read_bytes, remove_tree, write_bytes, write_json
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.results.promotion import POINTER, read_pointer
from prefect_ddp.tasks.results.registry import ALIAS, align_champion, pointer_of
from prefect_ddp.tasks.results.tracking_run import fetch_registered_model
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.tracking import Tracking
from prefect_ddp.tasks.training.model import SAVED_MODEL_FILES, loading_problem, model_problem
from prefect_ddp.tasks.urls import absolute_url, child_url

REGISTRY_PREFIX = "models:/"
POINTER_NAME = POINTER.removesuffix(".json")  # OUTPUT/NAME/latest names OUTPUT/NAME/latest.json
WEIGHTS, CARD = SAVED_MODEL_FILES
RUN_MODEL_FOLDER = "model"
SOURCE_RECORD = "source.json"  # which spec and folder the run's copy came from
CARD_FIELDS = {"backbone": str, "image_size": int}
ALLOWED_SPECS = (
    "OUTPUT/NAME/latest (the model kept under NAME by training's output.model_name or its deployment), "
    "a run or version folder holding model.pt and model.json, or models:/NAME@ALIAS"
)


def resolve_model_folder(spec: str, store: Location) -> Location:
    """The folder, with `store`'s credentials, that holds the model `spec` names.

    Args:
        spec: see ALLOWED_SPECS; a local path may be relative.
        store: connection settings for `spec`'s storage (its url is not used).

    """
    if kept := kept_folder(spec, store):
        return kept_version(spec, kept)
    folder = store.with_url(absolute_url(spec).rstrip("/"))
    require_model_files(spec, folder)
    return folder


def kept_folder(spec: str, store: Location) -> Location | None:
    """`OUTPUT/NAME` when `spec` names its pointer (OUTPUT/NAME/latest or .../latest.json), else None."""
    url = absolute_url(spec).rstrip("/")
    if posixpath.basename(url) == POINTER or (
        posixpath.basename(url) == POINTER_NAME and exists(f"{url}.json", store.storage_options())
    ):
        return store.with_url(posixpath.dirname(url))
    return None


def kept_version(spec: str, kept: Location) -> Location:
    """The version folder that `kept`/latest.json names, read once."""
    pointer = read_pointer(kept)
    if pointer is None or not pointer.get("version"):
        raise FileNotFoundError(
            f"model={spec!r}: {child_url(kept.url, POINTER)} "
            f"{'names no version' if pointer else 'does not exist'}, so no model is kept under "
            f"{posixpath.basename(kept.url)!r}. Check the output url and name, or give {ALLOWED_SPECS}."
        )
    folder = kept.with_url(pointer["version"])
    require_model_files(spec, folder)
    return folder


def require_model_files(spec: str, folder: Location) -> None:
    """Refuse a folder that is not a saved model, saying what it is instead."""
    options = folder.storage_options()
    missing = [name for name in (WEIGHTS, CARD) if not exists(child_url(folder.url, name), options)]
    if not missing:
        return
    hint = ""
    if exists(child_url(folder.url, POINTER), options):
        hint = f" It holds {POINTER}: name the kept model as {child_url(folder.url, POINTER_NAME)}."
    elif spec.rstrip("/").endswith(f"/{POINTER_NAME}"):
        hint = f" No {posixpath.dirname(folder.url)}/{POINTER} either: nothing was kept under that name."
    raise FileNotFoundError(
        f"model={spec!r}: {folder.url} has no {' and no '.join(missing)}, so it is not a saved model.{hint} "
        f"Give {ALLOWED_SPECS}."
    )


def check_card(data: bytes, url: str) -> dict[str, Any]:
    """The model card in `data` (read from `url`), one `load_model` can rebuild a classifier from;
    ValueError naming what is wrong."""
    try:
        card = json.loads(data)
    except ValueError as exc:
        raise ValueError(f"{url} is not valid JSON ({exc}): a model card is the model.json that the "
                         "transfer-learning flow writes beside model.pt.") from exc
    if not isinstance(card, dict):
        card = {}  # not a model card at all: told as the classes it lacks
    classes = card.get("classes")
    if not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        raise ValueError(
            f"{url} lists no classes (got classes={classes!r}): batch-predict names each prediction by "
            "the card's class names. Use a model.json written by the transfer-learning flow, or add "
            '"classes": [...] in the order of the model\'s outputs.'
        )
    wrong = [name for name, kind in CARD_FIELDS.items() if not isinstance(card.get(name), kind)]
    if wrong:
        raise ValueError(
            f"{url} lacks {', '.join(wrong)} (or holds the wrong type): a model card needs "
            f"{', '.join(f'{n} ({k.__name__})' for n, k in CARD_FIELDS.items())} besides classes. Use a "
            "model.json written by the transfer-learning flow."
        )
    return card


def check_champion(spec: str, store: Location, tracking: Tracking) -> dict[str, Any] | None:
    """The registry's `champion` checked against the pointer when `spec` names either, moved
    where they disagree; None for other specs. Refuses models:/NAME@champion that still disagrees
    (a pointer it cannot read, or one of another server's, leaves it unchecked, with a warning)."""
    name, _, alias = spec.removeprefix(REGISTRY_PREFIX).partition("@")
    if spec.startswith(REGISTRY_PREFIX):
        pointer_url = pointer_of(tracking, name) if alias == ALIAS else None
        if not pointer_url:  # another alias or a version, or registered before the pointer was recorded
            return None
        kept = store.with_url(posixpath.dirname(pointer_url))
    else:
        folder = kept_folder(spec, store)
        if folder is None:
            return None
        kept = folder
        name = ((read_pointer(kept) or {}).get("registered") or {}).get("name") or posixpath.basename(kept.url)
    # A reader: it moves the alias to the version the pointer names, never removes it, and
    # leaves it unchecked where the pointer is not readable here or names another server's version.
    check = align_champion(tracking, name, lambda: read_pointer(kept), remove_unregistered=False)
    if spec.startswith(REGISTRY_PREFIX) and check.error:
        move = "" if check.kept_unregistered else (
            f", or let this tracking block's user move aliases of {name!r} and run again")
        raise ValueError(
            f"model={spec!r}: {check.disagreement()}. Scoring with it would not score with the kept model. "
            f"Give model={child_url(kept.url, POINTER_NAME)} (the kept model itself){move}."
        )
    return check.model_dump() | {"agrees": check.agrees}


def copy_registered_model(spec: str, tracking: Tracking | None, copy: Location,
                          record: dict[str, Any] | None = None) -> Location:
    """The registered model `spec` (models:/NAME@ALIAS) copied from the registry into `copy`;
    `record` adds to what source.json says of it."""
    if tracking is None:
        raise ValueError(f"model={spec!r} names a registered model, but no tracking block was given to read "
                         "it from. Set tracking_block to the mlflow-tracking block of the server holding it.")
    source = {"model": spec, "folder": f"registry at {tracking.tracking_uri}"} | (record or {})
    write_json(child_url(copy.url, SOURCE_RECORD), source, copy.storage_options())
    fetch_registered_model(tracking, spec, copy)  # model.json last, as below
    check_card(read_bytes(child_url(copy.url, CARD), copy.storage_options()), f"{spec} (extra_files/{CARD})")
    if problem := model_problem(copy):  # a copy with model.json counts as whole: not this one
        remove_tree(child_url(copy.url, CARD), copy.storage_options())
        raise ValueError(f"model={spec!r}: the registered model cannot be used: {problem}. Register a model that "
                         "loads (a transfer-learning run's), or name another version or alias.")
    run_logger().info("Scoring with model=%s from %s, copied to %s", spec, tracking.tracking_uri, copy.url)
    return copy


@task(name="keep-model", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def keep_model(spec: str, store: Location, out: Location, tracking: Tracking | None = None) -> Location:
    """The run's own copy of the model, `RUN/model/`: copied at the run's first attempt, reused after.

    model.json is written last, so a copy is whole exactly when it has model.json.
    """
    copy = out.with_url(child_url(out.url, RUN_MODEL_FOLDER))
    target = copy.storage_options()
    if exists(child_url(copy.url, CARD), target):
        run_logger().info("Scoring with the model this run copied before, in %s", copy.url)
        return copy
    checked = check_champion(spec, store, tracking) if tracking else None
    record = {"registry": checked} if checked else {}
    if spec.startswith(REGISTRY_PREFIX):
        return copy_registered_model(spec, tracking, copy, record)
    folder = resolve_model_folder(spec, store)
    source = folder.storage_options()
    card_bytes = read_bytes(child_url(folder.url, CARD), source)
    check_card(card_bytes, child_url(folder.url, CARD))
    weights = read_bytes(child_url(folder.url, WEIGHTS), source)
    if problem := loading_problem(card_bytes, weights):  # else every chunk would fail on it, after its images
        raise ValueError(f"model={spec!r} names {folder.url}, whose model cannot be used: {problem}. Score with "
                         "another version of it (OUTPUT/NAME/versions/RUN), or train it again.")
    write_bytes(child_url(copy.url, WEIGHTS), weights, target)
    write_json(child_url(copy.url, SOURCE_RECORD), {"model": spec, "folder": folder.url} | record, target)
    write_bytes(child_url(copy.url, CARD), card_bytes, target)
    run_logger().info("Scoring with model=%s: %s, copied to %s", spec, folder.url, copy.url)
    return copy

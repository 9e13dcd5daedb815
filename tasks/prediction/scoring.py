"""Scoring chunks of images on the Dask workers, one Parquet file per chunk.

Each chunk is an ordinary Prefect task run (`score-chunk`), retried on its own: images are
scored independently, so unlike training nothing needs a gang. A chunk fetches its images
as decode-check does (one GET each, exact paths, retries, a deadline), decodes and
transforms them as training's validation does (`open_rgb`, `eval_transform`), and runs the
model under `torch.inference_mode` on the worker's GPU where it has one.

A chunk's result is its file, `RUN/predictions/chunk-NNNNNN.parquet`, written whole (one PUT
on S3, a renamed temporary file locally): a chunk whose file exists is done, so a rerun of
the flow run skips it. The chunk's unreadable images (missing, or not decodable) travel in
that file's key-value metadata, so a skipped chunk still reports them.

The model is loaded once per worker process and kept for the chunks that follow: loading
a resnet50 costs about a second, a chunk of small images little more.
"""

from __future__ import annotations

import io
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import distributed
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from prefect import task
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture
from pydantic import BaseModel
from torch import nn

from prefect_ddp.tasks.data.cpu_share import map_on_cpus
from prefect_ddp.tasks.data.dataset import (
    DEFAULT_FETCH_TIMEOUT_S,
    FETCH_ATTEMPTS,
    eval_transform,
    needed_side,
)
from prefect_ddp.tasks.data.decoding import open_rgb
from prefect_ddp.tasks.data.object_reads import fetch_objects, object_read_options
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.storage import (
    exists,
    filesystem,
    garbled_text,
    load_torch,
    read_bytes,
    read_json,
    write_bytes,
)
from prefect_ddp.tasks.data.validation import raise_fetch_failures, raise_if_lost
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.prediction.image_keys import true_class
from prefect_ddp.tasks.prediction.model_source import CARD, WEIGHTS
from prefect_ddp.tasks.prediction.workers import worker_device
from prefect_ddp.tasks.reporting import run_logger
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.training.model import load_model
from prefect_ddp.tasks.urls import child_url

CHUNKS_FOLDER = "predictions"
UNREADABLE_METADATA = b"unreadable"  # {key: why} as JSON, in each chunk file's metadata
SCHEMA = pa.schema([
    ("key", pa.string()),
    ("predicted", pa.string()),
    ("probability", pa.float32()),
    ("top_k_classes", pa.list_(pa.string())),
    ("top_k_probabilities", pa.list_(pa.float32())),
    ("true_class", pa.string()),
])
# Models kept per worker process. One flow run scores with one model, but a long-lived cluster
# serves run after run, each with its own copy: keeping every one would grow without bound.
CACHED_MODELS = 2


class ScoringJob(BaseModel):
    """What every chunk gets: plain locations, never a Prefect block."""

    source: Location  # the image folder; keys are relative to its url
    model: Location  # a folder holding model.pt and model.json: the run's copy
    output: Location  # the run's folder
    batch_size: int
    top_k: int
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S


class ChunkOutcome(BaseModel):
    """What one chunk scored; `skipped` when an earlier attempt of the run had written it."""

    index: int
    rows: int
    unreadable: dict[str, str]  # key -> why it could not be read
    skipped: bool


class LoadedModel(NamedTuple):
    model: nn.Module
    classes: list[str]
    image_size: int
    preprocessing: Preprocessing  # as the model was validated (model.json)
    device: torch.device


_models: OrderedDict[tuple[str, str], LoadedModel] = OrderedDict()
_models_lock = threading.Lock()


def chunk_name(index: int) -> str:
    """The name of chunk `index`'s file, in the run's predictions/ folder.

    >>> chunk_name(7)
    'chunk-000007.parquet'
    """
    return f"chunk-{index:06d}.parquet"


def chunk_url(output_url: str, index: int) -> str:
    return child_url(output_url, CHUNKS_FOLDER, chunk_name(index))


def loaded_model(folder: Location) -> LoadedModel:
    """The model in `folder` on this worker's own device (tasks/prediction/workers.py), loaded on
    first use and kept (CACHED_MODELS)."""
    device = worker_device()
    key = (folder.url, str(device))
    with _models_lock:  # a worker with several threads loads each model once
        if key not in _models:
            options = folder.storage_options()
            card = read_json(child_url(folder.url, CARD), options)
            model = built_model(folder.url, card, load_torch(child_url(folder.url, WEIGHTS), options)).to(device)
            _models[key] = LoadedModel(model, card["classes"], card["image_size"], Preprocessing.of_card(card), device)
            while len(_models) > CACHED_MODELS:
                _models.popitem(last=False)
        _models.move_to_end(key)
        return _models[key]


def built_model(url: str, card: dict[str, Any], state: dict[str, torch.Tensor]) -> nn.Module:
    """`load_model`, with a ValueError (never retried) where the weights do not fit the card."""
    try:
        return load_model(card, state)
    except RuntimeError as exc:  # load_state_dict's missing, unexpected or mis-shaped keys
        raise ValueError(
            f"{url}: model.pt does not fit model.json (a {card['backbone']} with {len(card['classes'])} "
            f"classes): {str(exc)[:300]}. Use a model.pt and model.json written together by one "
            "transfer-learning run."
        ) from exc


@task(name="score-chunk", task_run_name="score-chunk-{index}", retries=2, retry_delay_seconds=5,
      retry_condition_fn=retry_transient)
def score_chunk(job: ScoringJob, index: int, keys: list[str]) -> ChunkOutcome:
    """Score one chunk of images on a Dask worker into its Parquet file; skip a chunk already written.

    A fetch that still fails after its retries (throttling, a reset connection, the deadline)
    says nothing about the image, so it raises and Prefect retries the chunk; only missing
    and undecodable images are listed as unreadable.
    """
    url = chunk_url(job.output.url, index)
    options = job.output.storage_options()
    if exists(url, options):
        data = read_bytes(url, options)  # the store's errors fail the attempt, to be retried
        try:
            done = outcome_of(index, data, skipped=True)
        except (pa.ArrowException, ValueError, OSError) as error:  # the bytes do not decode: scored again
            run_logger().warning("Chunk %d of an earlier attempt of this run cannot be read (%s): scoring it again "
                                 "into %s.", index, garbled_text(error), url)
        else:
            run_logger().info("Chunk %d was scored by an earlier attempt of this run: %s", index, url)
            return done
    loaded = loaded_model(job.model)
    transform = eval_transform(loaded.image_size, loaded.preprocessing)
    batches: list[pa.Table] = []
    unreadable: dict[str, str] = {}
    for start in range(0, len(keys), job.batch_size):
        images, failed = fetch_images(job.source, keys[start:start + job.batch_size], transform,
                                      job.fetch_timeout_s)
        unreadable |= failed
        if images:
            batches.append(predictions(loaded, images, job.top_k))
    table = pa.concat_tables(batches) if batches else SCHEMA.empty_table()
    data = parquet_bytes(table, unreadable)
    write_bytes(url, data, options)
    return outcome_of(index, data, skipped=False)


def fetch_images(source: Location, keys: Sequence[str], transform: Callable,
                 timeout_s: float) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """({key: transformed image}, {key: why unreadable}) for `keys`, fetched at once, decoded and
    transformed on every core the worker may use (prefect_ddp.tasks.data.cpu_share).

    Through s3fs, not obstore, as every read outside a loader process: these Dask workers may run
    a training gang later, whose ranks fork DataLoader workers, and obstore started here
    would leave those reading with s3fs (prefect_ddp.tasks.data.object_reads.fetch_objects).
    """
    options = object_read_options(source.url, source.storage_options(), len(keys))
    fs, root = filesystem(source.url, options)
    paths = {key: f"{root}/{key}" for key in keys}
    fetched = fetch_objects(fs, list(paths.values()), len(keys), FETCH_ATTEMPTS, timeout_s)
    found = raise_fetch_failures(source, {key: fetched[path] for key, path in paths.items()}, timeout_s)
    outcomes = map_on_cpus(partial(transformed, transform=transform), list(found.values()))
    images = {key: outcome for key, outcome in zip(found, outcomes) if isinstance(outcome, torch.Tensor)}
    unreadable = {key: outcome for key, outcome in zip(found, outcomes) if isinstance(outcome, str)}
    return images, unreadable


def transformed(data: bytes | FileNotFoundError, transform: Callable) -> torch.Tensor | str:
    """The image `data` holds, transformed; or why it is unreadable, as decode-check words it."""
    if isinstance(data, FileNotFoundError):
        return f"FileNotFoundError: {data}"
    try:
        image = open_rgb(data, needed_side(transform))
    except Exception as exc:  # any decoder error means unreadable, as decode-check takes it
        return f"{type(exc).__name__}: {exc}"
    return transform(image)


def predictions(loaded: LoadedModel, images: dict[str, torch.Tensor], top_k: int) -> pa.Table:
    """One row per image: the most probable class, its probability, the top k, the true class."""
    batch = torch.stack(list(images.values())).to(loaded.device)
    with torch.inference_mode():
        probabilities = loaded.model(batch).float().softmax(dim=1)
    top = probabilities.topk(min(top_k, len(loaded.classes)), dim=1)
    values, indices = top.values.cpu().tolist(), top.indices.cpu().tolist()
    named = [[loaded.classes[i] for i in row] for row in indices]
    return pa.table({
        "key": list(images),
        "predicted": [row[0] for row in named],
        "probability": [row[0] for row in values],
        "top_k_classes": named,
        "top_k_probabilities": values,
        "true_class": [true_class(key) for key in images],
    }, schema=SCHEMA)


def parquet_bytes(table: pa.Table, unreadable: dict[str, str]) -> bytes:
    """The chunk's file: its rows, and its unreadable images in the file's metadata."""
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata({UNREADABLE_METADATA: json.dumps(unreadable)}), sink)
    return sink.getvalue().to_pybytes()


def read_chunk(data: bytes) -> tuple[pa.Table, dict[str, str]]:
    """A chunk file's rows and its unreadable images."""
    table = pq.read_table(io.BytesIO(data))
    return table, json.loads((table.schema.metadata or {}).get(UNREADABLE_METADATA, b"{}"))


def outcome_of(index: int, data: bytes, skipped: bool) -> ChunkOutcome:
    table, unreadable = read_chunk(data)
    return ChunkOutcome(index=index, rows=table.num_rows, unreadable=unreadable, skipped=skipped)


def score_images(runner: DaskTaskRunner, job: ScoringJob, chunks: list[list[str]]) -> list[ChunkOutcome]:
    """Score every chunk across the cluster's workers; return each chunk's outcome, in order.

    Dask reruns a chunk whose worker died on another worker; when it gives up (KilledWorker),
    the run stops as decode-check's does (prefect_ddp.tasks.data.validation.raise_if_lost).
    """
    futures = [runner.submit(score_chunk, parameters={"job": job, "index": index, "keys": keys})
               for index, keys in enumerate(chunks)]
    log_progress(runner, futures, chunks)
    raise_if_lost(futures, chunks, lambda keys: f"Scoring the chunk from {keys[0]!r}")
    return [future.result() for future in futures]


def log_progress(runner: DaskTaskRunner, futures: list[PrefectDaskFuture], chunks: list[list[str]]) -> None:
    """Wait for every chunk, logging at each tenth of the images done."""
    log = run_logger()
    total, done, told = sum(map(len, chunks)), 0, 0
    sizes = {future.wrapped_future.key: len(keys) for future, keys in zip(futures, chunks)}
    log.info("Scoring %d images in %d chunk(s) across the Dask workers", total, len(chunks))
    for finished in distributed.as_completed([future.wrapped_future for future in futures], loop=runner.client.loop):
        done += sizes[finished.key]
        if done * 10 // total > told:
            told = done * 10 // total
            log.info("Chunks done for %d of %d images (%d%%)", done, total, 100 * done // total)

"""What a batch-predict run found: summary.json in its folder and the `batch-predictions` artifact.

Read from the chunk files, not from the tasks' results, so a chunk skipped by a rerun counts
like one scored now. Accuracy needs true classes the model knows: an image in a folder that
is not one of the model's classes ("unknown class") or directly under the prefix (no
class) is scored and counted, but left out of the accuracy and the confusion matrix.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from matplotlib.figure import Figure
from prefect import task
from prefect.artifacts import create_markdown_artifact

from prefect_ddp.tasks.data.dataset import FETCH_ATTEMPTS
from prefect_ddp.tasks.data.object_reads import fetch_objects, object_read_options
from prefect_ddp.tasks.data.storage import filesystem, read_bytes, write_json
from prefect_ddp.tasks.data.validation import DEFAULT_MAX_UNREADABLE, unreadable_verdict
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.prediction.image_keys import KEYS_FILE
from prefect_ddp.tasks.prediction.model_source import CARD, SOURCE_RECORD
from prefect_ddp.tasks.prediction.scoring import CHUNKS_FOLDER, SCHEMA, ScoringJob, chunk_name, read_chunk
from prefect_ddp.tasks.reporting import markdown_table, run_logger
from prefect_ddp.tasks.results.plots import markdown_image, png_bytes
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.urls import child_url

SUMMARY_FILE = "summary.json"
LEAST_CONFIDENT = 10
SHOWN_UNREADABLE = 20
HISTOGRAM_BINS = 20
READ_CONCURRENCY = 32


def read_predictions(output: Location, chunk_count: int) -> tuple[pa.Table, dict[str, str]]:
    """Every chunk's rows, in key order, and every unreadable image with why.

    The files are fetched READ_CONCURRENCY at a time: a million images are 4,000 chunk files,
    minutes of GETs one after another on S3.
    """
    options = object_read_options(output.url, output.storage_options(), READ_CONCURRENCY)
    fs, root = filesystem(output.url, options)
    paths = [f"{root}/{CHUNKS_FOLDER}/{chunk_name(index)}" for index in range(chunk_count)]
    fetched = fetch_objects(fs, paths, READ_CONCURRENCY, FETCH_ATTEMPTS)
    tables: list[pa.Table] = []
    unreadable: dict[str, str] = {}
    for path in paths:
        data = fetched[path]
        if isinstance(data, Exception):
            raise data  # every chunk was written before the summary: retried as any storage error
        table, failed = read_chunk(data)
        tables.append(table)
        unreadable |= failed
    return (pa.concat_tables(tables) if tables else SCHEMA.empty_table()), dict(sorted(unreadable.items()))


def accuracy_and_confusion(table: pa.Table, classes: list[str]) -> tuple[float | None, list[list[int]] | None]:
    """Accuracy and confusion matrix (rows: true class, columns: predicted, in `classes` order) over
    the images whose folder is one of `classes`; (None, None) when there are none."""
    position = {name: i for i, name in enumerate(classes)}
    pairs = [(position[true], position[predicted])
             for true, predicted in zip(table["true_class"].to_pylist(), table["predicted"].to_pylist())
             if true in position]
    if not pairs:
        return None, None
    matrix = np.zeros((len(classes), len(classes)), dtype=int)
    for true, predicted in pairs:
        matrix[true, predicted] += 1
    return float(np.trace(matrix) / len(pairs)), matrix.tolist()


def summarize(table: pa.Table, unreadable: dict[str, str], classes: list[str]) -> dict[str, Any]:
    """The run's numbers: rows, unreadable images, counts per class, accuracy where labelled."""
    true = table["true_class"].to_pylist()
    accuracy, confusion = accuracy_and_confusion(table, classes)
    least = table.take(pc.sort_indices(table, [("probability", "ascending"), ("key", "ascending")])[:LEAST_CONFIDENT])
    return {
        "rows": table.num_rows,
        "unreadable": unreadable,
        "classes": classes,
        "predicted_counts": {name: n for name, n in Counter(table["predicted"].to_pylist()).most_common()},
        "labelled": sum(t in classes for t in true),
        "unknown_class": sorted({t for t in true if t is not None and t not in classes}),
        "unknown_class_images": sum(t is not None and t not in classes for t in true),
        "no_class_images": true.count(None),
        "accuracy": accuracy,
        "confusion_matrix": confusion,
        "least_confident": least.select(["key", "predicted", "probability", "true_class"]).to_pylist(),
    }


def confidence_histogram_png(probabilities: list[float]) -> bytes:
    """How sure the model was: the predicted class's probability over all scored images."""
    figure = Figure(figsize=(6, 3), dpi=90, layout="constrained")
    axes = figure.subplots()
    axes.hist(probabilities, bins=HISTOGRAM_BINS, range=(0, 1))
    axes.set_xlabel("probability of the predicted class")
    axes.set_ylabel("images")
    axes.grid(alpha=0.3)
    return png_bytes(figure)


def report_markdown(summary: dict[str, Any], probabilities: list[float]) -> str:
    """The artifact: counts, confidence, accuracy where labelled, least confident and unreadable images."""
    unreadable = summary["unreadable"]
    parts = [
        (f"# Batch predictions: `{summary['source']}`\n\n"
         f"Scored **{summary['rows']}** images with `{summary['model']['model']}` "
         f"({summary['model']['folder']}); **{len(unreadable)}** unreadable.\n"),
        accuracy_line(summary),
        markdown_image(confidence_histogram_png(probabilities), "confidence histogram") + "\n",
        "## Predicted classes\n\n"
        + markdown_table(["class", "images"], [[k, v] for k, v in summary["predicted_counts"].items()]),
    ]
    if summary["confusion_matrix"]:
        parts.append("## Confusion matrix (rows: true class, columns: predicted)\n\n" + markdown_table(
            ["true \\ predicted", *summary["classes"]],
            [[name, *row] for name, row in zip(summary["classes"], summary["confusion_matrix"])]))
    parts.append(f"## The {LEAST_CONFIDENT} least confident\n\n" + markdown_table(
        ["key", "predicted", "probability", "true class"],
        [[r["key"], r["predicted"], r["probability"], r["true_class"] or ""] for r in summary["least_confident"]]))
    if unreadable:
        parts.append(f"## Unreadable images ({min(len(unreadable), SHOWN_UNREADABLE)} of {len(unreadable)})\n\n"
                     + markdown_table(["key", "error"], [[k, v] for k, v in list(unreadable.items())[:SHOWN_UNREADABLE]]))
    return "\n".join(parts)


def accuracy_line(summary: dict[str, Any]) -> str:
    left_out = []
    if summary["unknown_class_images"]:
        left_out.append(f"{summary['unknown_class_images']} in folders that are not model classes "
                        f"({', '.join(summary['unknown_class'])}: unknown class)")
    if summary["no_class_images"]:
        left_out.append(f"{summary['no_class_images']} outside any class folder")
    if summary["accuracy"] is None:
        return ("No accuracy: no image sits in a folder named after one of the model's classes "
                f"({', '.join(summary['classes'])}).\n")
    return (f"**Accuracy {summary['accuracy']:.4f}** on {summary['labelled']} images in folders named after "
            "the model's classes"
            + (f"; left out: {'; '.join(left_out)}" if left_out else "") + ".\n")


@task(name="summarize-predictions", retries=2, retry_delay_seconds=10, retry_condition_fn=retry_transient)
def summarize_predictions(job: ScoringJob, chunk_count: int,
                          max_unreadable_fraction: float = DEFAULT_MAX_UNREADABLE) -> dict[str, Any]:
    """Read every chunk, write summary.json beside them, publish the `batch-predictions` artifact.

    Then fail (ValueError, not retried) when no image, or more than `max_unreadable_fraction`
    of them, could be read, as training does (prefect_ddp.tasks.data.validation.unreadable_verdict):
    after the summary and the artifact, which list the unreadable images, keeping the chunks
    written.
    """
    options = job.output.storage_options()
    card = json.loads(read_bytes(child_url(job.model.url, CARD), job.model.storage_options()))
    table, unreadable = read_predictions(job.output, chunk_count)
    files = {name: child_url(job.output.url, name) for name in (SUMMARY_FILE, KEYS_FILE)}
    files |= {"predictions": child_url(job.output.url, CHUNKS_FOLDER), "model": job.model.url}
    summary = {
        "source": job.source.url,
        "model": json.loads(read_bytes(child_url(job.model.url, SOURCE_RECORD), job.model.storage_options())),
        **summarize(table, unreadable, card["classes"]),
        "files": files,
    }
    write_json(files[SUMMARY_FILE], summary, options)
    probabilities = table["probability"].to_pylist()
    create_markdown_artifact(key="batch-predictions", markdown=report_markdown(summary, probabilities),
                             description=f"Batch predictions of {job.source.url}")
    run_logger().info("Scored %d images, %d unreadable; accuracy %s", summary["rows"], len(unreadable),
                      "n/a" if summary["accuracy"] is None else f"{summary['accuracy']:.4f}")
    verdict = unreadable_verdict(job.source.url, summary["rows"] + len(unreadable), unreadable,
                                 max_unreadable_fraction, "max_unreadable_fraction", "score the rest")
    if verdict:
        raise ValueError(f"{verdict} Every unreadable image is listed in {files[SUMMARY_FILE]}.")
    return summary

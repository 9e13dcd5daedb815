"""The final report: curves as an inline PNG, the promotion verdict, text the UI shows whole."""

from __future__ import annotations

import base64
import io
import re

import pytest
from PIL import Image

from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.reporting import markdown_table
from prefect_ddp.tasks.results.plots import markdown_image, training_curves_png
from prefect_ddp.tasks.results.aggregation import attempt_rows
from prefect_ddp.tasks.results.promotion import Promotion
from prefect_ddp.tasks.results.records import TrainingSummary
from prefect_ddp.tasks.results.report import (
    attempts_markdown,
    promotion_markdown,
    report_markdown,
    trained_images_text,
)

pytestmark = pytest.mark.unit

HISTORY = [{"epoch": e, "train_loss": 1.0 / e, "train_acc": 0.3 * e, "val_loss": 1.2 / e, "val_acc": 0.25 * e,
            "lr": 0.01, "seconds": 1.5, "train_samples": 28} for e in (1, 2, 3)]


def test_curves_are_a_png_that_renders_inline():
    png = training_curves_png(HISTORY)
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.width > 2 * image.height
    markdown = markdown_image(png, "curves")
    encoded = re.fullmatch(r"!\[curves\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", markdown).group(1)
    assert base64.b64decode(encoded) == png


def test_the_report_shows_curves_and_says_whether_the_model_was_promoted():
    summary = TrainingSummary.model_validate({
        "history": HISTORY, "final_val_acc": 0.75, "final_val_loss": 0.4, "best_val_acc": 0.75, "best_epoch": 3,
        "selected_by": "highest val_acc", "train_size": 30, "val_size": 9, "world_size": 2, "split_digests": ["abc"],
        "ranks": [{"rank": 0, "worker_address": "tcp://a:1"}, {"rank": 1, "worker_address": "tcp://b:1"}],
        "files": {"model.pt": "s3://b/out/run/model.pt"}, "time": None, "pruned_at": None, "attempts": [],
        "unreadable": {"decode_check": 1, "in_training": 0, "keys": []}, "recipe": None, "comparison": None})
    manifest = Manifest(root="s3://b/images", classes=["a", "b", "c"], paths=["a/1.jpg"], labels=[0], sizes=[1])
    refused = Promotion(promoted=False, reason="best_val_acc 0.7500 is worse than 0.8000 of owl, which stays",
                        pointer_url="s3://b/out/nightly/latest.json", kept_url="s3://b/out/nightly/versions/owl-1")
    report = report_markdown(summary, manifest, markdown_image(training_curves_png(HISTORY), "curves"),
                             promotion_markdown(refused, None))
    assert "![curves](data:image/png;base64," in report
    assert "**Model: the weights of epoch 3, val accuracy 0.7500** (the epoch with the highest val_acc)" in report
    assert ("**Not promoted**: `s3://b/out/nightly/latest.json` still points to `s3://b/out/nightly/versions/owl-1`: "
            "best_val_acc 0.7500 is worse than 0.8000 of owl") in report
    assert "| 3 | 0.3333 | 0.9 | 0.4 | 0.75 | 0.01 | 1.5 |" in report
    assert "Images trained per epoch: 28 of 30 training images." in report
    assert "Unreadable images left out: 1 by decode-check, none during training." in report
    assert "outside a deployment" in promotion_markdown(None, None)
    assert "trials never promote on their own" in promotion_markdown(None, None, in_sweep=True)


def test_images_trained_per_epoch_show_beside_the_training_set_size():
    assert trained_images_text([{"train_samples": 1008}] * 3, 1010) == (
        "Images trained per epoch: 1,008 of 1,010 training images.")
    resumed_on_fewer_ranks = [{"train_samples": 1008}, {"train_samples": 1009}, {"train_samples": 1009}]
    assert trained_images_text(resumed_on_fewer_ranks, 1010) == (
        "Images trained per epoch: 1,008 to 1,009 of 1,010 training images.")


def test_table_cells_keep_angle_brackets_and_pipes_visible():
    table = markdown_table(["key", "error"], [["a|b.jpg", "cannot identify image file <_io.BytesIO object>\nat 0x1"]])
    assert "| a\\|b.jpg | cannot identify image file &lt;_io.BytesIO object&gt; at 0x1 |" in table


def test_the_report_lists_each_change_of_the_gang_s_size_where_it_went_on_from_and_its_cost():
    gang = [{"number": 1, "workers": ["a", "b", "c"], "world_size": 3, "seconds": 40.0, "started_at": 1000.0,
             "ended": "Worker b of rank 1 left the cluster (killed, out of memory or lost) while training"},
            {"number": 2, "workers": ["a", "c"], "world_size": 2, "seconds": 30.0, "started_at": 1042.5,
             "ended": "regrouped: a worker came free, and the gang was formed again larger"},
            {"number": 3, "workers": ["a", "c", "d"], "world_size": 3, "seconds": 50.0, "started_at": 1073.5,
             "ended": "completed"}]
    resumes = [{"attempt": 1, "world_size": 3, "resumed_after_epoch": 0},  # written by an older release
               {"attempt": 2, "world_size": 2, "resumed_after_epoch": 1, "at_sample": 24, "handed_over": True},
               {"attempt": 3, "world_size": 3, "resumed_after_epoch": 3, "at_sample": 0, "handed_over": True}]
    rows = attempt_rows(gang, resumes)
    assert [r.reformed_s for r in rows] == [None, 2.5, 1.0]
    report = attempts_markdown(rows)
    assert "Its size changed: 3 -> 2 ranks, 2 -> 3 ranks." in report
    assert "| 2 | 00:17:22 | 2 | a, c | in epoch 2 at sample 24, handed over in memory | 2.5 | 30 | regrouped:" in report
    assert "| 3 | 00:17:53 | 3 | a, c, d | after epoch 3, handed over in memory | 1 | 50 | completed |" in report
    assert "| 1 | 00:16:40 | 3 | a, b, c | from the start |  | 40 |" in report

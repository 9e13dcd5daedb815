"""Rank results and training summaries are read by attribute inside the package, so a renamed
field fails under mypy where it is read, not at run time far from its cause."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from prefect_ddp.tasks.results.records import TrainingSummary
from prefect_ddp.tasks.training.step_times import PARTS, epoch_timing

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# `summary["x"]`, `results[0]["x"]`, `result.get("x")`, `summary[METRIC]`: a key read of the names
# that hold a rank result or a training summary (an index such as `results[0]` alone is no key read) ...
BY_NAME = re.compile(r"\b(?:results?|summary)(?:\[\d+\])?(?:\[(?!\d)|\.get\()")
# ... and of the fields only a rank result or a training summary has, whatever holds them.
BY_FIELD = re.compile(r"""\[["'](?:worker_address|split_digests?|local_train_samples|checkpoint_s|selected_by|"""
                      r"""pruned_at|best_val_acc|final_val_acc|final_val_loss)["']\]""")


def key_reads(folders: list[Path]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
            for folder in folders for path in sorted(folder.rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), 1)
            if BY_NAME.search(line) or BY_FIELD.search(line)]


def test_no_rank_result_or_training_summary_is_read_by_string_key():
    # Where rank results and training summaries go; tasks/data and tasks/prediction have `results`
    # and `summary` of their own (object reads, batch predictions) and never see these.
    folders = [ROOT / "flows", *(ROOT / "tasks" / name for name in ("gang", "results", "sweeps", "training"))]
    assert key_reads(folders) == []


def test_a_metrics_json_of_the_first_release_still_reads_as_a_training_summary():
    """A kept model's metrics.json, or a resumed sweep's best trial's, may come from an earlier
    release: flows.sweep.promote_best validates it, and failed on every field added since."""
    first_release = {"world_size": 1, "ranks": [{"rank": 0, "worker_address": "tcp://127.0.0.1:1"}],
                     "split_digests": ["d"], "train_size": 8, "val_size": 2,
                     "history": [{"epoch": 1, "val_acc": 0.5, "val_loss": 0.7}], "best_epoch": 1,
                     "best_val_acc": 0.5, "final_val_acc": 0.5, "final_val_loss": 0.7,
                     "files": {"model.pt": "/out/model.pt"}}
    summary = TrainingSummary.model_validate(first_release)
    assert (summary.best_val_acc, summary.time, summary.recipe, summary.comparison, summary.attempts) == (
        0.5, None, None, None, [])


def test_the_search_finds_the_reads_it_forbids():
    lines = ['stopped = results[0]["unreadable"]["stopped"] if results else None',
             'theirs = global_metrics(result["history"])', '"pruned_at": results[0].get("pruned_at"),',
             'metric = summary[METRIC]', 'workers = [r["worker_address"] for r in ranks]']
    assert [bool(BY_NAME.search(line) or BY_FIELD.search(line)) for line in lines] == [True] * len(lines)
    assert not BY_NAME.search("first = results[0] if isinstance(results[0], dict) else {}")


def test_an_epoch_timing_records_its_checkpoint_time_only_when_measured():
    row = [1.0, 2.0, 4.0, 0.5, 0.4, 0.1, 1.0, 8.0, 100.0]
    timing = epoch_timing([row, row], "")
    assert "checkpoint_s" not in timing.model_dump()
    assert timing.model_copy(update={"checkpoint_s": 0.5}).model_dump()["checkpoint_s"] == 0.5
    assert list(timing.model_dump()) == ["images_per_s", "shares", "per_rank", "slowest_rank", "slower_by", "verdict"]
    per_rank = timing.model_dump()["per_rank"]
    assert [list(rank) for rank in per_rank] == [["rank", "step_s", *PARTS, "validation", "train_wall_s", "images"]] * 2

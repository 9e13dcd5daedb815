"""batch-predict: a model trained here scores a labelled folder on moto S3 across the session's
Dask cluster; a rerun skips the chunks already written; bad model specs are told clearly; a
folder of nothing readable, or too many unreadable images, fails the run; each worker scores
on a device of its own."""

from __future__ import annotations

import json
from pathlib import Path

import distributed
import pyarrow.parquet as pq
import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.deployments.sample_data import shapes_dataset
from prefect_ddp.flows.batch_predict import batch_predict
from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.config import ClusterConfig, DataConfig, ModelConfig, OutputConfig, TrainingConfig
from prefect_ddp.tasks.data.storage import save_torch, write_json
from prefect_ddp.tasks.data.validation import chunked, unreadable_verdict
from prefect_ddp.tasks.gang import GpuClaim
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.prediction.model_source import check_card, copy_registered_model, keep_model, resolve_model_folder
from prefect_ddp.tasks.prediction.scoring import ScoringJob, built_model, chunk_url, read_chunk, score_chunk
from prefect_ddp.tasks.prediction.summary import summarize_predictions
from prefect_ddp.tasks.training.model import build_model
from prefect_ddp.tasks.prediction.workers import (
    ScoringRefused,
    probe_scoring_worker,
    scoring_device,
    scoring_problems,
)
from tests.conftest import BUCKET, truncated_jpeg
from tests.support.flow_runs import TINY_TRAINING, assert_failed_cleanly

MODEL_NAME = "shapes-scorer"
CLASSES = ["circle", "square", "triangle"]
CHUNK_SIZE = 4
TOP_K = 2
UNREADABLE = {"square/truncated.jpg", "triangle/not-an-image.jpg"}
ALLOWED_UNREADABLE = 0.2  # the folder's 2 unreadable images of 13 are 15 %, above the default 10 %


@pytest.fixture(scope="module")
def kept_model(image_location: DataLocation, dask_cluster, tmp_path_factory) -> str:
    """OUTPUT/NAME/latest of a tiny model trained on the session's shapes, kept under MODEL_NAME."""
    image_location.save("test-images", overwrite=True)
    output = tmp_path_factory.mktemp("trained")
    transfer_learning(
        data=DataConfig(block="test-images", index_cache_minutes=0),
        model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(**TINY_TRAINING),
        cluster=ClusterConfig(address=dask_cluster.scheduler_address, world_size=1, init_timeout_s=60,
                              max_restarts=0),
        output=OutputConfig(url=str(output), model_name=MODEL_NAME),
    )
    return f"{output}/{MODEL_NAME}/latest"


@pytest.fixture(scope="module")
def labelled_folder(image_location: DataLocation, s3_fs) -> tuple[str, set[str]]:
    """(url, readable keys): class folders of the model's classes, one folder it has no class for,
    an image outside any folder, two unreadable images and a file that is no image."""
    files = shapes_dataset(3, size=32, seed=11)
    files["hexagon/0000.jpg"] = files["circle/0000.jpg"]
    files["loose.jpg"] = files["square/0000.jpg"]
    readable = set(files)
    files["square/truncated.jpg"] = truncated_jpeg()
    files["triangle/not-an-image.jpg"] = b"these bytes are no image"
    files["notes.txt"] = b"not listed: no image extension"
    s3_fs.pipe({f"{BUCKET}/to-score/{key}": data for key, data in files.items()})
    return f"s3://{BUCKET}/to-score", readable


@pytest.fixture(scope="module")
def scored(kept_model: str, labelled_folder, dask_cluster, tmp_path_factory):
    url, _ = labelled_folder
    state = batch_predict(
        model=kept_model, data_url=url, data_block="test-images",
        output_url=str(tmp_path_factory.mktemp("predictions")),
        cluster=ClusterConfig(address=dask_cluster.scheduler_address),
        chunk_size=CHUNK_SIZE, batch_size=3, top_k=TOP_K, max_unreadable_fraction=ALLOWED_UNREADABLE,
        return_state=True,
    )
    summary = state.result()
    return state, summary, Path(summary["files"]["summary.json"]).parent


def test_one_row_per_readable_image_and_the_unreadable_listed(scored, labelled_folder):
    _, summary, run_dir = scored
    _, readable = labelled_folder
    chunks = sorted(p.name for p in (run_dir / "predictions").iterdir())
    assert chunks == [f"chunk-{i:06d}.parquet" for i in range(4)]  # 13 images in chunks of 4
    rows = pq.read_table(run_dir / "predictions").to_pylist()
    assert sorted(r["key"] for r in rows) == sorted(readable)
    assert summary["rows"] == len(readable)
    listed = {}
    for chunk in chunks:
        listed |= read_chunk((run_dir / "predictions" / chunk).read_bytes())[1]
    assert set(listed) == set(summary["unreadable"]) == UNREADABLE
    for row in rows:
        assert row["predicted"] in CLASSES and 0 <= row["probability"] <= 1
        assert row["top_k_classes"][0] == row["predicted"] and len(row["top_k_classes"]) == TOP_K
        assert row["top_k_probabilities"][0] == row["probability"]
        assert row["top_k_probabilities"] == sorted(row["top_k_probabilities"], reverse=True)
        assert row["true_class"] == (row["key"].split("/")[0] if "/" in row["key"] else None)


def test_the_reported_accuracy_is_that_of_the_rows_in_the_model_classes(scored):
    state, summary, run_dir = scored
    rows = pq.read_table(run_dir / "predictions").to_pylist()
    labelled = [r for r in rows if r["true_class"] in CLASSES]
    assert len(labelled) == summary["labelled"] == 9
    assert summary["accuracy"] == pytest.approx(sum(r["predicted"] == r["true_class"] for r in labelled) / 9)
    assert (summary["unknown_class"], summary["unknown_class_images"], summary["no_class_images"]) == (["hexagon"], 1, 1)
    assert sum(map(sum, summary["confusion_matrix"])) == 9
    assert json.loads((run_dir / "summary.json").read_text()) == json.loads(json.dumps(summary))
    with get_client(sync_client=True) as api:
        artifacts = api.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    report = next(a for a in artifacts if a.key == "batch-predictions").data
    assert f"**Accuracy {summary['accuracy']:.4f}** on 9 images in folders named after" in report
    assert "data:image/png;base64," in report and "square/truncated.jpg" in report


def test_the_run_scores_with_its_own_copy_of_the_kept_model(scored, kept_model):
    _, summary, run_dir = scored
    version = Path(json.loads(Path(f"{kept_model}.json").read_text())["version"])
    assert (run_dir / "model" / "model.pt").read_bytes() == (version / "model.pt").read_bytes()
    assert summary["model"] == {"model": kept_model, "folder": str(version)}


def test_a_rerun_scores_only_the_chunks_not_written_yet(scored, image_location, labelled_folder):
    _, _, run_dir = scored
    url, _ = labelled_folder
    job = ScoringJob(source=image_location.plain().with_url(url), model=Location(url=str(run_dir / "model")),
                     output=Location(url=str(run_dir)), batch_size=3, top_k=TOP_K)
    chunks = chunked(json.loads((run_dir / "keys.json").read_text())["keys"], CHUNK_SIZE)
    files = [Path(chunk_url(str(run_dir), i)) for i in range(len(chunks))]
    before = [f.stat().st_mtime_ns for f in files]
    first_rows = pq.read_table(files[1]).to_pylist()
    files[1].unlink()
    outcomes = [score_chunk.fn(job, i, keys) for i, keys in enumerate(chunks)]
    assert [o.skipped for o in outcomes] == [True, False, True, True]
    assert [f.stat().st_mtime_ns for f in files[:1] + files[2:]] == before[:1] + before[2:]
    again = pq.read_table(files[1]).to_pylist()
    assert [(r["key"], r["predicted"]) for r in again] == [(r["key"], r["predicted"]) for r in first_rows]
    assert sum(len(o.unreadable) for o in outcomes) == len(UNREADABLE)  # skipped chunks still know theirs


def saved_model(folder: Path, card: dict | None = None) -> Path:
    """A folder as training leaves it: a model that loads (keep_model loads it before copying)."""
    folder.mkdir(parents=True)
    card = card or {"backbone": "mobilenet_v3_small", "classes": CLASSES, "image_size": 32}
    model = build_model(ModelConfig(backbone=card["backbone"]), len(CLASSES))
    save_torch(str(folder / "model.pt"), model.state_dict(), {})
    write_json(str(folder / "model.json"), card, {})
    return folder


@pytest.mark.unit
def test_model_specs_resolve_or_say_what_is_allowed(tmp_path):
    version = saved_model(tmp_path / "out" / "shapes" / "versions" / "run-1")
    write_json(str(tmp_path / "out" / "shapes" / "latest.json"), {"version": str(version)}, {})
    store = Location()
    assert resolve_model_folder(str(tmp_path / "out" / "shapes" / "latest"), store).url == str(version)
    assert resolve_model_folder(str(version) + "/", store).url == str(version)
    with pytest.raises(ValueError, match="'models:/shapes@champion' names a registered model, but no tracking block"):
        copy_registered_model("models:/shapes@champion", None, Location(url=str(tmp_path / "copy")))
    with pytest.raises(FileNotFoundError, match="has no model.pt and no model.json.*It holds latest.json: name "
                                                "the kept model as .*/shapes/latest"):
        resolve_model_folder(str(tmp_path / "out" / "shapes"), store)
    with pytest.raises(FileNotFoundError, match="No .*/other/latest.json either: nothing was kept under that name"):
        resolve_model_folder(str(tmp_path / "out" / "other" / "latest"), store)
    (version / "model.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"run-1 has no model.json, so it is not a saved model.*Give OUTPUT"):
        resolve_model_folder(str(tmp_path / "out" / "shapes" / "latest"), store)


@pytest.mark.unit
def test_a_model_card_without_classes_or_fields_or_fitting_weights_is_refused():
    with pytest.raises(ValueError, match=r"m.json lists no classes \(got classes=None\)"):
        check_card(b'{"backbone": "resnet18", "image_size": 32}', "m.json")
    with pytest.raises(ValueError, match="m.json lacks image_size"):
        check_card(json.dumps({"backbone": "resnet18", "classes": CLASSES}).encode(), "m.json")
    with pytest.raises(ValueError, match="m.json is not valid JSON"):
        check_card(b"{", "m.json")
    with pytest.raises(ValueError, match="model.pt does not fit model.json"):
        built_model("run/model", {"backbone": "mobilenet_v3_small", "classes": CLASSES, "image_size": 32}, {})


@pytest.mark.unit
def test_a_rerun_keeps_the_model_copied_first_though_the_pointer_moved(tmp_path):
    first, second = (saved_model(tmp_path / "kept" / "versions" / name) for name in ("first", "second"))
    pointer = tmp_path / "kept" / "latest.json"
    out = Location(url=str(tmp_path / "run"))
    write_json(str(pointer), {"version": str(first)}, {})
    copy = keep_model.fn(str(tmp_path / "kept" / "latest"), Location(), out)
    write_json(str(pointer), {"version": str(second)}, {})
    assert keep_model.fn(str(tmp_path / "kept" / "latest"), Location(), out) == copy
    assert (Path(copy.url) / "model.pt").read_bytes() == (first / "model.pt").read_bytes()
    assert json.loads((Path(copy.url) / "source.json").read_text())["folder"] == str(first)


@pytest.mark.unit
def test_a_model_cut_short_is_refused_before_any_image_is_scored(tmp_path):
    """Issue 46: every chunk failed on it, after fetching its images, and each retried."""
    version = saved_model(tmp_path / "kept" / "versions" / "cut")
    (version / "model.pt").write_bytes((version / "model.pt").read_bytes()[:1000])
    out = Location(url=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"whose model cannot be used: model.pt cannot be loaded as model.json "
                                         r"describes it \(RuntimeError: PytorchStreamReader"):
        keep_model.fn(str(version), Location(), out)
    assert not (tmp_path / "run").exists()  # nothing copied: a retry reads the source again


def scored_job(run_dir: Path, source: Location) -> ScoringJob:
    """The ScoringJob of the run that wrote `run_dir`."""
    return ScoringJob(source=source, model=Location(url=str(run_dir / "model")), output=Location(url=str(run_dir)),
                      batch_size=3, top_k=TOP_K)


def test_more_unreadable_images_than_allowed_fail_after_the_summary(scored, image_location, labelled_folder):
    _, _, run_dir = scored
    url, _ = labelled_folder
    (run_dir / "summary.json").unlink()
    with pytest.raises(ValueError, match=r"2 of the 13 images checked under .*to-score' \(15.4%\) could not be read, "
                                         r"more than max_unreadable_fraction=0.1 allows; e.g. square/truncated.jpg, "
                                         r"triangle/not-an-image.jpg .*raise max_unreadable_fraction to score "
                                         r"the rest"):
        summarize_predictions.fn(scored_job(run_dir, image_location.plain().with_url(url)), 4, 0.1)
    assert json.loads((run_dir / "summary.json").read_text())["unreadable"].keys() == UNREADABLE  # written first


@pytest.mark.unit
def test_no_readable_image_fails_whatever_the_allowed_share():
    assert unreadable_verdict("s3://b/p", 2, {"a.jpg": "OSError", "b.jpg": "OSError"}, 1, "max_unreadable_fraction",
                              "score the rest").startswith("None of the 2 images checked under 's3://b/p'")
    assert unreadable_verdict("s3://b/p", 10, {"a.jpg": "OSError"}, 0.1, "max_unreadable_fraction", "score") is None


def test_a_folder_of_nothing_readable_fails_and_keeps_its_chunks(kept_model, image_location, s3_fs, dask_cluster,
                                                                tmp_path):
    # A prefix of its own: tests/test_unreadable.py writes below test-images/unreadable.
    s3_fs.pipe({f"{BUCKET}/nothing-readable/a/{n}.jpg": b"no image" for n in range(3)})
    state = batch_predict(
        model=kept_model, data_url=f"s3://{BUCKET}/nothing-readable", data_block="test-images", output_url=str(tmp_path),
        cluster=ClusterConfig(address=dask_cluster.scheduler_address), chunk_size=2, return_state=True,
    )
    assert_failed_cleanly(state, ValueError, r"None of the 3 images checked under .*nothing-readable' could be read: all 3 "
                                             r"failed to decode or are missing, e.g. a/0.jpg, a/1.jpg, a/2.jpg")
    (run_dir,) = tmp_path.iterdir()
    assert sorted(p.name for p in (run_dir / "predictions").iterdir()) == ["chunk-000000.parquet",
                                                                         "chunk-000001.parquet"]


@pytest.mark.unit
def test_a_worker_scores_on_the_gpu_it_claimed_and_one_without_is_refused():
    assert scoring_device(None).type == "cpu"
    assert str(scoring_device(GpuClaim("GPU-c", 2))) == "cuda:2"  # before: every worker on "cuda", i.e. GPU 0
    held = GpuClaim(None, None, "all 2 GPU(s) it sees are held by other processes on its host")
    with pytest.raises(ScoringRefused, match="no GPU of its own to score on: all 2 GPU"):
        scoring_device(held)
    problems = scoring_problems({"tcp://a:1": {"host": "h", "sees_output": True, "gpu_claim": held},
                                 "tcp://b:1": {"host": "h", "sees_output": False, "gpu_claim": GpuClaim("GPU-a", 0)}},
                                "/data/run")
    assert [p.split(":")[0] for p in problems] == ["The run folder /data/run is local to the flow's host, and "
                                                   "worker(s) tcp", "Worker tcp"]
    assert "Fix: give an s3:// output_url" in problems[0] and "held by other processes" in problems[1]


@pytest.mark.gpu
def test_the_workers_of_one_host_score_on_gpus_of_their_own(dask_cluster):
    with distributed.Client(dask_cluster) as client:
        claims = client.run(probe_scoring_worker, None)
    held = [probe["gpu_claim"].uuid for probe in claims.values() if probe["gpu_claim"].uuid]
    assert len(held) == min(len(claims), torch.cuda.device_count()) == len(set(held)), claims

"""Promotion and warm start, on real files and moto's S3: a worse run never replaces the kept
model, and runs promoting at once leave the better model kept, whole."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
import torch

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import ModelConfig
from prefect_ddp.tasks.data.dataset import forget_parent_exit_hooks
from prefect_ddp.tasks.data.storage import (
    read_bytes,
    save_torch,
    write_bytes,
    write_json,
)
from prefect_ddp.tasks.data.manifest import Manifest
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.results.comparison import UnusableChampion, champion_to_beat, comparison_markdown
from prefect_ddp.tasks.results.pointer import read_json_document
from prefect_ddp.tasks.results.promotion import decide, find_warm_start, kept_location, promote, read_pointer
from prefect_ddp.tasks.results.records import TrainingSummary
from prefect_ddp.tasks.training.champion import Champion
from prefect_ddp.tasks.training.model import build_model, load_warm_start, model_card, model_problem

CLASSES = ["circle", "square", "triangle"]


def summary_of(acc: float) -> TrainingSummary:
    history = [{"epoch": 1, "val_acc": acc, "val_loss": 1 - acc}]
    return TrainingSummary(
        world_size=1, ranks=[], split_digests=[], train_size=0, val_size=0, history=history, best_epoch=1,
        best_val_acc=acc, selected_by="highest val_acc", final_val_acc=acc, final_val_loss=1 - acc, time=None,
        pruned_at=None, attempts=[], unreadable={}, recipe=None, comparison=None, files={})


def finished_run(tmp_path, name: str, best_val_acc: float, classes=CLASSES) -> tuple[TrainingSummary, DataLocation]:
    """A run's summary and its folder as the flow leaves it: model.pt, model.json."""
    run = DataLocation(url=str(tmp_path / name))
    config = ModelConfig(backbone="mobilenet_v3_small")
    save_torch(f"{run.url}/model.pt", build_model(config, len(classes)).state_dict(), {})
    write_json(f"{run.url}/model.json", model_card(config, classes, 32), {})
    return summary_of(best_val_acc), run


def kept_version(kept: DataLocation) -> Path:
    return Path(read_pointer(kept)["version"])


@pytest.mark.unit
def test_a_worse_run_does_not_replace_the_kept_model_and_a_better_one_does(tmp_path):
    kept = kept_location(DataLocation(url=str(tmp_path)), "nightly")
    for name, acc, expect_promoted, expect_kept in [
        ("first", 0.80, True, "first"),
        ("worse", 0.70, False, "first"),
        ("better", 0.90, True, "better"),
        ("tie", 0.90, True, "tie"),  # "at least as good" keeps the newer model
    ]:
        summary, run = finished_run(tmp_path, name, acc)
        promotion = promote.fn(summary, run, kept, {"name": name, "flow_run_id": "id-" + name})
        assert promotion.promoted is expect_promoted, promotion.reason
        assert read_pointer(kept)["run"]["name"] == expect_kept
    pointer = read_pointer(kept)
    assert pointer["run"]["url"] == str(tmp_path / "tie") and pointer["best_val_acc"] == 0.90
    # Every promoted model keeps its own version; the one not promoted left none.
    assert sorted(p.name for p in (tmp_path / "nightly" / "versions").iterdir()) == ["better", "first", "tie"]
    version = kept_version(kept)
    assert sorted(p.name for p in version.iterdir()) == ["metrics.json", "model.json", "model.pt"]
    assert (version / "model.pt").read_bytes() == (tmp_path / "tie" / "model.pt").read_bytes()


@pytest.mark.unit
def test_the_reason_says_what_was_compared(tmp_path):
    kept = kept_location(DataLocation(url=str(tmp_path)), "nightly")
    promote.fn(*finished_run(tmp_path, "good", 0.8), kept, {"name": "good", "flow_run_id": "1"})
    promotion = promote.fn(*finished_run(tmp_path, "bad", 0.5), kept, {"name": "bad", "flow_run_id": "2"})
    assert promotion.reason == "best_val_acc 0.5000 is worse than 0.8000 of good, which stays"
    assert (promotion.previous_run, promotion.previous_metric) == ("good", 0.8)
    assert promotion.kept_url == str(tmp_path / "nightly" / "versions" / "good")


@pytest.mark.unit
def test_a_deployment_name_cannot_escape_the_output_prefix():
    assert kept_location(DataLocation(url="s3://bucket/out"), "../../etc").url == "s3://bucket/out/etc"


def promote_at_once(kept: DataLocation, run: DataLocation, acc: float, barrier) -> None:
    """One of several processes promoting at the same moment (a forked process's target)."""
    forget_parent_exit_hooks(0)  # this test process runs Prefect's services: prefect_ddp.tasks.data.dataset says why
    barrier.wait()
    promote.fn(summary_of(acc), run, kept, {"name": run.url.rsplit("/", 1)[-1], "flow_run_id": str(acc)})


def run_with_model(location: DataLocation, name: str, acc: float) -> DataLocation:
    """A run folder whose model.pt and model.json both name the run, so a mixed pair shows."""
    run = location.with_url(f"{location.url}/{name}")
    options = run.storage_options()
    write_bytes(f"{run.url}/model.pt", f"weights of {name} ".encode() * 20_000, options)
    write_json(f"{run.url}/model.json", {"backbone": "resnet18", "classes": CLASSES, "run": name}, options)
    return run


@pytest.fixture(params=["local", "s3"])
def output(request, tmp_path, s3_endpoint) -> DataLocation:
    if request.param == "local":
        return DataLocation(url=str(tmp_path / "out"))
    from prefect_ddp.deployments.local_services import (
        MOTO_CREDENTIALS,
        MOTO_REGION,
        create_bucket,
    )

    create_bucket(s3_endpoint, "promotions")
    return DataLocation(url=f"s3://promotions/{tmp_path.name}", endpoint_url=s3_endpoint, region_name=MOTO_REGION,
                        **MOTO_CREDENTIALS)


def test_concurrent_promotions_keep_the_better_model_whole(output):
    """Four runs promote at once, twice over: the best always stays, its files together. (The
    promotion without a swap kept a worse model, or one model's weights beside another's card,
    in 8 of 10 such rounds.)"""
    scores = [0.60, 0.95, 0.70, 0.80]
    context = multiprocessing.get_context("fork")
    for round_ in range(2):
        kept = kept_location(output.with_url(f"{output.url}/round-{round_}"), "nightly")
        runs = {acc: run_with_model(output, f"r{round_}-run-{i}", acc) for i, acc in enumerate(scores)}
        barrier = context.Barrier(len(scores))
        processes = [context.Process(target=promote_at_once, args=(kept, run, acc, barrier)) for acc, run in runs.items()]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
        assert [p.exitcode for p in processes] == [0] * len(scores)
        pointer = read_json_document(f"{kept.url}/latest.json", kept.storage_options())
        best = runs[max(scores)].url.rsplit("/", 1)[-1]
        assert (pointer["best_val_acc"], pointer["run"]["name"]) == (max(scores), best), pointer
        options = kept.storage_options()
        version = pointer["version"]
        assert json.loads(read_bytes(f"{version}/model.json", options))["run"] == best
        assert read_bytes(f"{version}/model.pt", options) == f"weights of {best} ".encode() * 20_000
        assert json.loads(read_bytes(f"{version}/metrics.json", options))["run"]["name"] == best


@pytest.mark.unit
def test_warm_start_loads_every_weight_when_the_classes_match(tmp_path):
    kept = kept_location(DataLocation(url=str(tmp_path)), "nightly")
    summary, run = finished_run(tmp_path, "kept", 0.9)
    promote.fn(summary, run, kept, {"name": "kept", "flow_run_id": "1"})
    warm = find_warm_start(kept, "mobilenet_v3_small", CLASSES)
    assert warm is not None and warm.with_head and warm.origin == "run `kept`"
    assert warm.model.url == str(tmp_path / "nightly" / "versions" / "kept" / "model.pt")
    model = build_model(ModelConfig(backbone="mobilenet_v3_small"), len(CLASSES))
    load_warm_start(model, warm)
    saved = torch.load(tmp_path / "kept" / "model.pt", weights_only=True)
    assert all(torch.equal(model.state_dict()[k], saved[k]) for k in saved)


@pytest.mark.unit
def test_warm_start_keeps_a_fresh_head_when_the_classes_changed(tmp_path):
    kept = kept_location(DataLocation(url=str(tmp_path)), "nightly")
    summary, run = finished_run(tmp_path, "kept", 0.9)
    promote.fn(summary, run, kept, {"name": "kept", "flow_run_id": "1"})
    classes = CLASSES + ["star"]
    warm = find_warm_start(kept, "mobilenet_v3_small", classes)
    assert warm is not None and not warm.with_head
    model = build_model(ModelConfig(backbone="mobilenet_v3_small"), len(classes))
    load_warm_start(model, warm)
    saved = torch.load(tmp_path / "kept" / "model.pt", weights_only=True)
    assert torch.equal(model.state_dict()["features.0.0.weight"], saved["features.0.0.weight"])
    assert model.state_dict()["classifier.3.weight"].shape[0] == 4


@pytest.mark.unit
@pytest.mark.parametrize("backbone, promoted", [("mobilenet_v3_small", False), ("resnet18", True)])
def test_no_warm_start_without_a_kept_model_of_that_backbone(tmp_path, backbone, promoted):
    kept = kept_location(DataLocation(url=str(tmp_path)), "nightly")
    if promoted:
        promote.fn(*finished_run(tmp_path, "kept", 0.9), kept, {"name": "kept", "flow_run_id": "1"})
    assert find_warm_start(kept, backbone, CLASSES) is None


# -- champion against challenger on the same images (prefect_ddp.tasks.results.comparison) -------

def compared(new: float, old: float, images: int, better: int, worse: int, version: str = "v1") -> dict:
    return {"images": images, "challenger_acc": new, "champion_acc": old, "better": better, "worse": worse,
            "challenger_epoch": 1, "champion_version": version, "champion_run": "night-1", "left_out": 0,
            "split_known": True}


KEPT = {"best_val_acc": 0.5, "version": "v1", "run": {"name": "night-1"}}


@pytest.mark.unit
@pytest.mark.parametrize("comparison, min_improvement, promoted, says", [
    # The same images, the same answers: a tie keeps the champion, whatever its own score said.
    (compared(0.8, 0.8, 50, 0, 0), None, False, "+0.0000 is not more than the noise of the paired count, 0.0000"),
    # 4 more right of 50 but 16 images differ: within one standard error (sqrt(16)/50 = 0.08).
    (compared(0.88, 0.8, 50, 10, 6), None, False, "+0.0800 is not more than the noise of the paired count, 0.0800"),
    (compared(0.9, 0.8, 50, 7, 2), None, True, "better by +0.1000, more than the noise of the paired count, 0.0600"),
    (compared(0.9, 0.8, 50, 7, 2), 0.15, False, "is not more than output.min_improvement 0.1500"),
    (compared(0.9, 0.8, 50, 7, 2, version="v0"), None, False, "the kept model changed while this run trained"),
    (compared(0.0, 0.0, 0, 0, 0), None, False, "none of this run's validation images is one the kept model never"),
])
def test_promotion_compares_both_models_on_the_same_images(comparison, min_improvement, promoted, says):
    # The challenger's own best_val_acc (1.0) would have promoted it under the old rule every time.
    decision, reason = decide(1.0, KEPT, comparison, min_improvement)
    assert decision is promoted and says in reason, reason


def kept_model_of(tmp_path, classes=CLASSES, train_keys: list[str] | None = None, beside: bool = True) -> tuple:
    """A kept model's pointer and folder, its split.json beside it or only in its run's folder."""
    version, run_folder = tmp_path / "kept" / "versions" / "night-1", tmp_path / "night-1"
    version.mkdir(parents=True)
    run_folder.mkdir()
    config = ModelConfig(backbone="mobilenet_v3_small")
    (version / "model.json").write_text(json.dumps(model_card(config, classes, 32)))
    save_torch(str(version / "model.pt"), build_model(config, len(classes)).state_dict(), {})
    if train_keys is not None:
        (version if beside else run_folder).joinpath("split.json").write_text(json.dumps({"train_keys": train_keys}))
    pointer = {"best_val_acc": 0.9, "version": str(version), "run": {"name": "night-1", "url": str(run_folder)}}
    write_json(str(tmp_path / "kept" / "latest.json"), pointer, {})
    return pointer, DataLocation(url=str(tmp_path / "kept"))


def manifest_and_split():
    keys = [f"{cls}/{n}.jpg" for cls in CLASSES for n in range(20)]
    manifest = Manifest(root="s3://b/p", paths=keys, labels=[CLASSES.index(k.split("/")[0]) for k in keys],
                        sizes=[1] * len(keys), classes=CLASSES)
    return manifest, stratified_split(manifest, 0.3, seed=1)


@pytest.mark.unit
@pytest.mark.parametrize("beside", [True, False])
def test_the_comparison_leaves_out_the_images_the_kept_model_trained_on(tmp_path, beside):
    manifest, split = manifest_and_split()
    other_seed = stratified_split(manifest, 0.3, seed=2)  # the champion's split: another seed
    trained = [manifest.paths[i] for i in other_seed.train]
    pointer, kept = kept_model_of(tmp_path, train_keys=trained, beside=beside)
    champion = champion_to_beat(kept, pointer, manifest, split)
    never_trained = [i for i in split.val if manifest.paths[i] not in set(trained)]
    assert champion.positions == never_trained and champion.left_out == len(split.val) - len(never_trained) > 0
    assert champion.split_known and champion.version == pointer["version"]


@pytest.mark.unit
def test_a_kept_model_without_its_split_is_compared_on_every_image_and_says_so(tmp_path):
    manifest, split = manifest_and_split()
    pointer, kept = kept_model_of(tmp_path)
    champion = champion_to_beat(kept, pointer, manifest, split)
    assert champion.positions == split.val and not champion.split_known
    text = comparison_markdown(compared(0.9, 0.8, 18, 2, 0) | {"split_known": False})
    assert "its score may include images it trained on" in text and "| 0.9000 |" in text and "| 0.8000 |" in text


@pytest.mark.unit
@pytest.mark.parametrize(("damage", "says"), [
    (lambda pt, card: pt.unlink(), "model.pt is missing"),
    (lambda pt, card: pt.write_bytes(pt.read_bytes()[: pt.stat().st_size // 2]),
     "model.pt cannot be loaded as model.json describes it (RuntimeError: PytorchStreamReader failed"),
    (lambda pt, card: pt.write_bytes(b""), "model.pt cannot be loaded as model.json describes it (EOFError"),
    (lambda pt, card: card.write_text(card.read_text()[:20]), "model.json cannot be read (JSONDecodeError"),
    (lambda pt, card: card.write_text(card.read_text().replace("mobilenet_v3_small", "resnet18")),
     "model.pt cannot be loaded as model.json describes it (RuntimeError: Error(s) in loading state_dict"),
])
def test_a_kept_model_that_cannot_be_loaded_is_not_scored_and_is_replaced(tmp_path, damage, says):
    """Issue 46: a kept model.pt cut to half its bytes failed every rank of every later run at the
    champion's scoring, after all of training; it is now found before training, said, and replaced."""
    manifest, split = manifest_and_split()
    pointer, kept = kept_model_of(tmp_path, train_keys=[])
    damage(Path(pointer["version"], "model.pt"), Path(pointer["version"], "model.json"))
    unusable = champion_to_beat(kept, pointer, manifest, split)
    assert isinstance(unusable, UnusableChampion) and unusable.version == pointer["version"]
    assert says in unusable.problem, unusable.problem
    # Replaced though its recorded score (0.9) is better than this run's, and only while still kept.
    promoted, reason = decide(0.5, pointer, None, kept_at_start=pointer["version"], unusable=unusable)
    assert promoted and f"the kept model (of night-1) cannot be used, {unusable.problem}" in reason
    rival = pointer | {"version": str(tmp_path / "kept" / "versions" / "night-2")}
    assert not decide(0.5, rival, None, kept_at_start=pointer["version"], unusable=unusable)[0]
    assert find_warm_start(kept, "mobilenet_v3_small", CLASSES) is None  # training starts from model.weights


@pytest.mark.unit
def test_a_kept_model_that_loads_is_scored_and_warm_started_from(tmp_path):
    manifest, split = manifest_and_split()
    pointer, kept = kept_model_of(tmp_path, train_keys=[])
    assert isinstance(champion_to_beat(kept, pointer, manifest, split), Champion)
    assert find_warm_start(kept, "mobilenet_v3_small", CLASSES).with_head


@pytest.mark.unit
def test_a_model_kept_while_the_run_trained_is_not_replaced_on_the_runs_own_score():
    # No model was kept when the run began (None), so it was compared with nothing.
    decision, reason = decide(1.0, KEPT, None, kept_at_start=None)
    assert not decision and "changed while this run trained" in reason
    assert decide(1.0, KEPT, None, kept_at_start="v1")[0]  # the same model kept, of other classes: own scores


@pytest.mark.unit
def test_a_gain_of_exactly_the_margin_keeps_the_champion():
    # 58 against 57 right of 100 is +0.01; 0.58 - 0.57 is 0.010000000000000009 in floating point.
    decision, reason = decide(1.0, KEPT, compared(0.58, 0.57, 100, 1, 0), min_improvement=0.01)
    assert not decision, reason
    decision, _ = decide(1.0, KEPT, compared(0.59, 0.57, 100, 2, 0), min_improvement=0.01)
    assert decision
    assert "were not compared" in comparison_markdown(compared(0.0, 0.0, 0, 0, 0) | {"left_out": 18})


@pytest.mark.unit
def test_a_kept_model_of_other_classes_is_not_scored(tmp_path):
    manifest, split = manifest_and_split()
    pointer, kept = kept_model_of(tmp_path, classes=["cat", "dog"], train_keys=[])
    assert champion_to_beat(kept, pointer, manifest, split) is None


def lost_replies_output(front, s3_endpoint, tmp_path, bucket: str = "lost-replies") -> DataLocation:
    from prefect_ddp.deployments.local_services import MOTO_CREDENTIALS, MOTO_REGION, create_bucket

    create_bucket(s3_endpoint, bucket)
    return DataLocation(url=f"s3://{bucket}/{tmp_path.name}", endpoint_url=front.endpoint,
                        region_name=MOTO_REGION, **MOTO_CREDENTIALS)


def test_a_promotion_whose_pointer_reply_is_lost_keeps_its_model(front, s3_endpoint, tmp_path):
    """S3 stored the pointer, the connection dropped before its reply, the PUT was sent again and S3
    answered 412: the write that landed is this run's own, not a rival's (issue 46). Taken for a
    rival's, the promotion removed the version it had just kept, and the pointer named nothing."""
    output = lost_replies_output(front, s3_endpoint, tmp_path)
    kept = kept_location(output, "nightly")
    kept_at_start = None  # as the flow records it when the run begins: no model kept yet, then the first
    for round_, acc in enumerate([0.7, 0.9]):  # the first model kept under a name, then a better one
        run = run_with_model(output, f"run-{round_}", acc)
        front.drop_replies("PUT", f"lost-replies/{tmp_path.name}/nightly/latest.json", times=1)
        result = promote.fn(summary_of(acc), run, kept, {"name": f"run-{round_}", "flow_run_id": str(round_)},
                            kept_at_start=kept_at_start)
        assert front.rules_left() == 0 and result.promoted, result.reason  # the reply was lost, and yet
        pointer = read_json_document(f"{kept.url}/latest.json", kept.storage_options())
        assert pointer["run"]["name"] == f"run-{round_}" and result.kept_url == pointer["version"]
        options = kept.storage_options()
        assert read_bytes(f"{pointer['version']}/model.pt", options) == f"weights of run-{round_} ".encode() * 20_000
        assert json.loads(read_bytes(f"{pointer['version']}/metrics.json", options))["run"]["name"] == f"run-{round_}"
        kept_at_start = pointer["version"]


def test_a_version_a_pointer_named_stays_when_a_rival_replaces_that_pointer(front, s3_endpoint, tmp_path):
    """This run's pointer landed (its reply lost), a reader read it, and a better run's replaced it
    before the PUT was sent again: the version the reader was given must still be there."""
    output = lost_replies_output(front, s3_endpoint, tmp_path, "lost-then-overtaken")
    kept = kept_location(output, "nightly")
    run, rival = run_with_model(output, "run-a", 0.7), run_with_model(output, "run-b", 0.9)
    read: list[str] = []

    def reader_then_rival() -> None:
        read.append(read_json_document(f"{kept.url}/latest.json", kept.storage_options())["version"])
        promote.fn(summary_of(0.9), rival, kept, {"name": "run-b", "flow_run_id": "b"})

    pointer_key = f"lost-then-overtaken/{tmp_path.name}/nightly/latest.json"
    front.drop_replies("PUT", pointer_key, times=1)
    front.before_forwarding("PUT", pointer_key, reader_then_rival)  # the resend of run-a's PUT
    result = promote.fn(summary_of(0.7), run, kept, {"name": "run-a", "flow_run_id": "a"}, kept_at_start=None)
    assert front.rules_left() == 0 and not result.promoted and "run-b" in result.reason
    assert read == [f"{kept.url}/versions/run-a"]
    assert read_bytes(f"{read[0]}/model.pt", kept.storage_options()) == b"weights of run-a " * 20_000


@pytest.mark.unit
def test_a_retried_promotion_whose_pointer_write_landed_reports_its_model_kept(tmp_path):
    """A retry of the promote task after its pointer write landed finds its own version named: kept,
    not 'the kept model changed while this run trained (now this run's)' (issue 46)."""
    summary, run = finished_run(tmp_path, "run-a", 0.8)
    kept = DataLocation(url=str(tmp_path / "kept"))
    first = promote.fn(summary, run, kept, {"name": "run-a", "flow_run_id": "a"}, kept_at_start=None)
    assert first.reason.startswith("first model kept under this name"), first.reason  # nothing was there
    retried = promote.fn(summary, run, kept, {"name": "run-a", "flow_run_id": "a"}, kept_at_start=None)
    assert first.promoted and retried.promoted and retried.kept_url == first.kept_url, retried.reason
    assert retried.reason.startswith("kept already: the pointer names this run's version")
    assert (Path(retried.kept_url) / "model.pt").exists()


@pytest.mark.unit
def test_a_pointer_cut_short_is_said_taken_as_absent_and_replaced(tmp_path, caplog):
    """Issue 46: a latest.json cut short failed every reader (warm start, promotion, batch-predict)."""
    first, run = finished_run(tmp_path, "run-a", 0.8)
    kept = DataLocation(url=str(tmp_path / "kept"))
    promote.fn(first, run, kept, {"name": "run-a", "flow_run_id": "a"}, kept_at_start=None)
    pointer = tmp_path / "kept" / "latest.json"
    pointer.write_bytes(pointer.read_bytes()[:30])
    with caplog.at_level("WARNING"):
        assert read_pointer(kept) is None
        assert find_warm_start(kept, "mobilenet_v3_small", CLASSES) is None
    assert f"{pointer} cannot be read (JSONDecodeError" in caplog.text
    worse, later = finished_run(tmp_path, "run-b", 0.5)
    result = promote.fn(worse, later, kept, {"name": "run-b", "flow_run_id": "b"}, kept_at_start=None)
    assert result.promoted and read_pointer(kept)["version"] == result.kept_url
    assert result.reason.startswith("latest.json was there but could not be read"), result.reason


def test_a_sweeps_promotion_replaces_a_kept_model_that_cannot_be_loaded(tmp_path, prefect_api):
    """A sweep promotes its best trial at its end; like a run's promotion, it replaces a kept model
    that does not load whatever the score recorded for it (its trials said it would)."""
    from prefect_ddp.flows.sweep import promote_best

    first, run = finished_run(tmp_path, "night-1", 0.9)
    kept = DataLocation(url=str(tmp_path / "kept"))
    promote.fn(first, run, kept, {"name": "night-1", "flow_run_id": "1"}, kept_at_start=None)
    weights = Path(read_pointer(kept)["version"], "model.pt")
    weights.write_bytes(weights.read_bytes()[:100])
    trial, trial_run = finished_run(tmp_path, "trial-3", 0.5)
    write_json(f"{trial_run.url}/metrics.json", trial.model_dump(), {})
    best = {"model_url": f"{trial_run.url}/model.pt", "run": "trial-3", "flow_run_id": "3"}
    promotion = promote_best(best, DataLocation(url=str(tmp_path)), kept)
    assert promotion.promoted and "the kept model (of night-1) cannot be used" in promotion.reason, promotion.reason
    assert read_pointer(kept)["run"]["name"] == "trial-3"


@pytest.mark.unit
@pytest.mark.parametrize("card", [b"null", b"[]", b'"x"', b'{"classes": 2}', b'{"backbone": 7}'])
def test_a_card_of_another_shape_is_a_problem_said_not_an_error_raised(tmp_path, card):
    _, run = finished_run(tmp_path, "run-a", 0.8)
    (tmp_path / "run-a" / "model.json").write_bytes(card)
    problem = model_problem(run)
    assert problem and problem.startswith(("model.json cannot be read", "model.pt cannot be loaded")), problem


def test_a_pointer_cut_short_between_the_read_and_the_write_is_said_and_the_last_one_read_is_compared(
        front, s3_endpoint, tmp_path):
    """Issue 56: another writer cut the pointer short after this promotion read it (run-a's 0.95) and
    before its conditional PUT; the promotion said "first model kept under this name" with no previous
    run, though run-a's model was kept and replaced without being compared."""
    output = lost_replies_output(front, s3_endpoint, tmp_path, "cut-between")
    kept = kept_location(output, "nightly")
    promote.fn(summary_of(0.95), run_with_model(output, "run-a", 0.95), kept, {"name": "run-a", "flow_run_id": "a"},
               kept_at_start=None)
    direct = kept.model_copy(update={"endpoint_url": s3_endpoint})  # not through the front

    def cut_the_pointer() -> None:
        write_bytes(f"{direct.url}/latest.json", b'{"version": "s3://cut-bet', direct.storage_options())

    front.before_forwarding("PUT", f"cut-between/{tmp_path.name}/nightly/latest.json", cut_the_pointer)
    result = promote.fn(summary_of(0.97), run_with_model(output, "run-b", 0.97), kept,
                        {"name": "run-b", "flow_run_id": "b"}, kept_at_start=read_pointer(kept)["version"])
    assert front.rules_left() == 0, "the pointer was never cut"
    assert result.promoted and result.previous_run == "run-a" and result.previous_metric == 0.95, result
    assert result.reason.startswith("latest.json could not be read when this run came to write it"), result.reason
    assert "decided against the last one read, run-a's" in result.reason and "0.95" in result.reason
    assert read_pointer(kept)["run"]["name"] == "run-b"

"""The recipe at world size 1 (no process group): the real loop, checkpoints and resume."""

import dataclasses
import io
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.host_budget import MAX_DEFAULT_LOADER_WORKERS, HostLimits, LoaderLoad, rank_budget
from prefect_ddp.tasks.data.loaders import LoaderWorkers, loader_workers, rank_data
from prefect_ddp.tasks.gang.plan import thread_shares
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.data.storage import save_torch
from prefect_ddp.tasks.gang import RankContext
from prefect_ddp.tasks.gang.handover import drop_parked, park
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.training.checkpoints import CheckpointMismatch, TrainingState
from prefect_ddp.tasks.training.model import build_model, load_model
from prefect_ddp.tasks.training.optimization import (
    Warmup,
    build_optimizer,
    build_scheduler,
    warmup_epochs,
)
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.passes import evaluate, train_one_epoch
from prefect_ddp.tasks.training.rank_setup import batch_inputs
from prefect_ddp.tasks.training.recipe import train_classifier
from prefect_ddp.tasks.data.device_batches import ToDevice
from tests.support.image_folders import local_image_folder


def local_job(tmp_path, epochs: int) -> TrainJob:
    images = tmp_path / "images"
    manifest = local_image_folder(images, per_class=4)
    return TrainJob(
        source=DataLocation(url=str(images)), output=DataLocation(url=str(tmp_path / "run")),
        manifest=manifest, split=stratified_split(manifest, 0.25, 0),
        model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=epochs, batch_size=4, image_size=32, num_workers=0, optimizer="adamw", lr=1e-3),
    )


CTX = RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, backend="gloo", device="cpu",
                  worker_address="local", master_addr="127.0.0.1", master_port=0)


@pytest.mark.unit
def test_training_resumes_from_the_last_checkpoint(tmp_path):
    first = train_classifier(CTX, local_job(tmp_path, epochs=1))
    assert len(first.history) == 1 and (tmp_path / "run" / "checkpoints" / "checkpoint.pt").exists()
    resumed = train_classifier(CTX, local_job(tmp_path, epochs=2))
    assert [h["epoch"] for h in resumed.history] == [1, 2]
    assert resumed.history[0] == first.history[0]  # epoch 1 was not trained again
    # Only epoch 2 ran: 9 train images in batches of 4, the lone ninth dropped for BatchNorm.
    assert resumed.local_train_samples == [8]
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "checkpoint.pt", weights_only=True)
    assert set(checkpoint) == {"model", "optimizer", "lr_scheduler", "scaler", "epoch", "history", "job", "world_size"}
    assert checkpoint["epoch"] == 1  # the last finished epoch's index, as torchvision keeps it
    from_storage = {"at_sample": 0, "handed_over": False, "regroups": 0}
    assert resumed.attempts == [{"attempt": 1, "world_size": 1, "resumed_after_epoch": 0} | from_storage,
                                   {"attempt": 1, "world_size": 1, "resumed_after_epoch": 1} | from_storage]


@pytest.mark.unit
def test_a_checkpoint_of_another_job_is_refused_and_left_as_it_was(tmp_path):
    train_classifier(CTX, local_job(tmp_path, epochs=1))
    checkpoint = tmp_path / "run" / "checkpoints" / "checkpoint.pt"
    before = checkpoint.read_bytes()
    other = local_job(tmp_path, epochs=2)
    other = other.model_copy(update={"training": other.training.model_copy(update={"lr": 0.5})})
    with pytest.raises(CheckpointMismatch, match=r"belongs to another job \(recipe: checkpoint .*'lr': 0.001.*this run .*'lr': 0.5"):
        train_classifier(CTX, other)
    assert checkpoint.read_bytes() == before


@pytest.mark.unit
def test_a_checkpoint_and_attempts_list_cut_short_are_said_and_training_starts_over(tmp_path, caplog):
    """Issue 46: a checkpoint or attempts.json cut short by its store failed every attempt of the
    gang on the same file; the gang now says which file and goes on without it."""
    train_classifier(CTX, local_job(tmp_path, epochs=1))
    folder = tmp_path / "run" / "checkpoints"
    for name in ("checkpoint.pt", "attempts.json"):
        (folder / name).write_bytes((folder / name).read_bytes()[: (folder / name).stat().st_size // 2])
    with caplog.at_level(logging.WARNING):
        result = train_classifier(CTX, local_job(tmp_path, epochs=2))
    assert [record["epoch"] for record in result.history] == [1, 2]  # started over: both epochs trained
    assert [row["attempt"] for row in result.attempts] == [1]
    said = caplog.text
    assert f"The checkpoint at {folder / 'checkpoint.pt'} cannot be read (RuntimeError: PytorchStreamReader" in said
    assert f"{folder / 'attempts.json'}, cannot be read (JSONDecodeError" in said
    assert torch.load(folder / "checkpoint.pt", weights_only=True)["epoch"] == 1  # whole again


@pytest.mark.unit
@pytest.mark.parametrize("epochs_left", [1, 0])
def test_a_best_epoch_handed_over_in_memory_reaches_model_pt_only_once_a_checkpoint_holds_it(
        tmp_path, monkeypatch, epochs_left):
    """Issue 46: a formation that took over, in memory, a best epoch no checkpoint held wrote it
    to model.pt at once; lost before its own checkpoint, the gang resumed from the older one while
    model.pt named the lost epoch. Now it waits for the formation's first checkpoint; taken over
    after the last epoch, the formation checkpoints before it writes model.pt."""
    train_classifier(CTX, local_job(tmp_path, epochs=1))  # the checkpoint of epoch 1, and its model.pt
    folder = tmp_path / "run"
    saved = torch.load(folder / "checkpoints" / "checkpoint.pt", weights_only=True)
    # What a survivor of the lost formation parked: epoch 2 trained, the best, in no checkpoint.
    history = [*saved["history"], saved["history"][0] | {"epoch": 2, "val_acc": 2.0, "val_loss": 0.0}]
    buffer = io.BytesIO()
    torch.save(saved | {"epoch": 1, "history": history, "position": 0, "trained": None}, buffer)
    ctx = dataclasses.replace(CTX, gang_id="handed-over", elastic=True)
    park(ctx.gang_id, (2, 0), buffer.getvalue())
    try:
        if epochs_left:
            def lost(*args, **kwargs):
                raise RuntimeError("a rank of this formation was lost")

            monkeypatch.setattr("prefect_ddp.tasks.training.recipe.run_epoch", lost)
            with pytest.raises(RuntimeError, match="was lost"):
                train_classifier(ctx, local_job(tmp_path, epochs=2 + epochs_left))
        else:
            train_classifier(ctx, local_job(tmp_path, epochs=2))
    finally:
        drop_parked()
    checkpointed = [row["epoch"] for row in torch.load(folder / "checkpoints" / "checkpoint.pt",
                                                         weights_only=True)["history"]]
    assert checkpointed == ([1] if epochs_left else [1, 2])
    assert json.loads((folder / "model.json").read_text())["epoch"] == max(checkpointed)


@pytest.mark.unit
@pytest.mark.parametrize("scheduler", ["cosine", "plateau", "none"])
def test_a_gang_resumed_on_fewer_ranks_scales_its_learning_rate_down(tmp_path, scheduler):
    """Linear scaling: lr x world size. Saved at 4 ranks, resumed at 2: half the saved lr."""
    cfg = TrainingConfig(lr=0.01, scheduler=scheduler, epochs=4)
    url, fingerprint = str(tmp_path / "ckpt.pt"), {"job": 1}

    def state(world_size: int) -> TrainingState:
        model = torch.nn.Linear(2, 2)
        optimizer = build_optimizer(model, cfg, world_size)
        return TrainingState(model, optimizer, build_scheduler(optimizer, cfg), torch.amp.GradScaler("cpu", enabled=False))

    saved = state(4)
    saved.optimizer.step()
    if scheduler == "cosine":
        saved.scheduler.step()
    save_torch(url, saved.snapshot(0, [], fingerprint, world_size=4), {})
    resumed = state(2)
    assert resumed.resume(url, {}, fingerprint, world_size=2, scale_lr=True) == (1, [], None, 0, None, None, True)
    saved_lr = saved.optimizer.param_groups[0]["lr"]
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(saved_lr / 2)
    if scheduler == "cosine":  # the schedule goes on from the halved base lr
        resumed.scheduler.step()
        saved.scheduler.step()
        assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(saved.optimizer.param_groups[0]["lr"] / 2)
    unscaled = state(2)
    unscaled.resume(url, {}, fingerprint, world_size=2, scale_lr=False)
    assert unscaled.optimizer.param_groups[0]["lr"] == pytest.approx(saved_lr)


@pytest.mark.unit
def test_invalid_optimizer_and_scheduler_say_what_is_allowed():
    model = torch.nn.Linear(2, 2)
    bad_opt = TrainingConfig.model_construct(**(TrainingConfig().model_dump() | {"optimizer": "lamb"}))
    with pytest.raises(ValueError, match="Invalid optimizer 'lamb'. Only sgd and adamw are supported."):
        build_optimizer(model, bad_opt, 1)
    bad_sched = TrainingConfig.model_construct(**(TrainingConfig().model_dump() | {"scheduler": "step"}))
    with pytest.raises(ValueError, match="Invalid scheduler 'step'. Only cosine, plateau and none"):
        build_scheduler(torch.optim.SGD(model.parameters(), lr=0.1), bad_sched)


@pytest.mark.unit
def test_learning_rate_scales_with_world_size_for_sgd_and_when_asked_with_a_warmup():
    model = torch.nn.Linear(2, 2)
    lrs = {(optimizer, scale): build_optimizer(model, TrainingConfig(lr=0.01, optimizer=optimizer,
                                                                   scale_lr_by_world_size=scale), 4).param_groups[0]["lr"]
           for optimizer in ("sgd", "adamw") for scale in (None, True, False)}
    assert lrs == pytest.approx({("sgd", None): 0.04, ("sgd", True): 0.04, ("sgd", False): 0.01,
                                 ("adamw", None): 0.01, ("adamw", True): 0.04, ("adamw", False): 0.01})
    # A scaled rate is warmed up (one epoch by default); one that is not scaled needs none.
    assert warmup_epochs(TrainingConfig(), 4) == 1 and warmup_epochs(TrainingConfig(), 1) == 0
    assert warmup_epochs(TrainingConfig(optimizer="adamw"), 4) == 0
    assert warmup_epochs(TrainingConfig(warmup_epochs=0), 4) == 0 and warmup_epochs(TrainingConfig(warmup_epochs=3), 1) == 3


@pytest.mark.unit
def test_norm_and_bias_parameters_get_no_weight_decay():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    model(torch.zeros(2, 3, 8, 8))
    decayed, plain = build_optimizer(model, TrainingConfig(weight_decay=0.05), 1).param_groups
    assert decayed["weight_decay"] == 0.05 and {p.ndim for p in decayed["params"]} == {2, 4}
    assert plain["weight_decay"] == 0.0 and len(plain["params"]) == 4 and {p.ndim for p in plain["params"]} == {1}


@pytest.mark.unit
@pytest.mark.parametrize("frozen", [True, False])
def test_a_frozen_backbone_keeps_its_batchnorm_statistics(tmp_path, frozen):
    job = local_job(tmp_path, epochs=1)
    job = job.model_copy(update={"model": job.model.model_copy(update={"freeze_backbone": frozen})})
    result = train_classifier(CTX, job)
    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    stats = {k: v for k, v in trained.items() if k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    untouched = {k: v for k, v in build_model_state(job).items() if k in stats}
    assert len(stats) > 10 and all(torch.equal(stats[k], untouched[k]) for k in stats) == frozen
    # Every BatchNorm layer of mobilenet_v3_small is in the backbone.
    assert result.recipe.frozen_batchnorm == (len(stats) // 3 if frozen else 0)


def build_model_state(job: TrainJob) -> dict[str, torch.Tensor]:
    return build_model(job.model, len(job.manifest.classes)).state_dict()


@pytest.mark.unit
def test_warmup_raises_the_rate_step_by_step_then_leaves_the_schedule_its_own():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.8)
    warmup, seen = Warmup(steps=4), []
    for _ in range(2):  # two epochs of two steps: the warmup spans both
        for _ in range(2):
            warmup.before_step(optimizer)
            seen.append(optimizer.param_groups[0]["lr"])
        warmup.end_epoch(optimizer)
        assert optimizer.param_groups[0]["lr"] == 0.8  # what the schedule and checkpoints see
    warmup.before_step(optimizer)
    assert seen == pytest.approx([0.2, 0.4, 0.6, 0.8]) and optimizer.param_groups[0]["lr"] == 0.8


@pytest.mark.unit
def test_a_scaled_rate_warms_up_from_the_unscaled_one():
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.8)  # 0.2 per rank, scaled by 4 ranks
    warmup, seen = Warmup(steps=4, start=1 / 4), []
    for _ in range(4):
        warmup.before_step(optimizer)
        seen.append(optimizer.param_groups[0]["lr"])
    assert seen == pytest.approx([0.35, 0.5, 0.65, 0.8])  # never below the per-rank rate of 0.2


@pytest.mark.unit
def test_daemonic_workers_get_the_fix_not_a_multiprocessing_error():
    import multiprocessing

    from prefect_ddp.tasks.data.loaders import require_non_daemonic

    process = multiprocessing.current_process()
    process.daemon = True
    try:
        with pytest.raises(RuntimeError, match="num_workers=2 needs DataLoader worker processes.*DAEMON=False"):
            require_non_daemonic(2)
    finally:
        process.daemon = False


@pytest.mark.unit
def test_only_transient_errors_are_retried():
    from prefect.states import Failed

    from prefect_ddp.tasks.retries import retry_transient

    assert retry_transient(None, None, Failed(data=ConnectionError("reset"))) is True
    for permanent in (FileNotFoundError("gone"), PermissionError("denied"), ValueError("empty")):
        assert retry_transient(None, None, Failed(data=permanent)) is False


# Not `unit` (it starts nothing): the whole recipe twice, 5-15 s on 2 busy cores.
def test_training_with_cache_gb_keeps_the_images_in_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_DDP_CACHE_DIR", str(tmp_path / "cache"))
    job = local_job(tmp_path, epochs=1)
    job = job.model_copy(update={"training": job.training.model_copy(update={"cache_gb": 0.01})})
    train_classifier(CTX, job)
    kept = list((tmp_path / "cache").glob("*/*"))  # the entries, one folder down (the ledger sits on top)
    # Every image once, but the ninth training image: a lone last batch is dropped for BatchNorm.
    assert len(kept) == len(job.manifest) - 1


# Batches of the default 32 images at 224 px, as float32 tensors, of 1,000 images of 100 kB.
LOAD = LoaderLoad.of(TrainingConfig(), [100_000] * 1000, 3 * 224 * 224 * 4, pinned=False)


def cores_only(cfg: TrainingConfig, limits: HostLimits) -> LoaderWorkers:
    """The loader processes `limits`' CPUs give, on a host whose other limits leave room for them all."""
    roomy = dataclasses.replace(limits, memory_bytes=2**40, shm_bytes=2**40, open_files=2**20, threads=None)
    return loader_workers(rank_budget(cfg, roomy, LOAD))


@pytest.mark.unit
def test_loader_workers_default_to_the_ranks_share_of_cores_less_one():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # as limit_threads sets it: the host's cores over its workers
        chosen = cores_only(TrainingConfig(num_workers=None), HostLimits.of_this_host())
        assert chosen.workers == 3 and "share of its host is 4 CPU(s)" in chosen.why
        assert "less one for the rank itself" in chosen.why
        torch.set_num_threads(1)
        assert cores_only(TrainingConfig(num_workers=None), HostLimits.of_this_host()).workers == 0
        assert "loads its batches itself" in cores_only(TrainingConfig(num_workers=None), HostLimits.of_this_host()).why
    finally:
        torch.set_num_threads(threads)
    a_gpu_host = HostLimits(cpus=96, affinity=96, ranks=1, memory_bytes=2**40, shm_bytes=2**39, open_files=1024)
    chosen = cores_only(TrainingConfig(num_workers=None), a_gpu_host)  # 96 cores and one GPU: capped, and it says so
    assert chosen.workers == MAX_DEFAULT_LOADER_WORKERS and "at most 32 by default" in chosen.why
    as_set = LoaderWorkers(2, "training.num_workers=2, as set", 96)
    assert cores_only(TrainingConfig(num_workers=2), a_gpu_host) == as_set


@pytest.mark.unit
def test_the_default_loader_workers_are_the_default():
    assert TrainingConfig().num_workers is None


@pytest.mark.unit
@pytest.mark.parametrize(("cpu_sets", "expected"), [
    ({"tcp://gpu-host:1": tuple(range(16))}, 15),  # a 16-core host with one GPU worker
    ({"tcp://gpu-host:1": tuple(range(16)), "tcp://gpu-host:2": tuple(range(16))}, 7),  # two workers, no affinity
    ({"tcp://gpu-host:1": tuple(range(8)), "tcp://gpu-host:2": tuple(range(8, 16))}, 7),  # dask-cuda's pinning
    ({"tcp://gpu-host:1": tuple(range(16)), "tcp://other-host:1": tuple(range(16))}, 15),  # another host's
])
def test_affinity_and_the_workers_sharing_a_host_decide_the_loader_workers(cpu_sets, expected):
    """The chain a rank goes through: the gang's share (plan.thread_shares), the rank's torch threads
    set to it (rank.limit_threads), the loader's default from them (HostLimits.of_this_host)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(thread_shares(cpu_sets, ["tcp://gpu-host:1"])["tcp://gpu-host:1"])
        assert cores_only(TrainingConfig(), HostLimits.of_this_host()).workers == expected
    finally:
        torch.set_num_threads(threads)


def test_a_process_pinned_to_one_cpu_loads_its_batches_itself():
    """A real affinity: a process that may run on one CPU gets a share of one, and no loader process."""
    script = (
        "import os, torch\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from prefect_ddp.tasks.gang.plan import cpu_set, thread_shares\n"
        "torch.set_num_threads(thread_shares({'tcp://h:1': cpu_set()}, ['tcp://h:1'])['tcp://h:1'])\n"
        "from prefect_ddp.tasks.config import TrainingConfig\n"
        "from prefect_ddp.tasks.data.host_budget import HostLimits, LoaderLoad, rank_budget\n"
        "from prefect_ddp.tasks.data.loaders import loader_workers\n"
        "load = LoaderLoad.of(TrainingConfig(), [100_000], 3 * 224 * 224 * 4, pinned=False)\n"
        "print(loader_workers(rank_budget(TrainingConfig(), HostLimits.of_this_host(), load)).why)\n"
    )
    why = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120).stdout
    assert "is 1 CPU(s) of the 1 its worker may run on" in why and "loads its batches itself" in why


@pytest.mark.unit
def test_a_batch_is_fetched_in_one_round_trip_unless_fetch_threads_says_otherwise():
    assert TrainingConfig(batch_size=8).fetches_in_flight() == 8
    assert TrainingConfig(batch_size=8, fetch_threads=3).fetches_in_flight() == 3


# Not `unit` (it starts nothing): several epochs of the whole recipe, 15-50 s on 2 busy cores.
def test_the_model_file_holds_the_weights_of_the_epoch_reported_best_not_the_last(tmp_path):
    # lr 0.03 with AdamW on this tiny set diverges after the first epoch: the validation loss
    # climbs while the accuracy never beats epoch 1's, so the best epoch is not the last.
    torch.manual_seed(0)
    job = local_job(tmp_path, epochs=4)
    job = job.model_copy(update={"training": job.training.model_copy(update={"lr": 0.03, "scheduler": "none"})})
    result = train_classifier(CTX, job)
    history = result.history
    assert result.best_epoch != history[-1]["epoch"], "the case must have a best epoch before the last"
    assert history[result.best_epoch - 1]["val_loss"] != pytest.approx(history[-1]["val_loss"], rel=1e-3)

    card = json.loads((tmp_path / "run" / "model.json").read_text())
    model = load_model(card, torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    val_loader = rank_data(CTX, job.source, job.output, job.manifest, job.split, job.training, job.preprocessing).val
    sums = evaluate(model, val_loader, batch_inputs(job.training, job.preprocessing, torch.device("cpu"))[1])
    best = history[result.best_epoch - 1]
    assert card["epoch"] == result.best_epoch and card["selected_by"] == "highest val_acc"
    assert (sums.loss_sum / sums.count, sums.correct / sums.count) == (pytest.approx(best["val_loss"], rel=1e-4),
                                                                        best["val_acc"])


@pytest.mark.unit
def test_a_job_carries_plain_settings_to_the_ranks_never_the_block(tmp_path):
    """A rank gets `Location`s: no Prefect block (and its API client) travels to a worker."""
    job = local_job(tmp_path, epochs=1)
    block = DataLocation(url="s3://bucket/images", endpoint_url="http://127.0.0.1:9", aws_access_key_id="AKIA1",
                         aws_secret_access_key="hidden")
    job = job.model_copy(update={"source": block})
    revalidated = TrainJob.model_validate(job.model_dump())
    plain = TrainJob(**{**dict(job), "source": block})
    for settings in (revalidated.source, plain.source):
        assert type(settings) is Location
        assert settings.storage_options()["secret"] == "hidden" and "hidden" not in repr(settings)
        assert settings.endpoint_url == "http://127.0.0.1:9"


@pytest.mark.unit
def test_a_frozen_backbone_without_starting_weights_is_warned_about():
    from prefect_ddp.tasks.training.optimization import frozen_random_backbone

    assert "model.weights" in frozen_random_backbone(ModelConfig(freeze_backbone=True), warm_started=False)
    assert frozen_random_backbone(ModelConfig(freeze_backbone=True, weights="DEFAULT"), warm_started=False) is None
    assert frozen_random_backbone(ModelConfig(freeze_backbone=True), warm_started=True) is None
    assert frozen_random_backbone(ModelConfig(), warm_started=False) is None


class KeyedTensors(list):
    """Batches of a loader whose dataset names its images (stand-ins name theirs by position)."""

    class dataset:  # noqa: N801 - the attribute a DataLoader has
        keys = [f"img-{i}.jpg" for i in range(8)]


@pytest.mark.unit
def test_a_training_pass_reads_no_value_off_the_device_until_it_is_asked(monkeypatch):
    """A value read per step (`.item()`) makes a CUDA rank's CPU wait for every step before it can
    queue the next (tasks/training/pass_sums.py): the pass's sums are read once, when asked."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    # Every batch holds a stand-in for the unreadable image at position 6 (label -7).
    loader = KeyedTensors((torch.randn(4, 3, 2, 2), torch.tensor([0, 1, -7, 2])) for _ in range(5))
    reads: list[str] = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k: (reads.append(_n), _o(self, *a, **k))[1])
    sums = train_one_epoch(model, loader, torch.optim.SGD(model.parameters(), lr=0.1),
                           torch.amp.GradScaler("cpu", enabled=False), ToDevice(torch.device("cpu")), None)
    assert reads == []
    loss_sum, correct, count = sums.sums()
    assert count == 15 and 0 <= correct <= 15 and loss_sum > 0
    assert sums.unreadable == {"img-6.jpg"}


@pytest.mark.unit
def test_rank_zero_says_how_many_loader_processes_it_starts_and_why(tmp_path, caplog):
    job = local_job(tmp_path, epochs=1)
    job.training = job.training.model_copy(update={"num_workers": None})
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # a share of one CPU: no loader process (the unit tier starts none)
        with caplog.at_level(logging.INFO):
            train_classifier(CTX, job)
    finally:
        torch.set_num_threads(threads)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Loader processes per loader")]
    assert said == ["Loader processes per loader of rank 0: 0 (training.num_workers empty: this rank's share of "
                    f"its host is 1 CPU(s) of the {len(os.sched_getaffinity(0))} its worker may run on (shared among "
                    "the cluster's workers that may run on them), less one for the rank itself: the rank loads its "
                    "batches itself)."]

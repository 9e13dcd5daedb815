"""The fine-tuning knobs (issue 58; docs/models.md, "Fine-tuning knobs"): label smoothing, MixUp and
CutMix, TrivialAugmentWide, RandomErasing and gradient clipping.

Their defaults train as the recipe did before them; each knob on does what torchvision's function
for it says, never mixes a stand-in for an unreadable image into a readable one, and all of them
at once train a real 2-rank gloo gang. The device path's bitwise agreement with the knobs' steps is
tests/test_device_batches.py's.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image
from pydantic import ValidationError
from torch import nn
from torchvision.transforms import v2

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.tasks.config import FINE_TUNING_KNOBS, ModelConfig, TrainingConfig
from prefect_ddp.tasks.data.dataset import train_transform, train_transform_for
from prefect_ddp.tasks.data.preprocessing import Preprocessing
from prefect_ddp.tasks.data.splitting import stratified_split
from prefect_ddp.tasks.gang import free_port
from prefect_ddp.tasks.sweeps.search_space import Dimension
from prefect_ddp.tasks.training.checkpoints import RECIPE_FIELDS, job_fingerprint
from prefect_ddp.tasks.training.job import TrainJob
from prefect_ddp.tasks.training.optimization import Warmup
from prefect_ddp.tasks.training.passes import readable_loss
from prefect_ddp.tasks.training.step_knobs import BatchMixing, StepKnobs
from tests.support.image_folders import local_image_folder
from tests.support.rank_processes import start_ranks
from tests.support.two_ranks import accumulate_as_rank, accumulation_data, accumulation_model, train_as_rank

ALL_KNOBS = {"label_smoothing": 0.1, "mixup_alpha": 0.2, "cutmix_alpha": 1.0, "trivial_augment": True,
             "random_erasing": 0.25, "clip_grad_norm": 1.0, "accumulate_steps": 2, "ema_decay": 0.9}


def batch_with_stand_ins() -> tuple[torch.Tensor, torch.Tensor]:
    """8 images of 3 classes, each of one grey level of its own (so that a mix shows whose pixels it
    took), with stand-ins for unreadable images (negative labels) at positions 2, 3 and 6."""
    images = torch.stack([torch.full((3, 8, 8), float(level)) for level in range(8)])
    return images, torch.tensor([0, 1, -3, -4, 2, 0, -7, 1])


@pytest.mark.unit
def test_the_knobs_defaults_train_as_the_recipe_did_before_them():
    cfg = TrainingConfig(image_size=32)
    assert cfg.knobs_set() == {} and set(FINE_TUNING_KNOBS) <= set(TrainingConfig.model_fields)
    steps = [type(step) for step in train_transform_for(cfg, Preprocessing()).transforms]
    assert steps == [v2.PILToTensor, v2.RandomResizedCrop, v2.RandomHorizontalFlip, v2.ToDtype, v2.Normalize]
    knobs = StepKnobs.of(cfg, num_classes=3)
    images, labels = batch_with_stand_ins()
    assert knobs.mixed(images, labels) == (images, None)
    logits = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    loss_sum, readable = readable_loss(logits, labels, None, knobs.label_smoothing)
    before = nn.functional.cross_entropy(logits, labels.clamp(min=0), reduction="none")  # the loss as it was
    assert torch.equal(loss_sum, torch.where(labels >= 0, before, 0).sum()) and readable == 5
    # A checkpoint written before the knobs existed still matches a job that leaves them at their defaults.
    fingerprint = job_fingerprint(["a"], "digest", ModelConfig(), cfg)
    assert fingerprint["recipe"] == cfg.model_dump(include=RECIPE_FIELDS)
    assert job_fingerprint(["a"], "digest", ModelConfig(), cfg.model_copy(update={"mixup_alpha": 0.2})) != fingerprint


@pytest.mark.unit
def test_label_smoothing_is_cross_entropy_s_own_over_the_readable_images():
    images, labels = batch_with_stand_ins()
    logits = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    smoothed, _ = readable_loss(logits, labels, None, label_smoothing=0.1)
    readable = labels >= 0
    expected = nn.functional.cross_entropy(logits[readable], labels[readable], reduction="sum", label_smoothing=0.1)
    assert torch.allclose(smoothed, expected)
    assert not torch.allclose(smoothed, readable_loss(logits, labels)[0])


@pytest.mark.unit
@pytest.mark.parametrize("alphas", [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)], ids=["mixup", "cutmix", "either"])
def test_mixed_batches_have_soft_targets_and_never_take_in_a_stand_in(alphas):
    images, labels = batch_with_stand_ins()
    readable = labels >= 0
    mixing = BatchMixing(3, *alphas)
    mixed_some = False
    for seed in range(20):
        torch.manual_seed(seed)
        mixed, targets = mixing(images, labels)
        assert mixed.shape == images.shape and targets.shape == (8, 3)
        assert torch.allclose(targets.sum(1), torch.ones(8))
        for i in map(int, torch.nonzero(readable)):
            own = nn.functional.one_hot(labels[i], 3).float()
            partner = (i - 1) % 8  # torchvision mixes each image with the one before it
            if not readable[partner]:  # a stand-in's pixels and target are kept out: the image as it was
                assert torch.equal(mixed[i], images[i]) and torch.equal(targets[i], own), (seed, i)
                continue
            # Only its own and its partner's pixels (grey levels between theirs), and only their classes.
            assert min(i, partner) <= mixed[i].min() and mixed[i].max() <= max(i, partner), (seed, i)
            others = [c for c in range(3) if c not in (labels[i], labels[partner])]
            assert torch.all(targets[i][others] == 0), (seed, i)
            mixed_some |= not torch.equal(mixed[i], images[i])
    assert mixed_some  # some readable pair was mixed: the check above is not vacuous


@pytest.mark.unit
@pytest.mark.parametrize("scaled", [False, True], ids=["full-precision", "loss-scaled"])
def test_clipping_bounds_the_gradient_norm_the_optimizer_steps_with(scaled):
    torch.manual_seed(0)
    model = nn.Linear(16, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=scaled, init_scale=2.0 ** 12)
    before = [p.detach().clone() for p in model.parameters()]
    loss = 100 * nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 3, (8,)))
    scaler.scale(loss).backward()
    StepKnobs(clip_grad_norm=0.5).clip(model.parameters(), optimizer, scaler)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
    assert norm == pytest.approx(0.5, rel=1e-4)  # the loss's gradient is far larger: clipped to the bound
    scaler.step(optimizer)  # unscaled once, by the clip: the step takes the clipped gradient as it is
    moved = torch.linalg.vector_norm(torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]))
    assert moved == pytest.approx(0.5, rel=1e-4)  # lr 1 x the clipped norm


@pytest.mark.unit
def test_the_image_knobs_keep_the_train_transform_s_shape_and_type_and_change_its_images():
    image = Image.effect_mandelbrot((48, 40), (-2.0, -1.2, 0.8, 1.2), 60).convert("RGB")
    bicubic = Preprocessing(interpolation="bicubic")
    plain = train_transform(24, bicubic)
    for knobs in ({"trivial_augment": True}, {"random_erasing": 1.0}):
        changed = train_transform(24, bicubic, **knobs)
        differ = False
        for seed in range(5):
            torch.manual_seed(seed)
            expected = plain(image)
            torch.manual_seed(seed)
            got = changed(image)
            assert got.shape == expected.shape == (3, 24, 24) and got.dtype == expected.dtype == torch.float32
            differ |= not torch.equal(got, expected)
        assert differ, knobs
    augment = next(step for step in train_transform(24, bicubic, trivial_augment=True).transforms
                   if isinstance(step, v2.TrivialAugmentWide))
    # Bilinear for bicubic weights too (the loop above ran it): on a tensor, torchvision's turns refuse bicubic.
    assert augment.interpolation == v2.InterpolationMode.BILINEAR


@pytest.mark.unit
@pytest.mark.parametrize(("field", "value", "message"), [
    ("label_smoothing", 1.0, "less than 1"),
    ("label_smoothing", -0.1, "greater than or equal to 0"),
    ("mixup_alpha", -0.2, "greater than or equal to 0"),
    ("cutmix_alpha", -1, "greater than or equal to 0"),
    ("random_erasing", 1.5, "less than or equal to 1"),
    ("clip_grad_norm", 0, "greater than 0"),
])
def test_bad_knob_values_are_refused_naming_the_field_and_its_bound(field, value, message):
    with pytest.raises(ValidationError, match=rf"{field}\n  Input should be {message}"):
        TrainingConfig(**{field: value})


@pytest.mark.unit
def test_a_sweep_takes_a_knob_s_values_as_its_field_does():
    from prefect_ddp.flows.sweep import check_space_values

    def check(values: list) -> None:
        check_space_values({"training.label_smoothing": Dimension(kind="choice", values=values)}, ModelConfig(),
                           TrainingConfig())

    check([0.0, "0.1", 0.2])
    with pytest.raises(ValueError, match=r"offers training.label_smoothing=1.5, .* less than 1"):
        check([0.1, 1.5])


def test_every_knob_at_once_trains_two_gloo_ranks(tmp_path):
    """The knobs together in the recipe on a real gang: a finished epoch, finite losses."""
    manifest = local_image_folder(tmp_path / "images", per_class=4)
    job = TrainJob(source=DataLocation(url=str(tmp_path / "images")), output=DataLocation(url=str(tmp_path / "run")),
                   manifest=manifest, split=stratified_split(manifest, 0.25, 0),
                   model=ModelConfig(backbone="mobilenet_v3_small"),
                   training=TrainingConfig(epochs=1, batch_size=2, image_size=32, num_workers=0, optimizer="adamw",
                                           lr=1e-3, **ALL_KNOBS))
    start_ranks(train_as_rank, (free_port(), {"knobs": job}, tmp_path, ("history",)), 2)
    (epoch,) = json.loads((tmp_path / "rank0.json").read_text())["knobs"]["history"]
    assert epoch["train_samples"] == 8
    assert math.isfinite(epoch["train_loss"]) and math.isfinite(epoch["val_loss"])


@pytest.mark.unit
def test_warmup_counts_every_batch_an_accumulated_step_took():
    plain, accumulated = (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0) for _ in range(2))
    one_by_one, two_by_two = Warmup(steps=4), Warmup(steps=4)
    rates = []
    for batch in range(4):
        one_by_one.before_step(plain)
        if batch % 2:
            two_by_two.before_step(accumulated, batches=2)
            rates.append((plain.param_groups[0]["lr"], accumulated.param_groups[0]["lr"]))
    assert rates == [(0.5, 0.5), (1.0, 1.0)] and two_by_two.done == one_by_one.done == 4


def test_two_accumulated_batches_on_two_gloo_ranks_take_the_step_of_one_batch_of_all_eight_images(tmp_path):
    """What accumulate_steps decides: the step equals the one over the whole batch; DDP all-reduces the
    group's gradients once, at its last batch, and boundaries see optimizer steps only, while every other
    batch still beats (a step over many slow batches was taken for a hung gang: review of issue 58)."""
    start_ranks(accumulate_as_rank, (free_port(), tmp_path), 2)
    ranks = [torch.load(tmp_path / f"accumulated{rank}.pt", weights_only=True) for rank in range(2)]
    model = accumulation_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    images, labels = (torch.cat(parts) for parts in zip(*(accumulation_data(rank) for rank in range(2))))
    nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
    for rank in ranks:
        assert rank["steps"] == [2] and rank["beats"] == [1]  # one optimizer step, after the pass's 2 batches
        assert all(torch.allclose(rank["state"][name], expected, atol=1e-6) for name, expected in model.state_dict().items())

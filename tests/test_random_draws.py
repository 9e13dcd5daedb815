"""The crop boxes and flips both per-image paths draw (prefect_ddp.tasks.data.random_draws) are
torchvision's own, seed by seed, and leave torch's generator where torchvision leaves it.

Unit tier: no processes.
"""

import pytest
import torch
from torchvision.transforms import v2

from prefect_ddp.tasks.data.random_draws import drawn_params, flips

# Shapes (height, width) where a box fits at once, where it often takes several tries, and where none
# ever fits (RandomResizedCrop's central fallback: a strip too thin for its ratios, one pixel).
SHAPES = [(375, 500), (188, 250), (4032, 3024), (7, 5), (3, 500), (500, 3), (1, 1)]
STEPS = {
    "defaults": v2.RandomResizedCrop(224),
    "narrow": v2.RandomResizedCrop(32, scale=(0.9, 1.0), ratio=(0.99, 1.01)),
    "lists": v2.RandomResizedCrop(64, scale=[0.08, 0.5], ratio=[0.5, 2.0]),  # torchvision takes any sequence
}


@pytest.mark.unit
@pytest.mark.parametrize("name", STEPS)
def test_drawn_params_draw_the_box_make_params_draws_and_leaves_the_generator_as_it_does(name):
    step = STEPS[name]
    differing = []
    for shape in SHAPES:
        image = torch.zeros(1, 1, 1, dtype=torch.uint8).expand(1, 3, *shape)  # only the shape counts
        for seed in range(50):
            torch.manual_seed(seed)
            expected = (step.make_params([image]), torch.rand(2).tolist())
            torch.manual_seed(seed)
            if (drawn_params(step, image), torch.rand(2).tolist()) != expected:
                differing.append((shape, seed))
    assert differing == []


@pytest.mark.unit
def test_a_subclass_of_random_resized_crop_and_other_steps_draw_their_own_params():
    class Fixed(v2.RandomResizedCrop):
        def make_params(self, flat_inputs):
            return {"top": 1, "left": 2, "height": 3, "width": 4}

    assert drawn_params(Fixed(8), torch.zeros(3, 20, 20)) == {"top": 1, "left": 2, "height": 3, "width": 4}
    center = v2.CenterCrop(8)  # the device path's other sizing steps make theirs too
    assert drawn_params(center, torch.zeros(3, 20, 30)) == center.make_params([torch.zeros(3, 20, 30)])


@pytest.mark.unit
@pytest.mark.parametrize("p", [0.0, 0.3, 0.5, 0.7, 1.0])
def test_flips_tosses_the_coin_the_flip_transform_tosses(p):
    step = v2.RandomHorizontalFlip(p)
    image = torch.arange(6, dtype=torch.uint8).reshape(1, 2, 3)
    torch.manual_seed(p * 100)
    expected = [not torch.equal(step(image), image) for _ in range(500)]
    torch.manual_seed(p * 100)
    assert [flips(step) for _ in range(500)] == expected
    assert 0 < sum(expected) < 500 or p in (0.0, 1.0)


@pytest.mark.unit
def test_a_step_made_under_float64_draws_its_own_box_after_a_float32_one_with_the_same_ratio():
    """The bounds are the step's own (RandomResizedCrop keeps them in the dtype it was made in), not
    remade from its ratio: once cached by ratio, a float64 step's boxes took a float32 step's bounds
    and came out a pixel narrower (found by review)."""
    image = torch.zeros(1, 1, 1).expand(3, 10**6, 10**6)  # no memory: only the shape counts
    drawn_params(v2.RandomResizedCrop(8), image)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        step = v2.RandomResizedCrop(8)
        for seed in range(200):  # the cached bounds gave 2 of these a narrower box (seeds 33, 110)
            torch.manual_seed(seed)
            expected = step.make_params([image])
            torch.manual_seed(seed)
            assert drawn_params(step, image) == expected, seed
    finally:
        torch.set_default_dtype(default)


@pytest.mark.unit
@pytest.mark.parametrize(("dtype", "p", "draw"), [
    (torch.float32, 0.7, 0.7),  # float32: 0.69999999, the float32 p: no flip, where the double 0.7 would flip
    (torch.float64, 0.1, 0.1000000001),  # float64: above the double 0.1, below the float32 0.10000000149
])
def test_a_coin_at_p_is_compared_in_its_own_dtype_as_the_transform_compares_it(monkeypatch, dtype, p, draw):
    coin = torch.tensor([draw], dtype=dtype)
    step = v2.RandomHorizontalFlip(p)
    image = torch.arange(6, dtype=torch.uint8).reshape(1, 2, 3)
    monkeypatch.setattr(torch, "rand", lambda *size, **options: coin.clone())
    assert torch.equal(step(image), image)  # the transform does not flip at this draw
    assert flips(step) is False

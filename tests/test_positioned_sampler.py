"""The train sampler of a gang that changes size mid-epoch (tasks/data/positioned_sampler.py)."""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils.data import DistributedSampler

from prefect_ddp.tasks.data.positioned_sampler import PositionedSampler

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("size, ranks", [(40, 2), (41, 3), (7, 4), (100, 1)])
def test_from_the_start_it_deals_what_distributed_sampler_deals(size, ranks):
    for rank in range(ranks):
        ours = PositionedSampler(size, ranks, rank, seed=5, batch_size=64)
        theirs = DistributedSampler(range(size), num_replicas=ranks, rank=rank, shuffle=True, seed=5)
        ours.set_epoch(3)
        theirs.set_epoch(3)
        assert list(ours) == list(theirs)


def trained(size: int, ranks: int, batch: int, epoch: int, start: int, batches: int | None) -> tuple[list[int], int]:
    """The images `ranks` ranks train from `start`, each `batches` full batches (None: to the end);
    and the position a gang formed next starts from."""
    images: list[int] = []
    samplers = [PositionedSampler(size, ranks, rank, seed=1, batch_size=batch) for rank in range(ranks)]
    for sampler in samplers:
        sampler.set_epoch(epoch, start)
        mine = list(sampler)
        images += mine if batches is None else mine[:batches * batch]
    taken = len(samplers[0]) if batches is None else batches * batch
    return images, samplers[0].position_after(taken)


def test_a_gang_shrunk_then_grown_mid_epoch_trains_each_image_once_but_for_a_bounded_remainder():
    size, batch = 1003, 4
    first, position = trained(size, ranks=3, batch=batch, epoch=2, start=0, batches=20)  # a worker is lost
    assert position == 20 * batch * 3
    second, position = trained(size, ranks=2, batch=batch, epoch=2, start=position, batches=30)  # one joins
    third, position = trained(size, ranks=3, batch=batch, epoch=2, start=position, batches=None)
    counts = Counter(first + second + third)
    never = set(range(size)) - set(counts)
    twice = {image for image, n in counts.items() if n > 1}
    # Padding repeats fewer than 3 images; a last batch of one, left out, skips at most 3.
    assert len(twice) < 3 and len(never) <= 3, (twice, never)
    assert sum(counts.values()) - len(twice) == size - len(never)


def test_the_positions_follow_the_epoch_s_own_order():
    sampler = PositionedSampler(10, 1, 0, seed=0, batch_size=4)
    sampler.set_epoch(0)
    whole = list(sampler)
    sampler.set_epoch(0, start=4)
    assert list(sampler) == whole[4:]
    sampler.set_epoch(1)
    assert list(sampler) != whole  # a new epoch, a new order
    with pytest.raises(ValueError, match="start=11 is outside the epoch's positions 0..10"):
        sampler.set_epoch(0, start=11)

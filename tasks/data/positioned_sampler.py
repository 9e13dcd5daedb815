"""The train sampler of a gang whose size may change within an epoch: DistributedSampler's order, from a position on.

A gang re-formed mid-epoch on another number of ranks (a worker lost, or one come back:
docs/architecture.md, "Gang: elastic size") must go on where the old one stopped, or the
epoch trains some images twice and skips others. DistributedSampler cannot: its shard of the
epoch's order depends on the number of ranks, and it always starts at the beginning.

Here every rank draws the same permutation of the epoch (seeded by `seed + epoch`, exactly as
DistributedSampler draws it), and the ranks deal its positions out in turn: rank r takes
positions start + r, start + r + W, ... for W ranks. After k full batches of b images on
every rank, positions start .. start + k·b·W are trained, whichever rank trained each: the
"global sample position" a new gang starts from (`position_after`). From position 0 the
indices are DistributedSampler's own (tests/test_positioned_sampler.py). The remainder is
bounded: the positions left are padded with repeats of their first ones to a multiple of W
(fewer than W images seen twice, as DistributedSampler pads), and a last batch of a single
image, which breaks BatchNorm in training mode, is left out on every rank (at most W images
skipped).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


class PositionedSampler(Sampler[int]):
    """One rank's indices of an epoch's shuffled order, from global position `start` on.

    Args:
        size: images in the train set.
        num_replicas, rank: the gang's size and this rank.
        seed: the split's seed; the epoch's order is `torch.randperm(size)` seeded `seed + epoch`.
        batch_size: the rank's batch; a last batch of one image is left out (see the module).
    """

    def __init__(self, size: int, num_replicas: int, rank: int, seed: int, batch_size: int) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} is not one of the {num_replicas} ranks 0..{num_replicas - 1}.")
        self.size, self.num_replicas, self.rank = size, num_replicas, rank
        self.seed, self.batch_size = seed, batch_size
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Sample epoch `epoch` from global position `start` (0: its beginning) on."""
        if not 0 <= start <= self.size:
            raise ValueError(f"start={start} is outside the epoch's positions 0..{self.size}.")
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        share = math.ceil((self.size - self.start) / self.num_replicas)
        return share - 1 if share % self.batch_size == 1 else share

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        rest = torch.randperm(self.size, generator=generator).tolist()[self.start:]
        padding = math.ceil(len(rest) / self.num_replicas) * self.num_replicas - len(rest)
        padded = rest + (rest * math.ceil(padding / max(len(rest), 1)))[:padding]
        return iter(padded[self.rank::self.num_replicas][:len(self)])

    def position_after(self, samples: int) -> int:
        """The global position reached once every rank has trained `samples` of its indices this epoch."""
        return min(self.size, self.start + samples * self.num_replicas)

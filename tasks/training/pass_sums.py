"""One pass's sums (loss, correct, count) and the unreadable images it met, kept on the rank's device.

Read once a pass, not once a step: reading a CUDA tensor's value (`.item()`) waits for every kernel
queued before it, so three reads per step (as this was until issue 45) made the rank's CPU wait for
each step to finish before it could take the next batch, copy it and queue its kernels, leaving the
GPU idle meanwhile (docs/architecture.md, "Data: the next epoch ahead"). Here each step adds to
tensors on the device, and `sums()` / `unreadable` read them when the pass (or an elastic gang's
mid-epoch hand-over) needs the values. Added as float64, the sums are the numbers Python floats
added up before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from prefect_ddp.tasks.data.dataset import unreadable_positions


@runtime_checkable
class KeyedImages(Protocol):
    """A dataset whose stand-ins for unreadable images name them by position in `keys`
    (S3ImageFolder, ShardDataset: prefect_ddp.tasks.data.dataset.unreadable_label)."""

    @property
    def keys(self) -> Sequence[str]: ...


class PassSums:
    """One pass over a rank's batches: the sums the gang's metrics add up, and what it left out.

    `count` counts only the images trained or validated on: the stand-ins for unreadable
    images (prefect_ddp.tasks.data.dataset) add nothing to the sums, and their keys go to `unreadable`.

    >>> sums = PassSums()
    >>> sums.add(None, torch.tensor([[0.0, 1.0], [2.0, 0.0]]), torch.tensor([1, 1]), torch.tensor(0.5),
    ...          torch.tensor(2))
    >>> sums.sums(), sums.unreadable
    ([0.5, 1.0, 2.0], set())
    """

    def __init__(self) -> None:
        self._totals: torch.Tensor | None = None  # loss sum, correct, count: float64 on the device
        self._labels: list[torch.Tensor] = []  # every batch's labels: stand-ins' name their images
        self._dataset: Any = None  # the loader's dataset, whose keys those positions index

    def add(self, loader: Any, logits: torch.Tensor, labels: torch.Tensor, loss_sum: torch.Tensor,
            readable: torch.Tensor) -> None:
        """Add one batch (of `loader`'s): its logits, labels and `readable_loss`, without reading a value."""
        correct = (logits.argmax(1) == labels).sum()  # a stand-in's negative label matches no class
        step = torch.stack([loss_sum.detach().double(), correct.double(), readable.double()])
        self._totals = step if self._totals is None else self._totals + step
        # A copy: a CPU rank's labels are the loader process's tensor in shared memory, and each one
        # kept holds a file descriptor open (1,024 batches reached the usual limit).
        self._labels.append(labels.detach().clone())
        self._dataset = loader.dataset if loader is not None else None

    def sums(self) -> list[float]:
        """Loss sum, correct and count so far: read from the device (one wait for the steps queued)."""
        return [0.0, 0.0, 0.0] if self._totals is None else self._totals.tolist()

    @property
    def loss_sum(self) -> float:
        return self.sums()[0]

    @property
    def correct(self) -> float:
        return self.sums()[1]

    @property
    def count(self) -> float:
        return self.sums()[2]

    @property
    def unreadable(self) -> set[str]:
        """The keys of the images the pass met unreadable so far (the stand-ins' positions)."""
        if not self._labels:
            return set()
        positions = unreadable_positions(torch.cat(self._labels).cpu())
        if not positions:
            return set()
        assert isinstance(self._dataset, KeyedImages), "only datasets with keys hand over stand-ins"
        return {self._dataset.keys[p] for p in positions}

"""Batches handed from loader processes to their rank through the processes' pipes, not /dev/shm
(docs/architecture.md, "Data: loader processes from the host").

DataLoader hands a loader process's tensors over in /dev/shm: each batch is allocated there
(`default_collate` in a worker) and only its handle crosses the pipe. A container's /dev/shm is
64 MiB unless its runner says otherwise (Docker's and Kubernetes' default), which holds two loader
processes' ready batches at batch 32 of 224-px images, and none at 64: the host budget would leave
such a rank loading every batch itself, on one core. Through the pipe a batch costs the rank its
copies out of the pipe instead (1.3-1.9 ms of CPU per MiB, against 0.4-0.6 through /dev/shm:
bench/pipe_handover.py), and /dev/shm nothing: `rank_budget` chooses it where /dev/shm would hold
fewer than half the loader processes, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


class PipedTensor:
    """A tensor that crosses a process boundary as its bytes, and arrives a tensor.

    torch registers its own reducer for tensors and storages with multiprocessing's pickler, which
    moves their memory to /dev/shm; this object is not a tensor, so it pickles by `__reduce__`: its
    data as raw bytes (a uint8 numpy array, so any dtype goes, bfloat16 too, which numpy lacks) in
    its memory order, so a channels-last batch stays channels-last.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
        order = dense_order(self.tensor)
        inverse = tuple(order.index(dim) for dim in range(len(order)))
        dense = self.tensor.detach().permute(order).contiguous()
        return unpiped, (dense.reshape(-1).view(torch.uint8).numpy(), dense.dtype, tuple(dense.shape), inverse)


def dense_order(tensor: torch.Tensor) -> tuple[int, ...]:
    """The dims of `tensor` from its largest stride to its smallest: permuted so, a dense tensor
    (contiguous, or channels-last) is contiguous.

    >>> dense_order(torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last))
    (0, 2, 3, 1)
    """
    strides = tensor.stride()
    return tuple(sorted(range(tensor.dim()), key=lambda dim: (-strides[dim], dim)))


def unpiped(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...], inverse: tuple[int, ...]) -> torch.Tensor:
    """The tensor a PipedTensor pickled, in the process that unpickles it."""
    return torch.from_numpy(data).view(dtype).reshape(shape).permute(inverse)


def to_pipe(batch: Any) -> Any:
    """`batch` with every tensor in it (in tuples, lists and named tuples) a PipedTensor.

    >>> images, labels = to_pipe((torch.zeros(2, 3), [torch.ones(2)]))
    >>> type(images).__name__, type(labels[0]).__name__
    ('PipedTensor', 'PipedTensor')
    """
    if isinstance(batch, torch.Tensor):
        return PipedTensor(batch)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple (EncodedBatch)
        return type(batch)(*(to_pipe(item) for item in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_pipe(item) for item in batch)
    return batch


class PipedCollate:
    """A collate function whose batches cross the loader process's pipe (`to_pipe`), for a
    DataLoader whose rank hands batches over through pipes. `collate` must allocate nothing in
    /dev/shm (`collate_images(..., shared=False)`; `default_collate` does, in a loader process)."""

    def __init__(self, collate: Callable[[Sequence[Any]], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: Sequence[Any]) -> Any:
        return to_pipe(self.collate(samples))

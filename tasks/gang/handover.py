"""State handed from one formation of a gang to the next in memory, not through storage.

When a gang changes size (a worker lost, or one come free: docs/architecture.md, "Gang:
elastic size"), its surviving ranks hold the very state the next formation needs. Each
rank parks it in its worker process as it leaves (`park`: the bytes of the training
function's own snapshot, and how far it got); the next formation's ranks agree which rank
holds the newest (`hand_over`, a collective) and that rank sends its bytes to every other
over the new process group. Storage is read only when no rank holds parked state: every
survivor's worker was lost, or the gang never parked (a Prefect retry in a new process).

A worker process keeps at most one parked state (a gang's rank parks only on its own
worker, and parking drops whatever was there), under a key naming the run, so that a
later run of the same job never takes an earlier run's state; `drop_parked` frees it when
the run's gang is over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from prefect_ddp.tasks.gang.process_group import broadcast_bytes

_parked: dict[str, Parked] = {}


@dataclass(frozen=True)
class Parked:
    """A rank's state as it left its formation: `position` orders states (later is newer)."""

    key: str
    position: tuple[int, int]  # e.g. (epoch, global sample position within it)
    data: bytes
    # The epoch of best weights the state carries because storage may lack them (the training
    # function's to say); -1: none. Of states equally new, one that carries them is handed over.
    carries: int = -1


def park(key: str, position: tuple[int, int], data: bytes, carries: int = -1) -> None:
    """Keep `data` in this worker process for the next formation of the gang named `key`."""
    _parked.clear()
    _parked[key] = Parked(key, position, data, carries)


def drop_parked(key: str | None = None, dask_worker: Any = None) -> bool:
    """Forget the state parked here under `key` (None: any); True where there was one.

    Run on every worker when a run's gang is over (`client.run(drop_parked, key)`).
    """
    if key is None or key in _parked:
        had = bool(_parked)
        _parked.clear()
        return had
    return False


def hand_over(key: str, device: torch.device | str = "cpu") -> Parked | None:
    """The newest state parked under `key` on any rank of this process group, on every rank
    (a collective: call it on every rank); None where no rank parked any.

    Of states equally new, one that `carries` weights storage may lack wins (a rank whose write
    failed may have parked without them while another rank kept them), then the lowest rank.
    The parked state is dropped on every rank once handed over: the next change parks afresh.
    """
    mine = _parked.get(key)
    position = torch.tensor([*mine.position, mine.carries] if mine else [-1, -1, -1], dtype=torch.int64,
                            device=device)
    if not (dist.is_available() and dist.is_initialized()):
        _parked.pop(key, None)
        return mine
    positions = [torch.zeros_like(position) for _ in range(dist.get_world_size())]
    dist.all_gather(positions, position)
    newest = max(range(len(positions)), key=lambda rank: (tuple(positions[rank].tolist()), -rank))
    epoch, sample, carries = (int(p) for p in positions[newest].tolist())
    if epoch < 0:
        return None
    data = broadcast_bytes(mine.data if mine and dist.get_rank() == newest else None, device, src=newest)
    _parked.pop(key, None)
    assert data is not None  # the source parked it: its length went out above
    return Parked(key, (epoch, sample), data, carries)

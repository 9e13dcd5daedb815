"""Running the transfer-learning flow small and fast from tests, and checking what it left."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from prefect.states import State

from prefect_ddp.blocks.data_location import DataLocation
from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrainingConfig,
)
from tests.support.api_helpers import assert_no_task_run_left_running

TINY_TRAINING = {"epochs": 1, "batch_size": 4, "image_size": 32, "num_workers": 0}


def run_tiny_flow(output: Path | str, cluster: dict[str, Any], data: dict[str, Any] | None = None,
                  model: dict[str, Any] | None = None, training: dict[str, Any] | None = None,
                  flow_run_name: str | None = None) -> State:
    """One small run (world size 1 unless `cluster` says otherwise); returns its final state."""
    flow = transfer_learning.with_options(flow_run_name=flow_run_name) if flow_run_name else transfer_learning
    return flow(
        data=DataConfig(**({"block": "test-images", "index_cache_minutes": 0} | (data or {}))),
        model=ModelConfig(**({"backbone": "mobilenet_v3_small"} | (model or {}))),
        training=TrainingConfig(**(TINY_TRAINING | (training or {}))),
        cluster=ClusterConfig(**({"world_size": 1, "init_timeout_s": 60, "max_restarts": 0} | cluster)),
        output=OutputConfig(url=str(output)),
        return_state=True,
    )


def assert_failed_cleanly(state: State, error: type[BaseException], match: str) -> None:
    """The run failed with `error` matching `match`, and left no task run unfinished."""
    import pytest

    assert state.is_failed(), state
    with pytest.raises(error, match=match):
        state.result()
    assert_no_task_run_left_running(state.state_details.flow_run_id)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file below `folder` with a digest of its bytes, to prove later runs left them alone."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def block_copy(location: DataLocation, **changes: Any) -> DataLocation:
    """A copy of a saved block with `changes`, to save under a name of its own.

    A plain `model_copy` keeps the saved block's document id, and Prefect's
    `save(other_name, overwrite=True)` then overwrites the original's document when
    `other_name` exists already: a second test run would repoint the shared test block.
    """
    copy = location.model_copy(update=changes)
    copy._block_document_id = None
    copy._block_document_name = None
    return copy

"""A `hyperparameter-sweep` run in its own process, as `prefect-ddp worker` (or serve) starts one.

    python -m tests.support.warm_sweep IMAGES OUTPUT OUT.json

Two tiny trials of one rank each, side by side, on the cluster the sweep's process finds
(the warm one of its parent, where it fits: ClusterConfig's default of 2 workers). Writes
{"state": the sweep's final state type, "message": its message, "trials": the sweep
record's trials (each with its state, model_url and the workers its ranks ran on)}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect_ddp.flows.sweep import hyperparameter_sweep
from prefect_ddp.tasks.config import DataConfig, ModelConfig, OutputConfig, TrainingConfig
from prefect_ddp.tasks.sweeps.settings import SweepSettings


def main(images: str, output: str, out: Path) -> None:
    state = hyperparameter_sweep(
        space={"training.lr": {"kind": "grid", "values": [0.01, 0.001]}},
        settings=SweepSettings(name="warm-sweep", n_trials=2, concurrency=2, ranks_per_trial=1, sampler="grid",
                               pruner="none", metric="val_acc"),
        data=DataConfig(url=images, index_cache_minutes=0),
        model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=1, batch_size=4, image_size=32, num_workers=0),
        output=OutputConfig(url=output),
        return_state=True,
    )
    trials = state.result()["trials"] if state.is_completed() else []
    out.write_text(json.dumps({"state": state.type.value, "message": state.message, "trials": trials}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))

"""Run the flow from a process of its own, on a local cluster it starts, and print the outcome.

    python -m tests.support.long_run_script IMAGES OUTPUT EPOCHS

For tests that must disturb a run from outside (restart its Prefect server): the run
reports to PREFECT_API_URL from the environment. Prints one JSON line: the final state's
type and message and the flow run's id.
"""

from __future__ import annotations

import json
import sys

from prefect_ddp.flows.transfer_learning import transfer_learning
from prefect_ddp.tasks.config import (
    ClusterConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    TrainingConfig,
)


def main(images: str, output: str, epochs: int) -> None:
    state = transfer_learning(
        data=DataConfig(url=images, index_cache_minutes=0),
        model=ModelConfig(backbone="mobilenet_v3_small"),
        training=TrainingConfig(epochs=epochs, batch_size=4, image_size=32, num_workers=0),
        cluster=ClusterConfig(n_workers=2, init_timeout_s=60, max_restarts=0),
        output=OutputConfig(url=output),
        return_state=True,
    )
    print(json.dumps({"state": state.type.value, "message": state.message,
                      "flow_run_id": str(state.state_details.flow_run_id)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

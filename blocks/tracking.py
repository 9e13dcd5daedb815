"""The MLflow server runs are tracked on, with its credentials: a Prefect block.

Save one per server, then name it in the flow's `tracking.block`:

    MlflowTracking(tracking_uri="https://mlflow.internal", username="ci", password="...").save("mlflow")

The password and token are SecretStr: masked in the UI, in logs and in reprs, and only
turned into plain text for MLflow's requests (prefect_ddp.tasks.tracking.mlflow_session).
"""

from __future__ import annotations

from prefect.blocks.core import Block

from prefect_ddp.tasks.tracking import Tracking


class MlflowTracking(Block, Tracking):
    """An MLflow tracking server, the experiment runs go to, and the credentials to reach it."""

    _block_type_name = "MLflow Tracking"
    _block_type_slug = "mlflow-tracking"
    _description = "An MLflow tracking server (and model registry) that training runs are recorded in."
    # The fields are Tracking's (prefect_ddp.tasks.tracking): the flow hands rank 0
    # `block.plain()`, never the block.

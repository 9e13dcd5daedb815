"""Typed parameters of the batch-predict flow: bounds the server checks before any cluster starts.

Flat values rather than nested models: batch-predict has few settings, and each one is changed
alone from the CLI (`--param chunk_size=64`). Help text never holds angle brackets (the UI
reads `<url>` as an HTML tag and drops it): placeholders are in capitals, as in tasks/config.py.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from prefect_ddp.tasks.data.validation import DEFAULT_MAX_UNREADABLE

ModelSpec = Annotated[str, Field(
    min_length=1,
    description="The model to score with: OUTPUT/NAME/latest (the model kept under NAME), a run or "
    "version folder holding model.pt and model.json (s3://... or a local path), or models:/NAME@ALIAS.",
)]
DataUrl = Annotated[str | None, Field(
    description="Images to score: s3://bucket/prefix, file:///path or a local path; class folders "
    "(URL/CLASS/IMAGE.jpg) are optional and, where present, give the accuracy. Overrides the block's url.",
)]
DataBlock = Annotated[str | None, Field(
    description="Name of a saved `data-location` block with the S3 endpoint, region and credentials "
    "(and a default url).",
)]
OutputUrl = Annotated[str, Field(
    min_length=1,
    description="s3://bucket/prefix or a local path; each run writes to URL/RUN-NAME-ID/.",
)]
OutputBlock = Annotated[str | None, Field(
    description="data-location block for the output's and the model's credentials; empty reuses the "
    "data block for S3 urls.",
)]
ChunkSize = Annotated[int, Field(
    ge=1, le=100_000,
    description="Images per score-chunk task: a rerun of the flow run skips the chunks already written.",
)]
BatchSize = Annotated[int, Field(ge=1, le=4096, description="Images per forward pass.")]
TopK = Annotated[int, Field(ge=1, le=100, description="Most probable classes kept per image.")]
TrackingBlock = Annotated[str | None, Field(
    description="Name of the saved `mlflow-tracking` block whose registry model=models:/NAME@ALIAS is read from.",
)]
MaxUnreadableFraction = Annotated[float, Field(
    ge=0, le=1,
    description=f"Largest share of the images that may be missing or fail to decode and be left out (training's "
    f"data.max_unreadable_fraction, {DEFAULT_MAX_UNREADABLE:g} by default); above it, or when none could be "
    "read, the run fails after writing summary.json. 0 allows none, 1 any but not all.",
)]
OutputShared = Annotated[bool, Field(
    description="output_url is a local path on one filesystem mounted at the same path on every worker's host: "
    "skips the check that every worker sees the flow's files there.",
)]

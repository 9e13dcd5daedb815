"""Each flow run's own output folder, claimed (and proven writable) before any work is done.

A folder named after the flow run alone is shared by two runs of one name (a custom
`flow_run_name`, a repeat of Prefect's two-word names, two sweeps' `trial-3`): the second
would find the first's finished checkpoint and train nothing. The folder is keyed on the
flow run's id as well; a retry of the same flow run keeps its id, so it still resumes.

Claiming writes `run.json` into the folder. That is also the check that the output can be
written at all, done before the data is checked or a rank starts rather than after an
hour of training.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from prefect import task

from prefect_ddp.tasks.data.storage import exists, read_json, write_json
from prefect_ddp.tasks.location import Location
from prefect_ddp.tasks.retries import retry_transient
from prefect_ddp.tasks.urls import child_url, safe_segment

RUN_RECORD = "run.json"


def run_folder_name(run_name: str, run_id: str | None) -> str:
    """`NAME-ID8`: readable in a listing, unique per flow run, stable across its retries."""
    name = safe_segment(run_name)
    return f"{name}-{str(run_id)[:8]}" if run_id else name


class OutputNotWritable(PermissionError):
    """The output location refused a write; nothing was trained."""


@task(name="claim-output", retries=3, retry_delay_seconds=[2, 10, 30], retry_condition_fn=retry_transient)
def claim_run_folder(out: Location, run: dict[str, Any]) -> None:
    """Write `run.json` (who owns this folder) below `out.url`; refuse a folder another run owns."""
    options = out.storage_options()
    record_url = child_url(out.url, RUN_RECORD)
    try:
        owner = read_json(record_url, options) if exists(record_url, options) else None
        if owner and owner.get("flow_run_id") != run.get("flow_run_id"):
            raise ValueError(
                f"{out.url} already belongs to flow run {owner.get('name')!r} "
                f"({owner.get('flow_run_id')}); its files are left as they are. Choose another "
                "output.url for this run."
            )
        write_json(record_url, run | {"claimed_at": datetime.now(timezone.utc).isoformat()}, options)
    except (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError) as exc:
        raise OutputNotWritable(
            f"Cannot write to the output location {out.url} ({type(exc).__name__}: {exc}). "
            "Check output.url (an existing bucket or a folder that can be created), and the "
            "credentials of output.block (or of the data block, which S3 outputs reuse)."
        ) from exc

"""Take the docs' screenshots again (docs/images/): the Run form, a run's graph, the training report,
and a sweep's comparison.

    python -m tests.support.screenshots          # writes docs/images/*.png

It starts a Prefect server on a fresh database, serves the laptop deployments
(`prefect_ddp.deployments.serve`) on the demo images, submits a run and a sweep from the UI's Run form
in headless Chromium, waits for them, and photographs what a person sees. About 4 minutes
on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from playwright.sync_api import expect
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_ddp.deployments.local_services import prefect_server
from prefect_ddp.deployments.serve import DEPLOYMENT, serving
from tests.support.browser import (
    VIEWPORT,
    flow_run_by_name,
    prefect_ui,
    wait_for_final_state,
)

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"


def submit_and_wait(ui, deployment_id: str) -> str:
    """Submit the open Run form; returns the flow run's id once it completed."""
    name = ui.submit_run(deployment_id)
    run = flow_run_by_name(name)
    state = wait_for_final_state(run.id, timeout_s=900)
    if state != "COMPLETED":
        raise RuntimeError(f"The run {name} ended {state}: no screenshots of a finished run.")
    return str(run.id)


def artifact_shot(ui, flow_run_id: str, key: str, path: Path) -> Path:
    ui.open_flow_run(flow_run_id)
    # An artifact scrolls inside the page; a tall window shows all of it at once.
    ui.page.set_viewport_size({"width": 1440, "height": 1800})
    body = ui.open_artifact(key)
    expect(body.locator("img.markdown-renderer__image").first).to_be_visible()
    shot = ui.screenshot(path, body)
    ui.page.set_viewport_size(VIEWPORT)
    return shot


def take(ui, deployment_id: str, folder: Path) -> list[Path]:
    ui.open_run_form(deployment_id)
    shots = [ui.screenshot(folder / "run-form.png")]
    run_id = submit_and_wait(ui, deployment_id)
    shots.append(ui.screenshot(folder / "run-graph.png", ui.open_flow_run(run_id)))
    shots.append(artifact_shot(ui, run_id, "training-report", folder / "training-report.png"))
    with get_client(sync_client=True) as api:
        sweep_id = str(api.read_deployment_by_name(f"hyperparameter-sweep/{DEPLOYMENT}-sweep").id)
    ui.open_run_form(sweep_id)
    sweep_run_id = submit_and_wait(ui, sweep_id)
    shots.append(artifact_shot(ui, sweep_run_id, "sweep-comparison", folder / "sweep-comparison.png"))
    return shots


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=IMAGES, help="folder for the PNGs")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="prefect-ddp-shots-"))
    os.environ["PREFECT_HOME"] = str(work / "home")  # a fresh database: only this run in the UI
    with prefect_server(work, database=work / "prefect.db") as api_url, \
            temporary_settings({PREFECT_API_URL: api_url}), \
            serving(api_url, work / "serve.log", "--output", str(work / "outputs")) as deployment_id, \
            prefect_ui(api_url.removesuffix("/api")) as ui:
        for path in take(ui, deployment_id, args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()

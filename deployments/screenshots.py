"""Take the README's screenshots again: the Run form, a run's graph, the training report.

    python -m deployments.screenshots          # writes docs/images/*.png

It starts a Prefect server on a fresh database, serves the laptop deployment
(`deployments.serve`) on the demo images, submits a run from the UI's Run form in headless
Chromium, waits for it, and photographs what a person sees. About 3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from playwright.sync_api import expect
from prefect.settings import PREFECT_API_URL, temporary_settings

from deployments.browser import flow_run_by_name, prefect_ui, wait_for_final_state
from deployments.local_services import prefect_server
from deployments.serve import serving

IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"


def take(ui, deployment_id: str, folder: Path) -> list[Path]:
    ui.open_run_form(deployment_id)
    shots = [ui.screenshot(folder / "run-form.png")]
    name = ui.submit_run(deployment_id)
    run = flow_run_by_name(name)
    state = wait_for_final_state(run.id, timeout_s=600)
    if state != "COMPLETED":
        raise RuntimeError(f"The run {name} ended {state}: no screenshots of a finished run.")
    shots.append(ui.screenshot(folder / "run-graph.png", ui.open_flow_run(str(run.id))))
    # The report scrolls inside the page; a tall window shows all of it at once.
    ui.page.set_viewport_size({"width": 1440, "height": 1800})
    report = ui.open_artifact("training-report")
    expect(report.locator("img.markdown-renderer__image").first).to_be_visible()
    shots.append(ui.screenshot(folder / "training-report.png", report))
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

"""Drive the Prefect UI in headless Chromium, as a person would: the browser test and the
docs' screenshots (docs/images/) both go through here.

Debian's `chromium` package does the rendering, driven by Playwright for Python through
`executable_path` (Playwright's own browser download is never used: it needs internet).
The selectors are those of prefect 3.8.8's UI; where one is surprising, a comment says why.

    with prefect_ui("http://127.0.0.1:4200") as ui:
        ui.open_run_form(deployment_id)
        ui.field("training (Optional)")  ...
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from playwright.sync_api import Locator, Page, expect, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId, FlowRunFilter, FlowRunFilterName

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")
HOW_TO_GET_CHROMIUM = "apt-get update && apt-get install -y chromium   (Debian's package; .ci/run does this)"
VIEWPORT = {"width": 1440, "height": 1000}
UI_WAIT_MS = 180_000
CLICK_WAIT_MS = 60_000  # a Submit's wait for the page to move on before the API is asked


def chromium_path() -> str | None:
    """The Chromium executable, or None when it is not installed."""
    for candidate in CHROMIUM_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


class PrefectUI:
    """One browser page on a Prefect server's UI, with the few moves people make there."""

    def __init__(self, page: Page, base_url: str) -> None:
        self.page, self.base_url = page, base_url.rstrip("/")

    def goto(self, path: str) -> None:
        # The UI renders from API calls after the page loads: wait for them to settle.
        self.page.goto(self.base_url + path, wait_until="networkidle")

    def field(self, label: str, scope: Locator | Page | None = None) -> Locator:
        """The form field whose own label reads `label` exactly, e.g. 'Epochs (Optional)'.

        Matched by XPath on the field's own header: `has_text` is a case-insensitive
        substring match, so 'epochs (Optional)' would also find training's 'Epochs'.
        """
        own_label = self.page.locator(
            "xpath=./div[contains(@class,'p-label__header')]//span[contains(@class,"
            f"'schema-form-property__label')][normalize-space()='{label}']"
        )
        return (scope or self.page).locator(".schema-form-property").filter(has=own_label).first

    @staticmethod
    def description(field: Locator) -> Locator:
        """The field's help text; rendered from markdown after the field, so assert on it with
        `expect(...)`, which waits, rather than reading it once."""
        return field.locator(":scope > .p-label__header .schema-form-property__description")

    def open_run_form(self, deployment_id: str, prefill: dict | None = None) -> None:
        """The deployment's custom Run form, by its Run button, optionally prefilled."""
        if prefill is None:
            self.goto(f"/deployments/deployment/{deployment_id}")
            self.page.get_by_role("button", name="Run", exact=True).click()
            self.page.get_by_text("Custom run", exact=True).click()
            self.page.wait_for_url("**/run?**")
            self.page.wait_for_load_state("networkidle")
        else:
            # The form reads ?parameters= encoded twice (encodeURIComponent of the JSON, again).
            encoded = urllib.parse.quote(urllib.parse.quote(json.dumps(prefill), safe=""), safe="")
            self.goto(f"/deployments/deployment/{deployment_id}/run?parameters={encoded}")
        expect(self.page.locator(".schema-form-property").first).to_be_visible()

    def choose(self, field: Locator, option: str) -> None:
        """Pick `option` in a field that may be several types (`DataConfig | None`, `str | None`)."""
        field.get_by_role("button", name=option, exact=True).click()

    def submit_run(self, deployment_id: str, output_url: str | None = None) -> str:
        """Submit the Run form; returns the new flow run's name (with `output_url`, the run of
        the deployment whose output.url it is: other tests may start runs of it meanwhile).

        Asserts the outcome in the API, not the page alone: on a loaded machine a Submit once
        created no flow run and the page stayed on the form for 180 s (a click the busy page
        lost). So Submit is clicked again while the API holds no new run of the deployment,
        as a person would, and a run the API holds counts whether or not the page moved on;
        no run after UI_WAIT_MS fails, naming what the page showed.
        """
        before = deployment_run_names(deployment_id, output_url)
        deadline = time.monotonic() + UI_WAIT_MS / 1000
        while True:
            self.page.get_by_role("button", name="Submit", exact=True).click()
            try:
                self.page.wait_for_url(f"**/deployments/deployment/{deployment_id}?tab=Runs", timeout=CLICK_WAIT_MS)
            except PlaywrightTimeoutError:
                pass
            created = deployment_run_names(deployment_id, output_url) - before
            if created:  # two, where a click the page seemed to lose reached the server late: alike
                return sorted(created)[0]
            if time.monotonic() > deadline:
                raise AssertionError(f"Submit created no flow run of deployment {deployment_id} in "
                                     f"{UI_WAIT_MS / 1000:.0f} s; the page at {self.page.url} shows: "
                                     f"{self.page.locator('body').inner_text()[:2000]}")

    def open_flow_run(self, flow_run_id: str) -> Locator:
        """The flow run's page; returns its run graph once painted."""
        self.goto(f"/runs/flow-run/{flow_run_id}")
        graph = self.page.locator(".flow-run-graphs").first
        expect(graph.locator("canvas")).to_be_visible()
        self.page.wait_for_timeout(1500)  # the graph is WebGL, painted after its data arrives
        return graph

    def open_artifact(self, key: str) -> Locator:
        """From an open flow run page, the artifact `key`; returns its rendered markdown."""
        # The tab by click: a fresh goto to ?tab=Artifacts is ignored and shows Logs.
        self.page.locator("li.p-tab#artifacts").click()
        card = self.page.locator("a[href^='/artifacts/artifact/']").filter(has_text=key).first
        card.click()
        self.page.wait_for_url("**/artifacts/artifact/**")
        self.page.wait_for_load_state("networkidle")
        return self.page.locator(".markdown-renderer").nth(1)  # 0 is the artifact's description

    def screenshot(self, path: Path, target: Locator | None = None) -> Path:
        """A PNG of `target`, or of what the window shows."""
        path.parent.mkdir(parents=True, exist_ok=True)
        (target or self.page).screenshot(path=str(path))
        return path


@contextmanager
def prefect_ui(base_url: str) -> Iterator[PrefectUI]:
    """A headless Chromium page on the UI at `base_url`, closed on the way out."""
    executable = chromium_path()
    if executable is None:
        raise RuntimeError(f"Chromium is not installed; install it with: {HOW_TO_GET_CHROMIUM}")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=VIEWPORT)
            # The session's SQLite-backed server at times answers nothing for up to 60 s on a
            # loaded machine (tests/conftest.py, PATIENT_CLIENT): a Submit's navigation waited
            # out 30 s there. Waits end at their event; only a broken page waits this long.
            page.set_default_timeout(UI_WAIT_MS)
            expect.set_options(timeout=UI_WAIT_MS)
            yield PrefectUI(page, base_url)
        finally:
            browser.close()


def deployment_run_names(deployment_id: str, output_url: str | None = None) -> set[str]:
    """The names of the deployment's flow runs the API holds now (with `output_url`, of those
    whose output.url parameter it is)."""
    with get_client(sync_client=True) as api:
        runs = api.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])))
    return {run.name for run in runs
            if output_url is None or (run.parameters.get("output") or {}).get("url") == output_url}


def flow_run_by_name(name: str):
    with get_client(sync_client=True) as api:
        (run,) = api.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
        return run


def wait_for_final_state(flow_run_id, timeout_s: float) -> str:
    """Poll the API until the flow run ends; returns its state type (e.g. 'COMPLETED')."""
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as api:
        while True:
            state = api.read_flow_run(flow_run_id).state
            if state and state.is_final():
                return state.type.value
            if time.monotonic() > deadline:
                raise TimeoutError(f"Flow run {flow_run_id} still {state.type.value if state else 'new'} after {timeout_s:.0f}s")
            time.sleep(1)

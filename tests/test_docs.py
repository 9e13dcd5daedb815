"""The docs site and its front page (issue 34, "Docs as a site").

`mkdocs.yml` builds `docs/` into a site in strict mode: a link to a page or file that does
not exist, an anchor that names no heading, a page left out of the navigation, or a
docstring the API page's generator (mkdocstrings, griffe) cannot read is an error. The build
runs here as a child process of this environment's Python, so CI (which runs the whole
suite) builds the site on every run; a copy of the site with one planted fault shows the
check can fail. The README is the front page: under 250 lines, its first code block still
the two commands (.ci/run runs the second), and every relative link pointing at a file.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import prefect_ddp

REPOSITORY = Path(__file__).resolve().parents[1]
README = REPOSITORY / "README.md"
BUILD_TIMEOUT_S = 180
MAX_README_LINES = 250
# The README's first code block, exactly: CI runs the second line (.ci/run).
TWO_COMMANDS = [
    "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -C editable_mode=strict -e '.[demo]'"
    " && .venv/bin/prefect-ddp demo",
    "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -C editable_mode=strict -e '.[dev]'"
    " && .venv/bin/python -m pytest",
]
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CROSSINGS_ROW = re.compile(r"^\| (cell|\d+) \|.*\|$", re.MULTILINE)


def mkdocs_build(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the mkdocs.yml in `root`, run from `root` as CI runs it."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(root / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=root, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)


def page_text(page: Path) -> str:
    """A built page's text, without its tags."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8")))


def code_blocks(markdown: str) -> list[list[str]]:
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in markdown.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def test_the_site_builds_in_strict_mode_with_the_api_from_the_docstrings(tmp_path: Path) -> None:
    site = tmp_path / "site"
    built = mkdocs_build(REPOSITORY, site)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}{built.stderr}"
    for page in ("running", "parameters", "deployments", "sweeps", "after-training", "gang", "scaling",
                 "troubleshooting", "testing", "architecture", "migration", "api"):
        assert (site / page / "index.html").is_file(), f"no page {page} in the site"
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    # every public name has its entry, generated from its docstring
    undocumented = [name for name in prefect_ddp.__all__ if f'id="prefect_ddp.{name}"' not in api]
    assert not undocumented, f"public names without an entry on the API page: {undocumented}"
    text = page_text(site / "api" / "index.html")
    assert "run_gang(train_fn, config, *, task_runner=None" in text  # its signature
    assert "Run train_fn(ctx, config) on world_size Dask workers as one DDP world." in text  # its docstring
    assert "the per-rank function. Its process group is already initialised" in text  # an argument's text


@pytest.mark.parametrize("fault, expected", [
    ("[a page that is gone](no-such-page.md)", "no-such-page.md"),
    ("[a heading that is gone](running.md#no-such-heading)", "no-such-heading"),
    ("[an image that is gone](images/no-such-image.png)", "no-such-image.png"),
    (None, "not-in-nav.md"),
])
def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(tmp_path: Path, fault: str | None,
                                                                  expected: str) -> None:
    """The same check on a copy of the site with one fault planted: the strict build fails and
    names it."""
    root = tmp_path / "repository"
    shutil.copytree(REPOSITORY / "docs", root / "docs")
    shutil.copy(REPOSITORY / "mkdocs.yml", root / "mkdocs.yml")
    if fault is None:
        (root / "docs" / "not-in-nav.md").write_text("# A page no navigation entry names\n")
    else:
        with (root / "docs" / "gang.md").open("a") as page:
            page.write(f"\nSee {fault}.\n")
    built = mkdocs_build(root, tmp_path / "site")
    output = built.stdout + built.stderr
    assert built.returncode != 0, f"the strict build passed with {expected}:\n{output}"
    assert expected in output and "strict mode" in output, output


@pytest.mark.unit
def test_the_readme_is_a_short_front_page_whose_links_resolve() -> None:
    readme = README.read_text(encoding="utf-8")
    lines = readme.count("\n")
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; the rest belongs in docs/"
    blocks = code_blocks(readme)
    assert blocks and [line for line in blocks[0] if line.strip()] == TWO_COMMANDS, (
        "the README's first code block must stay the two commands (.ci/run runs the second)")
    broken = []
    for target in MARKDOWN_LINK.findall(readme):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the README itself
        if not (REPOSITORY / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"README.md links to files that do not exist: {broken}"


@pytest.mark.unit
def test_the_readme_lists_the_crossing_cells_as_the_testing_page_does() -> None:
    """tests/test_crossings.py's cells, in the README's "Testing" section and in
    docs/testing.md: the two tables stay one."""
    readme = README.read_text(encoding="utf-8")
    testing = readme[readme.index("\n## Testing\n"):]
    in_readme = [m.group(0) for m in CROSSINGS_ROW.finditer(testing)]
    in_docs = [m.group(0) for m in CROSSINGS_ROW.finditer((REPOSITORY / "docs" / "testing.md").read_text())]
    assert in_readme and len(in_readme) == 10, "the README's Testing section lists no crossing cells"
    assert in_readme == in_docs


@pytest.mark.unit
def test_the_api_page_names_every_public_name() -> None:
    """Each name `prefect_ddp` exports has a `::: prefect_ddp.NAME` entry on docs/api.md."""
    api = (REPOSITORY / "docs" / "api.md").read_text(encoding="utf-8")
    entries = set(re.findall(r"^::: prefect_ddp\.(\w+)$", api, re.MULTILINE))
    assert sorted(set(prefect_ddp.__all__) - entries) == [], "public names missing from docs/api.md"
    assert sorted(entries - set(prefect_ddp.__all__)) == [], "docs/api.md names what prefect_ddp does not export"

"""The suite's cost in view: bench/suite_times.py's table, and the order conftest reads from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench import suite_times
from bench.suite_times import per_file, table
from tests import conftest

pytestmark = pytest.mark.unit

JUNIT = """<testsuites><testsuite>
<testcase classname="tests.test_gang" name="a" time="2.5"/>
<testcase classname="tests.test_gang" name="b" time="1.0"/>
<testcase classname="tests.test_sweep" name="c[x]" time="6.0"/>
<testcase classname="" name="tests" time="0"/>
</testsuite></testsuites>"""


def test_each_file_gets_its_tests_and_seconds_and_the_table_reads_back_in_order(tmp_path, monkeypatch):
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    files = per_file(report)
    assert files == {"tests/test_gang.py": (2, 3.5), "tests/test_sweep.py": (1, 6.0), "(collection error)": (1, 0.0)}
    written = table(files, wall_s=60, source="the JUnit report of a fresh clone of abc1234", load="0.1 before the clone")
    assert "from the JUnit report of a fresh clone of abc1234." in written
    assert "load average 0.1 before the clone." in written
    assert "| tests/test_sweep.py | 1 | 6.0 | 63.2% |" in written  # the slowest first
    assert written.index("tests/test_sweep.py") < written.index("tests/test_gang.py")
    (tmp_path / "DURATIONS.md").write_text(written + "| tests/test_edited.py | 3 | n/a | 1% |\n| tests/x.py |\n")
    monkeypatch.setattr(conftest, "__file__", str(tmp_path / "conftest.py"))
    # A row edited by hand is skipped, not a failed collection.
    assert conftest.recorded_seconds() == {"tests/test_sweep.py": 6.0, "tests/test_gang.py": 3.5}
    assert "| (collection error) | 1 | 0.0 | 0.0% |" in table({"(collection error)": (1, 0.0)}, 1, "pytest", "0")


class Item:
    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid


def test_the_slowest_files_go_first_each_with_its_tests_in_their_order(monkeypatch):
    monkeypatch.setattr(conftest, "recorded_seconds", lambda: {"tests/b.py": 9.0, "tests/c.py": 20.0})
    items = [Item(n) for n in ("tests/a.py::x", "tests/b.py::y", "tests/b.py::z[1]", "tests/c.py::w", "tests/b.py::v")]
    conftest.slowest_files_first(items)
    assert [i.nodeid for i in items] == ["tests/c.py::w", "tests/b.py::y", "tests/b.py::z[1]", "tests/b.py::v",
                                         "tests/a.py::x"]


def test_about_and_load_are_refused_without_a_report_to_describe(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["suite_times", "--about", "a fresh clone"])
    with pytest.raises(SystemExit) as refused:
        suite_times.main()  # refused before it would start the suite
    assert refused.value.code == 2
    assert "--about and --load describe a report read with --junit" in capsys.readouterr().err

"""Performance scripts (DESIGN 8): run them as modules, e.g. `python -m bench.data_path`.

They are scripts, not tests: pytest collects only tests/ (pyproject's testpaths), so nothing
here is timed inside the test suite.
"""

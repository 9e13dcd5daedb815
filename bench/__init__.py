"""Performance scripts: run them as modules, e.g. `python -m bench.data_path`.

Why they measure through a latency front and not moto alone: docs/architecture.md,
"Facts: moto".

They are scripts, not tests: pytest collects only tests/ (pyproject's testpaths), so nothing
here is timed inside the test suite.
"""

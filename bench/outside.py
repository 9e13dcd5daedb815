"""Libraries the benches compare against, installed beside the project, never into its environment.

`pip install --no-deps --target bench/.cache/NAME`: their own pins must not move the
project's packages (torch above all), and what they need besides is named here by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CACHE = Path(__file__).resolve().parent / ".cache"
PIP_TIMEOUT_S = 180


def install_beside(name: str, requirements: list[str], module: str) -> str | None:
    """Make `module` importable from bench/.cache/`name`, installing `requirements` there on first
    use; None when it is, else why it cannot be had."""
    target = CACHE / name
    if not (target / module).is_dir():
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                   *requirements]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return (f"`pip install {' '.join(requirements)}` did not finish within {PIP_TIMEOUT_S} s "
                    "(is the package index reachable?)")
        if done.returncode:
            return f"`pip install {' '.join(requirements)}` failed: {(done.stderr or done.stdout).strip()[-300:]}"
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    return None

"""Which failures are worth a Prefect retry.

A missing prefix, denied credentials or an invalid dataset fail the same way every time;
retrying them only delays the message a person needs. Network errors and throttling pass.
"""

from __future__ import annotations

from typing import Any

PERMANENT_ERRORS = (FileNotFoundError, PermissionError, ValueError)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn`: retry unless the task raised a permanent error."""
    try:
        state.result()
    except PERMANENT_ERRORS:
        return False
    except Exception:
        return True
    return False

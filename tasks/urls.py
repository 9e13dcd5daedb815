"""URLs the project derives below a prefix the user chose: joined safely, told apart by scheme.

Plain string work, no filesystem: every layer (the gang included) may use it.
`child_url` keeps every name the project derives (run names, file names) inside the prefix.
"""

from __future__ import annotations

import os
import posixpath
import re
from urllib.parse import urlparse


def child_url(base: str, *parts: str) -> str:
    """Join `parts` below `base`, refusing any part that would step outside of it.

    Args:
        base: the output prefix the user chose.
        parts: single path segments (run names, file names).

    >>> child_url("s3://b/out", "run-1", "model.pt")
    's3://b/out/run-1/model.pt'
    """
    for part in parts:
        if not part or part in (".", "..") or "/" in part or "\\" in part or "\x00" in part:
            raise ValueError(
                f"Path segment {part!r} is not allowed below {base!r}: use a plain name "
                "without '/', '\\\\', '.' or '..'."
            )
    return posixpath.join(base.rstrip("/"), *parts)


def safe_segment(name: str) -> str:
    """`name` as one harmless path segment: a flow run renamed 'a/../b' becomes 'a-..-b'."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")
    return cleaned or "run"


def is_s3(url: str) -> bool:
    return url.startswith(("s3://", "s3a://"))


def absolute_url(url: str) -> str:
    """A plain local path made absolute (ranks run in other processes, in other folders);
    URLs (s3://, file://) as they are."""
    return url if "://" in url else os.path.abspath(url)


def is_local_url(url: str) -> bool:
    """A path on this host's disk: a plain path or file://, not s3:// or another store."""
    return urlparse(url).scheme in ("", "file")

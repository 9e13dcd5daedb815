"""Folders of one user's on a shared host: created private (0700), refused when they are not.

A host's temporary and data folders are shared by its users; a folder with a predictable
name there could be made first by someone else, who could then read or plant files in it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def private_folder(path: Path | str, fix: str) -> Path:
    """`path` as a folder only this user can use: made with mode 0700 where it is new.

    Raises PermissionError naming the folder, its owner and mode, and `fix` (what the
    caller's user can do instead), when it belongs to another user or others may write to it.
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{path} is owned by uid {info.st_uid} with mode {oct(stat.S_IMODE(info.st_mode))}, but only a folder "
            f"of this user's (uid {os.geteuid()}) that no one else can write to may be used: another user could "
            f"read or plant files there. Fix: chmod 700 {path} as its owner, or {fix}."
        )
    return path

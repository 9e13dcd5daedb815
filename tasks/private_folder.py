"""Folders of one user's on a shared host: created private (0700), refused when they are not.

A host's temporary and data folders are shared by its users; a folder with a predictable
name there could be made first by someone else, who could then read or plant files in it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def private_folder(path: Path | str) -> Path:
    """`path` as a folder only this user can use: made with mode 0700 where it is new.

    Raises PermissionError naming the folder, its owner and mode, and the fix, when it
    exists but belongs to another user or others may write to it.
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{path} is owned by uid {info.st_uid} with mode {stat.filemode(info.st_mode)}; this process "
            f"(uid {os.getuid()}) keeps its files only in a folder of its own that no one else may write. "
            f"Remove it, or chmod 700 it if it is yours, or point the setting that chose it elsewhere."
        )
    return path

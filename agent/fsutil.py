"""Atomic file writes for the agent and the training library (no torch, no network).

A file written with :func:`atomic_write_bytes` is either the old one or the whole new one,
never a torn mix: the bytes go to ``.tmp-<name>.<pid>`` beside it, are fsync'd, and the
temporary file is renamed over the target (``os.replace``, atomic on POSIX); then the folder
is fsync'd so the rename survives a power loss. Readers that list a folder skip names
starting with ``.tmp-``; a crash leaves at most such a file behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel

TMP_PREFIX = ".tmp-"


def fsync_dir(path: Path | str) -> None:
    """fsync a directory so a rename in it is durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to ``path`` under a temporary name, fsync, then rename.

    Args:
        path: The target file; its folder must exist.
        data: The whole new content.
        fsync: fsync the file before and its folder after the rename (False: atomic but not
            durable, for files rewritten often on tmpfs).

    Raises:
        OSError: the write, fsync or rename failed (the temporary file is removed).
    """
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write_json(
    path: Path, obj: BaseModel | Mapping[str, object], *, fsync: bool = True
) -> None:
    """:func:`atomic_write_bytes` of a pydantic model or a mapping as JSON (indent 1).

    Raises:
        OSError: as :func:`atomic_write_bytes`.
    """
    data = (
        obj.model_dump_json(indent=1)
        if isinstance(obj, BaseModel)
        else json.dumps(obj, indent=1, default=str)
    )
    atomic_write_bytes(path, data.encode(), fsync=fsync)

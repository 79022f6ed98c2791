"""Atomic file writes and link-proof opens for the agent and the training library (no torch,
no network).

A file written with :func:`atomic_write_bytes` is either the old one or the whole new one,
never a torn mix: the bytes go to ``.tmp-<name>.<pid>`` beside it, are fsync'd, and the
temporary file is renamed over the target (``os.replace``, atomic on POSIX); then the folder
is fsync'd so the rename survives a power loss. Readers that list a folder skip names
starting with ``.tmp-``; a crash leaves at most such a file behind.

The memory folder is writable by the training ranks, so the agent never follows a symbolic
link there: :func:`open_regular` opens a file under a trusted root with ``O_NOFOLLOW`` on
every component below the root and accepts only a regular file; :func:`open_dir` does the
same for a folder (and can create the missing ones).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel

TMP_PREFIX = ".tmp-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A path the agent refuses to open: a component below the trusted root is a symbolic
    link, a folder is not a folder, or the file is not a regular file (a FIFO, a device, a
    socket). The message names the path and says what it is."""


def _components(root: Path, path: Path) -> tuple[str, ...]:
    """``path`` relative to ``root`` as plain names (no ``.``/``..``, never outside root).

    Raises:
        UnsafePathError: ``path`` is not under ``root`` or has a ``..`` component.
    """
    try:
        parts = Path(path).relative_to(root).parts
    except ValueError:
        raise UnsafePathError(f"{path}: not under {root}; refused") from None
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePathError(f"{path}: has a '..' component; refused")
    return parts


def open_dir(root: Path, path: Path, *, create: bool = False) -> int:
    """Open folder ``path`` under ``root`` without following a symbolic link below ``root``.

    ``root`` itself (the operator's ``--memory-dir``) is trusted and may be a link (as
    ``/dev/shm`` is on some systems). Every component below it is opened relative to the
    previous one (``openat``) with ``O_DIRECTORY | O_NOFOLLOW``: a component that is a link,
    or not a folder, is refused.

    Why per component and not ``realpath(path)`` compared with the root: the training ranks
    write in these folders while the agent reads them, so a folder checked by ``realpath``
    can be swapped for a link before the following ``open`` (a check-then-use race). Opening
    each component relative to the descriptor of its parent makes the check and the open one
    step: what is opened is what was checked. ``O_NOFOLLOW`` on the last component alone would
    still follow a linked parent (``jobs/<job>`` or ``step-<N>`` pointing at another job).

    Args:
        root: The trusted folder.
        path: A folder at or below ``root``.
        create: Create missing folders (mode 0o777 less the umask), each one in its parent's
            descriptor.

    Returns:
        An open descriptor of the folder (the caller closes it).

    Raises:
        UnsafePathError: a component is a link or not a folder, or ``path`` is not under root.
        FileNotFoundError: a component is missing (and ``create`` is False).
        OSError: another error opening or creating a folder.
    """
    parts = _components(root, path)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        where = Path(root)
        for part in parts:
            where = where / part
            if create:
                try:
                    os.mkdir(part, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePathError(_what_is(fd, part, where)) from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


def _what_is(dir_fd: int, name: str, where: Path) -> str:
    """Why ``name`` in ``dir_fd`` was refused, for the error message."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return f"{where}: refused (changed while being opened)"
    if stat.S_ISLNK(st.st_mode):
        return (
            f"{where}: a symbolic link; the agent never follows links in the memory folder "
            "(replace it with the real file or folder)"
        )
    if stat.S_ISDIR(st.st_mode):
        return f"{where}: a folder, not a regular file"
    kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
    if stat.S_ISREG(st.st_mode):
        kind = "a regular file, not a folder"
    return f"{where}: {kind}; refused"


def open_regular(path: Path, *, root: Path | None = None) -> BinaryIO:
    """Open a regular file for reading without following a symbolic link.

    The file itself is opened with ``O_NOFOLLOW`` (a link is refused, never followed) and
    ``O_NONBLOCK`` (a FIFO cannot hang the open), then checked with ``fstat`` to be a regular
    file. With ``root``, every folder between ``root`` and the file is opened as
    :func:`open_dir` does, so a linked parent folder is refused too.

    Args:
        path: The file.
        root: The trusted folder ``path`` lies under (None: only the last component is
            checked).

    Returns:
        The file, open for binary reading (blocking reads; the caller closes it).

    Raises:
        UnsafePathError: ``path`` or a folder below ``root`` is a link, or ``path`` is not a
            regular file.
        FileNotFoundError: it does not exist.
        OSError: it cannot be opened.
    """
    path = Path(path)
    dir_fd = open_dir(root, path.parent) if root is not None else None
    name = path.name if dir_fd is not None else str(path)
    try:
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                if dir_fd is None:
                    raise UnsafePathError(
                        f"{path}: a symbolic link; the agent never follows links in the memory "
                        "folder (replace it with the real file)"
                    ) from None
                raise UnsafePathError(_what_is(dir_fd, name, path)) from None
            raise
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "not a regular file"
            if stat.S_ISDIR(st.st_mode):
                kind = "a folder"
            raise UnsafePathError(f"{path}: {kind}; the agent reads only regular files")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def iter_file(f: BinaryIO, size: int, chunk: int = 1024 * 1024) -> Iterator[bytes]:
    """Yield at most ``size`` bytes of ``f`` in chunks, then close it (also when the consumer
    stops early and the generator is closed).

    Args:
        f: An open binary file (e.g. from :func:`open_regular`).
        size: Most bytes to yield (the size the caller announced, e.g. a Content-Length).
        chunk: Bytes per read.
    """
    try:
        left = size
        while left > 0:
            data = f.read(min(chunk, left))
            if not data:
                return
            left -= len(data)
            yield data
    finally:
        f.close()


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

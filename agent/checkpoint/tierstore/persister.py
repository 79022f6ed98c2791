"""The persistent tier: an fsspec URL holding plain DCP step folders.

``<url>/<job_id>/step-<N>/`` holds every rank's ``__<r>_0.distcp`` and ``manifest-<r>.json``
and, written last by the agent of the node whose rank lists it, ``.metadata``. A step exists
on this tier only once its ``.metadata`` is there.

That agent uploads ``.metadata`` together with its rank's files, but as
``.metadata.staged`` (the trainer may drop the step from memory long before the other nodes'
uploads finish); once every rank's manifest is in the folder it renames it to ``.metadata``.

Writes: on a local filesystem (``file://``) each file goes to a temporary name, is fsync'd,
renamed and its folder fsync'd; on an object store (``s3://`` with s3fs installed, …) a plain
put is the commit (objects appear whole or not at all).

No torch here.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    check_job_id,
    parse_manifest_name,
    parse_step_dirname,
    persistent_step_path,
    step_dirname,
)
from tierwatch.agent.checkpoint.format.manifest import (
    CHUNK,
    FileEntry,
    Manifest,
    ManifestError,
    read_manifest,
)
from tierwatch.agent.fsutil import fsync_dir

log = logging.getLogger(__name__)

STAGED_METADATA = METADATA + ".staged"

ProgressFn = Callable[[int], None]


class PersistentError(Exception):
    """The persistent tier cannot be read or written (the message names the URL/file)."""


class PersistentTier:
    """One fsspec URL as the persistent tier.

    Args:
        url: ``file:///path``, ``s3://bucket/prefix`` (needs s3fs), or any fsspec URL.

    Raises:
        PersistentError: the URL's protocol is unknown or its filesystem package missing.
    """

    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        self.error: str | None = None
        try:
            self.fs, self.root = url_to_fs(self.url)
        except (ImportError, ValueError) as exc:
            raise PersistentError(
                f"persistent URL {self.url}: {exc} (for s3:// install s3fs: "
                "pip install 'tierwatch[s3]')"
            ) from None
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        self.local = "file" in protocols or "local" in protocols
        self.root = self.root.rstrip("/") or "/"

    @classmethod
    def unavailable(cls, url: str, error: str) -> PersistentTier:
        """A tier whose URL cannot be used (unknown protocol, s3fs missing): :attr:`error`
        says why, and every read or write fails with it (an ``OSError`` inside, so callers
        report a :class:`PersistentError` or a failed file as for any broken tier)."""
        tier = cls.__new__(cls)
        tier.url = url.rstrip("/")
        tier.error = error
        tier.fs = _UnavailableFS(error)
        tier.root = "/"
        tier.local = False
        return tier

    @property
    def available(self) -> bool:
        """Whether the URL could be opened (see :attr:`error`)."""
        return self.error is None

    def write_problem(self) -> str | None:
        """Why files cannot be written here, when that is visible without writing: the URL
        is unusable, or (``file://``) its nearest existing folder is not a folder or not
        writable. None when nothing is known to be wrong (object stores are not probed)."""
        if self.error is not None:
            return self.error
        if not self.local:
            return None
        path = Path(self.root)
        while not path.exists() and path != path.parent:
            path = path.parent
        if not path.is_dir():
            return f"{self.url}: {path} is not a folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{self.url}: {path} is not writable by this agent (uid {os.getuid()})"
        return None

    # -- paths ---------------------------------------------------------------------------
    def step_url(self, job_id: str, step: int) -> str:
        """``<url>/<job>/step-<N>``."""
        return persistent_step_path(self.url, job_id, step)

    def _step_path(self, job_id: str, step: int) -> str:
        return f"{self.root}/{check_job_id(job_id)}/{step_dirname(step)}"

    def file_path(self, job_id: str, step: int, name: str) -> str:
        """The filesystem path (no protocol) of one file of a step."""
        return f"{self._step_path(job_id, step)}/{name}"

    # -- reading -------------------------------------------------------------------------
    def steps(self, job_id: str) -> list[int]:
        """Steps with a folder under ``<url>/<job>/``, ascending (none when missing).

        Raises:
            PersistentError: the listing failed for another reason than a missing folder.
        """
        base = f"{self.root}/{check_job_id(job_id)}"
        try:
            names = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            return []
        except (OSError, NotADirectoryError) as exc:
            raise PersistentError(f"cannot list {self.url}/{job_id}: {exc}") from None
        out = []
        for n in names:
            step = parse_step_dirname(str(n).rstrip("/").rsplit("/", 1)[-1])
            if step is not None:
                out.append(step)
        return sorted(set(out))

    def names(self, job_id: str, step: int) -> list[str]:
        """File names in one step folder ([] when missing)."""
        try:
            names = self.fs.ls(self._step_path(job_id, step), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise PersistentError(f"cannot list {self.step_url(job_id, step)}: {exc}") from None
        return sorted(str(n).rstrip("/").rsplit("/", 1)[-1] for n in names)

    def has_metadata(self, job_id: str, step: int) -> bool:
        """Whether the step's ``.metadata`` exists (the step is committed on this tier)."""
        try:
            return bool(self.fs.exists(self.file_path(job_id, step, METADATA)))
        except OSError:
            return False

    def manifest_ranks(self, job_id: str, step: int) -> set[int]:
        """Ranks with a ``manifest-<r>.json`` in the step folder."""
        return {r for n in self.names(job_id, step) if (r := parse_manifest_name(n)) is not None}

    def manifests(self, job_id: str, step: int) -> list[Manifest]:
        """The step's manifests that parse and match (job, step, rank in the name)."""
        out = []
        for name in self.names(job_id, step):
            rank = parse_manifest_name(name)
            if rank is None:
                continue
            try:
                with self.fs.open(self.file_path(job_id, step, name), "rb") as f:
                    m = read_manifest(f.read(), where=f"{self.step_url(job_id, step)}/{name}")
            except (OSError, ManifestError):
                continue
            if m.job_id == job_id and m.step == step and m.rank == rank:
                out.append(m)
        return out

    def manifest(self, job_id: str, step: int, rank: int) -> Manifest | None:
        """Rank ``rank``'s manifest of the step (None: missing, unreadable or not matching).

        Raises:
            PersistentError: the tier cannot be read (other than a missing file).
        """
        name = f"manifest-{rank}.json"
        try:
            with self.fs.open(self.file_path(job_id, step, name), "rb") as f:
                m = read_manifest(f.read(), where=f"{self.step_url(job_id, step)}/{name}")
        except FileNotFoundError:
            return None
        except ManifestError:
            return None
        except OSError as exc:
            raise PersistentError(
                f"cannot read {self.step_url(job_id, step)}/{name}: {exc}"
            ) from None
        if m.job_id != job_id or m.step != step or m.rank != rank:
            return None
        return m

    def open_read(self, job_id: str, step: int, name: str) -> BinaryIO:
        """Open one file for reading (binary).

        Raises:
            OSError / FileNotFoundError: it cannot be opened.
        """
        return self.fs.open(self.file_path(job_id, step, name), "rb")

    # -- writing -------------------------------------------------------------------------
    def put_file(
        self,
        local: Path,
        job_id: str,
        step: int,
        name: str,
        *,
        expect: FileEntry | None = None,
        progress: ProgressFn | None = None,
    ) -> int:
        """Upload one local file into the step folder, atomically.

        Args:
            local: The source file.
            job_id, step, name: Where it goes.
            expect: The manifest entry; the bytes read are checked against it and a mismatch
                leaves nothing behind.
            progress: Called with the bytes of each chunk written.

        Returns:
            Bytes written.

        Raises:
            PersistentError: the folder cannot be created, the file written, or the local file
                does not match ``expect`` (the message names the file and URL).
        """
        dest = self.file_path(job_id, step, name)
        where = f"{self.step_url(job_id, step)}/{name}"
        h = xxhash.xxh3_64()

        def check() -> None:
            if expect is not None and (n != expect.size or h.hexdigest() != expect.xxh3):
                raise _Mismatch(
                    f"{local}: {n} bytes with xxh3 {h.hexdigest()}, the manifest "
                    f"says {expect.size} bytes with xxh3 {expect.xxh3}; not uploaded"
                )

        n = 0
        try:
            if self.local:
                tmp = Path(dest).with_name(f".tmp-{name}.{uuid.uuid4().hex[:12]}")
                try:
                    tmp.parent.mkdir(parents=True, exist_ok=True)
                    with open(local, "rb") as src, open(tmp, "wb") as out:
                        while chunk := src.read(CHUNK):
                            out.write(chunk)
                            h.update(chunk)
                            n += len(chunk)
                            if progress:
                                progress(len(chunk))
                        out.flush()
                        os.fsync(out.fileno())
                    check()
                    os.replace(tmp, dest)
                finally:
                    tmp.unlink(missing_ok=True)
                fsync_dir(tmp.parent)
                return n
            self.fs.makedirs(self._step_path(job_id, step), exist_ok=True)
            with open(local, "rb") as src, self.fs.open(dest, "wb") as out:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    n += len(chunk)
                    if progress:
                        progress(len(chunk))
            try:
                check()
            except _Mismatch:
                self.fs.rm(dest)
                raise
            return n
        except _Mismatch as exc:
            raise PersistentError(f"cannot write {where}: {exc}") from None
        except OSError as exc:
            raise PersistentError(f"cannot write {where} from {local}: {exc}") from None

    def has_staged_metadata(self, job_id: str, step: int) -> bool:
        """Whether ``.metadata.staged`` waits in the step folder for the other ranks."""
        try:
            return bool(self.fs.exists(self.file_path(job_id, step, STAGED_METADATA)))
        except OSError:
            return False

    def commit_metadata(self, job_id: str, step: int) -> None:
        """Rename ``.metadata.staged`` to ``.metadata``: the step now exists on this tier
        (local: rename + fsync of the folder; object stores: a server-side copy, then the
        staged object is removed).

        Raises:
            PersistentError: the rename failed (names the step's URL).
        """
        src = self.file_path(job_id, step, STAGED_METADATA)
        dest = self.file_path(job_id, step, METADATA)
        try:
            if self.local:
                os.replace(src, dest)
                fsync_dir(Path(dest).parent)
            else:
                self.fs.mv(src, dest)
        except OSError as exc:
            raise PersistentError(
                f"cannot write {self.step_url(job_id, step)}/{METADATA}: {exc}"
            ) from None

    def remove_staged_metadata(self, job_id: str, step: int) -> None:
        """Remove ``.metadata.staged`` (a step given up on); missing is fine."""
        try:
            self.fs.rm(self.file_path(job_id, step, STAGED_METADATA))
        except (FileNotFoundError, OSError):
            pass

    def delete_step(self, job_id: str, step: int) -> None:
        """Remove one step folder, ``.metadata`` first (so it stops existing before its
        files go).

        Raises:
            PersistentError: the removal failed.
        """
        path = self._step_path(job_id, step)
        try:
            meta = self.file_path(job_id, step, METADATA)
            if self.fs.exists(meta):
                self.fs.rm(meta)
            if self.local:
                shutil.rmtree(path, ignore_errors=False)
            else:
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise PersistentError(f"cannot delete {self.step_url(job_id, step)}: {exc}") from None

    def info(self) -> dict[str, Any]:
        """``{url, local, error}``."""
        return {"url": self.url, "local": self.local, "error": self.error}


class _Mismatch(Exception):
    pass


class _UnavailableFS:
    """Stands for the filesystem of an unusable URL: every call raises ``OSError(error)``."""

    protocol = "unavailable"

    def __init__(self, error: str) -> None:
        self._error = error

    def __getattr__(self, name: str) -> Any:
        def fail(*_args: Any, **_kwargs: Any) -> Any:
            raise OSError(self._error)

        return fail

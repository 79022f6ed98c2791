"""The persistent tier: an fsspec URL holding plain DCP step folders.

``<url>/<job_id>/step-<N>/`` holds every rank's ``__<r>_0.distcp`` and ``manifest-<r>.json``
and, written last by the agent of the node whose rank lists it, ``.metadata``. A step exists
on this tier only once its ``.metadata`` is there.

That agent uploads ``.metadata`` together with its rank's files, but as
``.metadata.staged`` (the trainer may drop the step from memory long before the other nodes'
uploads finish); once every rank's manifest is in the folder it renames it to ``.metadata``.

Writes: on a local filesystem (``file://``) each file goes to a temporary name, is fsync'd,
renamed and its folder fsync'd; on S3 (``s3://``, see :mod:`.s3`) a file is one ``PutObject``
or a parallel multipart upload, hashed in the same pass and completed only when it matches
its manifest entry (objects appear whole or not at all); on other object stores a streamed
write.

Freshness: the tier is shared by every node's agent, so a listing is never answered from a
cache. Object-store filesystems are opened with ``use_listings_cache=False`` (s3fs's directory
cache never expires by default, so a long-running agent would miss other agents' uploads),
every listing or existence check first drops what the filesystem cached for that folder, and
each :class:`PersistentTier` has a filesystem instance of its own (``skip_instance_cache``).

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
from tierwatch.agent.checkpoint.tierstore import s3
from tierwatch.agent.fsutil import fsync_dir, open_regular
from tierwatch.agent.urlsafe import redact_url

log = logging.getLogger(__name__)

STAGED_METADATA = METADATA + ".staged"

ProgressFn = Callable[[int], None]


class PersistentError(Exception):
    """The persistent tier cannot be read or written (the message names the URL/file)."""


class PersistentTier:
    """One fsspec URL as the persistent tier.

    Args:
        url: ``file:///path``, ``s3://bucket/prefix``, or any fsspec URL.
        storage_options: fsspec storage options for the URL's filesystem (for ``s3://``:
            ``endpoint_url``, ``profile``, ``client_kwargs={"region_name": …}``, …; see
            :meth:`tierwatch.agent.config.AgentSettings.persistent_storage_options`). None:
            the filesystem's defaults (for S3, botocore's credential chain and region).
        part_size: S3 only: bytes per multipart-upload part; files up to this size are one
            ``PutObject`` (5 MiB … 5 GiB).
        upload_concurrency: S3 only: parts of one file uploaded at once (1 … 64).

    Raises:
        PersistentError: the URL's protocol is unknown, its filesystem package is missing,
            or a storage option is unknown or malformed (the message names it).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        part_size: int = s3.DEFAULT_PART_SIZE,
        upload_concurrency: int = s3.DEFAULT_CONCURRENCY,
    ) -> None:
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        self.shown_url = redact_url(self.url)  # for messages: never the credentials
        self.error: str | None = None
        self.part_size = part_size
        self.upload_concurrency = upload_concurrency
        options = dict(storage_options or {})
        try:
            if s3.is_s3_url(self.url):
                s3.check_s3_options(options)
            if not self.url.startswith(("file://", "local://")) and "://" in self.url:
                options.setdefault("use_listings_cache", False)
            options.setdefault("skip_instance_cache", True)
            self.fs, self.root = url_to_fs(self.url, **options)
        except (ImportError, ValueError, TypeError) as exc:
            raise PersistentError(f"persistent URL {self.shown_url}: {exc}") from None
        self.storage_options = options
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        self.local = "file" in protocols or "local" in protocols
        self.s3 = s3.is_s3_fs(self.fs)
        self.root = self.root.rstrip("/") or "/"
        self._errors = s3.store_errors()

    def _explain(self, exc: BaseException) -> str:
        """``exc`` as one line; for S3 with what to fix where the cause is known."""
        if self.s3:
            return s3.explain(exc, endpoint=self.storage_options.get("endpoint_url"))
        return str(exc)

    def _fresh(self, path: str) -> None:
        """Drop what the filesystem cached about ``path`` (and its folder) before a read
        that must see other agents' writes."""
        if not self.local:
            self.fs.invalidate_cache(path)

    @classmethod
    def unavailable(cls, url: str, error: str) -> PersistentTier:
        """A tier whose URL cannot be used (unknown protocol, s3fs missing): :attr:`error`
        says why, and every read or write fails with it (an ``OSError`` inside, so callers
        report a :class:`PersistentError` or a failed file as for any broken tier)."""
        tier = cls.__new__(cls)
        tier.url = url.rstrip("/")
        tier.shown_url = redact_url(tier.url)
        tier.error = error
        tier.fs = _UnavailableFS(error)
        tier.root = "/"
        tier.local = False
        tier.s3 = False
        tier.storage_options = {}
        tier.part_size = s3.DEFAULT_PART_SIZE
        tier.upload_concurrency = s3.DEFAULT_CONCURRENCY
        tier._errors = (OSError,)
        return tier

    @property
    def available(self) -> bool:
        """Whether the URL could be opened (see :attr:`error`)."""
        return self.error is None

    def write_problem(self) -> str | None:
        """Why files cannot be written here, when that is visible without writing: the URL
        is unusable, or (``file://``) its nearest existing folder is not a folder or not
        writable, or (S3) its bucket cannot be reached with the credentials in use (one
        ``HeadBucket``). None when nothing is known to be wrong (other object stores are not
        probed)."""
        if self.error is not None:
            return self.error
        if self.s3:
            return self._bucket_problem()
        if not self.local:
            return None
        path = Path(self.root)
        while not path.exists() and path != path.parent:
            path = path.parent
        if not path.is_dir():
            return f"{self.shown_url}: {path} is not a folder"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{self.shown_url}: {path} is not writable by this agent (uid {os.getuid()})"
        return None

    def _bucket_problem(self) -> str | None:
        """S3: why the bucket cannot be used (one ``HeadBucket``), or None."""
        bucket = self.root.split("/", 1)[0]
        try:
            self.fs.call_s3("head_bucket", Bucket=bucket)
        except FileNotFoundError:
            where = self.storage_options.get("endpoint_url") or "AWS S3"
            return (
                f"{self.shown_url}: bucket {bucket} does not exist at {where} (create the "
                "bucket first; the agent never creates buckets)"
            )
        except self._errors as exc:
            return f"{self.shown_url}: bucket {bucket}: {self._explain(exc)}"
        return None

    # -- paths ---------------------------------------------------------------------------
    def shown_step_url(self, job_id: str, step: int) -> str:
        """:meth:`step_url` with its credentials redacted, for messages and events."""
        return redact_url(self.step_url(job_id, step))

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
            self._fresh(base)
            names = self.fs.ls(base, detail=False)
        except FileNotFoundError:
            # no folder of this job yet; on S3 also what a missing bucket looks like, which
            # must not read as "no steps" (a restore would start the job from scratch)
            problem = self._bucket_problem() if self.s3 else None
            if problem is not None:
                raise PersistentError(f"cannot list {self.shown_url}/{job_id}: {problem}") from None
            return []
        except self._errors as exc:
            raise PersistentError(
                f"cannot list {self.shown_url}/{job_id}: {self._explain(exc)}"
            ) from None
        out = []
        for n in names:
            step = parse_step_dirname(str(n).rstrip("/").rsplit("/", 1)[-1])
            if step is not None:
                out.append(step)
        return sorted(set(out))

    def names(self, job_id: str, step: int) -> list[str]:
        """File names in one step folder ([] when missing)."""
        path = self._step_path(job_id, step)
        try:
            self._fresh(path)
            names = self.fs.ls(path, detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        except self._errors as exc:
            raise PersistentError(
                f"cannot list {self.shown_step_url(job_id, step)}: {self._explain(exc)}"
            ) from None
        return sorted(str(n).rstrip("/").rsplit("/", 1)[-1] for n in names)

    def has_metadata(self, job_id: str, step: int) -> bool:
        """Whether the step's ``.metadata`` exists (the step is committed on this tier; an
        unreadable tier answers False)."""
        return self._exists(self.file_path(job_id, step, METADATA))

    def _exists(self, path: str) -> bool:
        try:
            self._fresh(path)
            return bool(self.fs.exists(path))
        except self._errors:
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
                    m = read_manifest(f.read(), where=f"{self.shown_step_url(job_id, step)}/{name}")
            except (*self._errors, ManifestError):
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
                m = read_manifest(f.read(), where=f"{self.shown_step_url(job_id, step)}/{name}")
        except FileNotFoundError:
            return None
        except ManifestError:
            return None
        except self._errors as exc:
            raise PersistentError(
                f"cannot read {self.shown_step_url(job_id, step)}/{name}: {self._explain(exc)}"
            ) from None
        if m.job_id != job_id or m.step != step or m.rank != rank:
            return None
        return m

    def open_read(self, job_id: str, step: int, name: str) -> BinaryIO:
        """Open one file for reading (binary).

        Raises:
            OSError / FileNotFoundError: it cannot be opened (for S3 the message says what
                to fix where the cause is known).
        """
        return self._open(self.file_path(job_id, step, name))

    def open_url(self, url: str) -> BinaryIO:
        """Open a file of this tier by its full URL (``<url>/<job>/step-<N>/<name>``, as
        ``available`` answers give it) for reading, with this tier's storage options.

        Raises:
            FileNotFoundError: the file does not exist.
            OSError: it cannot be read, or ``url`` is not under this tier's URL (the message
                says which URL this agent is configured for).
        """
        if not url.startswith(self.url + "/"):
            raise OSError(
                f"{redact_url(url)} is not under this agent's persistent URL {self.shown_url} "
                "(every agent of a job needs the same --persistent-url)"
            )
        return self._open(f"{self.root.rstrip('/')}/{url[len(self.url) + 1 :]}")

    def _open(self, path: str) -> BinaryIO:
        try:
            return self.fs.open(path, "rb")
        except FileNotFoundError:
            raise
        except self._errors as exc:
            if isinstance(exc, OSError) and not self.s3:
                raise
            raise OSError(self._explain(exc)) from None

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
        root: Path | None = None,
    ) -> int:
        """Upload one local file into the step folder, atomically.

        The local file is opened once, without following a symbolic link
        (:func:`~tierwatch.agent.fsutil.open_regular`; with ``root``, no folder between
        ``root`` and it may be a link either), and must be a regular file; with ``expect``
        its size is checked before a byte is sent.

        Args:
            local: The source file.
            job_id, step, name: Where it goes.
            expect: The manifest entry; the bytes read are checked against it and a mismatch
                leaves nothing behind.
            progress: Called with the bytes of each chunk written.
            root: The trusted folder ``local`` lies under (the memory folder).

        Returns:
            Bytes written.

        Raises:
            PersistentError: the folder cannot be created, the file written, the local file
                is a link or not a regular file, or it does not match ``expect`` (the
                message names the file and URL).
        """
        dest = self.file_path(job_id, step, name)
        where = f"{self.shown_step_url(job_id, step)}/{name}"
        try:
            source = open_regular(local, root=root)
        except OSError as exc:
            raise PersistentError(f"cannot write {where}: {exc}") from None
        with source:
            size = os.fstat(source.fileno()).st_size
            if expect is not None and size != expect.size:
                raise PersistentError(
                    f"cannot write {where}: {local}: {size} bytes, the manifest says "
                    f"{expect.size} bytes; not uploaded"
                )
            return self._put(source, size, local, dest, where, job_id, step, name, expect, progress)

    def _put(
        self,
        source: BinaryIO,
        size: int,
        local: Path,
        dest: str,
        where: str,
        job_id: str,
        step: int,
        name: str,
        expect: FileEntry | None,
        progress: ProgressFn | None,
    ) -> int:
        """:meth:`put_file` from the open ``source`` (``size`` bytes)."""
        h = xxhash.xxh3_64()

        def check() -> None:
            if expect is not None and (n != expect.size or h.hexdigest() != expect.xxh3):
                raise _Mismatch(
                    f"{local}: {n} bytes with xxh3 {h.hexdigest()}, the manifest "
                    f"says {expect.size} bytes with xxh3 {expect.xxh3}; not uploaded"
                )

        n = 0

        def update(chunk: bytes) -> None:
            nonlocal n
            h.update(chunk)
            n += len(chunk)

        try:
            if self.local:
                tmp = Path(dest).with_name(f".tmp-{name}.{uuid.uuid4().hex[:12]}")
                try:
                    tmp.parent.mkdir(parents=True, exist_ok=True)
                    with open(tmp, "wb") as out:
                        while chunk := source.read(CHUNK):
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
            if self.s3:  # no folders on S3 (and makedirs would create a missing bucket)
                return s3.multipart_put(
                    self.fs,
                    source,
                    dest,
                    size=size,
                    part_size=self.part_size,
                    concurrency=self.upload_concurrency,
                    update=update,
                    check=check,
                    progress=progress,
                )
            self.fs.makedirs(self._step_path(job_id, step), exist_ok=True)
            with self.fs.open(dest, "wb") as out:
                while chunk := source.read(CHUNK):
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
        except self._errors as exc:
            raise PersistentError(
                f"cannot write {where} from {local}: {self._explain(exc)}"
            ) from None

    def has_staged_metadata(self, job_id: str, step: int) -> bool:
        """Whether ``.metadata.staged`` waits in the step folder for the other ranks."""
        return self._exists(self.file_path(job_id, step, STAGED_METADATA))

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
        except self._errors as exc:
            raise PersistentError(
                f"cannot write {self.shown_step_url(job_id, step)}/{METADATA}: {self._explain(exc)}"
            ) from None

    def remove_staged_metadata(self, job_id: str, step: int) -> None:
        """Remove ``.metadata.staged`` (a step given up on); missing is fine."""
        try:
            self.fs.rm(self.file_path(job_id, step, STAGED_METADATA))
        except self._errors:
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
            self._fresh(meta)
            if self.fs.exists(meta):
                self.fs.rm(meta)
            if self.local:
                shutil.rmtree(path, ignore_errors=False)
            else:
                self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            return
        except self._errors as exc:
            raise PersistentError(
                f"cannot delete {self.shown_step_url(job_id, step)}: {self._explain(exc)}"
            ) from None

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

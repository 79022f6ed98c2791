"""Restore staging: assemble the files a rank's load reads in ``restore/<job>/step-<N>/``.

For each requested file the sources are tried in the order given:

- ``holder`` is this node, tier ``memory``: hard link from ``jobs/<job>/step-<N>/`` (a copy
  when a link is impossible); tier ``peer``: the same from ``replicas/<src>/<job>/step-<N>/``;
- another holder: ``GET <url>/v1/peer/files/<job>/<N>/<name>?tier=…&src=…`` signed as this
  node, where ``url`` is the holder's in the server's registry (a ``url`` in the request is
  not followed);
- tier ``persistent``: a read of ``<step URL>/<name>`` through this agent's own persistent
  tier at the job's step, so with its storage options (S3 endpoint, credentials, region) and
  never from a cached listing (a request naming another URL is refused).

No source is read past the file's size in the request (the manifest's): a peer's answer is
read raw with ``Accept-Encoding: identity`` and stopped at that size
(:meth:`~.replicator.PeerClient.fetch_to`), a persistent read stops there too, and a local
file of another size is not linked. A local file is opened without following a symbolic link
anywhere below the memory folder and must be a regular file
(:func:`~tierwatch.agent.fsutil.open_regular`); the hard link made is checked to be that very
file.

Each staged file is checked (size and xxh3-64) before it is renamed into place; a file already
staged with the right checksum is reused. A mismatch, a missing file or an unreachable source
becomes a ``failed`` :class:`~tierwatch.agent.protocol.CheckpointEvent` naming the file and the
source, and the next source is tried. Staging a step first removes the job's other restore
folders. Two local ranks may stage at once: each target file has its own lock.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tierwatch.agent.checkpoint.format.layout import (
    MemoryLayout,
    check_file_name,
    check_job_id,
    check_node_name,
    check_step,
    parse_step_dirname,
)
from tierwatch.agent.checkpoint.format.manifest import CHUNK, FileEntry, verify_file
from tierwatch.agent.checkpoint.tierstore.persister import PersistentTier
from tierwatch.agent.checkpoint.tierstore.replicator import PeerClient, PeerError
from tierwatch.agent.fsutil import open_regular
from tierwatch.agent.protocol import CheckpointEvent, utcnow
from tierwatch.agent.urlsafe import redact_url

log = logging.getLogger(__name__)

EventSink = Callable[[CheckpointEvent], None]


class StageSource(BaseModel):
    """One place a file can be read from.

    Attributes:
        tier: ``memory`` | ``peer`` | ``persistent``.
        holder: The node that holds the copy (``persistent`` for the persistent tier).
        url: The holder agent's URL, or the persistent step's fsspec URL.
        src: The node whose rank wrote the file (needed for tier ``peer``: the replica folder).
    """

    model_config = ConfigDict(extra="forbid")

    tier: Literal["memory", "peer", "persistent"]
    holder: Annotated[str, Field(min_length=1, max_length=128)]
    url: Annotated[str, Field(max_length=2000)] = ""
    src: Annotated[str, Field(max_length=128)] | None = None


class StageFile(BaseModel):
    """One file to stage: name, size (bytes), xxh3-64 and the sources to try in order."""

    model_config = ConfigDict(extra="forbid")

    name: str
    size: Annotated[int, Field(ge=0)]
    xxh3: Annotated[str, Field(pattern=r"^[0-9a-f]{16}$")]
    sources: Annotated[list[StageSource], Field(max_length=64)]


class StageRequest(BaseModel):
    """Body of ``POST /v1/ckpt/jobs/{job_id}/stage``."""

    model_config = ConfigDict(extra="forbid")

    step: Annotated[int, Field(ge=0)]
    files: Annotated[list[StageFile], Field(max_length=65536)]


class StageError(Exception):
    """One source failed for one file (the message names both)."""


class RestoreStager:
    """Stages restore files into this node's memory folder.

    Args:
        layout: The node's memory folder.
        node: This node's name.
        peer: Client for other agents' peer endpoints (None: no server registry, other
            holders cannot be asked).
        emit: Receives a ``failed`` event per bad source.
        persistent: This agent's persistent tier, which reads ``persistent`` sources (None:
            such sources fail with a message saying so).
    """

    def __init__(
        self,
        layout: MemoryLayout,
        *,
        node: str,
        peer: PeerClient | None,
        emit: EventSink,
        persistent: PersistentTier | None = None,
    ) -> None:
        self.layout = layout
        self.node = node
        self.peer = peer
        self.emit = emit
        self.persistent = persistent
        self._locks: dict[Path, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._origin: dict[Path, tuple[str, str]] = {}

    def _lock(self, path: Path) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(path, threading.Lock())

    def stage(self, job_id: str, request: StageRequest) -> dict[str, Any]:
        """Stage every file of ``request``.

        Returns:
            ``{ok, dir, files: [{name, tier, holder}], errors: [str]}``: ``ok`` when every file
            is staged and verified; ``errors`` has one line per failed source or file.

        Raises:
            LayoutError: a bad job id, step, file or node name (nothing staged).
        """
        check_job_id(job_id)
        step = check_step(request.step)
        for f in request.files:
            check_file_name(f.name)
            for s in f.sources:
                if s.tier != "persistent":
                    check_node_name(s.holder)
                if s.src is not None:
                    check_node_name(s.src)
        target_dir = self.layout.restore_dir(job_id, step)
        with self._lock(target_dir.parent):
            self._remove_other_steps(target_dir.parent, step)
            target_dir.mkdir(parents=True, exist_ok=True)
        staged: list[dict[str, str]] = []
        errors: list[str] = []
        for f in request.files:
            with self._lock(target_dir / f.name):
                got = self._stage_one(job_id, step, f, target_dir, errors)
            if got is not None:
                staged.append({"name": f.name, "tier": got[0], "holder": got[1]})
        return {
            "ok": len(staged) == len(request.files),
            "dir": str(target_dir),
            "files": staged,
            "errors": errors,
        }

    def _remove_other_steps(self, job_restore: Path, step: int) -> None:
        if not job_restore.is_dir():
            return
        for p in job_restore.iterdir():
            other = parse_step_dirname(p.name)
            if other is not None and other != step:
                shutil.rmtree(p, ignore_errors=True)
                with self._locks_lock:
                    for k in [k for k in self._origin if k.parent == p]:
                        del self._origin[k]

    def _stage_one(
        self, job_id: str, step: int, f: StageFile, target_dir: Path, errors: list[str]
    ) -> tuple[str, str] | None:
        target = target_dir / f.name
        entry = FileEntry(name=f.name, size=f.size, xxh3=f.xxh3)
        if target.exists() and verify_file(target, entry) is None:
            return self._origin.get(target, ("memory", self.node))
        for source in f.sources:
            tmp = target_dir / f".tmp-stage-{f.name}.{uuid.uuid4().hex[:12]}"
            try:
                self._fetch(job_id, step, f, source, tmp)
                problem = verify_file(tmp, entry)
                if problem is not None:
                    raise StageError(problem)
                os.replace(tmp, target)
            except (StageError, PeerError, OSError) as exc:
                tmp.unlink(missing_ok=True)
                where = f"{source.tier}:{source.holder}" + (
                    f" (replica of {source.src})" if source.tier == "peer" and source.src else ""
                )
                message = f"stage {f.name} of step {step} from {where}: {exc}"
                errors.append(message)
                log.warning("%s", message)
                self.emit(
                    CheckpointEvent(
                        job_id=job_id,
                        step=step,
                        tier=source.tier,
                        kind="failed",
                        rank=_rank_of(f.name),
                        ts=utcnow(),
                        message=message[:2000],
                    )
                )
                continue
            origin = (source.tier, source.holder)
            self._origin[target] = origin
            return origin
        if not f.sources:
            errors.append(f"stage {f.name} of step {step}: no sources given")
        else:
            errors.append(f"stage {f.name} of step {step}: every source failed")
        return None

    def _fetch(self, job_id: str, step: int, f: StageFile, source: StageSource, tmp: Path) -> None:
        if source.tier == "persistent":
            self._fetch_persistent(job_id, step, f, source, tmp)
            return
        if source.holder == self.node:
            if source.tier == "memory":
                path = self.layout.step_dir(job_id, step) / f.name
            else:
                if not source.src:
                    raise StageError("a peer source needs src (the node whose rank wrote it)")
                path = self.layout.replica_step_dir(source.src, job_id, step) / f.name
            self._link_local(path, f.size, tmp)
            return
        if self.peer is None:
            raise StageError(
                "this agent has no server registry to find and authenticate peers with, so "
                f"it cannot read from {source.holder}"
            )
        # the holder's address is the server registry's, whatever URL the request named
        url = self.peer.url_of(source.holder)
        with open(tmp, "wb") as out:
            self.peer.fetch_to(
                url=url,
                holder=source.holder,
                job_id=job_id,
                step=step,
                name=f.name,
                tier=source.tier,
                src=source.src,
                out=out,
                max_bytes=f.size,
            )

    def _fetch_persistent(
        self, job_id: str, step: int, f: StageFile, source: StageSource, tmp: Path
    ) -> None:
        if self.persistent is None:
            raise StageError("this agent has no persistent tier to read from")
        # only this agent's own tier, at the job's own step: a URL in the request is not
        # followed (it could name another job's folder, or another store)
        own = self.persistent.step_url(job_id, step)
        shown = self.persistent.shown_step_url(job_id, step)
        if source.url and source.url.rstrip("/") not in (own.rstrip("/"), shown.rstrip("/")):
            raise StageError(
                f"a persistent source must be this agent's own tier ({shown}); "
                f"{redact_url(source.url)} is not read"
            )
        url = f"{own.rstrip('/')}/{f.name}"
        try:
            with self.persistent.open_url(url) as src, open(tmp, "wb") as out:
                _copy_at_most(src, out, f.size, what=url)
        except FileNotFoundError:
            raise StageError(f"missing: {url} does not exist") from None

    def _link_local(self, path: Path, size: int, tmp: Path) -> None:
        """Hard-link (or copy) a file of this node's memory folder to ``tmp``.

        The file is opened without following a link below the memory folder and must be a
        regular file of ``size`` bytes; the link is made to the name (never through a link)
        and kept only if it is the very file opened, else the bytes are copied from the open
        file.

        Raises:
            StageError: missing, a link, not a regular file, or not ``size`` bytes.
        """
        try:
            src = open_regular(path, root=self.layout.root)
        except FileNotFoundError:
            raise StageError(f"missing: {path} does not exist") from None
        except OSError as exc:
            raise StageError(str(exc)) from None
        with src:
            st = os.fstat(src.fileno())
            if st.st_size != size:
                raise StageError(f"{path}: size {st.st_size} bytes, manifest says {size}")
            try:
                os.link(path, tmp, follow_symlinks=False)
                linked = os.lstat(tmp)
                if (linked.st_dev, linked.st_ino) == (st.st_dev, st.st_ino):
                    return
                tmp.unlink()  # the name changed since it was opened: copy what was opened
            except OSError:
                tmp.unlink(missing_ok=True)
            with open(tmp, "wb") as out:
                _copy_at_most(src, out, size, what=str(path))


def _copy_at_most(src: Any, out: Any, size: int, *, what: str) -> int:
    """Copy ``src`` to ``out`` in chunks, stopping with an error once more than ``size``
    bytes arrive.

    Returns:
        Bytes copied.

    Raises:
        StageError: ``src`` holds more than ``size`` bytes.
    """
    n = 0
    while chunk := src.read(CHUNK):
        n += len(chunk)
        if n > size:
            raise StageError(
                f"{what}: more than the manifest's {size} bytes; the read was stopped after {n}"
            )
        out.write(chunk)
    return n


def _rank_of(name: str) -> int | None:
    if name.startswith("__") and name.endswith(".distcp"):
        head = name[2:].split("_", 1)[0]
        return int(head) if head.isdigit() else None
    return None

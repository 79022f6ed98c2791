"""The agent's side of the memory tier: its folder, budget, peer replicas and progress files.

:class:`MemoryStore` owns one node's memory folder (see
:mod:`~tierwatch.agent.checkpoint.format.layout`). It

- writes ``agent.json`` (who hosts this folder, where peers reach it);
- accounts the bytes the folder holds against the memory budget (hard links counted once,
  uploads in progress counted by the size they announced, which is reserved before a byte is
  written; a leftover partial upload counts by its size on disk);
- receives peer replicas as a stream (:meth:`MemoryStore.receive_replica`): an upload must
  announce its size (the Content-Length; 411 without), which is reserved against the budget
  (507 when it does not fit) before anything is written; the bytes go to a temporary name
  while being hashed (never more than announced: 413), the size and xxh3-64 are checked,
  then the file is renamed into ``replicas/<src>/<job>/step-<N>/``; a commit marker
  received for step N evicts that source's older replicas of the job that the marker's
  ``retain["peer"]`` does not keep and no pending restore request of the job names (a
  *pinned* step, :meth:`pinned_steps`); a replica folder holds one save of its step: files of
  another save are refused (409) where a rank is committed, and so are a dead timeline's
  (docs/checkpointing.md "Save identity");
- lists what it can supply for a restore (:meth:`MemoryStore.available`), from manifests only;
- opens the files it serves (:meth:`MemoryStore.open_file`) without following a symbolic link
  anywhere below the memory folder (the ranks can write there): only regular files are served;
- keeps the tier worker's progress in ``<step>/.tier-<r>.json``;
- pins the memory steps the tier worker is reading (:meth:`MemoryStore.pin_transfer`), so the
  ranks' memory retention keeps them until the transfer ends
  (:mod:`~tierwatch.agent.checkpoint.format.inflight`).

No torch here, and nothing that needs the network.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from tierwatch.agent.checkpoint.format.agreement import is_dead, transfer_refusal
from tierwatch.agent.checkpoint.format.inflight import (
    DEFAULT_LEASE_S,
    pins_lock,
    write_agent_pins,
)
from tierwatch.agent.checkpoint.format.layout import (
    MemoryLayout,
    check_file_name,
    check_job_id,
    check_node_name,
    check_step,
    commit_name,
    manifest_name,
    parse_commit_name,
    parse_manifest_name,
    parse_step_dirname,
    step_dirname,
    tier_progress_name,
)
from tierwatch.agent.checkpoint.format.manifest import (
    CommitMarker,
    Manifest,
    ManifestError,
    load_manifest,
    read_commit,
    read_manifest,
)
from tierwatch.agent.checkpoint.format.rollback import Timeline, describe_pins
from tierwatch.agent.fsutil import UnsafePathError, atomic_write_json, open_dir, open_regular
from tierwatch.agent.protocol import utcnow

log = logging.getLogger(__name__)

PinSource = Callable[[str], Mapping[int, list[int]]]
UPLOAD_TMP_PREFIX = ".tmp-upload-"


class StoreError(Exception):
    """A request the memory store refuses.

    Attributes:
        status: The HTTP status that fits (409 checksum/size mismatch, 422 bad name,
            507 over the memory budget, 500 an I/O error).
        message: What went wrong and what to do about it.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ReceivedFile:
    """A replica file the store accepted.

    Attributes:
        path: Where it now lives.
        size: Bytes.
        xxh3: Its xxh3-64 hex digest.
        evicted: ``(step, ranks)`` of replica steps evicted because this was a commit marker.
    """

    path: Path
    size: int
    xxh3: str
    evicted: list[tuple[int, list[int]]]


class MemoryStore:
    """One node's memory folder, as the agent sees it.

    Args:
        root: The memory folder (``--memory-dir``); created if missing.
        node: This node's name.
        budget_bytes: Most bytes the folder may hold before replica uploads are refused (507).
        pins: job id → {step: request ids} of the job's pending restore requests (the
            agent's :meth:`RequestStore.pinned_steps
            <tierwatch.agent.checkpoint.tierstore.requests.RequestStore.pinned_steps>`);
            None: no step is pinned.
        pin_lease_s: Seconds a pin of a step in transfer holds unless renewed
            (:meth:`refresh_pins`); an agent that dies mid-transfer holds memory that long.

    Raises:
        OSError: the folder cannot be created.
    """

    def __init__(
        self,
        root: Path,
        *,
        node: str,
        budget_bytes: int,
        pins: PinSource | None = None,
        pin_lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.layout = MemoryLayout(root)
        self.root = self.layout.root
        self.node = check_node_name(node)
        self.budget_bytes = budget_bytes
        self._pins = pins
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}
        self._progress_lock = threading.Lock()
        self._agent_info: dict[str, Any] | None = None
        self._agent_lock = threading.Lock()
        self.pin_lease_s = pin_lease_s
        self._transfers: dict[str, Counter[tuple[int, str]]] = {}
        self._transfers_lock = threading.Lock()

    # -- identity ------------------------------------------------------------------------
    def write_agent_file(
        self, *, peer_url: str, persistent_url: str, started_at: str | None = None
    ) -> dict[str, Any]:
        """Write ``agent.json`` atomically.

        Returns:
            What was written: ``{node, peer_url, memory_budget_bytes, persistent_url, pid,
            started_at}``.

        Raises:
            OSError: the file cannot be written.
        """
        info = {
            "node": self.node,
            "peer_url": peer_url,
            "memory_budget_bytes": self.budget_bytes,
            "persistent_url": persistent_url,
            "pid": os.getpid(),
            "started_at": started_at or utcnow().isoformat(),
        }
        atomic_write_json(self.layout.agent_file, info)
        self._agent_info = info
        return info

    def ensure_agent_file(self) -> bool:
        """Rewrite ``agent.json`` (and recreate the memory folder) when it went missing, e.g.
        the folder was deleted while the agent runs; the content is what
        :meth:`write_agent_file` last wrote. Nothing happens before that first write.

        Returns:
            Whether it was rewritten.

        Raises:
            OSError: it cannot be written.
        """
        info = self._agent_info
        if info is None or self.layout.agent_file.exists():
            return False
        with self._agent_lock:
            if self.layout.agent_file.exists():
                return False
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.layout.agent_file, info)
        log.warning("%s was missing (memory folder deleted?): rewritten", self.layout.agent_file)
        return True

    # -- budget --------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes the memory folder holds (apparent sizes; a hard-linked file counts once;
        uploads in progress count by the size they announced, not their partial file; a
        partial upload file no upload of this store owns, e.g. one a killed agent left,
        counts by its size)."""
        with self._lock:
            return self._disk_bytes(set(self._reserved)) + sum(self._reserved.values())

    def _disk_bytes(self, active: set[str]) -> int:
        """Bytes on disk, less the partial files of the uploads in ``active`` (their keys),
        which their reservations count instead."""
        seen: set[tuple[int, int]] = set()
        total = 0
        stack = [self.root]
        while stack:
            d = stack.pop()
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(Path(e.path))
                        continue
                    if e.name.startswith(UPLOAD_TMP_PREFIX) and e.name.rsplit(".", 1)[-1] in active:
                        continue
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                total += st.st_size
        return total

    def pinned_steps(self, job_id: str) -> dict[int, list[int]]:
        """The job's steps pinned by pending restore requests: step → request ids. Retention
        keeps them in every tier this agent manages (replicas; persistent on the node of rank
        0) until the request is retired or expires. An unreadable request folder pins
        nothing (its files are skipped with a warning)."""
        if self._pins is None:
            return {}
        try:
            return dict(self._pins(job_id))
        except (OSError, ValueError) as exc:
            log.warning("restore requests of %s unreadable (%s): no step pinned", job_id, exc)
            return {}

    def _over_budget(self, what: str, size: int, used: int, job_id: str) -> StoreError:
        pins = self.pinned_steps(job_id)
        pinned = (
            (
                f"; {job_id} also keeps {describe_pins(pins)} while those restore requests "
                "are pending"
            )
            if pins
            else ""
        )
        return StoreError(
            507,
            f"{what}: {size} bytes do not fit in node {self.node}'s memory budget "
            f"({used} of {self.budget_bytes} bytes used{pinned}); raise --memory-budget on "
            f"{self.node}, lower the job's retention, or free its memory folder "
            "(tierwatch-agent ckpt gc)",
        )

    # -- steps in transfer ---------------------------------------------------------------
    @contextmanager
    def pin_transfer(
        self, job_id: str, step: int, tier: str, ranks: Iterable[int]
    ) -> Iterator[bool]:
        """Pin memory step ``step`` of ``job_id`` while ``tier``'s transfer reads it.

        Under the job's pin lock, checks that every rank in ``ranks`` still has its commit
        marker of the step and, if so, adds the pin to ``jobs/<job>/.agent-pins.json``; the
        ranks' memory retention keeps pinned steps. The pin goes when the block ends (also on
        an error). docs/checkpointing.md, "Backpressure".

        Yields:
            True when the step is pinned; False when a rank evicted it already (read nothing).

        Raises:
            OSError: the pin file cannot be written (nothing is pinned).
        """
        job_dir = self.layout.job_dir(job_id)
        step_dir = self.layout.step_dir(job_id, step)
        key = (step, tier)
        with pins_lock(job_dir):
            if not all((step_dir / commit_name(r)).exists() for r in ranks):
                pinned = False
            else:
                with self._transfers_lock:
                    held = self._transfers.setdefault(job_id, Counter())
                    held[key] += 1
                    try:
                        self._write_pins(job_id)
                    except OSError:
                        held[key] -= 1
                        raise
                pinned = True
        try:
            yield pinned
        finally:
            if pinned:
                with pins_lock(job_dir), self._transfers_lock:
                    held = self._transfers[job_id]
                    held[key] -= 1
                    if held[key] <= 0:
                        del held[key]
                    try:
                        self._write_pins(job_id)
                    except OSError as exc:  # the lease runs out on its own
                        log.warning("cannot unpin step %d of %s: %s", step, job_id, exc)
                    if not held:
                        self._transfers.pop(job_id, None)

    def transfer_pins(self, job_id: str) -> dict[int, list[str]]:
        """Steps of ``job_id`` this agent pins now for its transfers: step → tiers."""
        with self._transfers_lock:
            out: dict[int, set[str]] = {}
            for (step, tier), n in self._transfers.get(job_id, Counter()).items():
                if n > 0:
                    out.setdefault(step, set()).add(tier)
        return {s: sorted(t) for s, t in sorted(out.items())}

    def refresh_pins(self) -> None:
        """Renew the lease of every job's pins (the tier worker calls this every third of
        :attr:`pin_lease_s`). A pin file that cannot be written is logged; its lease may
        then run out under a long transfer."""
        with self._transfers_lock:
            jobs = [j for j, held in self._transfers.items() if held]
        for job_id in jobs:
            try:
                with pins_lock(self.layout.job_dir(job_id)), self._transfers_lock:
                    self._write_pins(job_id)
            except OSError as exc:
                log.warning("cannot renew the pins of %s: %s", job_id, exc)

    def _write_pins(self, job_id: str) -> None:
        """Write the job's pin file from :attr:`_transfers` (caller holds both locks)."""
        steps: dict[int, set[str]] = {}
        for (step, tier), n in self._transfers.get(job_id, Counter()).items():
            if n > 0:
                steps.setdefault(step, set()).add(tier)
        write_agent_pins(
            self.layout.job_dir(job_id),
            node=self.node,
            steps={s: sorted(t) for s, t in steps.items()},
            lease_s=self.pin_lease_s,
        )

    # -- replicas ------------------------------------------------------------------------
    def begin_replica(
        self,
        *,
        src_node: str,
        job_id: str,
        step: int,
        name: str,
        xxh3: str | None,
        size: int | None,
    ) -> ReplicaUpload:
        """Start receiving one replica file (see :class:`ReplicaUpload`).

        ``size`` is reserved against the memory budget before anything is written, and
        counts in :meth:`used_bytes` until the upload ends; the upload can never write more.

        Args:
            src_node: The node whose rank wrote the file.
            job_id, step, name: Where it belongs (validated with the ``check_*`` rules).
            xxh3: Expected xxh3-64 hex digest (required).
            size: The file's size in bytes (the request's Content-Length; required: None is
                refused).

        Raises:
            StoreError: 411 no ``size``, 422 bad names, size or checksum header, 507 ``size``
                does not fit in the budget.
        """
        self.check_names(src_node=src_node, job_id=job_id, step=step, name=name)
        if size is None:
            raise StoreError(
                411,
                "a replica upload needs Content-Length (the file's size in bytes): the agent "
                "reserves it against its memory budget before it stores a byte, so chunked "
                "uploads are refused",
            )
        if size < 0:
            raise StoreError(422, f"Content-Length {size}: must be a size in bytes (0 or more)")
        if not xxh3 or len(xxh3) != 16 or any(c not in "0123456789abcdef" for c in xxh3):
            raise StoreError(
                422,
                "header X-Tierwatch-Xxh3 must be the file's xxh3-64 digest "
                "as 16 lowercase hex digits",
            )
        what = f"replica {src_node}/{job_id}/{step_dirname(step)}/{name}"
        self._refuse_over_committed(what, src_node, job_id, step, name, xxh3)
        key = uuid.uuid4().hex
        # measure, check and reserve at once, so concurrent uploads cannot overbook (an
        # upload that ends meanwhile is counted twice, never not at all)
        with self._lock:
            used = self._disk_bytes(set(self._reserved)) + sum(self._reserved.values())
            if size > self.budget_bytes - used:
                raise self._over_budget(what, size, used, job_id)
            self._reserved[key] = size
        return ReplicaUpload(
            self,
            key=key,
            what=what,
            src_node=src_node,
            job_id=job_id,
            step=step,
            name=name,
            xxh3=xxh3,
            size=size,
        )

    def receive_replica(
        self,
        *,
        src_node: str,
        job_id: str,
        step: int,
        name: str,
        chunks: Iterable[bytes],
        xxh3: str | None,
        size: int | None,
    ) -> ReceivedFile:
        """Store one replica file from an iterable of chunks (:meth:`begin_replica`, write
        every chunk, finish).

        Raises:
            StoreError: as :meth:`begin_replica` and :meth:`ReplicaUpload.finish`.
        """
        upload = self.begin_replica(
            src_node=src_node, job_id=job_id, step=step, name=name, xxh3=xxh3, size=size
        )
        try:
            for chunk in chunks:
                upload.write(chunk)
            return upload.finish()
        finally:
            upload.abort()

    def _refuse_over_committed(
        self, what: str, src_node: str, job_id: str, step: int, name: str, xxh3: str
    ) -> None:
        """Refuse a data file (shard, ``.metadata``) that a committed rank's manifest in the
        replica folder lists with other bytes: it is another save's, and a replica folder
        never takes a second save over a committed one (docs/checkpointing.md "Save
        identity"). The same bytes again (a retried push) are taken.

        Raises:
            StoreError: 409, naming the committed save.
        """
        if parse_commit_name(name) is not None or parse_manifest_name(name) is not None:
            return  # checked on arrival, from their content (ReplicaUpload.finish)
        d = self.layout.replica_step_dir(src_node, job_id, step)
        for m in manifests_in(d, job_id, step):
            if not (d / commit_name(m.rank)).exists():
                continue
            listed = next((f for f in m.files if f.name == name), None)
            if listed is not None and listed.xxh3 != xxh3:
                raise StoreError(
                    409,
                    f"{what}: step {step} here is committed from save "
                    f"{m.save_id[:12] or 'legacy'} (rank {m.rank}), whose {name} differs; "
                    "a tier never takes a second save of one step number, the committed one "
                    "stays",
                )

    def known_fences(self, src_node: str, job_id: str) -> set[tuple[int, int]]:
        """Rollback fences of the job this node knows: its ranks' ``timeline.json`` and
        every manifest of the replicas it holds for ``src_node``."""
        fences = set(Timeline.read(self.layout.timeline_file(job_id)).fences)
        job_dir = self.layout.replica_job_dir(src_node, job_id)
        for s in steps_in(job_dir):
            for m in manifests_in(job_dir / step_dirname(s), job_id, s):
                fences.update(m.fences)
        return fences

    def _release(self, key: str) -> None:
        with self._lock:
            self._reserved.pop(key, None)

    def evict_replicas(
        self, *, src_node: str, job_id: str, newest: int, keep: set[int]
    ) -> list[tuple[int, list[int]]]:
        """Remove replica steps of (src_node, job) older than ``newest`` not in ``keep`` and
        not pinned by a pending restore request of the job (:meth:`pinned_steps`).

        Returns:
            ``(step, ranks whose manifest it held)`` for each removed step.
        """
        job_dir = self.layout.replica_job_dir(src_node, job_id)
        steps = steps_in(job_dir)
        pins = self.pinned_steps(job_id) if any(s < newest and s not in keep for s in steps) else {}
        evicted = []
        for step in steps:
            if step >= newest or step in keep:
                continue
            if step in pins:
                log.debug(
                    "replica %s/%s/step-%d kept: pinned by restore request(s) %s",
                    src_node,
                    job_id,
                    step,
                    pins[step],
                )
                continue
            d = job_dir / step_dirname(step)
            ranks = sorted(r for p in d.iterdir() if (r := parse_manifest_name(p.name)) is not None)
            shutil.rmtree(d, ignore_errors=True)
            evicted.append((step, ranks))
        return evicted

    def evict_replicas_after(
        self, *, src_node: str, job_id: str, step: int
    ) -> list[tuple[int, list[int]]]:
        """Remove replica steps of (src_node, job) above ``step`` (a rollback to ``step``).

        Returns:
            ``(step, ranks whose manifest it held)`` for each removed step.

        Raises:
            LayoutError: a bad name.
        """
        job_dir = self.layout.replica_job_dir(src_node, job_id)
        evicted = []
        for s in steps_in(job_dir):
            if s <= step:
                continue
            d = job_dir / step_dirname(s)
            try:
                ranks = sorted(
                    r for p in d.iterdir() if (r := parse_manifest_name(p.name)) is not None
                )
            except OSError:
                ranks = []
            shutil.rmtree(d, ignore_errors=True)
            evicted.append((s, ranks))
        return evicted

    def delete_replica_step(self, *, src_node: str, job_id: str, step: int) -> bool:
        """Remove ``replicas/<src>/<job>/step-<N>``.

        Returns:
            Whether it existed.

        Raises:
            LayoutError: a bad name.
        """
        d = self.layout.replica_step_dir(src_node, job_id, step)
        if not d.is_dir():
            return False
        shutil.rmtree(d)
        return True

    def check_names(
        self, *, job_id: str, step: int, name: str | None = None, src_node: str | None = None
    ) -> None:
        """Validate path components (raises StoreError 422 naming the bad one)."""
        try:
            check_job_id(job_id)
            check_step(step)
            if name is not None:
                check_file_name(name)
            if src_node is not None:
                check_node_name(src_node)
        except ValueError as exc:
            raise StoreError(422, str(exc)) from None

    def file_path(self, *, job_id: str, step: int, name: str, tier: str, src: str | None) -> Path:
        """Path of a file this agent holds in its memory tier or in a replica, checked to be
        a regular file reached without a symbolic link (a missing file's path is returned:
        the caller says it is missing). The check is made now and the caller opens the path
        later; :meth:`open_file` opens it in the same step (no window between the two).

        Raises:
            StoreError: 422 bad names or tier, or tier ``peer`` without ``src``; 403 the file,
                its step folder or a folder above is a symbolic link, or it is not a regular
                file.
        """
        path = self._tier_path(job_id=job_id, step=step, name=name, tier=tier, src=src)
        try:
            with open_regular(path, root=self.root):
                pass
        except UnsafePathError as exc:
            raise StoreError(403, f"{self.node} refuses to serve {name}: {exc}") from None
        except OSError:
            pass  # missing or unreadable: the caller answers for it
        return path

    def open_file(
        self, *, job_id: str, step: int, name: str, tier: str, src: str | None
    ) -> tuple[BinaryIO, int]:
        """Open a file this agent holds in its memory tier (tier ``memory``) or in a replica
        of ``src`` (tier ``peer``), to serve it: every folder below the memory folder and the
        file are opened with ``O_NOFOLLOW`` and the file must be regular
        (:func:`~tierwatch.agent.fsutil.open_regular`).

        Returns:
            The open file (the caller closes it) and its size in bytes (from ``fstat``).

        Raises:
            StoreError: 422 bad names or tier; 404 no such file; 403 a symbolic link or not a
                regular file; 500 it cannot be opened.
        """
        path = self._tier_path(job_id=job_id, step=step, name=name, tier=tier, src=src)
        where = "memory tier" if tier == "memory" else f"replicas of {src}"
        try:
            f = open_regular(path, root=self.root)
        except UnsafePathError as exc:
            raise StoreError(403, f"{self.node} refuses to serve {name}: {exc}") from None
        except FileNotFoundError:
            raise StoreError(
                404, f"{name} of {job_id} step {step} is not in {self.node}'s {where}"
            ) from None
        except OSError as exc:
            raise StoreError(500, f"{name} of {job_id} step {step}: cannot open ({exc})") from None
        return f, os.fstat(f.fileno()).st_size

    def _tier_path(self, *, job_id: str, step: int, name: str, tier: str, src: str | None) -> Path:
        self.check_names(job_id=job_id, step=step, name=name, src_node=src)
        if tier == "memory":
            return self.layout.step_dir(job_id, step) / name
        if tier == "peer":
            if not src:
                raise StoreError(422, "tier=peer needs src=<node whose rank wrote the file>")
            return self.layout.replica_step_dir(src, job_id, step) / name
        raise StoreError(422, f"tier must be memory or peer, not {tier!r}")

    # -- restore listing -----------------------------------------------------------------
    def available(self, job_id: str, url: str) -> list[dict[str, Any]]:
        """Manifests this node can supply for ``job_id`` (memory and its replicas).

        Args:
            job_id: The job.
            url: This agent's advertise URL (the entries' ``url``).

        Returns:
            ``[{tier, holder, url, src, step, rank, manifest}]``; only manifests that parse,
            no file data read.
        """
        check_job_id(job_id)
        entries: list[dict[str, Any]] = []
        job_dir = self.layout.job_dir(job_id)
        for step in steps_in(job_dir):
            for m in manifests_in(job_dir / step_dirname(step), job_id, step):
                entries.append(
                    {
                        "tier": "memory",
                        "holder": self.node,
                        "url": url,
                        "src": m.node,
                        "step": step,
                        "rank": m.rank,
                        "manifest": m.model_dump(mode="json"),
                    }
                )
        rdir = self.layout.replicas_dir
        srcs = sorted(p.name for p in rdir.iterdir() if p.is_dir()) if rdir.is_dir() else []
        for src in srcs:
            try:
                job_dir = self.layout.replica_job_dir(src, job_id)
            except ValueError:
                continue
            for step in steps_in(job_dir):
                for m in manifests_in(job_dir / step_dirname(step), job_id, step):
                    entries.append(
                        {
                            "tier": "peer",
                            "holder": self.node,
                            "url": url,
                            "src": src,
                            "step": step,
                            "rank": m.rank,
                            "manifest": m.model_dump(mode="json"),
                        }
                    )
        return entries

    # -- progress ------------------------------------------------------------------------
    def read_progress(self, step_dir: Path, rank: int) -> dict[str, Any]:
        """The tier worker's progress on rank ``rank`` of one step ({} when none/unreadable)."""
        try:
            data = json.loads((step_dir / tier_progress_name(rank)).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def update_progress(
        self, step_dir: Path, rank: int, change: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        """Read-modify-write ``.tier-<r>.json`` under a lock (atomic rename, no fsync).

        Returns:
            The new progress.

        Raises:
            OSError: it cannot be written (e.g. the trainer removed the step meanwhile).
        """
        with self._progress_lock:
            progress = self.read_progress(step_dir, rank)
            change(progress)
            atomic_write_json(step_dir / tier_progress_name(rank), progress, fsync=False)
            return progress


class ReplicaUpload:
    """One replica file being received: bytes go to ``.tmp-upload-<name>.<id>`` in the
    replica step folder while being hashed; :meth:`finish` checks size and checksum and renames
    the file into place. Nothing is left behind on any error or on :meth:`abort`.

    The size announced is reserved in the store until the upload ends; a write past it is
    refused (413). The replica folders are opened (and created) component by component
    without following a symbolic link (:func:`~tierwatch.agent.fsutil.open_dir`), and the
    temporary file is created and renamed relative to that folder's descriptor, so a link a
    rank planted under ``replicas/`` cannot redirect the write.

    Created by :meth:`MemoryStore.begin_replica`.
    """

    def __init__(
        self,
        store: MemoryStore,
        *,
        key: str,
        what: str,
        src_node: str,
        job_id: str,
        step: int,
        name: str,
        xxh3: str,
        size: int,
    ) -> None:
        self.store = store
        self.key = key
        self.what = what
        self.src_node, self.job_id, self.step, self.name = src_node, job_id, step, name
        self.xxh3 = xxh3
        self.size = size
        self.written = 0
        self.dir = store.layout.replica_step_dir(src_node, job_id, step)
        self.tmp_name = f"{UPLOAD_TMP_PREFIX}{name}.{key}"
        self.tmp = self.dir / self.tmp_name
        self._hash = xxhash.xxh3_64()
        self._file: BinaryIO | None = None
        self._dir_fd: int | None = None
        self._done = False

    def write(self, chunk: bytes) -> None:
        """Append one chunk.

        Raises:
            StoreError: 413 more bytes than the size announced, 507 the disk is full, 500
                another write error or a symbolic link in the replica folders (the
                temporary file is removed).
        """
        try:
            if self.written + len(chunk) > self.size:
                raise StoreError(
                    413,
                    f"{self.what}: more than the {self.size} bytes its Content-Length "
                    "announced (and the agent reserved); nothing was stored",
                )
            if self._file is None:
                self._dir_fd = open_dir(self.store.root, self.dir, create=True)
                fd = os.open(
                    self.tmp_name,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    0o666,
                    dir_fd=self._dir_fd,
                )
                self._file = os.fdopen(fd, "w+b")
            self.written += len(chunk)
            self._hash.update(chunk)
            self._file.write(chunk)
        except UnsafePathError as exc:
            self.abort()
            raise StoreError(500, f"{self.what}: cannot write: {exc}") from None
        except OSError as exc:
            self.abort()
            raise StoreError(
                507 if _is_full(exc) else 500, f"{self.what}: cannot write in {self.dir} ({exc})"
            ) from None
        except StoreError:
            self.abort()
            raise

    def finish(self) -> ReceivedFile:
        """Verify and rename into place; a commit marker evicts older replicas.

        Returns:
            The stored file and what was evicted.

        Raises:
            StoreError: 409 size or checksum mismatch or an invalid commit marker, 500 an I/O
                error.
        """
        try:
            if self._file is None:  # an empty body
                self.write(b"")
            assert self._file is not None
            try:
                self._file.flush()
            except OSError as exc:
                raise StoreError(
                    507 if _is_full(exc) else 500,
                    f"{self.what}: cannot write in {self.dir} ({exc})",
                ) from None
            digest = self._hash.hexdigest()
            if self.written != self.size:
                raise StoreError(
                    409,
                    f"{self.what}: received {self.written} bytes, "
                    f"Content-Length said {self.size}; nothing was stored",
                )
            if digest != self.xxh3:
                raise StoreError(
                    409,
                    f"{self.what}: checksum {digest} of the received bytes "
                    f"does not match X-Tierwatch-Xxh3 {self.xxh3}; nothing was "
                    "stored",
                )
            marker: CommitMarker | None = None
            if parse_manifest_name(self.name) is not None:
                self._check_manifest()
            if parse_commit_name(self.name) is not None:
                try:
                    marker = read_commit(self._content(), where=self.what)
                except (ManifestError, OSError) as exc:
                    raise StoreError(409, str(exc)) from None
                if marker.job_id != self.job_id or marker.step != self.step:
                    raise StoreError(
                        409,
                        f"{self.what}: the marker is for job {marker.job_id} step {marker.step}",
                    )
                self._check_marker(marker)
            target = self.dir / self.name
            try:
                os.replace(
                    self.tmp_name, self.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd
                )
            except OSError as exc:
                raise StoreError(500, f"{self.what}: cannot rename into place ({exc})") from None
            self._done = True
        finally:
            self.abort()
        evicted: list[tuple[int, list[int]]] = []
        if marker is not None:
            evicted = self.store.evict_replicas(
                src_node=self.src_node,
                job_id=self.job_id,
                newest=self.step,
                keep=set(marker.retain.get("peer", [])),
            )
        return ReceivedFile(path=target, size=self.written, xxh3=digest, evicted=evicted)

    def _check_manifest(self) -> None:
        """Refuse a received manifest of another save than the folder's committed one, of
        an older save than the folder's, or of a dead timeline
        (:func:`~tierwatch.agent.checkpoint.format.agreement.transfer_refusal`).

        Raises:
            StoreError: 409.
        """
        try:
            incoming = read_manifest(self._content(), where=self.what)
        except (ManifestError, OSError) as exc:
            raise StoreError(409, f"{self.what}: {exc}") from None
        if (incoming.job_id, incoming.step, manifest_name(incoming.rank)) != (
            self.job_id,
            self.step,
            self.name,
        ):
            raise StoreError(
                409,
                f"{self.what}: the manifest is for job {incoming.job_id} step "
                f"{incoming.step} rank {incoming.rank}",
            )
        present = manifests_in(self.dir, self.job_id, self.step)
        committed = [m.rank for m in present if (self.dir / commit_name(m.rank)).exists()]
        refusal = transfer_refusal(
            incoming,
            present,
            committed_ranks=committed,
            fences=self.store.known_fences(self.src_node, self.job_id),
        )
        if refusal is not None:
            raise StoreError(409, f"{self.what}: {refusal}")

    def _check_marker(self, marker: CommitMarker) -> None:
        """Refuse a commit marker that does not belong to the rank's manifest in the folder
        (another save, no manifest of its save, or a dead timeline): its retention must not
        evict anything.

        Raises:
            StoreError: 409.
        """
        path = self.dir / manifest_name(marker.rank)
        try:
            m = load_manifest(path) if path.exists() else None
        except ManifestError:
            m = None
        if m is None:
            if marker.save_id:
                raise StoreError(
                    409,
                    f"{self.what}: no manifest of rank {marker.rank} of save "
                    f"{marker.save_id[:12]} here (the manifest goes before its marker)",
                )
            return
        if m.save_id != marker.save_id:
            raise StoreError(
                409,
                f"{self.what}: the marker is of save {marker.save_id[:12] or 'legacy'}, the "
                f"manifest here of save {m.save_id[:12] or 'legacy'}",
            )
        if is_dead(m, self.store.known_fences(self.src_node, self.job_id)):
            raise StoreError(
                409,
                f"{self.what}: step {self.step} of timeline {m.timeline} was rolled away; "
                "a late replication from an abandoned timeline evicts nothing",
            )

    def _content(self) -> bytes:
        """The bytes received so far (a manifest or commit marker: small)."""
        assert self._file is not None
        self._file.seek(0)
        return self._file.read()

    def abort(self) -> None:
        """Close and remove the temporary file and release the reservation (idempotent)."""
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
        if self._dir_fd is not None:
            try:
                os.unlink(self.tmp_name, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("%s: cannot remove %s: %s", self.what, self.tmp, exc)
            os.close(self._dir_fd)
            self._dir_fd = None
        self.store._release(self.key)
        try:  # leave no empty replica folders behind a refused first file
            if not self._done and not any(self.dir.iterdir()):
                self.dir.rmdir()
        except OSError:
            pass


def _is_full(exc: OSError) -> bool:
    import errno

    return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def steps_in(job_dir: Path) -> list[int]:
    """Step numbers with a ``step-<N>`` folder in ``job_dir``, ascending."""
    if not job_dir.is_dir():
        return []
    return sorted(
        s for p in job_dir.iterdir() if (s := parse_step_dirname(p.name)) is not None and p.is_dir()
    )


def manifests_in(step_dir: Path, job_id: str, step: int) -> list[Manifest]:
    """Manifests in ``step_dir`` that parse and match (job, step, rank in the name)."""
    out = []
    try:
        names = sorted(p.name for p in step_dir.iterdir())
    except OSError:
        return []
    for name in names:
        rank = parse_manifest_name(name)
        if rank is None:
            continue
        try:
            m = load_manifest(step_dir / name)
        except ManifestError:
            continue
        if m.job_id == job_id and m.step == step and m.rank == rank:
            out.append(m)
    return out

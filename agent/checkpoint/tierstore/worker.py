"""The agent's tier worker: replicate committed steps to peers and upload them to persistent.

Two threads scan ``<memory-dir>/jobs/*/step-*/commit-<r>.json`` (the commit markers the
node's own ranks write) every scan interval, and at once after ``POST /v1/ckpt/notify``:

- the **peer** thread pushes the newest step that every local rank of a job committed to each
  rank's peer targets (:func:`~.replicator.peer_targets`), in the order shards,
  ``.metadata`` (if the rank's manifest lists it), ``manifest-<r>.json``, ``commit-<r>.json``.
  The holder evicts its older replicas when the commit marker arrives.
- the **persistent** thread uploads the local ranks' files and manifests of the newest step
  with ``persist`` true that every local rank committed to
  ``<persistent-url>/<job>/step-<N>/``. The agent whose rank lists ``.metadata`` uploads it
  with them as ``.metadata.staged`` (the trainer may drop the step from memory before the
  other nodes are done), waits (polling each scan, at most
  ``metadata_wait_s``) until manifests of all ``world_size`` ranks are in the persistent
  folder, then renames it to ``.metadata`` (last), reports the whole step committed (``rank``
  None) and applies persistent retention (:func:`persistent_evictions`: the newest complete
  steps, never only decided ones; steps named by the job's pending restore requests stay:
  :meth:`MemoryStore.pinned_steps <.store.MemoryStore.pinned_steps>`; partial folders older
  than the newest complete step go). After a restart it finds such steps again on the
  persistent tier.

Backpressure (docs/checkpointing.md, "Backpressure"): each thread works on one step of a job
at a time, for all its local ranks, and pins it in memory while it reads it
(:meth:`MemoryStore.pin_transfer <.store.MemoryStore.pin_transfer>`; a third thread renews the
pins' lease). It finishes that step, then takes the newest one (:func:`next_transfer`): the
steps committed meanwhile are skipped on purpose, reported as a ``failed`` event with the lag
(at most one a minute per tier and job, counting the others).

Progress lives in ``<step>/.tier-<r>.json`` (``{"peer": {"targets": {node: "done"}, "done":
bool}, "persistent": {"uploaded": bool}}``), so a restarted agent skips finished work and
catches up on the newest steps the trainer committed while it was down; steps superseded
meanwhile are not replicated. Every outcome is a
:class:`~tierwatch.agent.protocol.CheckpointEvent`; a failure (disk full, unwritable URL, peer
unreachable) is a ``failed`` event naming the file, retried with a backoff, and the worker goes
on with other work.

Every file pushed or uploaded is opened without following a symbolic link below the memory
folder and must be a regular file (:func:`~tierwatch.agent.fsutil.open_regular`): a link a
rank planted (to ``/etc/passwd``, to another job's shard) or a linked step or job folder is
a ``failed`` event naming it, and nothing of it leaves the node.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from tierwatch.agent.checkpoint.format.agreement import transfer_refusal
from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    commit_name,
    manifest_name,
    parse_commit_name,
    parse_manifest_name,
    parse_step_dirname,
    parse_tier_progress_name,
)
from tierwatch.agent.checkpoint.format.manifest import (
    CommitMarker,
    FileEntry,
    Manifest,
    ManifestError,
    load_commit,
    load_manifest,
    mac_problem,
    xxh3_file,
)
from tierwatch.agent.checkpoint.format.priority import DEFAULT_NICE, lower_this_thread
from tierwatch.agent.checkpoint.format.rollback import Timeline
from tierwatch.agent.checkpoint.tierstore.persister import (
    STAGED_METADATA,
    PersistentError,
    PersistentTier,
)
from tierwatch.agent.checkpoint.tierstore.replicator import PeerClient, PeerError, peer_targets
from tierwatch.agent.checkpoint.tierstore.store import MemoryStore
from tierwatch.agent.fsutil import open_regular
from tierwatch.agent.protocol import CheckpointEvent, utcnow

log = logging.getLogger(__name__)

EventSink = Callable[[CheckpointEvent], None]
METADATA_WAIT_S = 600.0
BACKOFF_MAX_S = 60.0
FAILED_EVENT_EVERY_S = 60.0


@dataclass(frozen=True)
class PendingMetadata:
    """A step whose ``.metadata.staged`` this agent uploaded; it waits for every rank's
    manifest on the persistent tier (``since``: monotonic seconds when this agent's upload
    of the step ended; ``started``: when it began, for the step's commit time; ``keep``: the
    commit marker's ``retain["persistent"]``, None when unknown after a restart; ``save_id``:
    the save of the staged ``.metadata``: only that save's manifests commit it)."""

    job_id: str
    step: int
    world_size: int
    keep: list[int] | None
    since: float
    started: float | None = None
    save_id: str = ""


@dataclass(frozen=True)
class LocalCommit:
    """One local rank's committed step found in the memory folder."""

    job_id: str
    step: int
    rank: int
    step_dir: Path
    marker: CommitMarker


@dataclass(frozen=True)
class _Done:
    """The newest step a tier finished for all local ranks of a job (``seconds``: how long
    its transfer took, None when it was found done in the progress files)."""

    step: int
    created_at: str
    seconds: float | None


class TierWorker:
    """Replicates and persists the committed steps of this node's ranks.

    Args:
        store: The node's memory store.
        persistent: The persistent tier.
        emit: Receives every checkpoint event (queued into the next report).
        peer: The client for peers' endpoints (None: no peer tier, since the agent has no
            server registry; one ``failed`` event per job). Replicas go to the URLs the
            server's registry gives for the layout's nodes, never to URLs a rank wrote.
        replication: Peer nodes per rank (0: no peer tier, silently).
        scan_interval_s: Seconds between scans.
        metadata_wait_s: How long the ``.metadata`` writer waits for the other ranks'
            manifests on the persistent tier, seconds.
        nice: Nice value of the worker threads, so they yield the cores to training
            (:mod:`~tierwatch.agent.checkpoint.format.priority`; 0 keeps the agent's).
        job_key: The job's manifest key (32 bytes), or None while this agent has none (from
            a credential a rank sent, or the server's registry). Only steps whose commit
            marker and manifest carry a valid signature under it are replicated, persisted
            or let apply their ``retain`` lists: the memory folder is writable by every
            local user, and one without the job's credential must not be able to plant a
            step that pushes the job's good steps out of retention. None (the argument):
            no check, for tools that read a folder the caller owns.
    """

    def __init__(
        self,
        store: MemoryStore,
        persistent: PersistentTier,
        *,
        emit: EventSink,
        peer: PeerClient | None,
        replication: int,
        scan_interval_s: float,
        metadata_wait_s: float = METADATA_WAIT_S,
        nice: int = DEFAULT_NICE,
        job_key: Callable[[str], bytes | None] | None = None,
    ) -> None:
        self.store = store
        self._job_key = job_key
        self.nice = nice
        self.persistent = persistent
        self.emit = emit
        self.replication = replication
        self.scan_interval_s = scan_interval_s
        self.metadata_wait_s = metadata_wait_s
        self._peer = peer
        self._stop = threading.Event()
        self._wake = {"peer": threading.Event(), "persistent": threading.Event()}
        self._threads: list[threading.Thread] = []
        self._backoff: dict[tuple[Any, ...], tuple[int, float]] = {}
        self._said_once: set[tuple[str, str]] = set()
        self._failing: dict[tuple[str, str, int | None], tuple[float | None, int]] = {}
        self._pending: dict[tuple[str, int], PendingMetadata] = {}
        self._pending_loaded = False
        self._unavailable_said: dict[tuple[str, int], int] = {}
        self._agent_file_warned = False
        self._last_done: dict[tuple[str, str], _Done] = {}
        self._seen: dict[tuple[str, str], set[int]] = {}
        self._skip_said: dict[tuple[str, str], tuple[float, int]] = {}
        self.scans = {"peer": 0, "persistent": 0}

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the peer and persistent threads."""
        for tier, fn in (("peer", self.peer_pass), ("persistent", self.persistent_pass)):
            t = threading.Thread(
                target=self._loop, args=(tier, fn), daemon=True, name=f"tierwatch-{tier}"
            )
            t.start()
            self._threads.append(t)
        t = threading.Thread(target=self._renew_pins, daemon=True, name="tierwatch-pins")
        t.start()
        self._threads.append(t)

    def _renew_pins(self) -> None:
        """Renew the lease of the steps in transfer every third of it, until stopped."""
        while not self._stop.wait(self.store.pin_lease_s / 3):
            self.store.refresh_pins()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop both threads (a transfer in progress finishes or times out first)."""
        self._stop.set()
        for e in self._wake.values():
            e.set()
        for t in self._threads:
            t.join(timeout_s)
        if self._peer is not None:
            self._peer.close()

    def notify(self, job_id: str | None = None, step: int | None = None) -> None:
        """Wake both threads now (a rank committed ``step`` of ``job_id``)."""
        log.debug("notify job=%s step=%s", job_id, step)
        for e in self._wake.values():
            e.set()

    def forget_pending(self, job_id: str, *, after: int) -> list[int]:
        """Drop the job's pending ``.metadata`` commits of steps above ``after`` (the ranks
        rolled back to ``after``; those steps are a diverged future).

        Returns:
            The steps dropped.
        """
        dropped = sorted(s for (j, s) in list(self._pending) if j == job_id and s > after)
        for s in dropped:
            self._pending.pop((job_id, s), None)
        return dropped

    def _loop(self, tier: str, fn: Callable[[], None]) -> None:
        lower_this_thread(self.nice)
        wake = self._wake[tier]
        while not self._stop.is_set():
            wake.clear()
            try:
                fn()
            except Exception:  # noqa: BLE001 - a bug must not end the worker
                log.exception("%s tier pass failed", tier)
            self.scans[tier] += 1
            wake.wait(self.scan_interval_s)

    # -- scanning ------------------------------------------------------------------------
    def local_commits(self) -> dict[tuple[str, int], list[LocalCommit]]:
        """Committed steps of local ranks, per (job, rank), oldest first.

        Also removes progress files whose rank's commit marker is gone (the trainer evicted
        the step) and then the step folder if it is empty. A job or step folder that is a
        symbolic link is skipped (one ``failed`` event each): the agent reads, writes and
        removes nothing through a link in the memory folder.
        """
        try:
            if self.store.ensure_agent_file():
                self._agent_file_warned = False
        except OSError as exc:
            if not self._agent_file_warned:  # once until it works again
                self._agent_file_warned = True
                log.warning("cannot rewrite %s: %s", self.store.layout.agent_file, exc)
        out: dict[tuple[str, int], list[LocalCommit]] = {}
        layout = self.store.layout
        for job_id in layout.jobs():
            job_dir = layout.job_dir(job_id)
            if job_dir.is_symlink():
                self._linked(job_dir, job_id, 0)
                continue
            keys: list[bytes | None] = []  # the job's key, asked for at its first marker
            try:
                step_dirs = [p for p in job_dir.iterdir() if parse_step_dirname(p.name) is not None]
            except OSError:
                continue
            for step_dir in step_dirs:
                step = parse_step_dirname(step_dir.name)
                assert step is not None
                if step_dir.is_symlink():
                    self._linked(step_dir, job_id, step)
                    continue
                try:
                    names = [p.name for p in step_dir.iterdir()]
                except OSError:
                    continue
                for name in names:
                    rank = parse_commit_name(name)
                    if rank is None:
                        continue
                    try:
                        marker = load_commit(step_dir / name)
                    except ManifestError as exc:
                        if not (step_dir / name).exists():  # removed by retention meanwhile
                            log.debug("%s vanished while being read: %s", step_dir / name, exc)
                            continue
                        self._once(
                            "bad-commit",
                            f"{step_dir / name}",
                            job_id,
                            step,
                            "peer",
                            f"{name}: unreadable commit marker, skipped ({exc})",
                            rank,
                        )
                        continue
                    if marker.job_id != job_id or marker.step != step or marker.rank != rank:
                        continue
                    if self._job_key is not None:
                        if not keys:
                            keys.append(self._job_key(job_id))
                        if not self._signed(keys[0], marker, step_dir / name, job_id, step, rank):
                            continue
                    out.setdefault((job_id, rank), []).append(
                        LocalCommit(job_id, step, rank, step_dir, marker)
                    )
                self._clean_progress(step_dir, names)
        for commits in out.values():
            commits.sort(key=lambda c: c.step)
        return out

    def _signed(
        self,
        key: bytes | None,
        document: CommitMarker | Manifest,
        path: Path,
        job_id: str,
        step: int,
        rank: int,
    ) -> bool:
        """Whether ``document`` (read from ``path``) carries a valid signature under the job's
        manifest ``key``; one ``failed`` event per file that does not, and one per job while
        the agent has no key for it (its steps wait until a rank's credential or the server's
        registry provides it)."""
        if key is None:
            self._once(
                "no-manifest-key",
                job_id,
                job_id,
                step,
                "peer",
                f"job {job_id}: no manifest key yet (no rank of the job has sent its credential "
                "and the server's registry does not give it): its steps wait here, neither "
                "replicated nor persisted, until one does",
                None,
            )
            return False
        problem = mac_problem(document, key)
        if problem is None:
            return True
        self._once(
            "bad-signature",
            str(path),
            job_id,
            step,
            "peer",
            f"{problem}: step {step} skipped: not replicated, not persisted, and its "
            "retention list is not applied",
            rank,
        )
        return False

    def _linked(self, path: Path, job_id: str, step: int) -> None:
        """One ``failed`` event for a job or step folder that is a symbolic link."""
        self._once(
            "linked-folder",
            str(path),
            job_id,
            step,
            "peer",
            f"{path}: a symbolic link; the agent never follows links in the memory folder, so "
            "nothing in it is replicated or persisted (write the step into the job's own "
            "folder)",
            None,
        )

    def _clean_progress(self, step_dir: Path, names: list[str]) -> None:
        removed = False
        for name in names:
            rank = parse_tier_progress_name(name)
            if rank is None:
                continue
            if commit_name(rank) not in names and manifest_name(rank) not in names:
                (step_dir / name).unlink(missing_ok=True)
                removed = True
        if removed:
            try:
                step_dir.rmdir()
            except OSError:
                pass

    # -- peer ----------------------------------------------------------------------------
    def peer_pass(self) -> None:
        """Replicate the newest step every local rank of a job committed (one pass)."""
        if self.replication <= 0:
            return
        for job_id, per_rank in by_job(self.local_commits(), self.store.node).items():
            if self._stop.is_set():
                return
            steps = common_steps(per_rank)
            # nothing is read without a peer token or for a job on one node (one event each)
            one_node = bool(steps) and len(set(next(iter(steps[-1][1].values())).marker.layout)) < 2
            self._transfer_newest(
                "peer",
                job_id,
                steps,
                self._replicate,
                reads=self._peer is not None and not one_node,
            )

    def _replicate(self, c: LocalCommit) -> None:
        progress = self.store.read_progress(c.step_dir, c.rank)
        peer = progress.get("peer", {})
        if peer.get("done"):
            return
        marker = c.marker
        own = self.store.node
        if c.rank >= len(marker.layout):
            self._once(
                "layout",
                c.job_id,
                c.job_id,
                c.step,
                "peer",
                f"{commit_name(c.rank)}: layout has {len(marker.layout)} ranks, no rank "
                f"{c.rank}: no peer tier",
                c.rank,
            )
            return
        targets = peer_targets(marker.layout, c.rank, self.replication)
        if not targets:
            if self._once(
                "one-node",
                c.job_id,
                c.job_id,
                c.step,
                "peer",
                "job runs on one node: no peer tier",
                None,
            ):
                self._mark(c, "peer", done=True, none=True)
            return
        if self._peer is None:
            self._once(
                "no-token",
                c.job_id,
                c.job_id,
                c.step,
                "peer",
                f"agent on {own} has no server registry to find and authenticate peers "
                "with: no peer tier",
                None,
            )
            return
        if marker.layout[c.rank] != own:
            self._once(
                "wrong-node",
                c.job_id,
                c.job_id,
                c.step,
                "peer",
                f"{commit_name(c.rank)}: the layout places rank {c.rank} on "
                f"{marker.layout[c.rank]}, but this agent is {own} (start it with "
                f"--node {marker.layout[c.rank]}?)",
                c.rank,
            )
            return
        key = ("peer", c.job_id, c.step, c.rank)
        manifest = self._due_manifest(key, c, "peer")
        if manifest is None:
            return
        files = _push_order(c, manifest)
        done_targets = dict(peer.get("targets", {}))
        started = time.monotonic()
        sent = 0
        failed = False
        for target in targets:
            if done_targets.get(target) == "done":
                continue
            try:
                url = self._peer_client().url_of(target)
            except PeerError as exc:
                self._fail(key, c, "peer", f"{commit_name(c.rank)}: no peer URL: {exc}")
                failed = True
                continue
            try:
                for name, path, entry in files:
                    with open_regular(path, root=self.store.root) as source:
                        if entry is None:
                            size, digest = xxh3_file(source)
                            source.seek(0)
                        else:
                            size, digest = entry.size, entry.xxh3
                            there = os.fstat(source.fileno()).st_size
                            if there != size:
                                raise PeerError(
                                    f"{path}: {there} bytes, the manifest says {size}; not pushed"
                                )
                        self._peer_client().push_file(
                            url=url,
                            peer=target,
                            src_node=own,
                            job_id=c.job_id,
                            step=c.step,
                            name=name,
                            source=source,
                            size=size,
                            xxh3=digest,
                        )
                    sent += size
            except (PeerError, OSError) as exc:
                self._fail(
                    key, c, "peer", f"replicating step {c.step} of rank {c.rank} to {target}: {exc}"
                )
                failed = True
                continue
            done_targets[target] = "done"
            try:
                self.store.update_progress(
                    c.step_dir,
                    c.rank,
                    lambda p, t=target: (
                        p.setdefault("peer", {}).setdefault("targets", {}).__setitem__(t, "done")
                    ),
                )
            except OSError:
                pass  # the trainer removed the step meanwhile
        if failed:
            return
        self._backoff.pop(key, None)
        self._mark(c, "peer", done=True)
        self._event(
            c.job_id,
            c.step,
            "peer",
            "committed",
            c.rank,
            c.marker.world_size,
            bytes=manifest.total_bytes(),
            seconds=time.monotonic() - started,
            message=f"replicated to {', '.join(targets)}",
        )

    def _peer_client(self) -> PeerClient:
        assert self._peer is not None
        return self._peer

    # -- one step at a time ----------------------------------------------------------------
    def _tier_done(self, tier: str, c: LocalCommit) -> bool:
        """Whether ``tier``'s work on rank ``c.rank``'s files of the step is over (peer: every
        target done; persistent: uploaded, or refused for a conflict)."""
        progress = self.store.read_progress(c.step_dir, c.rank).get(tier, {})
        if tier == "peer":
            return bool(progress.get("done"))
        return bool(progress.get("uploaded") or progress.get("conflict"))

    def _transfer_newest(
        self,
        tier: str,
        job_id: str,
        steps: list[tuple[int, dict[int, LocalCommit]]],
        work: Callable[[LocalCommit], None],
        *,
        reads: bool = True,
    ) -> None:
        """Run ``work`` on every local rank's files of the job's newest step, pinned in memory
        meanwhile; report the steps skipped since the last one this tier finished.

        Args:
            tier: ``peer`` or ``persistent``.
            job_id: The job.
            steps: :func:`common_steps` of the job (for this tier).
            work: Replicates or uploads one rank's files (records its progress itself).
            reads: Whether ``work`` reads the step's files: then the step is pinned in memory
                meanwhile and skips are reported (False: no peer token, a job on one node).
        """
        if not steps:
            return
        key = (tier, job_id)
        done = {s for s, cs in steps if all(self._tier_done(tier, c) for c in cs.values())}
        last = self._last_done.get(key)
        newest_step, newest = steps[-1]
        seen = self._seen.setdefault(key, set())
        seen.update(s for s, _ in steps)
        seen.update(newest[min(newest)].marker.retain.get(tier, []))
        target, skipped = next_transfer(
            [s for s, _ in steps],
            done,
            last_done=last.step if last is not None else None,
            seen=seen,
        )
        if target is None:
            if newest_step in done and (last is None or last.step < newest_step):
                created = newest[min(newest)].marker.created_at
                self._last_done[key] = _Done(newest_step, created, None)
            return
        commits = newest
        if reads and skipped and last is not None:  # after a start: skipped silently
            self._report_skip(tier, job_id, commits[min(commits)], skipped, last)
        started = time.monotonic()
        with ExitStack() as stack:
            pinned = self._pin(stack, job_id, target, tier, sorted(commits)) if reads else True
            if not pinned:
                log.debug("step %d of %s was evicted before %s work began", target, job_id, tier)
                return
            for rank in sorted(commits):
                if self._stop.is_set():
                    return
                work(commits[rank])
        if all(self._tier_done(tier, c) for c in commits.values()):
            c0 = commits[min(commits)]
            self._last_done[key] = _Done(target, c0.marker.created_at, time.monotonic() - started)
            self._seen[key] = {s for s in seen if s > target}

    def _pin(self, stack: ExitStack, job_id: str, step: int, tier: str, ranks: list[int]) -> bool:
        """Pin the step in memory until ``stack`` closes; False when a rank evicted it
        already. A pin file that cannot be written is logged and the work goes on unpinned
        (a rank's eviction then fails it with a ``failed`` event)."""
        try:
            return stack.enter_context(self.store.pin_transfer(job_id, step, tier, ranks))
        except OSError as exc:
            log.warning("cannot pin step %d of %s in memory: %s", step, job_id, exc)
            return True

    def _report_skip(
        self, tier: str, job_id: str, c: LocalCommit, skipped: list[int], last: _Done
    ) -> None:
        """A ``failed`` event for steps ``skipped`` on purpose (the tier could not keep up),
        with the lag; at most one per :data:`FAILED_EVENT_EVERY_S` per tier and job, the
        next one counting the steps skipped since."""
        key = (tier, job_id)
        now = time.monotonic()
        said, quiet = self._skip_said.get(key, (None, 0))
        verb = "upload" if tier == "persistent" else "replication"
        if said is not None and now - said < FAILED_EVENT_EVERY_S:
            self._skip_said[key] = (said, quiet + len(skipped))
            log.info("%s tier of %s: skipped steps %s (reported already)", tier, job_id, skipped)
            return
        self._skip_said[key] = (now, 0)
        took = f" took {last.seconds:.1f} s" if last.seconds is not None else " ended"
        lag_s = _seconds_between(last.created_at, c.marker.created_at)
        lag = f"lag {c.step - last.step} steps" + (
            f" ({lag_s:.1f} s of training)" if lag_s is not None else ""
        )
        # the steps for this tier came every lag_s / (skipped + 1) seconds meanwhile
        pace = (
            f" while steps for it came every {lag_s / (len(skipped) + 1):.1f} s"
            if lag_s
            else ", and newer steps were committed meanwhile"
        )
        more = f"; {quiet} more step(s) skipped since the last report" if quiet else ""
        message = (
            f"{tier} tier on {self.store.node} cannot keep up: step(s) {_steps(skipped)} "
            f"skipped on purpose (the {verb} of step {last.step}{took}{pace}); the {verb} of "
            f"step {c.step} comes next; {lag}{more}"
        )
        log.warning("job %s: %s", job_id, message)
        self._event(
            job_id,
            skipped[-1],
            tier,
            "failed",
            None,
            c.marker.world_size,
            seconds=last.seconds,
            message=message,
        )

    # -- persistent ----------------------------------------------------------------------
    def persistent_pass(self) -> None:
        """Upload the newest persisted step of every local rank, finish pending
        ``.metadata`` writes and apply persistent retention (one pass)."""
        commits = self.local_commits()
        if not self.persistent.available:
            self._report_unavailable(commits)
            return
        if not self._pending_loaded:
            self._load_pending(commits)
        for job_id, per_rank in by_job(commits, self.store.node).items():
            if self._stop.is_set():
                return
            self._transfer_newest(
                "persistent", job_id, common_steps(per_rank, persisted=True), self._upload
            )
        for key in sorted(self._pending):
            if self._stop.is_set():
                return
            self._finish_metadata(self._pending[key])

    def _report_unavailable(self, commits: dict[tuple[str, int], list[LocalCommit]]) -> None:
        """The persistent URL is unusable: one ``failed`` event per local rank and step to
        persist (the newest of each rank; nothing is uploaded)."""
        for (job_id, rank), per_rank in commits.items():
            persisted = [c for c in per_rank if c.marker.persist]
            if not persisted:
                continue
            c = persisted[-1]
            if self._unavailable_said.get((job_id, rank), -1) >= c.step:
                continue
            self._unavailable_said[(job_id, rank)] = c.step
            log.debug(
                "persistent tier unavailable: step %d of %s rank %d not persisted",
                c.step,
                job_id,
                rank,
            )
            self._event(
                job_id,
                c.step,
                "persistent",
                "failed",
                rank,
                c.marker.world_size,
                message=f"step {c.step} not persisted: the persistent tier "
                f"{self.persistent.shown_url} is unavailable ({self.persistent.error})",
            )

    def _load_pending(self, commits: dict[tuple[str, int], list[LocalCommit]]) -> None:
        """After a start: find steps of local jobs whose ``.metadata.staged`` this agent
        uploaded before it stopped (the persistent manifest that lists ``.metadata`` names this
        node) and that still wait for other ranks' manifests."""
        self._pending_loaded = True
        newest: dict[str, LocalCommit] = {}
        for (job_id, _rank), per_rank in commits.items():
            if job_id not in newest or per_rank[-1].step > newest[job_id].step:
                newest[job_id] = per_rank[-1]
        for job_id in self.store.layout.jobs():
            try:
                steps = self.persistent.steps(job_id)
                for step in steps:
                    if self.persistent.has_metadata(
                        job_id, step
                    ) or not self.persistent.has_staged_metadata(job_id, step):
                        continue
                    manifests = self.persistent.manifests(job_id, step)
                    # only the agent whose rank lists .metadata (it uploaded the staged copy)
                    owner = [m for m in manifests if m.has_metadata() and m.node == self.store.node]
                    if not owner:
                        continue
                    world = manifests[0].world_size
                    marker = newest.get(job_id)
                    keep = marker.marker.retain.get("persistent", []) if marker else None
                    self._pending[(job_id, step)] = PendingMetadata(
                        job_id, step, world, keep, time.monotonic(), save_id=owner[0].save_id
                    )
            except PersistentError as exc:
                log.warning("cannot look for pending .metadata of %s: %s", job_id, exc)

    def _due_manifest(self, key: tuple[Any, ...], c: LocalCommit, tier: str) -> Manifest | None:
        """The local rank's manifest of a step whose ``tier`` work is due now, or None (not
        due, evicted meanwhile, or unreadable: then a failed event with a retry)."""
        if not self._due(key):
            return None
        path = c.step_dir / manifest_name(c.rank)
        try:
            manifest = load_manifest(path)
        except ManifestError as exc:
            if not self._evicted(c):
                self._fail(key, c, tier, f"{manifest_name(c.rank)}: {exc}")
            return None
        if self._job_key is not None and not self._signed(
            self._job_key(c.job_id), manifest, path, c.job_id, c.step, c.rank
        ):
            return None
        return manifest

    def _upload(self, c: LocalCommit) -> None:
        if self._tier_done("persistent", c):
            return
        key = ("persistent", c.job_id, c.step, c.rank)
        manifest = self._due_manifest(key, c, "persistent")
        if manifest is None:
            return
        try:
            conflict = self._conflict(c, manifest)
        except PersistentError as exc:
            self._fail(key, c, "persistent", str(exc))
            return
        if conflict is not None:
            self._backoff.pop(key, None)
            log.warning("persistent tier: %s", conflict)
            self._mark(c, "persistent", conflict=conflict)
            self._event(
                c.job_id,
                c.step,
                "persistent",
                "failed",
                c.rank,
                manifest.world_size,
                message=conflict,
            )
            return
        started = time.monotonic()
        total = 0
        try:
            # shards first, then .metadata under its staged name (renamed once every rank's
            # manifest is there), then the manifest
            for f in sorted(manifest.files, key=lambda f: (f.name == METADATA, f.name)):
                name = STAGED_METADATA if f.name == METADATA else f.name
                total += self.persistent.put_file(
                    c.step_dir / f.name, c.job_id, c.step, name, expect=f, root=self.store.root
                )
            self.persistent.put_file(
                c.step_dir / manifest_name(c.rank),
                c.job_id,
                c.step,
                manifest_name(c.rank),
                root=self.store.root,
            )
        except PersistentError as exc:
            self._fail(key, c, "persistent", str(exc))
            return
        self._backoff.pop(key, None)
        wait = manifest.has_metadata()
        if wait:
            self._pending[(c.job_id, c.step)] = PendingMetadata(
                c.job_id,
                c.step,
                manifest.world_size,
                c.marker.retain.get("persistent", []),
                time.monotonic(),
                started,
                save_id=manifest.save_id,
            )
        self._mark(c, "persistent", uploaded=True)
        self._event(
            c.job_id,
            c.step,
            "persistent",
            "committed",
            c.rank,
            manifest.world_size,
            bytes=total,
            seconds=time.monotonic() - started,
            message=f"rank {c.rank}'s files in {self.persistent.shown_step_url(c.job_id, c.step)}"
            + ("; .metadata follows once every rank's manifest is there" if wait else ""),
        )

    def _conflict(self, c: LocalCommit, manifest: Manifest) -> str | None:
        """Why rank ``c.rank``'s files of the step must not go to the persistent tier: the
        step folder there already holds a checkpoint of another world size or model (a
        manifest with another world_size or signature, or a ``.metadata`` without any
        manifest), or another save of the step that must stay (a committed one, a newer
        one, or a fence of this node's ``timeline.json`` or of a manifest there rolled this
        one away: :func:`~tierwatch.agent.checkpoint.format.agreement.transfer_refusal`).
        Reads this rank's manifest and the lowest-ranked other one.

        Raises:
            PersistentError: the folder cannot be read.
        """
        names = self.persistent.names(c.job_id, c.step)
        ranks = sorted(r for n in names if (r := parse_manifest_name(n)) is not None)
        if not ranks:
            if METADATA in names:
                return (
                    f"step {c.step} in {self.persistent.shown_step_url(c.job_id, c.step)} "
                    "already holds a checkpoint (.metadata without manifests) of another "
                    f"world size/model; left alone, rank {c.rank}'s files not uploaded"
                )
        read = [r for r in ranks if r == c.rank] + [r for r in ranks if r != c.rank][:1]
        present: list[Manifest] = []
        for r in read:
            there = self.persistent.manifest(c.job_id, c.step, r)
            if there is None:
                continue
            present.append(there)
            if there.world_size != manifest.world_size or there.signature != manifest.signature:
                return (
                    f"step {c.step} in {self.persistent.shown_step_url(c.job_id, c.step)} "
                    "already holds a checkpoint of another world size/model "
                    f"({manifest_name(r)}: world_size {there.world_size}, signature "
                    f"{there.signature!r}; this step: world_size {manifest.world_size}, "
                    f"signature {manifest.signature!r}); left alone, rank {c.rank}'s "
                    "files not uploaded"
                )
        # one save per step number (docs/checkpointing.md "Save identity")
        refusal = transfer_refusal(
            manifest,
            present,
            committed_ranks=range(manifest.world_size) if METADATA in names else (),
            fences=Timeline.read(self.store.layout.timeline_file(c.job_id)).fences,
        )
        if refusal is not None:
            return f"{self.persistent.shown_step_url(c.job_id, c.step)}: {refusal}"
        return None

    def _finish_metadata(self, p: PendingMetadata) -> None:
        key = ("metadata", p.job_id, p.step)
        if not self._due(key):
            return
        url = self.persistent.shown_step_url(p.job_id, p.step)  # for messages
        try:
            if not self.persistent.has_staged_metadata(p.job_id, p.step):
                self._pending.pop((p.job_id, p.step), None)  # removed by retention meanwhile
                return
            have = self.persistent.manifest_ranks(p.job_id, p.step)
        except PersistentError as exc:
            self._fail_step(key, p, str(exc))
            return
        missing = [r for r in range(p.world_size) if r not in have]
        if not missing:  # every manifest is there: they must all be of the staged save
            try:
                saves = {m.rank: m.save_id for m in self.persistent.manifests(p.job_id, p.step)}
            except PersistentError as exc:
                self._fail_step(key, p, str(exc))
                return
            owner = [r for r, m in saves.items() if m == p.save_id]
            if not owner:  # another save's upload replaced the staged one: it commits it
                self._pending.pop((p.job_id, p.step), None)
                return
            missing = [r for r in range(p.world_size) if saves.get(r) != p.save_id]
        if missing:
            if time.monotonic() - p.since > self.metadata_wait_s:
                self._pending.pop((p.job_id, p.step), None)
                self.persistent.remove_staged_metadata(p.job_id, p.step)
                self._event(
                    p.job_id,
                    p.step,
                    "persistent",
                    "failed",
                    None,
                    p.world_size,
                    message=f".metadata of step {p.step} not written: manifests of "
                    f"rank(s) {missing[:16]} did not reach {url} within "
                    f"{self.metadata_wait_s:g} s",
                )
            return
        started = time.monotonic()
        try:
            self.persistent.commit_metadata(p.job_id, p.step)
        except PersistentError as exc:
            self._fail_step(key, p, str(exc))
            return
        self._backoff.pop(key, None)
        self._pending.pop((p.job_id, p.step), None)
        total = 0
        for m in self.persistent.manifests(p.job_id, p.step):
            total += m.total_bytes()
        # the step's commit time: from this agent's first upload of it to .metadata
        began = p.started if p.started is not None else started
        self._event(
            p.job_id,
            p.step,
            "persistent",
            "committed",
            None,
            p.world_size,
            bytes=total,
            seconds=time.monotonic() - began,
            message=f"step {p.step} committed in {url} (.metadata written last)",
        )
        if p.keep is not None:
            self._retain_persistent(p)

    def _fail_step(self, key: tuple[Any, ...], p: PendingMetadata, message: str) -> None:
        attempts = self._backoff.get(key, (0, 0.0))[0] + 1
        delay = min(BACKOFF_MAX_S, self.scan_interval_s * 2 ** (attempts - 1))
        self._backoff[key] = (attempts, time.monotonic() + delay)
        self._event(
            p.job_id,
            p.step,
            "persistent",
            "failed",
            None,
            p.world_size,
            message=f"{message} (attempt {attempts}; retrying in {delay:.1f} s)",
        )

    def _retain_persistent(self, p: PendingMetadata) -> None:
        """Apply persistent retention after ``p.step`` committed (:func:`persistent_evictions`):
        keep the newest complete steps (as many as rank 0's ``retain["persistent"]`` names
        besides pinned ones; those it names, when complete) and every step a pending restore
        request of the job pins; remove other complete steps below ``p.step`` and partial
        folders (no ``.metadata``) below the newest complete step, which no agent uploads any
        more: each agent uploads one step at a time, oldest first, so all of them finished
        or gave up every older step before the newest one could complete."""
        keep = set(p.keep or [])
        try:
            steps = self.persistent.steps(p.job_id)
            complete = {
                s for s in steps if s == p.step or METADATA in self.persistent.names(p.job_id, s)
            }
        except PersistentError as exc:
            self._event(
                p.job_id,
                p.step,
                "persistent",
                "failed",
                None,
                p.world_size,
                message=f"retention: {exc}",
            )
            return
        pins = self.store.pinned_steps(p.job_id) if any(s < p.step for s in steps) else {}
        count = max(1, len(keep - set(pins)))
        doomed = persistent_evictions(
            steps, complete, newest=p.step, keep=keep, keep_count=count, pinned=set(pins)
        )
        kept = sorted(s for s in complete if s not in doomed)
        top = max(complete)
        for step in sorted(set(steps) & set(pins)):
            log.info(
                "persistent step %d of %s kept: pinned by restore request(s) %s",
                step,
                p.job_id,
                pins[step],
            )
        for step in doomed:
            try:
                self.persistent.delete_step(p.job_id, step)
            except PersistentError as exc:
                self._event(
                    p.job_id,
                    step,
                    "persistent",
                    "failed",
                    None,
                    p.world_size,
                    message=f"retention: {exc}",
                )
                continue
            self._pending.pop((p.job_id, step), None)
            if step in complete:
                why = (
                    f"retention after step {p.step} (keeps {kept}"
                    + (f", pinned {sorted(pins)}" if pins else "")
                    + ")"
                )
            else:
                why = (
                    f"partial step (no .metadata) below the newest complete step {top}, "
                    f"which no agent uploads any more: removed by retention after step {p.step}"
                )
            self._event(p.job_id, step, "persistent", "evicted", None, p.world_size, message=why)

    # -- helpers -------------------------------------------------------------------------
    def _mark(self, c: LocalCommit, tier: str, **values: Any) -> None:
        try:
            self.store.update_progress(
                c.step_dir, c.rank, lambda p: p.setdefault(tier, {}).update(values)
            )
        except OSError as exc:
            log.warning("cannot record progress in %s: %s", c.step_dir, exc)

    def _evicted(self, c: LocalCommit) -> bool:
        """Whether the trainer removed the step meanwhile (its commit marker is gone): not a
        failure, the next scan no longer sees it."""
        if (c.step_dir / commit_name(c.rank)).exists():
            return False
        log.debug("step %d of %s rank %d was removed while being read", c.step, c.job_id, c.rank)
        return True

    def _due(self, key: tuple[Any, ...]) -> bool:
        entry = self._backoff.get(key)
        return entry is None or time.monotonic() >= entry[1]

    def _fail(self, key: tuple[Any, ...], c: LocalCommit, tier: str, message: str) -> None:
        attempts = self._backoff.get(key, (0, 0.0))[0] + 1
        delay = min(BACKOFF_MAX_S, self.scan_interval_s * 2 ** (attempts - 1))
        self._backoff[key] = (attempts, time.monotonic() + delay)
        # One failed event per (tier, job, rank) a minute while the failure lasts: a peer
        # that is down for a while fails every new step, which is one outage, not many.
        ongoing = (tier, c.job_id, c.rank)
        now = time.monotonic()
        last, quiet = self._failing.get(ongoing, (None, 0))
        if last is not None and now - last < FAILED_EVENT_EVERY_S:
            self._failing[ongoing] = (last, quiet + 1)
            log.debug("%s tier: %s (attempt %d; reported already)", tier, message, attempts)
            return
        self._failing[ongoing] = (now, 0)
        more = f"; {quiet} more failure(s) since the last report" if quiet else ""
        log.warning("%s tier: %s (attempt %d, retry in %.1f s)", tier, message, attempts, delay)
        self._event(
            c.job_id,
            c.step,
            tier,
            "failed",
            c.rank,
            c.marker.world_size,
            message=f"{message} (attempt {attempts}; retrying in {delay:.1f} s{more})",
        )

    def _once(
        self,
        what: str,
        scope: str,
        job_id: str,
        step: int,
        tier: str,
        message: str,
        rank: int | None,
    ) -> bool:
        """Emit a failed event once per (what, scope) in this agent's lifetime."""
        if (what, scope) in self._said_once:
            return True
        self._said_once.add((what, scope))
        log.warning("%s tier, job %s: %s", tier, job_id, message)
        self._event(job_id, step, tier, "failed", rank, None, message=message)
        return True

    def _event(
        self,
        job_id: str,
        step: int,
        tier: str,
        kind: str,
        rank: int | None,
        world_size: int | None,
        *,
        bytes: int | None = None,  # noqa: A002
        seconds: float | None = None,
        message: str = "",
    ) -> None:
        if kind == "committed":  # a success ends an ongoing failure of this tier and rank
            self._failing.pop((tier, job_id, rank), None)
        self.emit(
            CheckpointEvent(
                job_id=job_id,
                step=step,
                tier=tier,
                kind=kind,
                rank=rank,
                world_size=world_size,
                ts=utcnow(),
                bytes=bytes,
                seconds=seconds,
                message=message[:2000],
            )
        )


def _push_order(c: LocalCommit, manifest: Manifest) -> list[tuple[str, Path, FileEntry | None]]:
    """Shards, then .metadata (if listed), then the manifest, then the commit marker."""
    shards = [(f.name, c.step_dir / f.name, f) for f in manifest.files if f.name != METADATA]
    meta = [(f.name, c.step_dir / f.name, f) for f in manifest.files if f.name == METADATA]
    tail: list[tuple[str, Path, FileEntry | None]] = [
        (manifest_name(c.rank), c.step_dir / manifest_name(c.rank), None),
        (commit_name(c.rank), c.step_dir / commit_name(c.rank), None),
    ]
    return [*shards, *meta, *tail]


def by_job(
    commits: Mapping[tuple[str, int], list[LocalCommit]], node: str
) -> dict[str, dict[int, list[LocalCommit]]]:
    """:meth:`TierWorker.local_commits` grouped per job: job → local rank → commits.

    The local ranks are those the newest commit marker's layout places on ``node``; ranks
    whose files are here but that it places elsewhere (an older run's) are left out. When it
    places none here (a misconfigured ``--node``), every rank found is kept, so the work
    reports the mismatch.
    """
    jobs: dict[str, dict[int, list[LocalCommit]]] = {}
    for (job_id, rank), found in commits.items():
        jobs.setdefault(job_id, {})[rank] = found
    out: dict[str, dict[int, list[LocalCommit]]] = {}
    for job_id, ranks in jobs.items():
        newest = max((c for cs in ranks.values() for c in cs), key=lambda c: c.step)
        local = {r for r, n in enumerate(newest.marker.layout) if n == node}
        mine = {r: cs for r, cs in ranks.items() if r in local}
        out[job_id] = mine or ranks
    return out


def common_steps(
    per_rank: Mapping[int, Sequence[LocalCommit]], *, persisted: bool = False
) -> list[tuple[int, dict[int, LocalCommit]]]:
    """The steps every local rank committed (only those marked ``persist`` when
    ``persisted``), ascending, each with every local rank's commit.

    The agent replicates and uploads one step for all its local ranks, never rank 0's
    step 8 with rank 1's step 7: a rank that has not written its commit marker of the newest
    step yet holds the others back until it has.
    """
    if not per_rank:
        return []
    by_step: dict[int, dict[int, LocalCommit]] = {}
    for rank, commits in per_rank.items():
        for c in commits:
            if persisted and not c.marker.persist:
                continue
            by_step.setdefault(c.step, {})[rank] = c
    return [(s, cs) for s, cs in sorted(by_step.items()) if len(cs) == len(per_rank)]


def next_transfer(
    steps: Sequence[int],
    done: Collection[int],
    *,
    last_done: int | None,
    seen: Iterable[int] = (),
) -> tuple[int | None, list[int]]:
    """Which step a tier works on next, and which it skips on purpose.

    The tier always takes the newest step (``steps[-1]``): a step it is working on is
    finished first (the caller works on one step at a time), then everything committed
    meanwhile but the newest is skipped. So a tier slower than the saves (an upload longer
    than ``persist_every`` × the step time) falls behind by at most one transfer, never by a
    growing queue.

    Args:
        steps: Steps every local rank committed (for persistent: marked ``persist``),
            ascending.
        done: Steps whose transfer is over (all local ranks).
        last_done: The newest step this tier finished, None when unknown (after a start).
        seen: Other steps the tier saw committed for it (earlier scans, rank 0's retain),
            which memory may have dropped since.

    Returns:
        ``(target, skipped)``: the step to transfer (None: the newest is done, or no step),
        and the steps above ``last_done`` and below ``target`` that were not transferred,
        ascending.
    """
    if not steps or steps[-1] in done:
        return None, []
    target = steps[-1]
    floor = -1 if last_done is None else last_done
    skipped = sorted({s for s in (*steps, *seen) if floor < s < target and s not in done})
    return target, skipped


def persistent_evictions(
    steps: Iterable[int],
    complete: Collection[int],
    *,
    newest: int,
    keep: Collection[int],
    keep_count: int,
    pinned: Collection[int] = (),
) -> list[int]:
    """The persistent steps retention removes after ``newest`` committed there.

    Retention counts completed steps, not decided ones: under backpressure rank 0's
    ``retain["persistent"]`` can name steps that some agent skipped and that never complete.

    Args:
        steps: Step folders on the persistent tier.
        complete: Those with ``.metadata``.
        newest: The step that just committed (it and newer folders always stay).
        keep: Rank 0's ``retain["persistent"]`` (kept when complete).
        keep_count: How many of the newest complete steps to keep (≥ 1).
        pinned: Steps pending restore requests pin (kept, complete or not).

    Returns:
        Ascending: complete steps below ``newest`` that are neither among the newest
        ``keep_count`` complete ones nor in ``keep``, and partial steps below the newest
        complete step; none of them pinned.
    """
    done = sorted(complete)
    top = max([newest, *done])
    kept = set(done[-max(1, keep_count) :]) | {newest}
    out = []
    for s in sorted(set(steps)):
        if s >= newest or s in pinned:
            continue
        if s in complete:
            if s not in kept and s not in keep:
                out.append(s)
        elif s < top:
            out.append(s)
    return out


def _steps(steps: list[int], most: int = 8) -> str:
    """``"20, 30"`` or ``"20, 30, …, 90 (9 steps)"``."""
    if len(steps) <= most:
        return ", ".join(str(s) for s in steps)
    return f"{', '.join(str(s) for s in steps[: most - 1])}, …, {steps[-1]} ({len(steps)} steps)"


def _seconds_between(earlier: str, later: str) -> float | None:
    """Seconds from one ISO time to another (None when either does not parse)."""
    try:
        return max(
            0.0, (datetime.fromisoformat(later) - datetime.fromisoformat(earlier)).total_seconds()
        )
    except (TypeError, ValueError):
        return None

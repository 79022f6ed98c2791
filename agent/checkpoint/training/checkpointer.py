"""``TieredCheckpointer``: the training side of tierwatch's tiered checkpoint store (torch).

Usage::

    ckpt = TieredCheckpointer(job_id="gpt-small", agent_url="http://127.0.0.1:9470",
                              persist_every=10)
    state = {"model": model, "optim": optimizer, "sched": scheduler, "rng": RNGState(),
             "data": sampler}
    last = ckpt.restore(state)            # the step whose state was loaded, or None
    step = 0 if last is None else last + 1
    while step < total:
        train_step(); ckpt.save(step, state)   # state after `step` completed
        rolled = ckpt.maybe_rollback(state, step=step)   # every rank, every step
        step = step + 1 if rolled is None else rolled + 1
    ckpt.close()

Design notes (each seam has a module of its own in this package):

- **Identity and groups** (:mod:`.collectives`). rank/world_size come from torch.distributed
  when it is initialised, else a single process. The checkpointer creates its own gloo
  groups: the save collectives run in a background thread, and on the training group they
  would interleave with the training loop's own collectives and deadlock; gloo also serves
  NCCL jobs.
- **What is saved** (:mod:`.state_adapter`). The user's top-level keys are kept. An
  ``nn.Module`` is saved through ``get_model_state_dict`` (FQNs without DDP's ``module.``
  prefix, so ``{"model": model.state_dict()}`` loads the step with plain DCP); an optimizer
  through ``get_optimizer_state_dict`` with the module whose parameters it updates (so a fresh
  optimizer restores fully); objects with ``state_dict``/``load_state_dict`` (schedulers,
  :class:`RNGState`, :class:`ResumableDistributedSampler`) through those; anything else as is.
- **Staging** (:mod:`.snapshot`). ``save()`` waits until the previous step is committed in
  the memory tier (at most one save in flight), copies buffers, RNG, sampler, scheduler and
  scalars into reused CPU buffers, and returns. Parameters and optimizer state are copied by
  the background thread while the next forward/backward runs; a step pre-hook on every
  optimizer in ``state`` waits for that copy, so a snapshot is never torn. Without an
  optimizer, staging is synchronous.
- **Commit** (:mod:`.commit_decision`, :mod:`.rank_files`). The background thread writes the
  step with ``dcp.save`` into the node's memory folder under a temporary name, hashing each
  file as it is written (:mod:`.digesting_writer`), renames, and writes the rank's manifest;
  the ranks then exchange their outcome and rank 0
  decides commit, persistence (every ``persist_every``-th step) and retention for all tiers,
  which every rank records in its commit marker. The node agent replicates and uploads from
  there; training never waits for it and keeps committing to memory while the agent is down.
- **Restore.** See :mod:`tierwatch.agent.checkpoint.training.restore`.
- **Rollback** (:mod:`.rollback`). An operator's restore request reaches every rank through
  its agent (a poller thread reads ``GET /v1/ckpt/jobs/{job}/restore-requests``).
  :meth:`maybe_rollback`, called by every rank at the same place of every step, all-reduces
  (MIN) the newest request id each rank knows on a second gloo group of the checkpointer's
  own (the first one may be busy with a background save), so all ranks roll back at the same
  step boundary once every rank knows the request. The diverged future (steps above the
  target) is dropped from every tier and fenced off.
- **Pinned steps.** Until the ranks act, a pending request's step is *pinned*: every rank
  sends the steps its agent's requests name with its save outcome, and rank 0 adds them all
  to the retention of every tier in its decision (the commit marker's ``retain``), so memory,
  replicas and the persistent tier keep the step although it is older than ``keep_*``; the
  agents also pin what they hold themselves. Once the request is served or expires, the next
  retention removes the step as usual.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierwatch.agent.checkpoint.format.inflight import held_steps
from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    MemoryLayout,
    check_job_id,
    commit_name,
    manifest_name,
)
from tierwatch.agent.checkpoint.format.manifest import (
    CommitMarker,
    make_manifest,
    new_save_id,
    sign_commit,
)
from tierwatch.agent.checkpoint.format.priority import DEFAULT_NICE, lower_this_thread
from tierwatch.agent.checkpoint.format.rollback import Timeline, describe_pins
from tierwatch.agent.checkpoint.training.client import (
    AgentClient,
    AgentRefused,
    AgentUnavailable,
    EventSender,
)
from tierwatch.agent.checkpoint.training.collectives import CheckpointCollectives
from tierwatch.agent.checkpoint.training.commit_decision import (
    CommitDecision,
    History,
    decide_commit,
    memory_evictions,
)
from tierwatch.agent.checkpoint.training.errors import CheckpointError
from tierwatch.agent.checkpoint.training.planner import CachedSavePlanner, cache_key, forget
from tierwatch.agent.checkpoint.training.rank_files import RankFiles
from tierwatch.agent.checkpoint.training.rollback import RequestPoller, RollbackServer
from tierwatch.agent.checkpoint.training.snapshot import PendingCopies, SnapshotStager
from tierwatch.agent.checkpoint.training.state_adapter import StateAdapter, data_ptr
from tierwatch.agent.checkpoint.training.verify import StepVerifier
from tierwatch.agent.credentials import (
    CredentialError,
    job_credential_from_env,
    manifest_key_of,
    unverified_job_id,
)
from tierwatch.agent.fsutil import atomic_write_json
from tierwatch.agent.protocol import (
    CheckpointEvent,
    JobProgress,
    LatencySample,
    RestoreReport,
    utcnow,
)

__all__ = ["CheckpointError", "TieredCheckpointer", "describe_error"]

log = logging.getLogger(__name__)

DEFAULT_AGENT_URL = "http://127.0.0.1:9470"


@dataclass
class _SaveJob:
    step: int
    staged: dict[str, Any]
    pending: PendingCopies
    staged_bytes: int
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    copy_done: threading.Event = field(default_factory=threading.Event)
    committed: bool = False
    error: str | None = None
    # why this rank cannot write the step, known in save() (staging failed): the writer
    # still enters the step's collectives with it, so every rank learns the cause
    refused: str | None = None
    write_s: float = 0.0
    blocking_s: float = 0.0  # time the training thread spent in save()
    persist: bool = False  # the caller asked for the persistent tier
    fences: list[tuple[int, int]] = field(default_factory=list)  # the manifest's timeline
    # this save's id: rank 0's (new_save_id(), made in save()), every rank's once the
    # writer's first exchange handed it out; "" on other ranks until then
    save_id: str = ""
    # which save() call this is (1, 2, ...: the same on every rank), and the newest restore
    # request every rank's agent knew when the writer's first exchange ran (0: none); see
    # RollbackServer.offer
    index: int = 0
    agreed_request: int = 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def describe_error(exc: BaseException) -> str:
    """One line per cause of a failed write, without tracebacks.

    ``torch.distributed.checkpoint``'s ``CheckpointException`` carries the exception of every
    rank that failed (``failures``: rank → exception, as raised on that rank); the line names
    the ranks and the first cause, e.g. ``on rank(s) [2, 3]: FileNotFoundError: …``.
    """
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        cause = first[0] if isinstance(first, tuple) else first
        text = (
            f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
        )
        return f"write failed on rank(s) {sorted(failures)}: {text.splitlines()[0]}"
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


class TieredCheckpointer:
    """Save every step to node memory, a peer's memory and persistent storage; restore from
    the fastest tier that holds a complete step.

    Args:
        job_id: The job's name (1-128 letters, digits, ``.``, ``_``, ``-``); one job id per
            model.
        agent_url: This node's agent (default ``$TIERWATCH_AGENT_URL`` or
            ``http://127.0.0.1:9470``).
        persist_every: A step goes to the persistent tier when it is the first committed step
            at or after a multiple of this many steps.
        keep_memory, keep_peer, keep_persistent: newest committed steps each tier keeps
            (defaults 2, 2, 3).
        memory_dir: The node's memory folder; default: what the agent reports
            (``GET /v1/ckpt/info``), else ``$TIERWATCH_MEMORY_DIR``.
        node: This node's name; default: the agent's, else ``$TIERWATCH_NODE`` or the host.
        latency_every: Time a small all_reduce on the job's process group every this many
            saves and report it as collective latency (0: never).
        process_group: The job's training group (for the latency probe; default: WORLD).
        timeout_s: Timeout of the checkpoint group's collectives (seconds).
        job_credential: The job's credential, which the agent asks of every call (issued by
            the server when the job registers; default ``$TIERWATCH_JOB_CREDENTIAL``, else the
            file ``$TIERWATCH_JOB_CREDENTIAL_FILE``; docs/security.md).
        write_threads: Threads DCP writes a rank's shard with (each writes its own
            ``__<r>_<i>.distcp`` file; 2 halves the write time on tmpfs).
        background_nice: Nice value (0-19) of the background writer thread, so it yields
            the cores to training (0: the training process's own priority).
        rollback_every: Also check for restore requests with an 8-byte all_reduce on every
            this many :meth:`maybe_rollback` calls (None, the default: no collective of its
            own; the check rides on the saves' first exchange, see :meth:`maybe_rollback`).
        request_poll_s: Seconds between two reads of the agent's restore requests (on a
            background thread).

    Raises:
        CheckpointError: a bad job id or argument, or no memory folder can be found (agent
            unreachable and no ``memory_dir``).
    """

    def __init__(
        self,
        job_id: str,
        agent_url: str | None = None,
        *,
        persist_every: int = 10,
        keep_memory: int = 2,
        keep_peer: int = 2,
        keep_persistent: int = 3,
        memory_dir: str | os.PathLike[str] | None = None,
        node: str | None = None,
        latency_every: int = 50,
        process_group: Any = None,
        timeout_s: float = 600.0,
        job_credential: str | None = None,
        write_threads: int = 2,
        background_nice: int = DEFAULT_NICE,
        rollback_every: int | None = None,
        request_poll_s: float = 0.5,
    ) -> None:
        try:
            self.job_id = check_job_id(job_id)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        for name, value in (
            ("persist_every", persist_every),
            ("keep_memory", keep_memory),
            ("keep_peer", keep_peer),
            ("keep_persistent", keep_persistent),
            *([("rollback_every", rollback_every)] if rollback_every is not None else []),
        ):
            if not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{name} must be an integer ≥ 1, not {value!r}")
        self.persist_every = persist_every
        self.keep = {"memory": keep_memory, "peer": keep_peer, "persistent": keep_persistent}
        self.latency_every = latency_every
        self.write_threads = max(1, int(write_threads))
        self.background_nice = background_nice
        self.collectives = CheckpointCollectives(timeout_s=timeout_s, train_group=process_group)
        self.distributed = self.collectives.distributed
        self.rank = self.collectives.rank
        self.world_size = self.collectives.world_size
        self.rollback_every = rollback_every

        self.agent_url = (
            agent_url or os.environ.get("TIERWATCH_AGENT_URL") or DEFAULT_AGENT_URL
        ).rstrip("/")
        try:
            credential = job_credential_from_env(job_credential)
        except CredentialError as exc:
            raise CheckpointError(str(exc)) from None
        claimed = unverified_job_id(credential) if credential else None
        if claimed is not None and claimed != self.job_id:
            raise CheckpointError(
                f"the job credential is for job {claimed!r}, not {self.job_id!r}: give each "
                "job its own credential"
            )
        try:
            # signs this rank's manifests; restore checks every step against it
            # (docs/security.md "Integrity of restored steps")
            self.manifest_key = manifest_key_of(credential) if credential else None
        except CredentialError as exc:
            raise CheckpointError(str(exc)) from None
        self.verifier = StepVerifier(self.manifest_key, self.rank)
        self.client = AgentClient(self.agent_url, token=credential)
        info: dict[str, Any] = {}
        try:
            info = self.client.info()
        except AgentRefused as exc:
            raise CheckpointError(
                f"{exc}. "
                + (
                    f"No job credential was given for {self.job_id}: register the job with "
                    "the server (tierwatch-server job credential, or POST "
                    "/api/v1/jobs/{job_id}/credential) and hand the credential to every rank "
                    "in TIERWATCH_JOB_CREDENTIAL_FILE (or TIERWATCH_JOB_CREDENTIAL)"
                    if credential is None
                    else "Register the job again for a new credential"
                )
            ) from None
        except AgentUnavailable as exc:
            log.warning("rank %d: %s; using the memory folder without the agent", self.rank, exc)
        chosen_dir = memory_dir or info.get("memory_dir") or os.environ.get("TIERWATCH_MEMORY_DIR")
        if not chosen_dir:
            raise CheckpointError(
                f"no memory folder for the checkpoint: the agent at {self.agent_url} is "
                "unreachable and neither memory_dir= nor TIERWATCH_MEMORY_DIR is set"
            )
        self.node = (
            node or info.get("node") or os.environ.get("TIERWATCH_NODE") or socket.gethostname()
        )
        self.peer_url = str(info.get("peer_url") or self.agent_url)
        self.memory_budget = int(info.get("memory_budget_bytes") or 0)
        self.layout = MemoryLayout(chosen_dir)
        self.job_dir = self.layout.job_dir(self.job_id)
        self.job_dir.mkdir(parents=True, exist_ok=True)

        nodes = self.collectives.all_gather((self.node, self.peer_url))
        self.nodes_by_rank: list[str] = [n for n, _ in nodes]
        self.peer_urls: dict[str, str] = dict(nodes)
        self.files = RankFiles(self.layout, self.job_id, self.rank)
        self.files.clean_torn_writes()
        # the rollbacks served, as every rank's node recorded them
        timeline = Timeline.merge(
            self.collectives.all_gather(Timeline.read(self.layout.timeline_file(self.job_id)))
        )

        self.progress_file = self.layout.progress_file(self.job_id, self.rank)
        self.events = EventSender(self.client, progress_file=self.progress_file)
        self._stager = SnapshotStager()
        self._queue: queue.Queue[_SaveJob | None] = queue.Queue()
        self._inflight: _SaveJob | None = None
        self._hook_wait = 0.0
        self._hooks: list[Any] = []
        self._hooked: set[int] = set()
        self._last_step: int | None = None
        self._last_save_at: float | None = None
        self._saves = 0
        self.plan_cache_key = cache_key(self.job_id)  # DCP plan caching (planner.py)
        self._signature: str | None = None
        # Rank 0's view of what each tier holds (seeded by restore).
        self._history = History()
        self.closed = False
        self._worker = threading.Thread(
            target=self._work, name="tierwatch-ckpt-writer", daemon=True
        )
        self._worker.start()
        self._poller = RequestPoller(self.client, self.job_id, period_s=request_poll_s)
        self._rollback = RollbackServer(self, self._poller, timeline, every=rollback_every)
        self.last_restore: RestoreReport | None = None
        if self.rank == 0:
            self.events.progress(
                JobProgress(
                    job_id=self.job_id,
                    rank=0,
                    world_size=self.world_size,
                    step=0,
                    ts=utcnow(),
                    layout=self.nodes_by_rank,
                ),
                completed=False,
            )
        # job.json is written at the first save, once the job's existing steps are known to
        # be this model's at this world size (a refused restart leaves the old job's alone)

    # -- what restore and rollback read and record ---------------------------------------------
    @property
    def fences(self) -> list[tuple[int, int]]:
        """``(request_id, step)`` of every rollback in the job's history, oldest first."""
        return list(self._rollback.timeline.fences)

    def restored(self, step: int, *, history: History | None = None) -> None:
        """Record that ``step`` is now loaded (called by restore): the next save must be
        after it; ``history`` (rank 0): the steps the tiers hold."""
        self._last_step = step
        if history is not None:
            self._history = history

    def record_restore(self, report: RestoreReport) -> None:
        """Keep ``report`` as :attr:`last_restore` and queue it for the agent."""
        self.last_restore = report
        self.events.restore(report)

    def drop_steps_after(self, step: int, *, why: str) -> None:
        """Remove this rank's memory files of every step above ``step`` (an ``evicted``
        event each, ``why`` as message) and forget them in rank 0's history."""
        for newer in self.layout.steps(self.job_id):
            if newer > step and self.files.remove(newer):
                self._event(newer, "memory", "evicted", message=why)
        if self.rank == 0:
            self._history = self._history.up_to(step)

    # -- files -----------------------------------------------------------------------------
    def _write_job_file(self) -> None:
        data = {
            "job_id": self.job_id,
            "world_size": self.world_size,
            "layout": self.nodes_by_rank,
            "peer_urls": self.peer_urls,
            "persist_every": self.persist_every,
            "keep": self.keep,
            "updated_at": utcnow().isoformat(),
            "finished": False,
        }
        try:
            atomic_write_json(self.layout.job_file(self.job_id), data, fsync=False)
        except OSError as exc:
            log.warning("cannot write %s: %s", self.layout.job_file(self.job_id), exc)

    # -- optimizer hooks ---------------------------------------------------------------------
    def _hook_optimizers(self, adapter: StateAdapter) -> None:
        for optim in adapter.optimizers.values():
            if id(optim) not in self._hooked:
                self._hooks.append(optim.register_step_pre_hook(self._before_optimizer_step))
                self._hooked.add(id(optim))

    def _before_optimizer_step(self, *_args: Any) -> None:
        job = self._inflight
        if job is None or job.done.is_set():
            return
        if not job.copy_done.is_set():  # host copies made, CUDA copies enqueued
            t0 = time.monotonic()
            while not job.copy_done.wait(1.0):
                self._check_worker()
            self._hook_wait += time.monotonic() - t0
        # the step may now change the sources; on CUDA its stream waits for the copies
        job.pending.before_optimizer_step()

    def _check_worker(self) -> None:
        """Raise if the background writer is gone (it never is, unless the interpreter is
        shutting down): waiting for it would hang training."""
        if not self._worker.is_alive():
            raise CheckpointError(
                "the checkpoint writer thread has stopped; see the log for "
                "the error, then restart the job"
            )

    # -- save --------------------------------------------------------------------------------
    def _stage_state(self, state: dict[str, Any]) -> tuple[dict[str, Any], PendingCopies]:
        """Stage ``state`` for a save (see :meth:`save`): the staged state dict and the
        copies left for the writer.

        Raises:
            CheckpointError: the job id holds steps of another model or world size here.
            Exception: what staging raised (a bad state, a CUDA error in a clone).
        """
        adapter = StateAdapter(state)
        live = adapter.live()
        if self._signature is None:
            signature = adapter.signature(live.state_dict)
            self._refuse_foreign_steps(signature)
            self._signature = signature
            self._write_job_file()
        lazy_allowed = bool(live.optim_keys)
        self._hook_optimizers(adapter)

        def lazy(path: tuple[Any, ...], t: torch.Tensor) -> bool:
            if not lazy_allowed:
                return False
            return path[0] in live.optim_keys or data_ptr(t) in live.param_ptrs

        return self._stager.stage(live.state_dict, lazy)

    def _queue_refused(self, step: int, t0: float, why: str) -> None:
        """Queue ``step`` for the writer as refused by this rank (``why``): it enters the
        step's first exchange with that verdict, so every rank drops the step together."""
        job = _SaveJob(
            step=step, staged={}, pending=PendingCopies(), staged_bytes=0, started=t0, refused=why
        )
        job.copy_done.set()
        self._inflight = job
        self._last_step, self._last_save_at = step, t0
        self._queue.put(job)

    def save(self, step: int, state: dict[str, Any], *, persist: bool | None = None) -> None:
        """Checkpoint ``state`` as it is after ``step`` completed.

        Returns once the state is staged (see the class notes); the write, checksums,
        replication and upload happen in the background.

        Args:
            step: The step just completed (an int ≥ 0, larger than the previous save's).
            state: name → model / optimizer / scheduler / Stateful / value.
            persist: True sends this step to the persistent tier whatever the cadence (e.g.
                the last step of a run); None leaves it to ``persist_every``. Rank 0's value
                decides for all ranks.

        Raises:
            CheckpointError: a bad step or state, the job id holds steps of another model or
                world size in this node's memory tier, or the checkpointer is closed.
            Exception: staging failed on this rank (e.g. a CUDA error in a clone). The step
                is refused on every rank all the same (a ``failed`` event there names this
                rank and the cause), so the ranks' next saves stay in step.
        """
        t0 = time.monotonic()
        if self.closed:
            raise CheckpointError("save() after close()")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"step must be an integer ≥ 0, not {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise CheckpointError(
                f"step {step} is not after the previous save's step "
                f"{self._last_step}: steps must increase"
            )
        self._finish_inflight()

        try:
            staged, pending = self._stage_state(state)
        except Exception as exc:
            # the other ranks' writers wait in this step's first exchange: refuse the step
            # there, with the cause, rather than leave them waiting for timeout_s
            self._queue_refused(step, t0, f"staging failed: {describe_error(exc)}")
            raise
        job = _SaveJob(
            step=step,
            staged=staged,
            pending=pending,
            staged_bytes=self._stager.staged_bytes,
            started=t0,
            persist=bool(persist),
            fences=self.fences,
            save_id=new_save_id() if self.rank == 0 else "",
            index=self._saves + 1,
        )
        if not pending.pairs:
            job.copy_done.set()
        self._hook_wait = 0.0
        self._inflight = job
        self._queue.put(job)

        step_time = None
        if self._last_save_at is not None and self._last_step is not None:
            step_time = (t0 - self._last_save_at) / max(1, step - self._last_step)
        self._last_step, self._last_save_at = step, t0
        self._saves += 1
        job.blocking_s = time.monotonic() - t0
        self.events.progress(
            JobProgress(
                job_id=self.job_id,
                rank=self.rank,
                world_size=self.world_size,
                step=step,
                step_time_s=step_time,
                ts=utcnow(),
                layout=self.nodes_by_rank if self.rank == 0 and self._saves % 100 == 1 else None,
            )
        )
        if self.latency_every and self.distributed and self._saves % self.latency_every == 0:
            self._probe_latency()

    def _probe_latency(self) -> None:
        """Time a 1-element all_reduce on the training group and report it (ms)."""
        sample = LatencySample(
            job_id=self.job_id,
            rank=self.rank,
            world_size=self.world_size,
            ts=utcnow(),
            latency_ms=self.collectives.latency_ms(),
        )
        threading.Thread(target=self._post_latency, args=(sample,), daemon=True).start()

    def _post_latency(self, sample: LatencySample) -> None:
        try:
            self.client.post_latency([sample.model_dump(mode="json")])
        except AgentUnavailable as exc:
            log.debug("collective latency not delivered: %s", exc)

    def _finish_inflight(self) -> None:
        """Wait for the in-flight save to commit in memory and report its staging."""
        job = self._inflight
        if job is None:
            return
        while not job.done.wait(1.0):
            self._check_worker()
        blocking = job.blocking_s + self._hook_wait
        self._hook_wait = 0.0
        self._inflight = None
        self._rollback.offer(job.index, job.agreed_request)
        self.events.event(
            CheckpointEvent(
                job_id=self.job_id,
                step=job.step,
                tier="memory",
                kind="staged",
                rank=self.rank,
                world_size=self.world_size,
                ts=utcnow(),
                bytes=job.staged_bytes,
                blocking_s=blocking,
                seconds=job.write_s,
            )
        )
        self.last_blocking_s = blocking

    def wait(self) -> bool:
        """Wait for the in-flight save; True when it committed in the memory tier."""
        job = self._inflight
        if job is None:
            return True
        self._finish_inflight()
        return job.committed

    # -- background writer --------------------------------------------------------------------
    def _work(self) -> None:
        lower_this_thread(self.background_nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(job)
            # BaseException: torch.distributed.checkpoint's CheckpointException derives from
            # it, and a writer thread that died would leave the next optimizer step waiting
            # for a copy nobody makes.
            except BaseException as exc:  # noqa: BLE001 - becomes an event; training goes on
                log.exception("rank %d: checkpoint of step %d failed", self.rank, job.step)
                job.error = describe_error(exc)
                self._event(job.step, "memory", "failed", message=job.error[:2000])
            finally:
                job.copy_done.set()
                job.done.set()

    def _event(self, step: int, tier: str, kind: str, **kw: Any) -> None:
        self.events.event(
            CheckpointEvent(
                job_id=self.job_id,
                step=step,
                tier=tier,  # type: ignore[arg-type]
                kind=kind,
                rank=self.rank,  # type: ignore[arg-type]
                world_size=self.world_size,
                ts=utcnow(),
                **kw,
            )
        )

    def _write(self, job: _SaveJob) -> None:
        from torch.distributed.checkpoint import save as dcp_save

        from tierwatch.agent.checkpoint.training.digesting_writer import DigestingWriter

        t0 = time.monotonic()
        # a tensor changed outside the hooked optimizer step makes a torn snapshot
        torn = job.refused
        if torn is None:
            try:
                torn = job.pending.run(issued=job.copy_done.set)
            except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error: this rank's verdict
                # below, so the other ranks learn of it at once instead of after timeout_s
                torn = f"snapshot copy failed: {describe_error(exc)}"[:1500]
        job.copy_done.set()

        # 1. Agree that every rank can write (a rank that skipped dcp.save alone would
        #    leave the others waiting in its collectives); the same exchange hands rank 0's
        #    save id to every rank (docs/checkpointing.md "Save identity").
        pins = self.pinned_steps()
        reason = torn or self._budget_problem(job.staged_bytes, pins)
        #    It also carries each rank's newest unserved restore request, so that
        #    maybe_rollback() needs no collective of its own (RollbackServer.offer).
        gathered_verdicts = self.collectives.all_gather(
            (reason, job.save_id, self._rollback.newest_unserved())
        )
        verdicts = [v for v, _, _ in gathered_verdicts]
        job.save_id = str(gathered_verdicts[0][1])
        job.agreed_request = min(int(r) for _, _, r in gathered_verdicts)
        problems = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v]
        if problems:
            job.error = "; ".join(problems)[:2000]
            self._event(
                job.step,
                "memory",
                "failed",
                bytes=job.staged_bytes,
                message=f"step {job.step} not written: {job.error}",
            )
            return

        # 2. Write under a temporary name, then move into step-<N>/ and checksum.
        tmp = self.layout.tmp_step_dir(self.job_id, job.step, self.rank)
        step_dir = self.layout.step_dir(self.job_id, job.step)
        error: str | None = None
        names: list[str] = []
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            writer = DigestingWriter(tmp, sync_files=False, thread_count=self.write_threads)
            dcp_save(
                job.staged,
                storage_writer=writer,
                planner=CachedSavePlanner(self.plan_cache_key),
                process_group=self.collectives.group,
                no_dist=not self.distributed,
            )
            step_dir.mkdir(parents=True, exist_ok=True)
            self.files.remove_stale(step_dir)
            names = sorted(
                p.name for p in tmp.iterdir() if p.name == METADATA or p.name.endswith(".distcp")
            )
            for name in names:
                os.replace(tmp / name, step_dir / name)
            shutil.rmtree(tmp, ignore_errors=True)
            manifest = make_manifest(
                job_id=self.job_id,
                step=job.step,
                rank=self.rank,
                world_size=self.world_size,
                node=self.node,
                directory=step_dir,
                names=names,
                signature=self._signature or "",
                created_at=utcnow().isoformat(),
                fences=job.fences,
                save_id=job.save_id,
                key=self.manifest_key,
                known=writer.digests,  # hashed while written: no read-back of the shards
            )
            atomic_write_json(step_dir / manifest_name(self.rank), manifest, fsync=False)
            nbytes = manifest.total_bytes()
        except BaseException as exc:  # noqa: BLE001 - reported to every rank below (DCP's
            # CheckpointException is a BaseException)
            error = describe_error(exc)[:1500]
            nbytes = 0
            shutil.rmtree(tmp, ignore_errors=True)
        job.write_s = time.monotonic() - t0

        # 3. Every rank's outcome and the steps its agent's restore requests pin; rank 0
        #    decides commit, persistence and retention (pinned steps stay in every tier).
        gathered = self.collectives.all_gather((error, sorted(pins)))
        outcomes = [e for e, _ in gathered]
        pinned = sorted({s for _, steps in gathered for s in steps})
        decision = None
        if self.rank == 0:
            decision, self._history = self._decide(
                job.step,
                outcomes,
                self._history,
                persist_every=self.persist_every,
                keep=self.keep,
                force_persist=job.persist,
                pinned=pinned,
            )
        decision = self.collectives.broadcast_from_0(decision)
        if not decision.committed:
            self.files.remove(job.step)
            job.error = decision.why
            self._event(
                job.step,
                "memory",
                "failed",
                bytes=nbytes,
                seconds=job.write_s,
                message=f"step {job.step} not committed: {decision.why}",
            )
            return
        marker = CommitMarker(
            job_id=self.job_id,
            step=job.step,
            rank=self.rank,
            world_size=self.world_size,
            persist=decision.persist,
            retain=decision.retain,
            layout=self.nodes_by_rank,
            peer_urls=self.peer_urls,
            created_at=utcnow().isoformat(),
            save_id=job.save_id,
        )
        if self.manifest_key is not None:
            marker = sign_commit(marker, self.manifest_key)
        atomic_write_json(step_dir / commit_name(self.rank), marker, fsync=False)
        job.committed = True
        self._event(job.step, "memory", "committed", bytes=nbytes, seconds=job.write_s)
        self._retain_memory(decision.retain["memory"], job.step)
        try:
            self.client.notify(self.job_id, job.step)
        except AgentUnavailable as exc:
            log.debug("notify failed (the agent scans on its own): %s", exc)

    def _decide(
        self, step: int, outcomes: list[str | None], history: History, **kw: Any
    ) -> tuple[CommitDecision, History]:
        """Rank 0: :func:`.commit_decision.decide_commit` (same arguments), whose failure is
        a step not committed: rank 0 still broadcasts, so no rank waits for ``timeout_s``."""
        try:
            return decide_commit(step, outcomes, history, **kw)
        except Exception as exc:  # noqa: BLE001 - every rank reports it (failed event)
            why = f"rank 0: commit decision failed: {describe_error(exc)}"[:1800]
            return CommitDecision(committed=False, why=why), history

    def _retain_memory(self, keep: list[int], newest: int) -> None:
        """Remove this rank's files of memory steps rank 0 did not retain.

        ``keep`` holds the steps pinned by pending restore requests (rank 0's decision); the
        steps this rank's agent pins now are kept too (a request that arrived since).

        The newest step marked for the persistent tier stays until this node's agent has
        uploaded it (``.tier-<r>.json`` says so): the agent reads the upload from memory,
        and with saves every step retention would otherwise evict it mid-upload. An older
        persist step is superseded (the agent uploads the newest one) and goes. A step the
        agent is replicating or uploading right now stays too: it pins it, and the removal
        runs under the agent's pin lock (docs/checkpointing.md, "Backpressure").
        """
        pinned = self.pinned_steps()
        steps = self.layout.steps(self.job_id)
        with held_steps(self.layout.job_dir(self.job_id)) as in_transfer:
            for step in memory_evictions(
                steps,
                retained=keep,
                newest=newest,
                pinned=[*pinned, *in_transfer],
                uploading=self.files.pending_upload(steps),
            ):
                if self.files.remove(step):
                    self._event(step, "memory", "evicted")

    def _refuse_foreign_steps(self, signature: str) -> None:
        """Refuse to save over steps of another model or world size in this node's memory
        tier: retention would evict them.

        Raises:
            CheckpointError: a manifest of this rank in the job's folder has another
                signature or world size (names the step and what to do).
        """
        for m in self.files.manifests():  # the newest step first, for the message
            if m.world_size != self.world_size or (m.signature and m.signature != signature):
                what = (
                    f"world_size {m.world_size}"
                    if m.world_size != self.world_size
                    else "a different model (other FQNs or shapes)"
                )
                raise CheckpointError(
                    f"job_id {self.job_id!r} already holds step {m.step} of {what} in "
                    f"{self.job_dir}; saving would evict it. Use another job_id, or free this "
                    f"one with `tierwatch-agent ckpt gc --job {self.job_id}` on every node"
                )

    def _budget_problem(self, nbytes: int, pins: dict[int, list[int]] | None = None) -> str | None:
        if self.memory_budget <= 0:
            return None
        # the pinned staging slab is node RAM too, and it cannot be swapped out
        pinned_slab = self._stager.pinned_bytes
        used = _dir_bytes(self.layout.root) + pinned_slab
        if used + nbytes > self.memory_budget:
            pinned = (
                (
                    f" (in use includes {describe_pins(pins)}, kept while those restore "
                    "requests are pending)"
                )
                if pins
                else ""
            )
            if pinned_slab:
                pinned += (
                    f" (in use includes this rank's pinned staging slab: {_human(pinned_slab)})"
                )
            return (
                f"node {self.node} memory budget exceeded: {_human(used)} in use + "
                f"{_human(nbytes)} for this step > budget {_human(self.memory_budget)}"
                f"{pinned}; raise the agent's --memory-budget or keep fewer steps "
                "(keep_memory)"
            )
        return None

    def pinned_steps(self) -> dict[int, list[int]]:
        """Steps named by the restore requests this rank's agent holds for the job (not
        served, not expired): step → request ids, from the poller's last answer (no network).

        Retention keeps them in every tier until the request is served or expires: rank 0
        adds every rank's pins to its retention decision, so a request one node's agent got
        first already protects the step on all nodes.
        """
        return self._rollback.pinned_steps()

    # -- restore -------------------------------------------------------------------------------
    def restore(self, state: dict[str, Any], step: int | None = None) -> int | None:
        """Load the newest step that is complete across the reachable tiers into ``state``.

        When an operator's restore request is pending on the agents (the job was down when
        it came) and not served yet, its step (from its tier) is loaded instead, exactly as
        :meth:`maybe_rollback` would have; if that fails (reported), the newest step is.

        Args:
            state: The same structure that is passed to :meth:`save`.
            step: Load exactly this step instead of the newest (pending requests are then
                left for :meth:`maybe_rollback`).

        Returns:
            The step loaded, or None when no tier holds a complete step of this job.

        Raises:
            CheckpointError: ``step`` is not restorable (the message lists the steps that
                are), the job id holds a different model, or an agent cannot be reached.
        """
        from tierwatch.agent.checkpoint.training.restore import restore_state

        if self.closed:
            raise CheckpointError("restore() after close()")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise CheckpointError(f"step must be None (the newest) or an integer ≥ 0, not {step!r}")
        self._finish_inflight()
        if step is None:
            loaded = self._rollback.serve_pending_at_start(state)
            if loaded is not None:
                return loaded
        return restore_state(self, state, wanted=step)

    # -- rollback ------------------------------------------------------------------------------
    def maybe_rollback(self, state: dict[str, Any], *, step: int | None = None) -> int | None:
        """Roll back in-process when an operator asked for it (a restore request).

        Call it on every rank at the same place of every training step, after the step
        (and its :meth:`save`, if any). A rank acts on the newest request every rank's agent
        has handed out, and all ranks act at the same call. How they agree adds no collective
        to the training step:

        - each save's first exchange (the all_gather every rank's writer runs anyway) also
          carries each rank's newest unserved request id; its minimum is the request every
          rank knew then;
        - every rank has joined that save by its next :meth:`save` call, so the first call
          after the next save acts on it: a request is served within two save intervals of
          reaching every rank's agent (plus ``request_poll_s``);
        - with ``rollback_every=K``, every K-th call also runs an 8-byte all_reduce (MIN) of
          the ids, for jobs that save rarely;
        - a one-process job reads its agent's requests at every call (no collective).

        Then:

        1. the in-flight save is waited for, and each rank reports ``phase="staging"``;
        2. the request's step is restored collectively (from its ``tier`` only, when it
           names one) into the live ``state`` (model, optimizer, scheduler, RNG, sampler);
        3. the steps above it (a diverged future) are dropped from every tier: memory by the
           ranks, replicas and persistent by the agents (``evicted`` events), and fenced
           off (``timeline.json``, and the fence in every later manifest);
        4. each rank reports ``phase="loaded"`` with step, seconds, ``steps_lost`` (``step``
           − the restored step), files per tier; then the request is retired (never served
           twice, also after a restart).

        A request that cannot be served (its tier does not hold the step completely, the
        step is gone) is reported ``phase="failed"`` and retired; ``state`` is untouched and
        None is returned. Older requests that a newer one overtook before every rank knew
        them are reported failed ("superseded").

        Args:
            state: The structure passed to :meth:`save`.
            step: The step the loop just completed (for ``steps_lost``; default: the last
                saved step).

        Returns:
            None (go on with ``step + 1``), or the step whose state is now loaded: the
            caller continues with ``restored + 1``, exactly as after :meth:`restore`, and
            must re-create iterators over restored objects (``iter(sampler)``; a
            ``DataLoader`` over a :class:`ResumableDistributedSampler`), since an iterator
            begun before the rollback goes on from its own position.

        Raises:
            CheckpointError: the checkpointer is closed, or the load failed midway (the live
                state may be partly overwritten: restart the job; the request is not
                retired, so the restart loads its step).
        """
        if self.closed:
            raise CheckpointError("maybe_rollback() after close()")
        return self._rollback.maybe_rollback(
            state, last_done=self._last_step if step is None else step, saves=self._saves
        )

    def finish(self) -> None:
        """Mark the job finished in the node's memory folder (``tierwatch-agent ckpt gc
        --finished`` then frees it)."""
        data_path = self.layout.job_file(self.job_id)
        self._write_job_file()
        try:
            data = json.loads(data_path.read_text())
            data["finished"] = True
            atomic_write_json(data_path, data, fsync=False)
        except (OSError, ValueError) as exc:
            log.warning("cannot mark %s finished: %s", self.job_id, exc)

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait for pending work, deliver queued events, stop the background threads."""
        if self.closed:
            return
        self._finish_inflight()
        self.closed = True
        self._queue.put(None)
        self._worker.join(timeout_s)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._poller.close()
        forget(self.plan_cache_key)
        self.events._write_progress()
        self.events.close(min(timeout_s, 5.0))
        self.client.close()

    def __enter__(self) -> TieredCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The agent's checkpoint service and its HTTP endpoints (docs/checkpointing.md).

:class:`CheckpointService` wires the memory store, the persistent tier, the tier worker and
the restore stager for one agent. :func:`ckpt_router` exposes them:

Trainer-facing (control endpoints: the agent token, or the job's credential for its own
job; loopback grants nothing, :mod:`tierwatch.agent.access`):

- ``GET /v1/ckpt/info`` → ``{node, memory_dir, peer_url, memory_budget_bytes,
  memory_used_bytes, persistent_url, persistent_error, replication, peer_tier}``
  (``persistent_error``: why the persistent tier is unavailable, null when it works)
- ``POST /v1/ckpt/events`` ``{events, progress, restores}`` → ``{queued: {events, progress,
  restores}}``: queued into the next report
- ``POST /v1/ckpt/notify`` ``{job_id, step}`` → ``{ok: true}``: wake the tier worker
- ``GET /v1/ckpt/jobs/{job_id}/available?persistent=0|1`` → ``{node, peer_url, entries:
  [{tier, holder, url, src, step, rank, manifest}], errors: [str]}``
- ``POST /v1/ckpt/jobs/{job_id}/stage`` ``{step, files: [{name, size, xxh3, sources: [{tier,
  holder, url, src}]}]}`` → ``{ok, dir, files: [{name, tier, holder}], errors: [str]}``
- ``GET /v1/ckpt/jobs/{job_id}/restore-requests`` → ``{requests: [RestoreRequest]}``: operator
  restore requests for the job's ranks, oldest first (:mod:`.requests`)
- ``DELETE /v1/ckpt/jobs/{job_id}/restore-requests/{request_id}`` → ``{retired: [id]}``: the
  ranks served (or gave up) ``request_id``; it and older requests of the job are retired
- ``POST /v1/ckpt/jobs/{job_id}/rollback`` ``{request_id, step, persistent}`` → ``{evicted:
  {peer: [step], persistent: [step]}, errors: [str]}``: the ranks rolled back to ``step``;
  the job's steps above it go from the replicas this agent holds and, with ``persistent``,
  from the persistent tier (``evicted`` events)

Peer endpoints (signed by the calling node: ``X-Tierwatch-Node-Certificate`` and
``Authorization: TierwatchNode <proof>``, :mod:`tierwatch.agent.peer_identity`; 401 when the
request does not authenticate as a node; 403 when that node is not one of the job's by the
server's registry, pushes another node's replicas, or a rank the pinned layout places
elsewhere):

- ``PUT /v1/peer/replicas/{src_node}/{job_id}/{step}/{name}`` body = bytes, header
  ``X-Tierwatch-Xxh3`` → ``{ok, name, bytes, xxh3, evicted: [step]}``; 409 size/checksum
  mismatch, 422 bad names, 507 over the memory budget
- ``DELETE /v1/peer/replicas/{src_node}/{job_id}/{step}`` → ``{deleted: bool}``
- ``GET /v1/peer/files/{job_id}/{step}/{name}?tier=memory|peer&src=<node>`` → the bytes
"""

import logging
import socket
import threading
from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from tierwatch.agent.access import Caller, LocalAccess, require_jobs
from tierwatch.agent.checkpoint.format.layout import (
    LayoutError,
    MemoryLayout,
    check_file_name,
    check_job_id,
    check_node_name,
    check_step,
    rank_of_file,
)
from tierwatch.agent.checkpoint.tierstore.persister import PersistentError, PersistentTier
from tierwatch.agent.checkpoint.tierstore.replicator import XXH3_HEADER, PeerClient
from tierwatch.agent.checkpoint.tierstore.requests import RequestStore, parse_restore_command
from tierwatch.agent.checkpoint.tierstore.restore_staging import RestoreStager, StageRequest
from tierwatch.agent.checkpoint.tierstore.store import MemoryStore, StoreError
from tierwatch.agent.checkpoint.tierstore.worker import TierWorker
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.credential_keys import ServerKeys
from tierwatch.agent.fsutil import iter_file
from tierwatch.agent.peer_identity import (
    CERT_HEADER,
    SCHEME,
    PeerAuthError,
    PeerCaller,
    ReplayCache,
    verify_request,
)
from tierwatch.agent.protocol import (
    CheckpointEvent,
    Command,
    JobId,
    JobProgress,
    RestoreReport,
    utcnow,
)
from tierwatch.agent.registry import PeerRegistry

log = logging.getLogger(__name__)

EventSink = Callable[[CheckpointEvent], None]
UPLOAD_BUFFER = 1024 * 1024


class RollbackRefused(Exception):
    """A rollback that no restore request of the job backs (answered 409)."""


class CheckpointService:
    """The tiered checkpoint store of one agent.

    Args:
        settings: Agent settings (node, memory_dir, persistent_url, replication,
            memory_budget, ckpt_scan_interval).
        emit: Receives every checkpoint event (the runtime queues them into the next report).
        registry: The server's node registry (None: no peer tier).
        keys: The server's public keys; the job credentials they check give the tier
            worker each job's manifest key (:meth:`job_key`).

    Raises:
        OSError: the memory folder cannot be created.

    A persistent URL that cannot be used (unknown protocol, s3fs missing) does not stop the
    service: the persistent tier is marked unavailable (``persistent_error`` in :meth:`info`),
    a WARNING is logged at start and every step to persist gets a ``failed`` event.
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        emit: EventSink,
        registry: PeerRegistry | None = None,
        keys: ServerKeys | None = None,
    ) -> None:
        self.settings = settings
        self.keys = keys
        self.emit = emit
        self.node = settings.node or ""
        self.started = False  # set by start(): agent.json written, worker running
        root = settings.resolved_memory_dir()
        # restore requests pin their steps: retention of replicas and of the persistent tier
        # (and the ranks' memory retention, through the requests they read) keeps them. They
        # live in the agent's own state folder, not in the memory folder the node's trainers
        # can all write: a planted request would roll a job back (docs/security.md)
        self.requests = RequestStore(MemoryLayout(settings.resolved_state_dir() / "requests"))
        self.store = MemoryStore(
            root,
            node=self.node,
            budget_bytes=settings.resolved_memory_budget(),
            pins=self.requests.pinned_steps,
        )
        url = settings.resolved_persistent_url()
        try:
            self.persistent = PersistentTier(
                url,
                settings.persistent_storage_options(),
                part_size=settings.s3_part_size,
                upload_concurrency=settings.s3_upload_concurrency,
            )
        except PersistentError as exc:  # the memory and peer tiers work without it
            self.persistent = PersistentTier.unavailable(url, str(exc))
        # peers authenticate as nodes (agent/peer_identity.py); addresses and job
        # membership come from the server's registry
        self.registry = registry
        self.replays = ReplayCache()
        self.peer_url = ""
        self._peer = PeerClient(registry) if registry is not None else None
        self.worker = TierWorker(
            self.store,
            self.persistent,
            emit=emit,
            peer=self._peer,
            replication=settings.replication,
            scan_interval_s=settings.ckpt_scan_interval,
            nice=settings.ckpt_nice,
            job_key=self.job_key,
        )
        self.restore_stager = RestoreStager(
            self.store.layout,
            node=self.node,
            peer=self._peer,
            emit=emit,
            persistent=self.persistent,
        )
        self.agent_info: dict[str, Any] = {}

    def job_key(self, job_id: str) -> bytes | None:
        """The job's manifest key: from a credential one of its ranks sent (checked by
        ``keys``), else from the server's registry (cached, kept across restarts in the
        registry cache); None while neither has it."""
        key = self.keys.manifest_key(job_id) if self.keys is not None else None
        if key is None and self.registry is not None:
            job = self.registry.job(job_id)
            key = job.manifest_key if job is not None else None
        return key

    def start(self, listen_host: str, port: int) -> None:
        """Write ``agent.json`` and start the tier worker.

        Args:
            listen_host: The local API's bind host.
            port: The port it actually listens on.

        Raises:
            OSError: ``agent.json`` cannot be written.
        """
        self.peer_url = self.settings.advertise_url or default_advertise_url(listen_host, port)
        self.agent_info = self.store.write_agent_file(
            peer_url=self.peer_url, persistent_url=self.persistent.shown_url
        )
        if self.registry is not None:  # ask for this node's certificate in the background
            threading.Thread(
                target=self.registry.register,
                args=(self.peer_url,),
                name="tierwatch-peer-certificate",
                daemon=True,
            ).start()
        self.worker.start()
        self.started = True
        problem = self.persistent.write_problem()
        if not self.persistent.available:
            log.warning(
                "persistent tier unavailable: %s; the memory and peer tiers work, "
                "every step to persist gets a failed event",
                problem,
            )
        elif problem is not None:
            log.warning(
                "persistent tier %s looks unwritable: %s; uploads will fail until that is fixed",
                self.persistent.shown_url,
                problem,
            )
        log.info(
            "checkpoint store: memory %s (budget %d bytes), persistent %s, peer URL %s, "
            "replication %d%s",
            self.store.root,
            self.store.budget_bytes,
            self.persistent.shown_url,
            self.peer_url,
            self.settings.replication,
            "" if self.registry is not None else " (no server registry: no peer tier)",
        )

    def stop(self) -> None:
        """Stop the tier worker."""
        self.worker.stop()
        if self._peer is not None:
            self._peer.close()
        if self.registry is not None:
            self.registry.close()

    def info(self) -> dict[str, Any]:
        """The answer of ``GET /v1/ckpt/info``."""
        return {
            "node": self.node,
            "memory_dir": str(self.store.root),
            "peer_url": self.peer_url,
            "memory_budget_bytes": self.store.budget_bytes,
            "memory_used_bytes": self.store.used_bytes(),
            "persistent_url": self.persistent.shown_url,  # credentials redacted
            "persistent_error": self.persistent.error,
            "replication": self.settings.replication,
            "peer_tier": self.registry is not None and self.settings.replication > 0,
        }

    def available(self, job_id: str, *, persistent: bool) -> dict[str, Any]:
        """The answer of ``GET /v1/ckpt/jobs/{job_id}/available``.

        Raises:
            LayoutError: a bad job id.
        """
        entries = self.store.available(job_id, self.peer_url)
        errors: list[str] = []
        if persistent and not self.persistent.available:
            errors.append(f"persistent tier unavailable: {self.persistent.error}")
        elif persistent:
            try:
                for step in self.persistent.steps(job_id):
                    if not self.persistent.has_metadata(job_id, step):
                        continue
                    # credentials redacted: staging reads its own tier, not this URL
                    url = self.persistent.shown_step_url(job_id, step)
                    for m in self.persistent.manifests(job_id, step):
                        entries.append(
                            {
                                "tier": "persistent",
                                "holder": "persistent",
                                "url": url,
                                "src": m.node,
                                "step": step,
                                "rank": m.rank,
                                "manifest": m.model_dump(mode="json"),
                            }
                        )
            except PersistentError as exc:
                errors.append(str(exc))
        return {"node": self.node, "peer_url": self.peer_url, "entries": entries, "errors": errors}

    # -- restore requests ------------------------------------------------------------------
    def add_restore_request(self, command: Command) -> None:
        """Keep a ``restore`` command for the job's ranks on this node.

        The request is written to ``requests/jobs/<job>/restore-requests/request-<id>.json``
        in the agent's state folder (fsync'd, so an agent restart keeps it; never in the memory
        folder, which the node's trainers can write); the ranks read it through
        ``GET /v1/ckpt/jobs/{job}/restore-requests``, roll back (or restore it at their next
        start) and retire it. A request id the ranks already retired is ignored (a command
        delivered again). While it is pending (not retired, not expired), its step is
        *pinned*: this agent's replica eviction and persistent retention keep it, and the
        ranks keep it in memory (docs/checkpointing.md, "Pinned steps").

        Args:
            command: ``kind="restore"``, ``args={"request_id": int, "job_id": str, "step":
                int, "tier": "memory"|"peer"|"persistent"|None, "reason": str, "actor": str}``.

        Raises:
            ValueError: another kind, or a missing, unknown or bad argument (the message
                names it).
            RuntimeError: the request cannot be written to the memory folder (the message
                names the folder and the OS error).
        """
        request = parse_restore_command(command)
        try:
            added = self.requests.add(request)
        except OSError as exc:
            raise RuntimeError(
                f"cannot keep restore request {request.request_id} in "
                f"{self.store.layout.requests_dir(request.job_id)}: "
                f"{exc}"
            ) from None
        if added:
            log.info(
                "restore request %d for %s: step %d, tier %s (%s, by %s)",
                request.request_id,
                request.job_id,
                request.step,
                request.tier or "any",
                request.reason or "no reason given",
                request.actor or "unknown",
            )
        else:
            log.info(
                "restore request %d for %s was served already; ignored",
                request.request_id,
                request.job_id,
            )

    def rollback(
        self, job_id: str, *, request_id: int, step: int, persistent: bool
    ) -> dict[str, Any]:
        """The job's ranks rolled back to ``step`` (request ``request_id``): its newer steps
        are a diverged future. Removes them from the replicas this agent holds (every source
        node) and, with ``persistent``, from the persistent tier, with an ``evicted`` event
        each; pending ``.metadata`` commits of those steps are dropped.

        Only for a restore request this agent received for the job (pending, or among the
        newest retired), and only down to a step at or below the request's: a rollback
        deletes newer steps, so it is never taken on a caller's word.

        Returns:
            ``{evicted: {peer: [step], persistent: [step]}, errors: [str]}``.

        Raises:
            LayoutError: a bad job id.
            RollbackRefused: no such request for the job, or ``step`` above its step.
        """
        check_job_id(job_id)
        requested = self.requests.request_step(job_id, request_id)
        if requested is None:
            raise RollbackRefused(
                f"agent {self.node} has no restore request {request_id} for job {job_id}: a "
                "rollback only follows an operator's restore request that reached this agent"
            )
        if step > requested:
            raise RollbackRefused(
                f"restore request {request_id} of job {job_id} asked for step {requested}; "
                f"a rollback to step {step}, above it, is refused"
            )
        why = f"rolled back to step {step} by restore request {request_id}"
        self.worker.forget_pending(job_id, after=step)
        peer: set[int] = set()
        rdir = self.store.layout.replicas_dir
        for src in sorted(p.name for p in rdir.iterdir() if p.is_dir()) if rdir.is_dir() else []:
            try:
                gone = self.store.evict_replicas_after(src_node=src, job_id=job_id, step=step)
            except LayoutError:
                continue
            for s, ranks in gone:
                peer.add(s)
                for rank in ranks or [None]:
                    self.emit(
                        CheckpointEvent(
                            job_id=job_id,
                            step=s,
                            tier="peer",
                            kind="evicted",
                            rank=rank,
                            ts=utcnow(),
                            message=f"replica of {src} on {self.node}: {why}",
                        )
                    )
        errors: list[str] = []
        removed: list[int] = []
        if persistent and not self.persistent.available:
            errors.append(f"persistent tier unavailable: {self.persistent.error}")
        elif persistent:
            try:
                newer = [s for s in self.persistent.steps(job_id) if s > step]
            except PersistentError as exc:
                newer = []
                errors.append(str(exc))
            for s in newer:
                try:
                    self.persistent.delete_step(job_id, s)
                except PersistentError as exc:
                    errors.append(str(exc))
                    continue
                removed.append(s)
                self.emit(
                    CheckpointEvent(
                        job_id=job_id,
                        step=s,
                        tier="persistent",
                        kind="evicted",
                        ts=utcnow(),
                        message=why,
                    )
                )
        if peer or removed:
            log.info(
                "%s: %s; evicted replicas %s, persistent steps %s",
                job_id,
                why,
                sorted(peer),
                removed,
            )
        return {"evicted": {"peer": sorted(peer), "persistent": removed}, "errors": errors}

    def evicted_events(
        self, src_node: str, job_id: str, newest: int, evicted: list[tuple[int, list[int]]]
    ) -> list[int]:
        """Emit an ``evicted`` peer event per (step, rank) a commit marker evicted."""
        for step, ranks in evicted:
            targets: list[int | None] = list(ranks) if ranks else [None]
            for rank in targets:
                self.emit(
                    CheckpointEvent(
                        job_id=job_id,
                        step=step,
                        tier="peer",
                        kind="evicted",
                        rank=rank,
                        ts=utcnow(),
                        message=f"replica of {src_node} on {self.node} evicted by "
                        f"retention after step {newest}",
                    )
                )
        return [s for s, _ in evicted]


def default_advertise_url(host: str, port: int) -> str:
    """``http://<host>:<port>``; a wildcard bind host becomes this machine's host name."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn() or socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}"


class EventsBody(BaseModel):
    """Body of ``POST /v1/ckpt/events`` (limits as in a report batch)."""

    model_config = ConfigDict(extra="forbid")

    events: Annotated[list[CheckpointEvent], Field(max_length=4096)] = []
    progress: Annotated[list[JobProgress], Field(max_length=4096)] = []
    restores: Annotated[list[RestoreReport], Field(max_length=1024)] = []


class RollbackBody(BaseModel):
    """Body of ``POST /v1/ckpt/jobs/{job_id}/rollback``."""

    model_config = ConfigDict(extra="forbid")

    request_id: Annotated[int, Field(ge=1, le=2**62)]
    step: Annotated[int, Field(ge=0, le=2**62)]
    persistent: bool = False


class NotifyBody(BaseModel):
    """Body of ``POST /v1/ckpt/notify``: a local rank committed ``step`` of ``job_id``."""

    model_config = ConfigDict(extra="forbid")

    job_id: JobId
    step: Annotated[int, Field(ge=0, le=2**62)]


ServiceGetter = Callable[[], CheckpointService | None]
EventQueue = Callable[
    [list[CheckpointEvent], list[JobProgress], list[RestoreReport]], dict[str, int]
]


def ckpt_router(
    get_service: ServiceGetter, *, access: LocalAccess, queue_events: EventQueue
) -> APIRouter:
    """The checkpoint and peer endpoints.

    Args:
        get_service: Returns the running service (None: not started, 503).
        access: Authenticates trainer-facing callers (the agent token, or a job credential
            that acts for its own job only; :mod:`tierwatch.agent.access`).
        queue_events: Queues trainer events into the next report; returns counts queued.

    Returns:
        The router.
    """
    router = APIRouter()

    def service() -> CheckpointService:
        svc = get_service()
        if svc is None:
            raise HTTPException(
                status_code=503,
                detail="the checkpoint store of this agent is "
                "not running: it is starting, or it could not start (its log "
                "says why: memory folder problem)",
            )
        return svc

    Service = Annotated[CheckpointService, Depends(service)]
    AnyCaller = Annotated[Caller, Depends(access.any())]
    JobCaller = Annotated[Caller, Depends(access.job())]

    def peer_caller(request: Request, svc: Service) -> PeerCaller:
        """The node that signed a peer request (agent/peer_identity.py).

        Raises:
            HTTPException: 403 when this agent has no peer tier; 401 when the request does
                not authenticate as a node (the detail says why).
        """
        if svc.registry is None:
            raise HTTPException(
                status_code=403,
                detail=f"agent {svc.node} has no peer tier: it has no server registry to "
                "check peers with",
            )
        query = request.scope.get("query_string", b"").decode()
        try:
            return verify_request(
                svc.registry.keys.verifier,
                svc.replays,
                me=svc.node,
                method=request.method,
                path=request.scope["path"] + (f"?{query}" if query else ""),
                authorization=request.headers.get("authorization"),
                certificate=request.headers.get(CERT_HEADER),
            )
        except PeerAuthError as exc:
            raise HTTPException(
                status_code=401, detail=str(exc), headers={"WWW-Authenticate": SCHEME}
            ) from None

    Peer = Annotated[PeerCaller, Depends(peer_caller)]

    def member(svc: CheckpointService, caller: PeerCaller, job_id: str, rank: int | None) -> None:
        """Refuse a peer that is not a node of the job (or, for ``rank``, not the node the
        job's layout names for it), by the server's registry.

        Raises:
            HTTPException: 403 naming the reason, 422 for a bad job id.
        """
        try:
            check_job_id(job_id)
        except LayoutError as exc:
            raise bad_name(exc) from None
        assert svc.registry is not None
        job = svc.registry.job(job_id)
        if job is None or caller.node not in job.nodes or svc.node not in job.nodes:
            job = svc.registry.job(job_id, fresh=True)  # a restart may have re-registered it
        if job is None:
            raise HTTPException(
                status_code=403,
                detail=f"job {job_id} is not registered with the server, or {svc.node} is "
                "not one of its nodes",
            )
        if caller.node not in job.nodes:
            raise HTTPException(
                status_code=403, detail=f"{caller.node} is not a node of job {job_id}"
            )
        owner = job.node_of(rank) if rank is not None else None
        if owner is not None and owner != caller.node:
            raise HTTPException(
                status_code=403,
                detail=f"rank {rank} of job {job_id} runs on {owner}, not on {caller.node}",
            )

    def own_replicas(
        svc: CheckpointService, caller: PeerCaller, src_node: str, job_id: str, name: str | None
    ) -> None:
        """A node pushes and deletes only its own ranks' replicas, of a job both nodes belong
        to (bad names are 422 whoever asks).

        Raises:
            HTTPException: 422 for a bad name, 403 (see :func:`member`) otherwise.
        """
        try:
            check_node_name(src_node)
            check_job_id(job_id)
            if name is not None:
                check_file_name(name)
        except LayoutError as exc:
            raise bad_name(exc) from None
        if src_node != caller.node:
            raise HTTPException(
                status_code=403,
                detail=f"{caller.node} may push and delete only its own replicas, not {src_node}'s",
            )
        member(svc, caller, job_id, rank_of_file(name) if name is not None else None)

    def replica_access(src_node: str, job_id: str, name: str, svc: Service, caller: Peer) -> None:
        own_replicas(svc, caller, src_node, job_id, name)

    def replica_delete_access(src_node: str, job_id: str, svc: Service, caller: Peer) -> None:
        own_replicas(svc, caller, src_node, job_id, None)

    def file_access(job_id: str, svc: Service, caller: Peer) -> None:
        """Files are served only to nodes of the job."""
        member(svc, caller, job_id, None)

    def bad_name(exc: Exception) -> HTTPException:
        return HTTPException(status_code=422, detail=str(exc))

    @router.get("/v1/ckpt/info")
    def info(svc: Service, _: AnyCaller) -> dict[str, Any]:
        """This agent's checkpoint store: node, folders, URLs, budget (bytes)."""
        return svc.info()

    @router.post("/v1/ckpt/events")
    def events(body: EventsBody, who: AnyCaller) -> dict[str, Any]:
        """Queue trainer checkpoint events, progress and restore reports for the next report
        (a job credential: of its own job only)."""
        require_jobs(who, {x.job_id for x in (*body.events, *body.progress, *body.restores)})
        return {"queued": queue_events(body.events, body.progress, body.restores)}

    @router.post("/v1/ckpt/notify")
    def notify(body: NotifyBody, svc: Service, who: AnyCaller) -> dict[str, Any]:
        """A local rank committed a step: replicate/persist it now."""
        require_jobs(who, [body.job_id])
        svc.worker.notify(body.job_id, body.step)
        return {"ok": True}

    @router.get("/v1/ckpt/jobs/{job_id}/available")
    def available(
        job_id: str, svc: Service, _: JobCaller, persistent: Annotated[int, Query(ge=0, le=1)] = 0
    ) -> dict[str, Any]:
        """Manifests this agent can supply (memory, replicas, persistent with persistent=1)."""
        try:
            return svc.available(job_id, persistent=bool(persistent))
        except LayoutError as exc:
            raise bad_name(exc) from None

    @router.post("/v1/ckpt/jobs/{job_id}/stage")
    def stage(job_id: str, body: StageRequest, svc: Service, _: JobCaller) -> dict[str, Any]:
        """Assemble files in restore/<job>/step-<N>/, trying sources in order."""
        try:
            return svc.restore_stager.stage(job_id, body)
        except LayoutError as exc:
            raise bad_name(exc) from None

    @router.get("/v1/ckpt/jobs/{job_id}/restore-requests")
    def restore_requests(job_id: str, svc: Service, _: JobCaller) -> dict[str, Any]:
        """Operator restore requests for the job's ranks, oldest first."""
        try:
            pending = svc.requests.pending(job_id)
        except LayoutError as exc:
            raise bad_name(exc) from None
        return {"requests": [r.model_dump(mode="json") for r in pending]}

    @router.delete("/v1/ckpt/jobs/{job_id}/restore-requests/{request_id}")
    def retire_restore_requests(
        job_id: str,
        request_id: Annotated[int, PathParam(ge=1, le=2**62)],
        svc: Service,
        _: JobCaller,
    ) -> dict[str, Any]:
        """The ranks served request_id: retire it and the job's older requests."""
        try:
            return {"retired": svc.requests.retire(job_id, request_id)}
        except LayoutError as exc:
            raise bad_name(exc) from None
        except OSError as exc:
            raise HTTPException(
                status_code=500,
                detail=f"cannot retire restore request {request_id} of {job_id}: {exc}",
            ) from None

    @router.post("/v1/ckpt/jobs/{job_id}/rollback")
    def rollback(job_id: str, body: RollbackBody, svc: Service, _: JobCaller) -> dict[str, Any]:
        """The ranks rolled back: drop the job's newer steps from replicas (and persistent)."""
        try:
            return svc.rollback(
                job_id, request_id=body.request_id, step=body.step, persistent=body.persistent
            )
        except LayoutError as exc:
            raise bad_name(exc) from None
        except RollbackRefused as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None

    @router.put(
        "/v1/peer/replicas/{src_node}/{job_id}/{step}/{name}",
        dependencies=[Depends(replica_access)],
    )
    async def put_replica(
        src_node: str, job_id: str, step: int, name: str, request: Request, svc: Service
    ) -> Any:
        """Receive one replica file as a stream (verified, then renamed into place)."""
        length = request.headers.get("content-length")
        try:
            size = int(length) if length is not None else None
        except ValueError:
            size = None
        try:
            upload = svc.store.begin_replica(
                src_node=src_node,
                job_id=job_id,
                step=step,
                name=name,
                xxh3=request.headers.get(XXH3_HEADER),
                size=size,
            )
        except StoreError as exc:
            return await _refuse(request, exc, svc, job_id, step, name, src_node)
        try:
            buf = bytearray()
            async for chunk in request.stream():
                buf += chunk
                if len(buf) >= UPLOAD_BUFFER:
                    data, buf = bytes(buf), bytearray()
                    await run_in_threadpool(upload.write, data)
            if buf:
                await run_in_threadpool(upload.write, bytes(buf))
            got = await run_in_threadpool(upload.finish)
        except StoreError as exc:
            return await _refuse(request, exc, svc, job_id, step, name, src_node)
        except ClientDisconnect:  # the sender went away mid-upload: nothing is kept
            log.warning(
                "replica %s/%s/%s/%s: the sender disconnected after %d bytes; partial file removed",
                src_node,
                job_id,
                step,
                name,
                upload.written,
            )
            return Response(status_code=400)
        finally:
            upload.abort()
        evicted = svc.evicted_events(src_node, job_id, step, got.evicted)
        return {"ok": True, "name": name, "bytes": got.size, "xxh3": got.xxh3, "evicted": evicted}

    @router.delete(
        "/v1/peer/replicas/{src_node}/{job_id}/{step}",
        dependencies=[Depends(replica_delete_access)],
    )
    def delete_replica(src_node: str, job_id: str, step: int, svc: Service) -> dict[str, Any]:
        """Evict one replica step held for src_node."""
        try:
            deleted = svc.store.delete_replica_step(src_node=src_node, job_id=job_id, step=step)
        except LayoutError as exc:
            raise bad_name(exc) from None
        if deleted:
            svc.emit(
                CheckpointEvent(
                    job_id=job_id,
                    step=step,
                    tier="peer",
                    kind="evicted",
                    ts=utcnow(),
                    message=f"replica of {src_node} on {svc.node} deleted on request",
                )
            )
        return {"deleted": deleted}

    @router.get("/v1/peer/files/{job_id}/{step}/{name}", dependencies=[Depends(file_access)])
    def get_file(
        job_id: str,
        step: int,
        name: str,
        svc: Service,
        tier: Literal["memory", "peer"] = "memory",
        src: str | None = None,
    ) -> StreamingResponse:
        """Stream one file from this agent's memory tier or from a replica it holds (opened
        without following a link below the memory folder; regular files only)."""
        try:
            f, size = svc.store.open_file(job_id=job_id, step=step, name=name, tier=tier, src=src)
        except StoreError as exc:
            raise HTTPException(status_code=exc.status, detail=exc.message) from None
        return StreamingResponse(
            iter_file(f, size, UPLOAD_BUFFER),
            media_type="application/octet-stream",
            headers={"Content-Length": str(size)},
        )

    return router


async def _refuse(
    request: Request,
    exc: StoreError,
    svc: CheckpointService,
    job_id: str,
    step: int,
    name: str,
    src_node: str,
) -> JSONResponse:
    """Answer a refused upload after reading (and discarding) the rest of its body, so the
    sender sees the answer instead of a broken connection."""
    try:
        async for _ in request.stream():
            pass
    except Exception:  # noqa: BLE001 - the client went away; the answer is moot
        pass
    if exc.status == 507:
        try:
            check_job_id(job_id)
            check_step(step)
            svc.emit(
                CheckpointEvent(
                    job_id=job_id,
                    step=step,
                    tier="peer",
                    kind="failed",
                    ts=utcnow(),
                    message=exc.message[:2000],
                )
            )
        except (LayoutError, ValueError):
            pass
    log.warning("refused replica %s/%s/%s/%s: %s", src_node, job_id, step, name, exc.message)
    return JSONResponse(status_code=exc.status, content={"detail": exc.message})

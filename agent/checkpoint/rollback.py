"""Operator restore requests and in-process rollback: the parts without torch.

A restore request (``Command(kind="restore")``, see :mod:`tierwatch.agent.protocol`) asks a
job to go back to a committed step. Its way to the ranks:

1. The agent's command executor hands it to :meth:`CheckpointService.add_restore_request
   <tierwatch.agent.checkpoint.api.CheckpointService.add_restore_request>`, which checks the
   arguments (:func:`parse_restore_command`) and keeps the request in
   ``<memory-dir>/jobs/<job>/restore-requests/request-<id>.json`` (:class:`RequestStore`),
   so an agent restart does not lose it.
2. Each rank's :class:`RequestPoller` thread reads ``GET /v1/ckpt/jobs/{job}/restore-requests``
   every ``period_s`` (an agent that is down only leaves the last answer in place).
3. ``TieredCheckpointer.maybe_rollback`` agrees with the other ranks on the newest request
   every rank knows (:func:`newest_unserved`, then an all_reduce MIN) and rolls back; at a
   start, ``restore()`` serves a pending request instead of loading the newest step.
4. The ranks record what they served in ``jobs/<job>/timeline.json`` (:class:`Timeline`):
   ``served`` (the newest request carried out or given up, so none runs twice, also across a
   restart) and ``fences``, one ``(request_id, step)`` per rollback that loaded ``step``.
   Then they retire the request on the agent (``DELETE …/restore-requests/{id}``).

Pins: while a request is pending (kept, not retired, not expired), its step is *pinned*:
retention keeps it in every tier (:func:`pins_of`, :meth:`RequestStore.pinned_steps`), since
the ranks act on it only once every rank's agent has it, possibly many steps later.

Fences and timelines: steps saved after rollback ``X`` list every fence in their manifest;
a step of an older timeline above a fence's step is a diverged future that no restore loads
(:func:`tierwatch.agent.checkpoint.agreement.is_dead`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from tierwatch.agent.checkpoint.layout import TIERS, LayoutError, MemoryLayout, check_job_id
from tierwatch.agent.checkpoint.manifest import atomic_write_json
from tierwatch.agent.protocol import Command, utcnow

if TYPE_CHECKING:
    from tierwatch.agent.checkpoint.client import AgentClient

log = logging.getLogger(__name__)

REQUEST_PREFIX = "request-"
RETIRED_FILE = "retired.json"
MAX_ID = 2**62


class RestoreRequest(BaseModel):
    """One operator restore request as the agent keeps it and the ranks read it.

    Attributes:
        request_id: Same on every agent of one request; increases with each request of the
            cluster.
        job_id: The job to roll back.
        step: The target step (resolved by the server: a tier holds it completely).
        tier: Restore only from this tier (memory | peer | persistent); None: any tier,
            fastest first.
        reason, actor: Why and who (for the reports and the log).
        command_id: The command that carried it.
        received_at: When this agent accepted it (UTC ISO).
        not_after: The server gives up on the request at this time (UTC ISO; its
            ``TIERWATCH_COMMANDS__RESTORE_TTL_S``): a job that starts later must not roll
            back to it. Empty: no limit.
    """

    model_config = ConfigDict(extra="forbid")

    request_id: int
    job_id: str
    step: int
    tier: Literal["memory", "peer", "persistent"] | None = None
    reason: str = ""
    actor: str = ""
    command_id: str = ""
    received_at: str = ""
    not_after: str = ""

    def expired(self, now: datetime) -> bool:
        """Whether the server has given up on this request by ``now``."""
        if not self.not_after:
            return False
        try:
            return datetime.fromisoformat(self.not_after) <= now
        except ValueError:
            return False


def _int(args: Mapping[str, Any], name: str, low: int) -> int:
    value = args.get(name)
    if value is None:
        raise ValueError(f"restore command: args.{name} is missing (an integer ≥ {low})")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_ID:
        raise ValueError(f"restore command: args.{name} must be an integer in {low}..2**62, "
                         f"not {value!r}")
    return value


def parse_restore_command(command: Command) -> RestoreRequest:
    """Check a ``restore`` command's arguments.

    ``args``: ``request_id`` (int ≥ 1), ``job_id`` (a job id), ``step`` (int ≥ 0), and
    optional ``tier`` (memory | peer | persistent | None), ``reason`` and ``actor`` (text).

    Raises:
        ValueError: another kind, a missing or bad argument, or an unknown one (the message
            names it and what is allowed).
    """
    if command.kind != "restore":
        raise ValueError(f"command {command.id}: kind {command.kind!r} is not a restore")
    args = command.args
    unknown = sorted(set(args) - {"request_id", "job_id", "step", "tier", "reason", "actor",
                                  "not_after"})
    if unknown:
        raise ValueError(f"restore command: unknown args {unknown} (allowed: request_id, "
                         "job_id, step, tier, reason, actor, not_after)")
    not_after = args.get("not_after") or ""
    if not_after:
        try:
            parsed = datetime.fromisoformat(str(not_after))
        except ValueError:
            raise ValueError("restore command: args.not_after must be an ISO 8601 time, not "
                             f"{not_after!r}") from None
        if parsed.tzinfo is None:
            raise ValueError("restore command: args.not_after needs a UTC offset")
    request_id = _int(args, "request_id", 1)
    step = _int(args, "step", 0)
    job_id = args.get("job_id")
    if job_id is None:
        raise ValueError("restore command: args.job_id is missing")
    try:
        check_job_id(job_id)
    except LayoutError as exc:
        raise ValueError(f"restore command: args.{exc}") from None
    tier = args.get("tier")
    if tier is not None and tier not in TIERS:
        raise ValueError(f"restore command: args.tier must be one of {', '.join(TIERS)} or "
                         f"null (any tier), not {tier!r}")
    for name in ("reason", "actor"):
        if not isinstance(args.get(name, ""), str):
            raise ValueError(f"restore command: args.{name} must be text, not "
                             f"{args.get(name)!r}")
    return RestoreRequest(request_id=request_id, job_id=job_id, step=step, tier=tier,
                          reason=str(args.get("reason", ""))[:500],
                          actor=str(args.get("actor", ""))[:200], command_id=command.id,
                          received_at=utcnow().isoformat(), not_after=str(not_after))


class RequestStore:
    """The restore requests an agent keeps for its node's ranks (one JSON file each).

    ``jobs/<job>/restore-requests/request-<id>.json`` holds a :class:`RestoreRequest`;
    ``retired.json`` ``{"up_to": id}`` the newest request the ranks retired, so a command
    delivered again after that is not handed out a second time. Files are written with
    :func:`~tierwatch.agent.checkpoint.manifest.atomic_write_json` (fsync'd).

    Args:
        layout: The node's memory folder.
    """

    def __init__(self, layout: MemoryLayout) -> None:
        self.layout = layout
        self._lock = threading.Lock()

    def _retired(self, job_id: str) -> int:
        try:
            data = json.loads((self.layout.requests_dir(job_id) / RETIRED_FILE).read_text())
            return int(data["up_to"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def add(self, request: RestoreRequest) -> bool:
        """Keep ``request`` (the same id again replaces it).

        Returns:
            False when the ranks already retired this id (nothing kept).

        Raises:
            OSError: the file cannot be written.
        """
        with self._lock:
            if request.request_id <= self._retired(request.job_id):
                return False
            d = self.layout.requests_dir(request.job_id)
            d.mkdir(parents=True, exist_ok=True)
            atomic_write_json(d / f"{REQUEST_PREFIX}{request.request_id}.json", request)
            return True

    def pending(self, job_id: str, *, quiet: bool = False) -> list[RestoreRequest]:
        """The job's requests not retired and not expired, oldest first (unreadable files
        are skipped).

        Args:
            job_id: The job.
            quiet: Log expired requests at DEBUG instead of INFO (retention asks often).

        Raises:
            LayoutError: a bad job id.
        """
        d = self.layout.requests_dir(job_id)
        retired = self._retired(job_id)
        out = []
        for p in sorted(d.glob(f"{REQUEST_PREFIX}*.json")) if d.is_dir() else []:
            try:
                req = RestoreRequest.model_validate_json(p.read_bytes())
            except FileNotFoundError:  # retired meanwhile
                continue
            except (OSError, ValueError) as exc:
                log.warning("restore request %s unreadable, skipped: %s", p, exc)
                continue
            if req.job_id == job_id and req.request_id > retired:
                if req.expired(utcnow()):
                    log.log(logging.DEBUG if quiet else logging.INFO,
                            "restore request %d for %s expired at %s; not served",
                            req.request_id, job_id, req.not_after)
                    continue
                out.append(req)
        return sorted(out, key=lambda r: r.request_id)

    def pinned_steps(self, job_id: str) -> dict[int, list[int]]:
        """The job's steps that retention must keep in every tier: step → ids of the pending
        requests (not retired, not expired) that name it.

        Raises:
            LayoutError: a bad job id.
        """
        return pins_of(self.pending(job_id, quiet=True))

    def retire(self, job_id: str, up_to: int) -> list[int]:
        """Retire the job's requests with ids ≤ ``up_to`` (served or superseded).

        Returns:
            The ids whose files were removed.

        Raises:
            LayoutError: a bad job id.
            OSError: ``retired.json`` cannot be written.
        """
        with self._lock:
            d = self.layout.requests_dir(job_id)
            if not d.is_dir():
                return []
            if up_to > self._retired(job_id):
                atomic_write_json(d / RETIRED_FILE, {"up_to": up_to,
                                                     "at": utcnow().isoformat()})
            gone = []
            for p in d.glob(f"{REQUEST_PREFIX}*.json"):
                text = p.name[len(REQUEST_PREFIX):-len(".json")]
                if text.isdigit() and int(text) <= up_to:
                    p.unlink(missing_ok=True)
                    gone.append(int(text))
            return sorted(gone)


@dataclass
class Timeline:
    """What a job's ranks served: ``timeline.json`` in the node's job folder.

    Attributes:
        served: The newest request carried out or given up (0: none).
        fences: ``(request_id, step)`` of every rollback that loaded ``step``, oldest first.
    """

    served: int = 0
    fences: list[tuple[int, int]] = field(default_factory=list)

    @property
    def timeline(self) -> int:
        """The newest rollback in the job's history (0: never rolled back)."""
        return max((rid for rid, _ in self.fences), default=0)

    @classmethod
    def read(cls, path: Path) -> Timeline:
        """Read ``path`` (an empty timeline when it is missing or unreadable)."""
        try:
            data = json.loads(path.read_text())
            return cls(served=int(data.get("served", 0)),
                       fences=sorted((int(r), int(s)) for r, s in data.get("fences", [])))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            log.warning("%s unreadable (%s); treated as no rollback served", path, exc)
            return cls()

    def write(self, path: Path) -> None:
        """Write atomically (fsync'd).

        Raises:
            OSError: it cannot be written.
        """
        atomic_write_json(path, {"served": self.served, "fences": self.fences,
                                 "updated_at": utcnow().isoformat()})

    @classmethod
    def merge(cls, timelines: Iterable[Timeline]) -> Timeline:
        """Several ranks' timelines as one: the newest ``served``, every fence."""
        items = list(timelines)
        return cls(served=max((t.served for t in items), default=0),
                   fences=sorted({f for t in items for f in t.fences}))

    def after(self, request_id: int, *, loaded_step: int | None) -> Timeline:
        """This timeline once ``request_id`` is served (a fence when it loaded a step)."""
        fences = list(self.fences)
        if loaded_step is not None and (request_id, loaded_step) not in fences:
            fences.append((request_id, loaded_step))
        return Timeline(served=max(self.served, request_id), fences=sorted(fences))


def pins_of(requests: Iterable[RestoreRequest], *, served: int = 0,
            now: datetime | None = None) -> dict[int, list[int]]:
    """Steps pinned by ``requests``: step → request ids, for requests above ``served`` that
    have not expired by ``now`` (default: the current time).

    A pinned step stays in every tier while its request is pending, whatever the retention
    (``keep_memory``, ``keep_peer``, ``keep_persistent``): the ranks may act on the request
    only several steps after the server accepted it.
    """
    now = now or utcnow()
    out: dict[int, list[int]] = {}
    for r in requests:
        if r.request_id > served and not r.expired(now):
            out.setdefault(r.step, []).append(r.request_id)
    return {step: sorted(ids) for step, ids in sorted(out.items())}


def describe_pins(pins: Mapping[int, Iterable[int]]) -> str:
    """``"step 5 (request 3), step 9 (requests 4, 6)"`` for messages ("" when none)."""
    parts = []
    for step, ids in sorted(pins.items()):
        ids = sorted(ids)
        parts.append(f"step {step} (request{'s' if len(ids) > 1 else ''} "
                     f"{', '.join(str(i) for i in ids)})")
    return ", ".join(parts)


def newest_unserved(requests: Iterable[RestoreRequest], served: int) -> int:
    """The newest request id above ``served`` (0: none); what a rank contributes to the
    all_reduce MIN that decides which request all ranks know."""
    return max((r.request_id for r in requests if r.request_id > served), default=0)


def pick_request(copies: Iterable[RestoreRequest | None], request_id: int
                 ) -> RestoreRequest | None:
    """The agreed request's arguments from the ranks' copies (each rank's agent got the same
    command; a rank whose agent has not got this id contributes None)."""
    for c in copies:
        if c is not None and c.request_id == request_id:
            return c
    return None


class RequestPoller:
    """Reads the job's pending restore requests from the agent on its own thread.

    Args:
        client: The rank's agent client.
        job_id: The job.
        period_s: Seconds between two reads.

    The training thread only takes :meth:`snapshot` (no network). An agent that is down keeps
    the last answer in place: requests are durable on the agent, and a retired one is
    filtered by the ranks' ``served``.
    """

    def __init__(self, client: AgentClient, job_id: str, *, period_s: float = 0.5) -> None:
        self.client = client
        self.job_id = job_id
        self.period_s = period_s
        self._requests: list[RestoreRequest] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.polls = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="tierwatch-ckpt-requests",
                                        daemon=True)
        self._thread.start()

    def snapshot(self) -> list[RestoreRequest]:
        """The requests of the last successful read."""
        with self._lock:
            return list(self._requests)

    def refresh(self) -> list[RestoreRequest]:
        """Read now (on the caller's thread); the last answer when the agent is down."""
        from tierwatch.agent.checkpoint.client import AgentUnavailable

        try:
            answer = self.client.restore_requests(self.job_id)
            requests = [RestoreRequest.model_validate(r) for r in answer.get("requests", [])]
        except (AgentUnavailable, ValueError) as exc:
            self.failures += 1
            if self.failures % 120 == 1:
                log.debug("restore requests of %s not read: %s", self.job_id, exc)
            return self.snapshot()
        with self._lock:
            self._requests = requests
        self.polls += 1
        return list(requests)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.refresh()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout_s)

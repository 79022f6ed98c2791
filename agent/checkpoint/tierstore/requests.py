"""The agent's side of operator restore requests: check a ``restore`` command and keep it
for the node's ranks until they retire it (no torch).

See :mod:`tierwatch.agent.checkpoint.format.rollback` for the whole flow; the ranks read
the requests kept here through ``GET /v1/ckpt/jobs/{job}/restore-requests``
(:mod:`tierwatch.agent.checkpoint.tierstore.api`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from tierwatch.agent.checkpoint.format.layout import (
    TIERS,
    LayoutError,
    MemoryLayout,
    check_job_id,
)
from tierwatch.agent.checkpoint.format.rollback import RestoreRequest, pins_of
from tierwatch.agent.fsutil import atomic_write_json
from tierwatch.agent.protocol import Command, utcnow

log = logging.getLogger(__name__)

REQUEST_PREFIX = "request-"
SERVED_KEPT = 64  # retired requests whose steps a late rank's rollback may still name
RETIRED_FILE = "retired.json"
MAX_ID = 2**62


def _int(args: Mapping[str, Any], name: str, low: int) -> int:
    value = args.get(name)
    if value is None:
        raise ValueError(f"restore command: args.{name} is missing (an integer ≥ {low})")
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_ID:
        raise ValueError(
            f"restore command: args.{name} must be an integer in {low}..2**62, not {value!r}"
        )
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
    unknown = sorted(
        set(args) - {"request_id", "job_id", "step", "tier", "reason", "actor", "not_after"}
    )
    if unknown:
        raise ValueError(
            f"restore command: unknown args {unknown} (allowed: request_id, "
            "job_id, step, tier, reason, actor, not_after)"
        )
    not_after = args.get("not_after") or ""
    if not_after:
        try:
            parsed = datetime.fromisoformat(str(not_after))
        except ValueError:
            raise ValueError(
                f"restore command: args.not_after must be an ISO 8601 time, not {not_after!r}"
            ) from None
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
        raise ValueError(
            f"restore command: args.tier must be one of {', '.join(TIERS)} or "
            f"null (any tier), not {tier!r}"
        )
    for name in ("reason", "actor"):
        if not isinstance(args.get(name, ""), str):
            raise ValueError(f"restore command: args.{name} must be text, not {args.get(name)!r}")
    return RestoreRequest(
        request_id=request_id,
        job_id=job_id,
        step=step,
        tier=tier,
        reason=str(args.get("reason", ""))[:500],
        actor=str(args.get("actor", ""))[:200],
        command_id=command.id,
        received_at=utcnow().isoformat(),
        not_after=str(not_after),
    )


class RequestStore:
    """The restore requests an agent keeps for its node's ranks (one JSON file each).

    ``jobs/<job>/restore-requests/request-<id>.json`` holds a :class:`RestoreRequest`;
    ``retired.json`` ``{"up_to": id}`` the newest request the ranks retired, so a command
    delivered again after that is not handed out a second time. Files are written with
    :func:`~tierwatch.agent.checkpoint.format.manifest.atomic_write_json` (fsync'd).

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
                    log.log(
                        logging.DEBUG if quiet else logging.INFO,
                        "restore request %d for %s expired at %s; not served",
                        req.request_id,
                        job_id,
                        req.not_after,
                    )
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
            served = self._served(job_id)
            gone = []
            for p in d.glob(f"{REQUEST_PREFIX}*.json"):
                text = p.name[len(REQUEST_PREFIX) : -len(".json")]
                if text.isdigit() and int(text) <= up_to:
                    try:
                        served[int(text)] = RestoreRequest.model_validate_json(p.read_bytes()).step
                    except (OSError, ValueError):
                        pass
                    gone.append(int(text))
            if up_to > self._retired(job_id) or gone:
                keep = dict(sorted(served.items())[-SERVED_KEPT:])
                atomic_write_json(
                    d / RETIRED_FILE,
                    {
                        "up_to": max(up_to, self._retired(job_id)),
                        "at": utcnow().isoformat(),
                        "served": {str(k): v for k, v in keep.items()},
                    },
                )
            for rid in gone:
                (d / f"{REQUEST_PREFIX}{rid}.json").unlink(missing_ok=True)
            return sorted(gone)

    def _served(self, job_id: str) -> dict[int, int]:
        """Request id → step of the job's newest retired requests (``retired.json``)."""
        try:
            data = json.loads((self.layout.requests_dir(job_id) / RETIRED_FILE).read_text())
            return {int(k): int(v) for k, v in dict(data.get("served") or {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def request_step(self, job_id: str, request_id: int) -> int | None:
        """The step of the job's restore request ``request_id`` that this agent received:
        pending (not expired), or among the newest retired ones; None when it has none.

        Raises:
            LayoutError: a bad job id.
        """
        for req in self.pending(job_id, quiet=True):
            if req.request_id == request_id:
                return req.step
        return self._served(job_id).get(request_id)

"""Operator restore requests and rollback timelines: what the agent and the ranks share.

A restore request (``Command(kind="restore")``, see :mod:`tierwatch.agent.protocol`) asks a
job to go back to a committed step. Its way to the ranks, one module per process:

1. Agent: the command executor hands it to :meth:`CheckpointService.add_restore_request
   <tierwatch.agent.checkpoint.tierstore.api.CheckpointService.add_restore_request>`, which
   checks the arguments and keeps the request in
   ``<state-dir>/requests/jobs/<job>/restore-requests/request-<id>.json`` (the agent's own folder)
   (:mod:`tierwatch.agent.checkpoint.tierstore.requests`), so an agent restart does not
   lose it.
2. Trainer: each rank's ``RequestPoller`` thread reads
   ``GET /v1/ckpt/jobs/{job}/restore-requests`` every ``period_s`` (an agent that is down
   only leaves the last answer in place); ``TieredCheckpointer.maybe_rollback`` agrees with
   the other ranks on the newest request every rank knows and rolls back; at a start,
   ``restore()`` serves a pending request instead of loading the newest step
   (:mod:`tierwatch.agent.checkpoint.training.rollback`).
3. The ranks record what they served in ``jobs/<job>/timeline.json`` (:class:`Timeline`):
   ``served`` (the newest request carried out or given up, so none runs twice, also across a
   restart) and ``fences``, one ``(request_id, step)`` per rollback that loaded ``step``.
   Then they retire the request on the agent (``DELETE …/restore-requests/{id}``).

This module holds what both sides read and write: the request (:class:`RestoreRequest`), the
timeline file, and the pins (no torch, no network).

Pins: while a request is pending (kept, not retired, not expired), its step is *pinned*:
retention keeps it in every tier (:func:`pins_of`), since the ranks act on it only once every
rank's agent has it, possibly many steps later.

Fences and timelines: steps saved after rollback ``X`` list every fence in their manifest;
a step of an older timeline above a fence's step is a diverged future that no restore loads
(:func:`tierwatch.agent.checkpoint.format.agreement.is_dead`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from tierwatch.agent.fsutil import atomic_write_json
from tierwatch.agent.protocol import utcnow

log = logging.getLogger(__name__)


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
            return cls(
                served=int(data.get("served", 0)),
                fences=sorted((int(r), int(s)) for r, s in data.get("fences", [])),
            )
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
        atomic_write_json(
            path, {"served": self.served, "fences": self.fences, "updated_at": utcnow().isoformat()}
        )

    @classmethod
    def merge(cls, timelines: Iterable[Timeline]) -> Timeline:
        """Several ranks' timelines as one: the newest ``served``, every fence."""
        items = list(timelines)
        return cls(
            served=max((t.served for t in items), default=0),
            fences=sorted({f for t in items for f in t.fences}),
        )

    def after(self, request_id: int, *, loaded_step: int | None) -> Timeline:
        """This timeline once ``request_id`` is served (a fence when it loaded a step)."""
        fences = list(self.fences)
        if loaded_step is not None and (request_id, loaded_step) not in fences:
            fences.append((request_id, loaded_step))
        return Timeline(served=max(self.served, request_id), fences=sorted(fences))


def pins_of(
    requests: Iterable[RestoreRequest], *, served: int = 0, now: datetime | None = None
) -> dict[int, list[int]]:
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
        parts.append(
            f"step {step} (request{'s' if len(ids) > 1 else ''} {', '.join(str(i) for i in ids)})"
        )
    return ", ".join(parts)

"""Maintenance windows: an operator silences a node, or the whole cluster, for a time.

While a window is in force (``starts_at <= now < ends_at``, and not ended early):

- the auto-isolation policy does not isolate a covered node, for any rule (hardware
  findings included), and leaves covered nodes out of the "many nodes at once" control-plane
  rule: a rack taken down for work is planned silence, not an outage. Each node the policy
  held is audited once per window (``maintenance_hold``).
- alerts about a covered node (label ``node``), and cluster-level alerts (label
  ``scope=cluster``) under a cluster window, are recorded with ``silenced_by`` and not
  delivered (:func:`~tierwatch.server.alerts.service.raise_alert`). Job alerts (a failed
  restore) are always delivered: the job's owner is not on maintenance.
- an operator's own isolate and release still act: a window silences automation, not people.

What a window does not do: forgive. A finding raised during the window still stands when it
ends, and the policy acts on it then; acknowledge findings the work itself caused before
ending the window. Opening and ending a window is audited (``maintenance_start``,
``maintenance_end``).

Windows are bounded (``TIERWATCH_POLICY__MAINTENANCE_MAX_S``, default 7 days) so a
forgotten window cannot silence a node for good.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    model_validator,
)
from sqlalchemy import and_, not_, or_, select
from sqlalchemy.orm import Session

from tierwatch.agent.protocol import _no_nul
from tierwatch.server.actions import audit
from tierwatch.server.actions.models import AuditEntry, MaintenanceWindow
from tierwatch.server.fleet.models import Node

CLUSTER = "cluster"
#: A start this far in the past is taken as "now" (clock skew between the operator and us).
PAST_START_SLACK_S = 300.0
#: How far ahead a window may be scheduled (seconds; a year).
MAX_AHEAD_S = 366 * 86400.0


class MaintenanceRefused(ValueError):
    """A window that cannot be opened as asked; the message says what to change."""


class MaintenanceIn(BaseModel):
    """Body of ``POST /api/v1/maintenance``.

    ``node``: the node to silence; leave it out (or null) for the whole cluster.
    ``starts_at``: when the window opens (default: now). Give exactly one of ``ends_at``
    (when it closes) and ``duration_s`` (how long it lasts, seconds).
    """

    model_config = ConfigDict(extra="forbid")

    node: (
        Annotated[
            str,
            StringConstraints(strip_whitespace=True, min_length=1, max_length=128),
            AfterValidator(_no_nul),
        ]
        | None
    ) = None
    reason: Annotated[
        str,
        StringConstraints(strip_whitespace=True, min_length=1, max_length=1000),
        AfterValidator(_no_nul),
        Field(description="why (required; shown with every alert the window silences)"),
    ]
    starts_at: AwareDatetime | None = None
    ends_at: AwareDatetime | None = None
    duration_s: Annotated[float, Field(gt=0, le=MAX_AHEAD_S)] | None = None

    @model_validator(mode="after")
    def _one_end(self) -> MaintenanceIn:
        if (self.ends_at is None) == (self.duration_s is None):
            raise ValueError(
                "give exactly one of ends_at (an RFC 3339 time with its offset) and "
                'duration_s (seconds), e.g. {"duration_s": 7200}'
            )
        return self


def plan(body: MaintenanceIn, *, now: datetime, max_s: float) -> tuple[datetime, datetime]:
    """The window's ``(starts_at, ends_at)`` (pure).

    Raises:
        MaintenanceRefused: it starts more than 5 minutes in the past or more than a year
            ahead, ends before it starts, or is longer than ``max_s`` seconds.
    """
    starts = body.starts_at or now
    if starts < now - timedelta(seconds=PAST_START_SLACK_S):
        raise MaintenanceRefused(
            f"starts_at {starts.isoformat()} is in the past; leave it out to start now"
        )
    if starts > now + timedelta(seconds=MAX_AHEAD_S):
        raise MaintenanceRefused(
            f"starts_at {starts.isoformat()} is more than a year ahead; schedule it later"
        )
    starts = max(starts, now)
    if body.duration_s is not None:
        ends = starts + timedelta(seconds=body.duration_s)
    else:
        assert body.ends_at is not None
        ends = body.ends_at
    if ends <= starts:
        raise MaintenanceRefused(
            f"ends_at {ends.isoformat()} is not after starts_at {starts.isoformat()}"
        )
    length = (ends - starts).total_seconds()
    if length > max_s:
        raise MaintenanceRefused(
            f"a window of {length / 3600:.1f} h is longer than the {max_s / 3600:g} h allowed "
            "(TIERWATCH_POLICY__MAINTENANCE_MAX_S): open a shorter one and extend it later"
        )
    return starts, ends


def closes_at(window: MaintenanceWindow) -> datetime:
    """When the window stops silencing: ``ends_at``, or earlier if it was ended early."""
    return min(window.ends_at, window.ended_at) if window.ended_at else window.ends_at


def state(window: MaintenanceWindow, now: datetime) -> Literal["scheduled", "active", "over"]:
    """``scheduled`` (not open yet), ``active`` or ``over`` at ``now`` (pure)."""
    if now >= closes_at(window):
        return "over"
    return "active" if now >= window.starts_at else "scheduled"


@dataclass(frozen=True)
class ActiveMaintenance:
    """The windows in force at one time, for lookups (pure once built).

    Attributes:
        cluster: the cluster window in force (the one open longest), or None.
        nodes: node name → its window in force (the one open longest).
    """

    cluster: MaintenanceWindow | None
    nodes: Mapping[str, MaintenanceWindow]

    @classmethod
    def of(cls, windows: Iterable[MaintenanceWindow], now: datetime) -> ActiveMaintenance:
        cluster: MaintenanceWindow | None = None
        nodes: dict[str, MaintenanceWindow] = {}
        for w in windows:
            if state(w, now) != "active":
                continue
            if w.scope == CLUSTER:
                if cluster is None or closes_at(w) > closes_at(cluster):
                    cluster = w
            elif w.node is not None:
                held = nodes.get(w.node)
                if held is None or closes_at(w) > closes_at(held):
                    nodes[w.node] = w
        return cls(cluster, nodes)

    def covering(self, node: str | None) -> MaintenanceWindow | None:
        """The window that silences ``node`` longest (its own or the cluster's), or None."""
        found = [w for w in (self.cluster, self.nodes.get(node or "")) if w is not None]
        return max(found, key=closes_at) if found else None

    def silencing(self, labels: Mapping[str, str]) -> MaintenanceWindow | None:
        """The window that silences an alert with these labels: a node's alert under its
        node's or the cluster's window, a cluster-level alert under a cluster window."""
        if "node" in labels:
            return self.covering(labels["node"])
        if labels.get("scope") == CLUSTER:
            return self.cluster
        return None


def active(session: Session, now: datetime) -> ActiveMaintenance:
    """The windows in force at ``now``."""
    rows = session.scalars(
        select(MaintenanceWindow).where(
            MaintenanceWindow.starts_at <= now,
            MaintenanceWindow.ends_at > now,
            or_(MaintenanceWindow.ended_at.is_(None), MaintenanceWindow.ended_at > now),
        )
    )
    return ActiveMaintenance.of(rows, now)


def start(
    session: Session,
    body: MaintenanceIn,
    *,
    actor: str,
    role: str,
    now: datetime,
    max_s: float,
) -> MaintenanceWindow:
    """Open a window (the caller commits) and audit it (``maintenance_start``).

    Raises:
        LookupError: ``body.node`` names no node tierwatch knows.
        MaintenanceRefused: see :func:`plan` (audited as refused).
    """
    target_kind, target = ("node", body.node) if body.node else (CLUSTER, CLUSTER)

    def audited(outcome: str, detail: dict[str, Any]) -> None:
        audit.record(
            session,
            actor=actor,
            role=role,
            action="maintenance_start",
            target_kind=target_kind,
            target=target,
            reason=body.reason,
            outcome=outcome,
            now=now,
            detail=detail,
        )

    if (
        body.node is not None
        and session.scalar(select(Node.id).where(Node.name == body.node)) is None
    ):
        raise LookupError(
            f"no node named {body.node!r}: a node is known once its agent has reported; "
            "leave node out to silence the whole cluster"
        )
    try:
        starts, ends = plan(body, now=now, max_s=max_s)
    except MaintenanceRefused as exc:
        audited("refused", {"error": str(exc)})
        raise
    window = MaintenanceWindow(
        scope="node" if body.node else CLUSTER,
        node=body.node,
        starts_at=starts,
        ends_at=ends,
        reason=body.reason,
        created_by=actor[:128],
        created_at=now,
        ended_at=None,
        ended_by="",
    )
    session.add(window)
    session.flush()
    audited(
        "ok", {"window": window.id, "starts_at": starts.isoformat(), "ends_at": ends.isoformat()}
    )
    return window


def end(
    session: Session, window_id: int, *, actor: str, role: str, reason: str, now: datetime
) -> tuple[MaintenanceWindow, bool]:
    """End a window now (the caller commits); audited as ``maintenance_end``.

    Returns:
        The window, and whether it changed (False: it was already over, audited ``noop``).

    Raises:
        LookupError: no window with that id.
    """
    window = session.get(MaintenanceWindow, window_id)
    if window is None:
        raise LookupError(f"no maintenance window {window_id}")
    changed = state(window, now) != "over"
    if changed:
        window.ended_at = now
        window.ended_by = actor[:128]
    audit.record(
        session,
        actor=actor,
        role=role,
        action="maintenance_end",
        target_kind="node" if window.node else CLUSTER,
        target=window.node or CLUSTER,
        reason=reason,
        outcome="ok" if changed else "noop",
        now=now,
        detail={"window": window.id},
    )
    return window, changed


OVER_SHOWN = 200


def list_windows(
    session: Session, *, now: datetime, node: str | None = None, include_over: bool = False
) -> list[MaintenanceWindow]:
    """Every window not over yet (scheduled or active), newest first; with ``include_over``,
    then the 200 newest that are over. ``node`` keeps that node's windows and the
    cluster's."""
    q = select(MaintenanceWindow)
    if node is not None:
        q = q.where(or_(MaintenanceWindow.node == node, MaintenanceWindow.scope == CLUSTER))
    open_ = and_(
        MaintenanceWindow.ends_at > now,
        or_(MaintenanceWindow.ended_at.is_(None), MaintenanceWindow.ended_at > now),
    )
    newest = MaintenanceWindow.id.desc()
    windows = list(session.scalars(q.where(open_).order_by(newest)))
    if include_over:
        windows += session.scalars(q.where(not_(open_)).order_by(newest).limit(OVER_SHOWN))
    return windows


def window_out(window: MaintenanceWindow, now: datetime) -> dict[str, Any]:
    """A window as the API shows it (``schemas.MaintenanceOut``)."""
    return {
        "id": window.id,
        "scope": window.scope,
        "node": window.node,
        "starts_at": window.starts_at,
        "ends_at": window.ends_at,
        "ended_at": window.ended_at,
        "ended_by": window.ended_by,
        "reason": window.reason,
        "created_by": window.created_by,
        "created_at": window.created_at,
        "state": state(window, now),
    }


def record_hold(
    session: Session, window: MaintenanceWindow, *, node: str, rule: str, reason: str, now: datetime
) -> bool:
    """Audit that the policy did not isolate ``node`` because of ``window``, once per window
    and node (``maintenance_hold``). Returns True when a new entry was written."""
    said = f"not isolated: maintenance window {window.id} ("
    seen = session.scalar(
        select(AuditEntry.id)
        .where(
            AuditEntry.action == "maintenance_hold",
            AuditEntry.target_kind == "node",
            AuditEntry.target == node,
            AuditEntry.ts >= window.starts_at,
            AuditEntry.reason.startswith(said, autoescape=True),
        )
        .limit(1)
    )
    if seen is not None:
        return False
    audit.record(
        session,
        actor=audit.POLICY_ACTOR,
        role="policy",
        action="maintenance_hold",
        target_kind="node",
        target=node,
        reason=f"{said}{window.reason}); {reason}",
        outcome="ok",
        now=now,
        detail={"window": window.id, "rule": rule},
    )
    return True

"""The audit log: record every action, query it with filters."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tierwatch.server.actions.models import AuditEntry

POLICY_ACTOR = "policy"


def record(
    session: Session,
    *,
    actor: str,
    role: str,
    action: str,
    target_kind: str,
    target: str,
    reason: str = "",
    outcome: str,
    now: datetime,
    detail: dict[str, Any] | None = None,
) -> AuditEntry:
    """Add one audit entry (the caller commits, so the entry lands with the action itself).

    See ``models.AuditEntry`` for the values of ``action``, ``target_kind`` and ``outcome``.
    """
    entry = AuditEntry(
        ts=now,
        actor=actor[:128],
        role=role[:16],
        action=action,
        target_kind=target_kind,
        target=target[:128],
        reason=reason,
        outcome=outcome,
        detail=detail or {},
    )
    session.add(entry)
    return entry


def query(
    session: Session,
    *,
    actor: str | None = None,
    action: str | None = None,
    target_kind: str | None = None,
    target: str | None = None,
    outcome: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    before_id: int | None = None,
    limit: int = 200,
) -> list[AuditEntry]:
    """Entries newest first, filtered by exact ``actor``/``action``/``target_kind``/
    ``target``/``outcome``, a time range and ``before_id`` (for paging)."""
    q = select(AuditEntry)
    for column, value in (
        (AuditEntry.actor, actor),
        (AuditEntry.action, action),
        (AuditEntry.target_kind, target_kind),
        (AuditEntry.target, target),
        (AuditEntry.outcome, outcome),
    ):
        if value:
            q = q.where(column == value)
    if since is not None:
        q = q.where(AuditEntry.ts >= since)
    if until is not None:
        q = q.where(AuditEntry.ts <= until)
    if before_id is not None:
        q = q.where(AuditEntry.id < before_id)
    return list(session.scalars(q.order_by(AuditEntry.id.desc()).limit(limit)))


def entry_out(e: AuditEntry) -> dict[str, Any]:
    """An entry as the API shows it (``schemas.AuditOut``)."""
    return {
        "id": e.id,
        "ts": e.ts,
        "actor": e.actor,
        "role": e.role,
        "action": e.action,
        "target_kind": e.target_kind,
        "target": e.target,
        "reason": e.reason,
        "outcome": e.outcome,
        "detail": e.detail or {},
    }

"""What an agent's report means for the action machinery: command results and the ranks'
restore progress, applied in the report's own transaction."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from tierwatch.agent.protocol import ReportBatch
from tierwatch.server.actions import audit, notify, queue, restores
from tierwatch.server.actions.models import TERMINAL_STATES, CommandRow

if TYPE_CHECKING:
    from tierwatch.server.config import Settings


def record_command_outcome(
    session: Session,
    settings: Settings,
    row: CommandRow,
    node_name: str,
    *,
    now: datetime,
    detail: dict[str, Any] | None = None,
) -> None:
    """Audit a finished command, and alert when a driver run did not succeed (the caller
    commits).

    Args:
        detail: what the driver adds for the audit entry, e.g. ``{"scheduler": {...}}``: the
            node's scheduler state before the change and what was left in place.
    """
    audit.record(
        session,
        actor=row.actor,
        role="system",
        action="command",
        target_kind="node",
        target=node_name,
        reason=row.reason,
        outcome=row.state,
        now=now,
        detail={
            "command": row.id,
            "kind": row.kind,
            "driver": row.driver,
            "exit_code": row.exit_code,
            "output": row.output[-500:],
            **(detail or {}),
        },
    )
    if row.state in ("failed", "expired") and row.kind != "restore":
        notify.command_failed(
            session,
            settings,
            node=node_name,
            command_id=row.id,
            kind=row.kind,
            driver=row.driver,
            output=row.output,
            now=now,
        )


def apply_report(
    session: Session, batch: ReportBatch, *, node_id: int, settings: Settings, now: datetime
) -> None:
    """Apply a freshly stored batch's ``command_results`` and request-tagged ``restores``
    (``batch`` is scoped: ``checkpoints.ingest.scope_reports`` dropped what the node may not
    report; a rank's restore progress is moved only by the node the request assigned it
    to)."""
    for row in queue.apply_results(session, node_id, batch.command_results, now=now):
        if row.state in TERMINAL_STATES:
            record_command_outcome(session, settings, row, batch.node, now=now)
    restores.apply_rank_reports(
        session, batch.restores, node=batch.node, now=now, settings=settings
    )

"""The durable command queue: enqueue, deliver to agents, apply their results, expire.

States (``models.COMMAND_STATES``): ``pending`` (queued) → ``delivered`` (sent in a report
answer; re-sent after ``redeliver_s`` until the agent reports on it) → ``running`` →
``succeeded`` | ``failed``; ``expired`` when nobody started it before ``expires_at``. Terminal
states never change again, and a state never moves backwards (a late ``running`` after
``succeeded`` is ignored), so a re-delivered command that the agent runs once is recorded
once. Server-executed commands (cluster drivers) go ``pending`` → ``running`` → done in the
leader replica (``claim_server_commands`` / ``finish``).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from tierwatch.agent.protocol import Command, CommandResult
from tierwatch.server.actions.models import TERMINAL_STATES, CommandRow
from tierwatch.server.actions.settings import QueueSettings
from tierwatch.server.db import execute_dml

OUTPUT_MAX = 4000
_ORDER = {s: i for i, s in enumerate(("pending", "delivered", "running"))}


def new_command_id() -> str:
    """A fresh command id (32 hex characters)."""
    return uuid.uuid4().hex


def enqueue(
    session: Session,
    *,
    kind: str,
    node_id: int,
    executor: str,
    driver: str,
    args: dict[str, Any],
    actor: str,
    reason: str,
    now: datetime,
    ttl_s: float,
    restore_id: int | None = None,
) -> CommandRow:
    """Add a pending command (the caller commits).

    Args:
        kind: ``isolate`` | ``release`` | ``restore``.
        executor: ``agent`` (delivered with report answers) or ``server`` (leader runs it).
        driver: ``command`` | ``slurm`` | ``kubernetes`` | ``restore``.
        ttl_s: seconds until it expires unless started.
    """
    row = CommandRow(
        id=new_command_id(),
        kind=kind,
        executor=executor,
        driver=driver,
        node_id=node_id,
        restore_id=restore_id,
        state="pending",
        args=args,
        actor=actor,
        reason=reason,
        created_at=now,
        expires_at=now + timedelta(seconds=ttl_s),
        attempts=0,
        output="",
    )
    session.add(row)
    session.flush()
    return row


def deliver(
    session: Session, node_ids: Sequence[int], *, now: datetime, settings: QueueSettings
) -> dict[int, list[Command]]:
    """The commands to send in the answers to these nodes' reports, oldest first, at most
    ``max_per_ack`` per node; marks them delivered (the caller commits with the reports).

    Sent: pending agent commands, and delivered ones the agent has not reported on for
    ``redeliver_s`` (the answer may have been lost), unless expired. One query for the
    whole ingest group.
    """
    out: dict[int, list[Command]] = {n: [] for n in node_ids}
    if not node_ids:
        return out
    stale = now - timedelta(seconds=settings.redeliver_s)
    rows = session.scalars(
        select(CommandRow)
        .where(
            CommandRow.node_id.in_(sorted(set(node_ids))),
            CommandRow.executor == "agent",
            CommandRow.expires_at > now,
            or_(
                CommandRow.state == "pending",
                (CommandRow.state == "delivered") & (CommandRow.delivered_at <= stale),
                # A driver run the agent said it started but never finished (it may have
                # crashed mid-run): sent again, so the agent answers with what it recorded.
                (CommandRow.state == "running")
                & (CommandRow.kind != "restore")
                & (CommandRow.delivered_at <= stale),
            ),
        )
        .order_by(CommandRow.created_at, CommandRow.id)
    ).all()
    for row in rows:
        mine = out[row.node_id]
        if len(mine) >= settings.max_per_ack:
            continue
        if row.state != "running":
            row.state = "delivered"
        row.delivered_at = now
        row.attempts += 1
        mine.append(Command(id=row.id, kind=row.kind, args=row.args, expires_at=row.expires_at))
    return out


def _advance(row: CommandRow, state: str, now: datetime) -> bool:
    """Move ``row`` to ``state`` if that is forward; True when it changed."""
    if row.state in TERMINAL_STATES or row.state == state:
        return False
    if state in _ORDER and _ORDER[state] < _ORDER.get(row.state, -1):
        return False
    row.state = state
    if state == "running":
        row.started_at = row.started_at or now
    if state in TERMINAL_STATES:
        row.finished_at = now
    return True


def apply_results(
    session: Session, node_id: int, results: Sequence[CommandResult], *, now: datetime
) -> list[CommandRow]:
    """Record what the agent reports about its commands; returns the rows that changed.

    Results for unknown commands, for another node's commands, or that would move a
    command backwards are ignored (a replayed or reordered report changes nothing).
    Restore commands stay ``running`` on the agent's word: they succeed when the node's
    ranks report (``restores.apply_rank_reports``).
    """
    if not results:
        return []
    ids = [r.id for r in results]
    rows = {
        r.id: r
        for r in session.scalars(
            select(CommandRow).where(CommandRow.id.in_(ids), CommandRow.node_id == node_id)
        )
    }
    changed = []
    for res in results:
        row = rows.get(res.id)
        if row is None:
            continue
        state = res.state
        if row.kind == "restore" and state == "succeeded":
            state = "running"
        if _advance(row, state, now):
            if res.exit_code is not None:
                row.exit_code = res.exit_code
            if res.output:
                row.output = res.output[-OUTPUT_MAX:]
            changed.append(row)
    return changed


def finish(row: CommandRow, *, ok: bool, exit_code: int | None, output: str, now: datetime) -> bool:
    """Record a finished run (server driver, or a restore whose ranks are done)."""
    if not _advance(row, "succeeded" if ok else "failed", now):
        return False
    row.exit_code = exit_code
    row.output = output[-OUTPUT_MAX:]
    return True


def claim_server_commands(session: Session, *, now: datetime, limit: int = 20) -> list[CommandRow]:
    """Pending server-executed commands, oldest first, marked running (the caller commits
    before running them, so a crash mid-run leaves them ``running`` and visible, not
    re-run). Call in the leader only."""
    rows = session.scalars(
        select(CommandRow)
        .where(
            CommandRow.executor == "server",
            CommandRow.state == "pending",
            CommandRow.expires_at > now,
        )
        .order_by(CommandRow.created_at, CommandRow.id)
        .limit(limit)
    ).all()
    for row in rows:
        _advance(row, "running", now)
        row.attempts += 1
    return list(rows)


def expire(session: Session, *, now: datetime, run_limit_s: float) -> list[CommandRow]:
    """End commands that will never finish; returns them.

    - ``pending``/``delivered`` ones nobody started before ``expires_at``: ``expired``;
    - driver runs (not restores: their requests expire on their own) ``running`` for longer
      than ``run_limit_s`` without a result: ``failed``, not run again (the agent went away,
      or the server stopped mid-run) — the node's state in the scheduler must be checked.
    """
    rows = list(
        session.scalars(
            select(CommandRow).where(
                CommandRow.state.in_(("pending", "delivered")), CommandRow.expires_at <= now
            )
        )
    )
    for row in rows:
        _advance(row, "expired", now)
        row.output = row.output or (
            "expired: not started before "
            f"{row.expires_at.isoformat(timespec='seconds')}"
            + (" (the node's agent did not report in time)" if row.executor == "agent" else "")
        )
    stuck = list(
        session.scalars(
            select(CommandRow).where(
                CommandRow.state == "running",
                CommandRow.kind != "restore",
                CommandRow.started_at <= now - timedelta(seconds=run_limit_s),
            )
        )
    )
    for row in stuck:
        where = "the node's agent" if row.executor == "agent" else "the server"
        finish(
            row,
            ok=False,
            exit_code=row.exit_code,
            now=now,
            output=(
                f"{row.output}\nno result {run_limit_s:g} s after the driver started: {where} "
                "stopped while it ran, so it is not run again; check the node's state in the "
                "scheduler and isolate/release again if needed"
            ).strip(),
        )
    return rows + stuck


def fail_running_for_restore(
    session: Session, restore_id: int, *, message: str, now: datetime, state: str = "failed"
) -> None:
    """End every open command of a restore request (``failed`` or ``expired``)."""
    session.execute(
        update(CommandRow)
        .where(
            CommandRow.restore_id == restore_id,
            CommandRow.state.in_(("pending", "delivered", "running")),
        )
        .values(state=state, finished_at=now, output=message[-OUTPUT_MAX:])
    )


def command_out(row: CommandRow, node_name: str | None = None) -> dict[str, Any]:
    """A command as the API shows it (``schemas.CommandOut``)."""
    return {
        "id": row.id,
        "kind": row.kind,
        "node": node_name,
        "executor": row.executor,
        "driver": row.driver,
        "state": row.state,
        "actor": row.actor,
        "reason": row.reason,
        "args": row.args,
        "created_at": row.created_at,
        "expires_at": row.expires_at,
        "delivered_at": row.delivered_at,
        "started_at": row.started_at,
        "finished_at": row.finished_at,
        "attempts": row.attempts,
        "exit_code": row.exit_code,
        "output": row.output,
        "restore_id": row.restore_id,
    }


def prune(session: Session, *, now: datetime, retention_s: float) -> dict[str, int]:
    """Delete finished commands, finished restore requests and audit entries older than
    ``retention_s`` (the event retention); returns rows deleted per table."""
    from sqlalchemy import delete

    from tierwatch.server.actions.models import AuditEntry, RestoreRequest

    cut = now - timedelta(seconds=retention_s)
    out = {}
    out["commands"] = execute_dml(
        session,
        delete(CommandRow).where(
            CommandRow.state.in_(sorted(TERMINAL_STATES)), CommandRow.created_at < cut
        ),
    )
    out["restore_requests"] = execute_dml(
        session,
        delete(RestoreRequest).where(
            RestoreRequest.state != "running", RestoreRequest.created_at < cut
        ),
    )
    out["audit_log"] = execute_dml(session, delete(AuditEntry).where(AuditEntry.ts < cut))
    return out


#: Driver runs shown on a node's page.
NODE_COMMAND_LIMIT = 10


def recent_node_commands(session: Session, node: Any) -> list[dict[str, Any]]:
    """The node's newest driver runs (isolate/release commands), newest first.

    Args:
        node: the node (a ``fleet.models.Node`` or a row with ``id`` and ``name``).

    Returns:
        At most :data:`NODE_COMMAND_LIMIT` commands in :func:`command_out`'s shape.
    """
    rows = session.scalars(
        select(CommandRow)
        .where(CommandRow.node_id == node.id, CommandRow.kind.in_(("isolate", "release")))
        .order_by(CommandRow.created_at.desc())
        .limit(NODE_COMMAND_LIMIT)
    )
    return [command_out(r, node.name) for r in rows]

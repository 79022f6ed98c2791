"""Isolate and release nodes: the server-side overlay, the driver command, the audit entry.

Isolation takes effect at once as an overlay on the node row (``isolated`` with who/when/
why), decided by one conditional ``UPDATE … WHERE isolated = <old>`` so concurrent isolate
and release requests of one node serialise on the row: each request's audit entry says
whether it changed the state (``ok``) or found it already so (``noop``), and the final
state is that of the last request that changed it. The configured driver's run is queued
as a command (``queue``): node-local drivers (``command``) run on the node's agent, cluster
drivers (``slurm``, ``kubernetes``) on the server's leader replica; ``none`` records only.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import update
from sqlalchemy.orm import Session

from tierwatch.server.actions import audit, notify, queue
from tierwatch.server.actions.models import CommandRow
from tierwatch.server.config import Settings
from tierwatch.server.db import execute_dml
from tierwatch.server.fleet.models import Node

CLUSTER_DRIVERS = frozenset({"slurm", "kubernetes"})
ALREADY = {True: "isolated", False: "in service"}


@dataclass
class IsolationOutcome:
    """What an isolate/release request did.

    Attributes:
        changed: False when the node already was in the requested state (nothing queued).
        command: the driver command queued, or None (driver ``none``, or no change).
    """

    changed: bool
    command: CommandRow | None


def _driver_command(
    session: Session,
    node: Node,
    kind: str,
    *,
    actor: str,
    reason: str,
    now: datetime,
    settings: Settings,
) -> CommandRow | None:
    driver = settings.isolation.driver
    if driver == "none":
        return None
    executor = "server" if driver in CLUSTER_DRIVERS else "agent"
    return queue.enqueue(
        session,
        kind=kind,
        node_id=node.id,
        executor=executor,
        driver=driver,
        args={"reason": reason, "actor": actor},
        actor=actor,
        reason=reason,
        now=now,
        ttl_s=settings.commands.ttl_s,
    )


def set_isolated(
    session: Session,
    node: Node,
    isolated: bool,
    *,
    actor: str,
    role: str,
    reason: str,
    now: datetime,
    settings: Settings,
    detail: dict[str, Any] | None = None,
) -> IsolationOutcome:
    """Isolate (``isolated=True``) or release a node (the caller commits).

    Args:
        reason: why (required by the API; stored with the isolation and in the audit log).
        detail: extra facts for the audit entry (e.g. the policy's rule).

    Returns:
        Whether the state changed and the driver command queued.
    """
    values: dict[str, Any] = {"isolated": isolated}
    if isolated:
        values |= {"isolated_at": now, "isolated_by": actor, "isolated_reason": reason}
    else:
        values |= {"released_at": now}
    changed = (
        execute_dml(
            session,
            update(Node)
            .where(Node.id == node.id, Node.isolated.is_(not isolated))
            .values(**values)
            .execution_options(synchronize_session=False),
        )
        == 1
    )
    session.refresh(node)
    kind = "isolate" if isolated else "release"
    command = None
    if changed:
        command = _driver_command(
            session, node, kind, actor=actor, reason=reason, now=now, settings=settings
        )
        notify.isolation_changed(
            session,
            settings,
            node=node.name,
            isolated=isolated,
            actor=actor,
            reason=reason,
            now=now,
        )
    audit.record(
        session,
        actor=actor,
        role=role,
        action=kind,
        target_kind="node",
        target=node.name,
        reason=reason,
        outcome="ok" if changed else "noop",
        now=now,
        detail={
            **(detail or {}),
            "driver": settings.isolation.driver,
            **({"command": command.id} if command is not None else {}),
            **({} if changed else {"note": f"node was already {ALREADY[isolated]}"}),
        },
    )
    return IsolationOutcome(changed=changed, command=command)

"""The alerts that actions raise (delivered to webhooks by ``tierwatch.server.alerts``).

Each function adds the alert inside the caller's transaction, so an alert exists exactly when
the action it reports was committed. Dedup keys: one per node (isolation, state), per job
(restore), per command, and one for the breaker.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tierwatch.server.alerts.models import Alert
from tierwatch.server.alerts.service import raise_alert
from tierwatch.server.config import Settings


def isolation_changed(
    session: Session,
    settings: Settings,
    *,
    node: str,
    isolated: bool,
    actor: str,
    reason: str,
    now: datetime,
) -> None:
    """A node was isolated (firing) or released (resolved)."""
    raise_alert(
        session,
        settings.alerts,
        kind="isolation",
        key=f"isolation:{node}",
        severity="warning",
        status="firing" if isolated else "resolved",
        summary=f"node {node} {'isolated' if isolated else 'released'} by {actor}: {reason}",
        labels={"node": node, "actor": actor},
        details={"reason": reason, "isolated": isolated},
        now=now,
    )


NODE_STATES_ALERTED = ("degraded", "unhealthy", "unreachable")


def node_state_changed(
    session: Session,
    settings: Settings,
    *,
    node: str,
    old: str,
    new: str,
    message: str,
    now: datetime,
) -> None:
    """A node's health state changed: the new state's alert fires (unless healthy), and
    every other state's alert of that node still firing resolves (so ``degraded →
    unhealthy → degraded → healthy`` leaves none open, whatever the path)."""
    for state in NODE_STATES_ALERTED:
        if state == new:
            continue
        key = f"node_state:{node}:{state}"
        if _newest_status(session, key) != "firing":
            continue
        raise_alert(
            session,
            settings.alerts,
            kind="node_state",
            key=key,
            severity="info",
            status="resolved",
            summary=f"node {node} is {new} (was {old})" + (f": {message}" if message else ""),
            labels={"node": node, "state": state},
            details={"old": old, "new": new, "message": message},
            now=now,
        )
    if new == "healthy":
        return
    raise_alert(
        session,
        settings.alerts,
        kind="node_state",
        key=f"node_state:{node}:{new}",
        severity={"unhealthy": "critical", "degraded": "warning"}.get(new, "info"),
        status="firing",
        summary=f"node {node} is {new} (was {old})" + (f": {message}" if message else ""),
        labels={"node": node, "state": new},
        details={"old": old, "new": new, "message": message},
        now=now,
    )


def _newest_status(session: Session, key: str) -> str | None:
    return session.scalar(
        select(Alert.status).where(Alert.key == key).order_by(Alert.id.desc()).limit(1)
    )


def breaker_tripped(
    session: Session, settings: Settings, *, message: str, held: list[str], now: datetime
) -> None:
    """The auto-isolation circuit breaker holds (a cluster-level alert)."""
    raise_alert(
        session,
        settings.alerts,
        kind="breaker",
        key="policy_breaker",
        severity="critical",
        summary=message,
        labels={"scope": "cluster"},
        details={"nodes_not_isolated": held},
        now=now,
    )


def breaker_reset(session: Session, settings: Settings, *, now: datetime) -> None:
    """The circuit breaker let go again (resolves the breaker alert)."""
    raise_alert(
        session,
        settings.alerts,
        kind="breaker",
        key="policy_breaker",
        severity="info",
        status="resolved",
        summary="auto-isolation circuit breaker reset: the policy acts again",
        labels={"scope": "cluster"},
        details={},
        now=now,
    )


def command_failed(
    session: Session,
    settings: Settings,
    *,
    node: str,
    command_id: str,
    kind: str,
    driver: str,
    output: str,
    now: datetime,
) -> None:
    """A driver run failed or expired."""
    raise_alert(
        session,
        settings.alerts,
        kind="command_failed",
        key=f"command:{command_id}",
        severity="warning",
        summary=f"{kind} of node {node} via {driver} did not succeed: {output[-300:]}",
        labels={"node": node, "driver": driver},
        details={"command": command_id, "output": output[-2000:]},
        now=now,
    )


def restore_failed(
    session: Session, settings: Settings, *, job: str, request_id: int, message: str, now: datetime
) -> None:
    """A restore request failed on some rank."""
    raise_alert(
        session,
        settings.alerts,
        kind="restore_failed",
        key=f"restore:{job}:{request_id}",
        severity="critical",
        summary=f"restore {request_id} of job {job} failed: {message[:300]}",
        labels={"job": job},
        details={"request_id": request_id, "message": message},
        now=now,
    )


CONTROL_PLANE_KEY = "control_plane_suspect"


def control_plane_suspect(
    session: Session,
    settings: Settings,
    *,
    message: str,
    held: list[str],
    evidence: dict[str, Any],
    now: datetime,
) -> bool:
    """The policy holds unreachable nodes because the control plane is the likely cause (a
    cluster-level alert). Returns True when a new notice was raised (not deduplicated)."""
    alert = raise_alert(
        session,
        settings.alerts,
        kind="control_plane",
        key=CONTROL_PLANE_KEY,
        severity="critical",
        summary=message,
        labels={"scope": "cluster"},
        details={"nodes_not_isolated": held, **evidence},
        now=now,
    )
    return alert is not None


def control_plane_clear(session: Session, settings: Settings, *, now: datetime) -> None:
    """Resolve the "control plane suspect" alert, if its newest notice is firing."""
    if _newest_status(session, CONTROL_PLANE_KEY) != "firing":
        return
    raise_alert(
        session,
        settings.alerts,
        kind="control_plane",
        key=CONTROL_PLANE_KEY,
        severity="info",
        status="resolved",
        summary="control plane no longer suspect: unreachability is acted on again",
        labels={"scope": "cluster"},
        details={},
        now=now,
    )


def agent_silent(
    session: Session, settings: Settings, *, node: str, reason: str, view: str, now: datetime
) -> None:
    """A node is silent to tierwatch, but the scheduler still hears from it: not isolated;
    its agent (or the path to the server) needs a look."""
    raise_alert(
        session,
        settings.alerts,
        kind="agent_silent",
        key=f"agent_silent:{node}",
        severity="warning",
        summary=(
            f"node {node}: {reason.removeprefix('policy: ')}, but {view}: not isolated; "
            "check the node's tierwatch agent"
        ),
        labels={"node": node},
        details={"scheduler": view},
        now=now,
    )

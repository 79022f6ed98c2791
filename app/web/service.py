"""Read models for the dashboard, built on the fleet service (no HTTP, no templates).

The cluster page must stay cheap at thousands of nodes, so it reads only the latest-value
tables, in a fixed number of queries whatever the node count: nodes and reasons through
``fleet.service.list_node_views(with_gpus=False)`` and one aggregate over ``gpus``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tierwatch.server.actions.models import CommandRow
from tierwatch.server.actions.queue import command_out
from tierwatch.server.fleet import rules
from tierwatch.server.fleet import service as fleet_service
from tierwatch.server.fleet.models import Event, Gpu, Node, ReasonRow
from tierwatch.server.fleet.xid_catalog import lookup as lookup_xid

XID_EVENT_LIMIT = 50
STATE_EVENT_LIMIT = 20
AGENT_EVENT_LIMIT = 20


@dataclass(frozen=True)
class Tile:
    """One node on the cluster page.

    Attributes:
        name: Node name.
        state: Effective state (healthy | degraded | unhealthy | unreachable).
        simulated: The agent runs a simulated collector.
        isolated: The node is isolated (cordoned/drained).
        reason: The worst active reason (highest severity, newest), or None.
        reason_count: Number of active reasons.
        gpu_count: GPUs in the node's inventory.
        max_temp_c: Hottest GPU's latest temperature (°C), None when none was read.
        last_seen: When the node last reported.
    """

    name: str
    state: str
    simulated: bool
    isolated: bool
    reason: ReasonRow | None
    reason_count: int
    gpu_count: int
    max_temp_c: float | None
    last_seen: datetime | None


def worst_reason(reasons: list[ReasonRow]) -> ReasonRow | None:
    """The reason to show first: highest severity, then the most recently seen."""
    if not reasons:
        return None
    return max(reasons, key=lambda r: (rules.STATE_ORDER.get(r.severity, 0), r.last_seen))


def sort_reasons(reasons: list[ReasonRow]) -> list[ReasonRow]:
    """Reasons worst first (severity, then most recently seen)."""
    return sorted(
        reasons, key=lambda r: (-rules.STATE_ORDER.get(r.severity, 0), -r.last_seen.timestamp())
    )


def gpu_summaries(session: Session) -> dict[int, tuple[int, float | None]]:
    """``node_id -> (GPU count, hottest latest temperature °C)`` in one aggregate query."""
    q = select(Gpu.node_id, func.count(Gpu.id), func.max(Gpu.temperature_c)).group_by(Gpu.node_id)
    return {node_id: (count, hottest) for node_id, count, hottest in session.execute(q)}


def cluster_tiles(
    session: Session,
    *,
    now: datetime,
    th: rules.HealthThresholds,
    state: str | None,
    name_contains: str | None,
) -> tuple[dict[str, int], list[Tile]]:
    """Counts per state (of the nodes matching ``name_contains``) and the tiles to show.

    Returns:
        ``(counts, tiles)``: ``counts`` has every state (zero included) and ignores the state
        filter, as ``GET /api/v1/nodes`` does; ``tiles`` are by name, filtered by ``state``.
    """
    views = fleet_service.list_node_views(
        session, now=now, th=th, name_contains=name_contains, with_gpus=False
    )
    counts = fleet_service.state_counts(views)
    summaries = gpu_summaries(session)
    tiles = []
    for v in views:
        if state and v.state != state:
            continue
        gpu_count, hottest = summaries.get(v.node.id, (0, None))
        tiles.append(
            Tile(
                name=v.node.name,
                state=v.state,
                simulated=v.node.simulated,
                isolated=v.node.isolated,
                reason=worst_reason(v.reasons),
                reason_count=len(v.reasons),
                gpu_count=gpu_count,
                max_temp_c=hottest,
                last_seen=v.node.last_seen,
            )
        )
    return counts, tiles


@dataclass(frozen=True)
class XidRow:
    """An XID event with its catalog entry (mnemonic and immediate action)."""

    event: Event
    mnemonic: str
    action: str
    action_text: str


def xid_rows(session: Session, node: Node) -> list[XidRow]:
    """The node's newest XID events with catalog mnemonic, action and its description."""
    out = []
    for event, _ in fleet_service.query_events(
        session, node=node, kind="xid", since=None, limit=XID_EVENT_LIMIT
    ):
        data = event.data or {}
        info = lookup_xid(event.code) if event.code is not None else None
        mnemonic = data.get("mnemonic") or (info.mnemonic if info else "UNKNOWN")
        action = data.get("action") or (info.action if info else rules.ACTION_UNKNOWN_XID)
        out.append(XidRow(event, str(mnemonic), str(action), rules.describe_action(str(action))))
    return out


def recent_events(session: Session, node: Node, kind: str, limit: int) -> list[Event]:
    """The node's newest events of one kind (``state``, ``agent``, ``ack``)."""
    return [
        e
        for e, _ in fleet_service.query_events(
            session, node=node, kind=kind, since=None, limit=limit
        )
    ]


COMMAND_LIMIT = 10


def recent_commands(session: Session, node: Node) -> list[dict[str, Any]]:
    """The node's newest driver runs (isolate/release commands), newest first."""
    rows = session.scalars(
        select(CommandRow)
        .where(CommandRow.node_id == node.id, CommandRow.kind.in_(("isolate", "release")))
        .order_by(CommandRow.created_at.desc())
        .limit(COMMAND_LIMIT)
    )
    return [command_out(r, node.name) for r in rows]

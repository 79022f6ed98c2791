"""Read side of the fleet and its housekeeping: node views, samples, events, acks, pruning."""

from __future__ import annotations

import base64
import functools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Integer, case, cast, delete, func, literal, select, update
from sqlalchemy.orm import Session

from tierwatch.agent.protocol import NODE_NAME_PATTERN, throttle_reason_names
from tierwatch.server.fleet import partitions, rollups, rules
from tierwatch.server.fleet.models import (
    BOOL_METRICS,
    METRIC_FIELDS,
    Acknowledgement,
    Event,
    Gpu,
    GpuSampleRollup,
    GpuSampleRow,
    LatencySampleRow,
    Node,
    ReasonRow,
    ReportRange,
    XidCount,
)
from tierwatch.server.fleet.xid_catalog import lookup as lookup_xid

STATES = ("healthy", "degraded", "unhealthy", "unreachable")
NODE_NAME_RE = re.compile(NODE_NAME_PATTERN)


class NotFoundError(LookupError):
    """A named object does not exist (answered as 404)."""


@dataclass
class NodeView:
    """A node as the API and dashboard show it (effective state includes reachability)."""

    node: Any  # a Node, or a read-only row with the same attributes
    state: str
    unreachable: bool
    reasons: list[Any]  # ReasonRow objects or rows with the same attributes
    gpus: list[Gpu] = field(default_factory=list)
    xid_counts: dict[int, int] = field(default_factory=dict)  # gpu index -> occurrences


def isolation_of(n: Any) -> dict[str, Any] | None:
    """``IsolationOut`` fields of an isolated node row, or None."""
    if not n.isolated:
        return None
    return {"at": n.isolated_at, "by": n.isolated_by, "reason": n.isolated_reason}


# --- the fields of a node, a GPU and a reason: one builder each -----------------------------
# The JSON API (``schemas.NodeOut``, and ``node_list_payload``'s rows), the dashboard pages
# and the rules engine (``rules.Reason``) all take a node's, a GPU's and a reason's fields
# from these functions, so they name and derive them alike.

#: The ``gpus`` columns a GPU's fields are built from, in :func:`gpu_fields`'s order.
GPU_COLUMNS: tuple[str, ...] = ("index", "uuid", "name", "ts", *METRIC_FIELDS)


def reason_fields(row: Any) -> dict[str, Any]:
    """The fields of a stored reason (a ``ReasonRow`` or a Core row of ``reasons``).

    The names are ``ReasonOut``'s and :class:`rules.Reason`'s: ``gpu`` is None for a
    node-level reason (stored with ``gpu_index`` -1 so the unique key works everywhere).
    """
    return {
        "rule": row.rule,
        "severity": row.severity,
        "gpu": None if row.gpu_index < 0 else row.gpu_index,
        "key": row.key,
        "message": row.message,
        "action": row.action,
        "evidence": row.evidence or {},
        "first_seen": row.first_seen,
        "last_seen": row.last_seen,
    }


@functools.lru_cache(maxsize=1024)
def _throttle_names(mask: int | None) -> tuple[str, ...]:
    return tuple(throttle_reason_names(mask))


def gpu_fields(values: Sequence[Any], *, xid_count: int) -> dict[str, Any]:
    """The fields of a GPU with its latest values (``GpuOut``'s names).

    Args:
        values: the GPU's :data:`GPU_COLUMNS` values, in that order (a Core row's columns,
            or read off a ``Gpu`` object).
        xid_count: XID occurrences on the GPU, all codes together (``xid_counts``).

    Returns:
        The columns plus ``throttle_reason_names`` (the bits of ``throttle_reasons`` by
        NVML name) and ``xid_count``.
    """
    d = dict(zip(GPU_COLUMNS, values, strict=True))  # C-speed: 16k GPUs on 2,048 nodes
    d["throttle_reason_names"] = list(_throttle_names(d["throttle_reasons"]))
    d["xid_count"] = xid_count
    return d


def node_fields(
    n: Any, *, state: str, reasons: list[dict[str, Any]], gpus: list[dict[str, Any]]
) -> dict[str, Any]:
    """The fields of a node (``NodeOut``'s names) from its row and its effective state.

    Args:
        n: a ``Node`` or a Core row of ``nodes``.
        state: the effective state (:func:`effective_state`: unreachable overrides health).
        reasons: its reasons' :func:`reason_fields`; gpus: its GPUs' :func:`gpu_fields`.
    """
    return {
        "name": n.name,
        "state": state,
        "health_state": n.state,
        "reasons": reasons,
        "isolated": n.isolated,
        "isolation": isolation_of(n),
        "released_at": n.released_at,
        "simulated": n.simulated,
        "collector": n.collector,
        "agent_version": n.agent_version,
        "interval_s": n.interval_s,
        "first_seen": n.first_seen,
        "last_seen": n.last_seen,
        "state_since": n.state_since,
        "gpus": gpus,
    }


def node_view_fields(view: NodeView) -> dict[str, Any]:
    """:func:`node_fields` of a node view, with its reasons and GPUs."""
    return node_fields(
        view.node,
        state=view.state,
        reasons=[reason_fields(r) for r in view.reasons],
        gpus=[
            gpu_fields(
                [getattr(g, c) for c in GPU_COLUMNS], xid_count=view.xid_counts.get(g.index, 0)
            )
            for g in view.gpus
        ],
    )


def effective_state(node: Node, now: datetime, th: rules.HealthThresholds) -> tuple[str, bool]:
    """(state, unreachable) of a node at ``now``: unreachable overrides the health state."""
    unreachable = rules.is_unreachable(node.last_seen, node.interval_s, now, th)
    return ("unreachable" if unreachable else node.state), unreachable


def list_node_views(
    session: Session,
    *,
    now: datetime,
    th: rules.HealthThresholds,
    state: str | None = None,
    name_contains: str | None = None,
    with_gpus: bool = True,
) -> list[NodeView]:
    """All nodes (optionally filtered by effective state and name substring), by name.

    Reads only the latest-value tables (nodes, gpus, reasons, xid_counts): never history.
    Nodes and reasons come back as read-only Core rows (attribute access like the ORM
    objects, a fraction of the cost for thousands of nodes); GPUs as ORM objects.
    """
    nodes_t = Node.__table__
    query = select(nodes_t).order_by(nodes_t.c.name)
    if name_contains:
        query = query.where(_name_filter(nodes_t.c.name, name_contains))
    nodes = session.execute(query).all()
    reasons: dict[int, list[Any]] = {}
    reasons_t = ReasonRow.__table__
    for r in session.execute(select(reasons_t).order_by(reasons_t.c.first_seen)):
        reasons.setdefault(r.node_id, []).append(r)
    gpus: dict[int, list[Gpu]] = {}
    counts: dict[int, dict[int, int]] = {}
    if with_gpus:
        for g in session.scalars(select(Gpu).order_by(Gpu.node_id, Gpu.index)):
            gpus.setdefault(g.node_id, []).append(g)
        for c in session.scalars(select(XidCount)):
            per = counts.setdefault(c.node_id, {})
            per[c.gpu_index] = per.get(c.gpu_index, 0) + c.count
    views = []
    for n in nodes:
        eff, unreachable = effective_state(n, now, th)
        if state and eff != state:
            continue
        views.append(
            NodeView(
                n, eff, unreachable, reasons.get(n.id, []), gpus.get(n.id, []), counts.get(n.id, {})
            )
        )
    return views


#: Nodes per page of ``GET /api/v1/nodes`` unless the client asks (``limit``), and the most.
NODE_PAGE_DEFAULT = 500
NODE_PAGE_MAX = 5000


class BadCursor(ValueError):
    """A ``cursor`` that this API did not give out (or that was edited)."""


def encode_cursor(name: str) -> str:
    """The opaque cursor of the page after node ``name`` (URL-safe base64, no padding)."""
    return base64.urlsafe_b64encode(name.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    """The node name a cursor points after.

    Raises:
        BadCursor: not base64 of a valid node name.
    """
    try:
        name = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadCursor("cursor is not one this API gave out: start again without it") from exc
    if not _NODE_NAME.fullmatch(name):
        raise BadCursor("cursor is not one this API gave out: start again without it")
    return name


_NODE_NAME = re.compile(NODE_NAME_PATTERN)


def node_list_payload(
    session: Session,
    *,
    now: datetime,
    th: rules.HealthThresholds,
    state: str | None = None,
    name_contains: str | None = None,
    limit: int | None = None,
    after: str | None = None,
) -> dict[str, Any]:
    """``GET /api/v1/nodes`` as plain dicts, read with Core queries, one page at a time.

    The same shape as ``schemas.NodeList`` (a test holds the two together) but built
    without ORM objects or model validation. Every node row is read (its effective state
    decides the counts and the state filter, and is not a column), but GPUs, XID counts and
    reasons only for the page: with 2,048 nodes × 8 GPUs the whole list was about 11 MB.

    Args:
        limit: most nodes in the page (None: every node).
        after: the page starts after this node name (from the previous ``next_cursor``).

    Returns:
        ``{"counts": {state: n}, "nodes": [node dict, ...], "next_cursor": str | None}``,
        nodes in name order; ``counts`` ignores the ``state`` filter and the paging (it
        counts every state of the name-filtered nodes); ``next_cursor`` is None on the last
        page.
    """
    nodes_t, gpus_t, reasons_t = Node.__table__, Gpu.__table__, ReasonRow.__table__
    q = select(nodes_t).order_by(nodes_t.c.name)
    if name_contains:
        q = q.where(_name_filter(nodes_t.c.name, name_contains))
    counts = dict.fromkeys(STATES, 0)
    page: list[tuple[Any, str]] = []
    more = False
    for n in session.execute(q):
        eff, _ = effective_state(n, now, th)
        counts[eff] += 1
        if (state and eff != state) or (after is not None and n.name <= after):
            continue
        if limit is not None and len(page) >= limit:
            more = True
            continue
        page.append((n, eff))
    ids = [n.id for n, _ in page]
    reasons: dict[int, list[dict[str, Any]]] = {}
    xids: dict[tuple[int, int], int] = {}
    gpus: dict[int, list[dict[str, Any]]] = {}
    for chunk in _chunks(ids, 1000):  # bound the IN list (SQLite's variable limit)
        for r in session.execute(
            select(reasons_t).where(reasons_t.c.node_id.in_(chunk)).order_by(reasons_t.c.first_seen)
        ):
            reasons.setdefault(r.node_id, []).append(reason_fields(r))
        for node_id, gpu, count in session.execute(
            select(XidCount.node_id, XidCount.gpu_index, func.sum(XidCount.count))
            .where(XidCount.node_id.in_(chunk))
            .group_by(XidCount.node_id, XidCount.gpu_index)
        ):
            xids[(node_id, gpu)] = int(count)
        gpu_cols = [gpus_t.c[c] for c in GPU_COLUMNS]
        query = (
            select(gpus_t.c.node_id, *gpu_cols)
            .where(gpus_t.c.node_id.in_(chunk))
            .order_by(gpus_t.c.node_id, gpus_t.c.index)
        )
        for row in session.execute(query):
            values = row[1:]
            gpus.setdefault(row[0], []).append(
                gpu_fields(values, xid_count=xids.get((row[0], values[0]), 0))
            )
    out = [
        node_fields(n, state=eff, reasons=reasons.get(n.id, []), gpus=gpus.get(n.id, []))
        for n, eff in page
    ]
    next_cursor = encode_cursor(page[-1][0].name) if more and page else None
    return {"counts": counts, "nodes": out, "next_cursor": next_cursor}


def _chunks(items: list[int], size: int) -> Iterator[list[int]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _name_filter(column: Any, text: str) -> Any:
    """Case-insensitive "name contains ``text``" with LIKE wildcards escaped."""
    text = text.replace("\x00", "")  # PostgreSQL text cannot hold NUL; no name contains one
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return column.ilike(f"%{escaped}%", escape="\\")


def get_node_view(
    session: Session, name: str, *, now: datetime, th: rules.HealthThresholds
) -> NodeView:
    """One node with its GPUs and reasons.

    Raises:
        NotFoundError: no node has that name.
    """
    node = get_node(session, name)
    eff, unreachable = effective_state(node, now, th)
    reasons = list(
        session.scalars(
            select(ReasonRow).where(ReasonRow.node_id == node.id).order_by(ReasonRow.first_seen)
        )
    )
    gpus = list(session.scalars(select(Gpu).where(Gpu.node_id == node.id).order_by(Gpu.index)))
    counts: dict[int, int] = {}
    for c in session.scalars(select(XidCount).where(XidCount.node_id == node.id)):
        counts[c.gpu_index] = counts.get(c.gpu_index, 0) + c.count
    return NodeView(node, eff, unreachable, reasons, gpus, counts)


def get_node(session: Session, name: str) -> Node:
    """The node named ``name``.

    Raises:
        NotFoundError: no node has that name.
    """
    node = None
    if NODE_NAME_RE.match(name):  # a name no node can have is never sent to the database
        node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        raise NotFoundError(f"no node named {name!r}")
    return node


def state_counts(views: list[NodeView]) -> dict[str, int]:
    """Number of nodes per effective state (every state present, zero included)."""
    counts = dict.fromkeys(STATES, 0)
    for v in views:
        counts[v.state] += 1
    return counts


def report_stats(session: Session, node: Node) -> dict[str, Any]:
    """What the server holds of the node's current agent epoch: first/last seq and count.

    ``count == last_seq - first_seq + 1`` proves no batch of the epoch is missing.
    """
    first, last, count = session.execute(
        select(
            func.min(ReportRange.first_seq),
            func.max(ReportRange.last_seq),
            func.sum(ReportRange.last_seq - ReportRange.first_seq + 1),
        ).where(ReportRange.node_id == node.id, ReportRange.epoch == node.epoch)
    ).one()
    count = int(count or 0)
    return {
        "epoch": node.epoch,
        "first_seq": first,
        "last_seq": last,
        "batches": count,
        "missing": (last - first + 1 - count) if last is not None else 0,
        "dropped_by_agent": node.dropped_batches,
    }


def query_samples(
    session: Session,
    node: Node,
    *,
    gpu: int | None,
    metric: str | None,
    since: datetime,
    until: datetime,
    limit: int,
    step_s: float | None = None,
    raw_since: datetime | None = None,
) -> list[dict[str, Any]]:
    """Raw or downsampled samples of one node in ``[since, until]``, oldest first.

    Args:
        step_s: when given, rows are averaged per GPU into buckets of this many seconds
            (``ts`` is the bucket start; boolean metrics are true when any sample was).
        raw_since: how far back the raw history is kept (``now - sample_retention_s``);
            with ``step_s``, the part of the range before it (to the start of its 5-minute
            bucket) reads the rollups (``fleet.rollups``) as far as they reach, and the rest
            the raw rows. Counters
            and flags from rollups are the bucket's maximum; gauges are weighted by the
            samples each rollup summarises. None: raw rows only.

    Returns:
        Rows ``{"gpu": int, "ts": datetime, <metric>: value, ...}``: every metric, or only
        ``metric`` when given. At most ``limit`` rows (the newest ones).

    Raises:
        ValueError: unknown metric name (the message lists the valid ones).
    """
    if metric is not None and metric not in METRIC_FIELDS:
        raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRIC_FIELDS)}")
    fields = [metric] if metric else list(METRIC_FIELDS)
    if step_s is None:
        where = [GpuSampleRow.node_id == node.id, GpuSampleRow.ts >= since]
        where.append(GpuSampleRow.ts <= until)
        if gpu is not None:
            where.append(GpuSampleRow.gpu_index == gpu)
        cols = [GpuSampleRow.gpu_index, GpuSampleRow.ts]
        cols += [getattr(GpuSampleRow, f) for f in fields]
        q = select(*cols).where(*where).order_by(GpuSampleRow.ts.desc()).limit(limit)
        rows = [(r[0], r[1], *r[2:]) for r in session.execute(q)]
        rows.sort(key=lambda r: (r[1], r[0]))
        return [{"gpu": r[0], "ts": r[1], **dict(zip(fields, r[2:], strict=True))} for r in rows]
    raw_from = since
    parts: list[_Bucketed] = []
    if raw_since is not None and since < raw_since:
        rolled_to = session.scalar(
            select(func.max(GpuSampleRollup.bucket)).where(GpuSampleRollup.node_id == node.id)
        )
        if rolled_to is not None:
            # rollups only where the raw rows may be gone: up to the bucket holding
            # raw_since (so no bucket is counted from both), and no further than they reach
            rollup_end = min(
                until,
                rolled_to + timedelta(seconds=rollups.ROLLUP_S),
                rollups.bucket_start(raw_since),
            )
            parts += _bucketed(
                session,
                GpuSampleRollup,
                GpuSampleRollup.bucket,
                node,
                gpu,
                fields,
                since,
                rollup_end,
                step_s,
                limit,
                weight=GpuSampleRollup.samples,
            )
            raw_from = max(since, rollup_end)
    if raw_from <= until:
        parts += _bucketed(
            session,
            GpuSampleRow,
            GpuSampleRow.ts,
            node,
            gpu,
            fields,
            raw_from,
            until,
            step_s,
            limit,
            weight=None,
        )
    merged = _merge_buckets(parts, fields)[-limit:]
    return [{"gpu": g, "ts": ts, **values} for (ts, g), values in merged]


# (gpu, bucket start, samples, values by field) of one source's bucketed query
_Bucketed = tuple[int, datetime, float, dict[str, Any]]


def _bucketed(
    session: Session,
    model: Any,
    ts_col: Any,
    node: Node,
    gpu: int | None,
    fields: list[str],
    since: datetime,
    until: datetime,
    step_s: float,
    limit: int,
    *,
    weight: Any,
) -> list[_Bucketed]:
    """One source (raw rows or rollups) grouped per GPU into ``step_s`` buckets; gauges as
    sums weighted by ``weight`` (rows summarised per rollup; 1 per raw row), counters and
    flags as maxima. ``until`` is inclusive for raw rows, exclusive for rollups."""
    epoch = _epoch_seconds(session, ts_col)
    bucket = (func.floor(epoch / step_s) * step_s).label("bucket")
    w = weight if weight is not None else literal(1)
    where = [model.node_id == node.id, ts_col >= since]
    where.append(ts_col < until if weight is not None else ts_col <= until)
    if gpu is not None:
        where.append(model.gpu_index == gpu)
    aggs: list[Any] = [func.sum(w)]
    for f in fields:
        col = getattr(model, f)
        if f in BOOL_METRICS:
            aggs.append(func.max(cast(col, Integer)))
        elif f in rollups.GAUGES:
            aggs += [func.sum(col * w), func.sum(case((col.is_not(None), w), else_=0))]
        else:
            aggs.append(func.max(col))
    q = (
        select(model.gpu_index, bucket, *aggs)
        .where(*where)
        .group_by(model.gpu_index, bucket)
        .order_by(bucket.desc())
        .limit(limit)
    )
    out: list[_Bucketed] = []
    for r in session.execute(q):
        values: dict[str, Any] = {}
        k = 3
        for f in fields:
            if f in rollups.GAUGES:
                total, n = r[k], r[k + 1]
                values[f] = (float(total), float(n)) if total is not None and n else None
                k += 2
            else:
                values[f] = r[k]
                k += 1
        out.append((r[0], datetime.fromtimestamp(float(r[1]), UTC), float(r[2] or 0), values))
    return out


def _merge_buckets(
    parts: list[_Bucketed], fields: list[str]
) -> list[tuple[tuple[datetime, int], dict[str, Any]]]:
    """Combine bucket rows of both sources (a bucket can straddle the rollups' newest
    bucket): gauges as weighted means, counters and flags as maxima; oldest first."""
    acc: dict[tuple[datetime, int], dict[str, Any]] = {}
    for g, ts, _n, values in parts:
        cur = acc.setdefault((ts, g), {})
        for f in fields:
            v = values[f]
            if v is None:
                cur.setdefault(f, None)
            elif f in rollups.GAUGES:
                old = cur.get(f)
                cur[f] = (old[0] + v[0], old[1] + v[1]) if old else v
            else:
                old = cur.get(f)
                cur[f] = v if old is None else max(old, v)
    out = []
    for key in sorted(acc):
        cur = acc[key]
        values = {}
        for f in fields:
            v = cur.get(f)
            if v is None:
                values[f] = None
            elif f in rollups.GAUGES:
                values[f] = v[0] / v[1]
            elif f in BOOL_METRICS:
                values[f] = bool(v)
            else:
                values[f] = int(v)  # a counter's maximum: still a count
        out.append((key, values))
    return out


def _epoch_seconds(session: Session, column: Any) -> Any:
    """SQL expression: a UTC timestamp column as seconds since the Unix epoch."""
    if session.get_bind().dialect.name == "postgresql":
        return func.extract("epoch", column)
    # SQLite stores naive UTC text; julianday keeps the fraction of a second. Rounded to the
    # millisecond so float error cannot push a reading on a bucket edge into the bucket before.
    return func.round((func.julianday(column) - 2440587.5) * 86400.0, 3)


def query_events(
    session: Session,
    *,
    node: Node | None,
    kind: str | None,
    since: datetime | None,
    limit: int,
) -> list[tuple[Event, str | None]]:
    """Events newest first, with the node name, filtered by node, kind and time."""
    q = select(Event, Node.name).join(Node, Node.id == Event.node_id, isouter=True)
    if node is not None:
        q = q.where(Event.node_id == node.id)
    if kind:
        q = q.where(Event.kind == kind)
    if since is not None:
        q = q.where(Event.ts >= since)
    return [
        (e, n)
        for e, n in session.execute(q.order_by(Event.ts.desc(), Event.id.desc()).limit(limit))
    ]


def acknowledge(
    session: Session,
    node: Node,
    *,
    rule: str | None,
    gpu: int | None,
    actor: str,
    note: str,
    now: datetime,
) -> int:
    """Acknowledge a node's reasons (all, or one rule and/or GPU): they are cleared now.

    Earlier XID occurrences stop counting toward repeat rules; a level condition that
    still holds (e.g. a hot GPU) is found again on the next report. Each GPU keeps the code
    of the newest XID reason cleared on it (``xid`` or ``xid_before_start``) as its
    ``acked_xid``, so the same value found again at the next agent start
    (``XidEvent.before_start``) is not raised again (:func:`rules.rule_xid_before_start`).

    Returns:
        The number of reasons cleared.
    """
    q = select(ReasonRow).where(ReasonRow.node_id == node.id)
    if rule:
        q = q.where(ReasonRow.rule == rule)
    if gpu is not None:
        q = q.where(ReasonRow.gpu_index == gpu)
    rows = list(session.scalars(q))
    for r in rows:
        session.add(
            Acknowledgement(
                node_id=node.id,
                rule=r.rule,
                gpu_index=r.gpu_index,
                key=r.key,
                acked_at=now,
                actor=actor,
                note=note,
            )
        )
        session.delete(r)
    for gpu_index, code in _acked_xids(rows).items():
        session.execute(
            update(Gpu).where(Gpu.node_id == node.id, Gpu.index == gpu_index).values(acked_xid=code)
        )
    session.flush()
    remaining = [
        rules.Reason(**reason_fields(r))
        for r in session.scalars(select(ReasonRow).where(ReasonRow.node_id == node.id))
    ]
    session.add(
        Event(
            node_id=node.id,
            kind="ack",
            ts=now,
            received_at=now,
            severity="info",
            message=f"{len(rows)} reason(s) acknowledged by {actor}"
            + (f": {note}" if note else ""),
            data={"rule": rule, "gpu": gpu, "actor": actor},
        )
    )
    set_state(session, node, rules.node_state(remaining, unreachable=False), remaining, now)
    return len(rows)


def _acked_xids(rows: Sequence[ReasonRow]) -> dict[int, int]:
    """GPU index -> code of the newest XID reason (by ``last_seen``) among ``rows``."""
    newest: dict[int, ReasonRow] = {}
    for r in rows:
        if r.rule not in (rules.RULE_XID, rules.RULE_XID_BEFORE_START) or r.gpu_index < 0:
            continue
        if not r.key.isdigit():
            continue
        best = newest.get(r.gpu_index)
        if best is None or r.last_seen > best.last_seen:
            newest[r.gpu_index] = r
    return {gpu: int(r.key) for gpu, r in newest.items()}


def prune(
    session: Session,
    *,
    now: datetime,
    sample_retention_s: float,
    event_retention_s: float,
    rollup_retention_s: float | None = None,
) -> dict[str, int]:
    """Delete raw history older than the retention windows (checkpoint history too, see
    ``checkpoints.service.prune``).

    Raw GPU samples: on PostgreSQL the hourly partitions wholly older than the cut are
    dropped (``fleet.partitions``; a partition's rows are kept until its whole hour is older
    than the cut, at most an hour past ``sample_retention_s``) and the partitions ahead are
    created; on SQLite the rows are deleted. Rollups older than ``rollup_retention_s``
    (None: ``event_retention_s``; the server passes ``TIERWATCH_ROLLUP_RETENTION_S``) are
    deleted. Ends the session's transaction first
    (dropping a partition needs the table to itself).

    Returns:
        Rows deleted per table.
    """
    sample_cut = now - timedelta(seconds=sample_retention_s)
    event_cut = now - timedelta(seconds=event_retention_s)
    rollup_cut = now - timedelta(seconds=rollup_retention_s or event_retention_s)
    deleted = {}
    session.commit()
    if session.get_bind().dialect.name == "postgresql":
        engine = session.get_bind()
        with engine.connect() as conn:  # type: ignore[union-attr]
            deleted["gpu_samples"] = partitions.maintain(conn, now=now, cut=sample_cut).rows_dropped
    else:
        result = session.execute(delete(GpuSampleRow).where(GpuSampleRow.ts < sample_cut))
        deleted["gpu_samples"] = int(result.rowcount or 0)  # type: ignore[attr-defined]
    deleted["gpu_sample_rollups"] = rollups.prune(session, cut=rollup_cut)
    for table, col, cut in (
        (LatencySampleRow, LatencySampleRow.ts, sample_cut),
        (ReportRange, ReportRange.received_at, sample_cut),
        (Event, Event.ts, event_cut),
        (Acknowledgement, Acknowledgement.acked_at, event_cut),
    ):
        result = session.execute(delete(table).where(col < cut))
        deleted[table.__tablename__] = result.rowcount  # type: ignore[attr-defined]
    from tierwatch.server.checkpoints import service as checkpoint_service  # (cycle-free)

    deleted |= checkpoint_service.prune(
        session,
        now=now,
        sample_retention_s=sample_retention_s,
        event_retention_s=event_retention_s,
    )
    session.commit()
    return deleted


def state_change_event(
    node_id: int, old: str, new: str, reasons: list[rules.Reason], at: datetime
) -> dict[str, Any]:
    """Column values of the ``state`` event recording a node's change from ``old`` to ``new``.

    The message names up to three of the worst reasons with their recommended actions.
    """
    worst = sorted(reasons, key=lambda r: -rules.STATE_ORDER[r.severity])[:3]
    detail = "; ".join(f"{r.message} → {r.action}" for r in worst)
    return {
        "node_id": node_id,
        "kind": "state",
        "gpu_index": None,
        "code": None,
        "ts": at,
        "received_at": at,
        "severity": new,
        "message": f"{old} → {new}" + (f": {detail}" if detail else ""),
        "data": {"from": old, "to": new},
    }


def set_state(
    session: Session, node: Node, state: str, reasons: list[rules.Reason], at: datetime
) -> None:
    """Set an (ORM-loaded) node's health state, recording a change as an event."""
    if state == node.state and node.state_since is not None:
        return
    old = node.state
    node.state = state
    node.state_since = at
    if old != state:
        session.add(Event(**state_change_event(node.id, old, state, reasons, at)))


# --- dashboard read models (the cluster and node pages) ----------------------------------
# The cluster page must stay cheap at thousands of nodes, so it reads only the latest-value
# tables, in a fixed number of queries whatever the node count: nodes and reasons through
# list_node_views(with_gpus=False) and one aggregate over ``gpus``.

XID_EVENT_LIMIT = 50
STATE_EVENT_LIMIT = 20
AGENT_EVENT_LIMIT = 20


@dataclass(frozen=True)
class Tile:
    """One node on the cluster page: only facts that change slowly, so a tile stays the same
    from one poll to the next until its node's state does (its digest is of these fields).

    Attributes:
        name: Node name.
        state: Effective state (healthy | degraded | unhealthy | unreachable).
        simulated: The agent runs a simulated collector.
        isolated: The node is isolated (cordoned/drained).
        reason: The worst active reason's message (highest severity, newest), or None.
        action: That reason's recommended action (``RESET_GPU``…), or None.
        reason_count: Number of active reasons.
        silent_since: When an unreachable node last reported; None for any other state (a
            reporting node's ``last_seen`` moves with every report).
    """

    name: str
    state: str
    simulated: bool
    isolated: bool
    reason: str | None
    action: str | None
    reason_count: int
    silent_since: datetime | None


def worst_reason(reasons: Sequence[Any]) -> Any | None:
    """The reason to show first: highest severity, then the most recently seen.

    ``reasons`` are anything with ``severity`` and ``last_seen`` (rows, ``ReasonOut``).
    """
    if not reasons:
        return None
    return max(reasons, key=lambda r: (rules.STATE_ORDER.get(r.severity, 0), r.last_seen))


def sort_reasons(reasons: Sequence[Any]) -> list[Any]:
    """Reasons worst first (severity, then most recently seen); see :func:`worst_reason`."""
    return sorted(
        reasons, key=lambda r: (-rules.STATE_ORDER.get(r.severity, 0), -r.last_seen.timestamp())
    )


def cluster_tiles(
    session: Session,
    *,
    now: datetime,
    th: rules.HealthThresholds,
    state: str | None,
    name_contains: str | None,
) -> tuple[dict[str, int], list[Tile]]:
    """Counts per state (of the nodes matching ``name_contains``) and the tiles to show.

    Reads the nodes and reasons tables only (:func:`list_node_views` without GPUs).

    Returns:
        ``(counts, tiles)``: ``counts`` has every state (zero included) and ignores the state
        filter, as ``GET /api/v1/nodes`` does; ``tiles`` are by name, filtered by ``state``.
    """
    views = list_node_views(session, now=now, th=th, name_contains=name_contains, with_gpus=False)
    counts = state_counts(views)
    tiles = []
    for v in views:
        if state and v.state != state:
            continue
        worst = worst_reason(v.reasons)
        tiles.append(
            Tile(
                name=v.node.name,
                state=v.state,
                simulated=v.node.simulated,
                isolated=v.node.isolated,
                reason=None if worst is None else worst.message,
                action=None if worst is None else worst.action,
                reason_count=len(v.reasons),
                silent_since=v.node.last_seen if v.unreachable else None,
            )
        )
    return counts, tiles


#: Order of the cluster page's "needs attention" list: worst first; a healthy node is in
#: the list only while it is isolated.
ATTENTION_ORDER = {"unhealthy": 0, "unreachable": 1, "degraded": 2, "healthy": 3}


def needs_attention(tiles: Sequence[Tile], limit: int) -> tuple[list[Tile], int]:
    """The tiles of nodes that need someone: not healthy, or isolated; worst first.

    Order: unhealthy, unreachable, degraded, then isolated healthy nodes; within a state the
    nodes still in service before the isolated ones, then by name.

    Returns:
        ``(first, more)``: at most ``limit`` tiles, and how many more there are.
    """
    trouble = sorted(
        (t for t in tiles if t.state != "healthy" or t.isolated),
        key=lambda t: (ATTENTION_ORDER.get(t.state, 0), t.isolated, t.name),
    )
    return trouble[:limit], max(0, len(trouble) - limit)


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
    for event, _ in query_events(session, node=node, kind="xid", since=None, limit=XID_EVENT_LIMIT):
        data = event.data or {}
        info = lookup_xid(event.code) if event.code is not None else None
        mnemonic = data.get("mnemonic") or (info.mnemonic if info else "UNKNOWN")
        action = data.get("action") or (info.action if info else rules.ACTION_UNKNOWN_XID)
        out.append(XidRow(event, str(mnemonic), str(action), rules.describe_action(str(action))))
    return out


def recent_events(session: Session, node: Node, kind: str, limit: int) -> list[Event]:
    """The node's newest events of one kind (``state``, ``agent``, ``ack``)."""
    return [e for e, _ in query_events(session, node=node, kind=kind, since=None, limit=limit)]

"""Ingest of agent reports: store a batch once, update latest values, re-evaluate health.

One report is one transaction of a handful of SQL statements (SQLAlchemy Core, no ORM
objects: this is the hot path, about 200 reports/s for 2,048 nodes at 10 s intervals).
A report with nothing wrong writes only the receipt, the samples, the GPUs' latest values
and the node row.

The health clock for a node is the agent's own clock (``batch.sent_at`` and sample
timestamps), so clock skew between agent and server cannot fake stale telemetry;
reachability uses the server's receive time.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Row, bindparam, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tierwatch.agent.protocol import GpuSample, ReportAck, ReportBatch
from tierwatch.server.config import Settings
from tierwatch.server.db import insert_ignore
from tierwatch.server.fleet import rules
from tierwatch.server.fleet import service as fleet_service
from tierwatch.server.fleet.models import (
    METRIC_FIELDS,
    Acknowledgement,
    Event,
    Gpu,
    GpuSampleRow,
    LatencySampleRow,
    Node,
    ReasonRow,
    ReportReceipt,
    XidCount,
)
from tierwatch.server.fleet.xid_catalog import lookup as lookup_xid

NODES = Node.__table__
GPUS = Gpu.__table__
REASONS = ReasonRow.__table__
EVENTS = Event.__table__
XID_COUNTS = XidCount.__table__
RECEIPTS = ReportReceipt.__table__
GPU_SAMPLES = GpuSampleRow.__table__

XID_RULES = ("xid", "xid_repeat")
SAMPLE_RULES = {
    "temperature",
    "ecc_uncorrectable",
    "row_remap",
    "throttling",
    "pcie_replay",
    "nvlink",
}
REASON_FIELDS = ("severity", "message", "action", "evidence", "first_seen", "last_seen")

# One executemany UPDATE for the latest values of all GPUs of a report. Bind names are
# prefixed: SQLAlchemy reserves a column's own name for its SET clause.
_UPDATE_GPU = (
    update(GPUS)
    .where(GPUS.c.id == bindparam("b_id"))
    .values(
        uuid=bindparam("b_uuid"),
        name=bindparam("b_name"),
        ts=bindparam("b_ts"),
        **{f: bindparam(f"b_{f}") for f in METRIC_FIELDS},
    )
)
_UPDATE_REASON = (
    update(REASONS)
    .where(REASONS.c.id == bindparam("b_id"))
    .values(**{f: bindparam(f"b_{f}") for f in REASON_FIELDS})
)


def get_or_create_node(session: Session, name: str, now: datetime) -> Row[Any]:
    """The node row for ``name`` (a Core row), created on first sight.

    Safe against a concurrent first report of the same node (insert-or-ignore, then read).
    """
    row = session.execute(select(NODES).where(NODES.c.name == name)).first()
    if row is None:
        insert_ignore(session, NODES, {"name": name, "first_seen": now, "state": "healthy"})
        row = session.execute(select(NODES).where(NODES.c.name == name)).one()
    return row


def gpu_row_to_sample(row: Any) -> GpuSample | None:
    """The latest values of a GPU row (ORM object or Core row) as a wire sample.

    None before the GPU's first sample. Built without re-validation: the values were
    validated when they arrived.
    """
    if row.ts is None:
        return None
    return GpuSample.model_construct(
        index=row.index, ts=row.ts, **{f: getattr(row, f) for f in METRIC_FIELDS}
    )


def reason_from_row(row: Any) -> rules.Reason:
    """A stored reason (ORM object or Core row) as the rules engine sees it."""
    return rules.Reason(
        rule=row.rule,
        severity=row.severity,
        gpu=None if row.gpu_index < 0 else row.gpu_index,
        key=row.key,
        message=row.message,
        action=row.action,
        evidence=row.evidence or {},
        first_seen=row.first_seen,
        last_seen=row.last_seen,
    )


def ingest_report(
    session: Session, *, batch: ReportBatch, settings: Settings, now: datetime
) -> ReportAck:
    """Store one agent batch and update the node's latest values, reasons and state.

    Idempotent on (node, epoch, seq): a replayed batch changes nothing but ``last_seen``.

    Args:
        session: open session; committed here.
        batch: the validated report (its node is already checked against the token).
        settings: server settings (health thresholds).
        now: server receive time (UTC).

    Returns:
        The ack with ``stored`` False for a replay and the highest seq held for the epoch.
    """
    node = get_or_create_node(session, batch.node, now)
    stored = insert_ignore(
        session,
        RECEIPTS,
        {
            "node_id": node.id,
            "epoch": batch.epoch,
            "seq": batch.seq,
            "sent_at": batch.sent_at,
            "received_at": now,
        },
    )
    changes: dict[str, Any] = {"last_seen": now}
    if node.first_seen is None:
        changes["first_seen"] = now
    if stored:
        changes |= _apply_batch(session, node, batch, settings)
    if batch.epoch == node.epoch:
        changes["last_seq"] = acked = max(node.last_seq, batch.seq)
    elif stored and _is_newer_epoch(session, node, batch):
        changes["epoch"], changes["last_seq"] = batch.epoch, batch.seq
        acked = batch.seq
    else:
        acked = (
            session.scalar(
                select(func.max(RECEIPTS.c.seq)).where(
                    RECEIPTS.c.node_id == node.id, RECEIPTS.c.epoch == batch.epoch
                )
            )
            or batch.seq
        )
    session.execute(update(NODES).where(NODES.c.id == node.id).values(**changes))
    session.commit()
    return ReportAck(epoch=batch.epoch, acked_seq=acked, stored=stored)


def _is_newer_epoch(session: Session, node: Row[Any], batch: ReportBatch) -> bool:
    """True when ``batch`` belongs to an agent start later than the node's current epoch."""
    current_sent = session.scalar(
        select(RECEIPTS.c.sent_at).where(
            RECEIPTS.c.node_id == node.id,
            RECEIPTS.c.epoch == node.epoch,
            RECEIPTS.c.seq == node.last_seq,
        )
    )
    return current_sent is None or batch.sent_at >= current_sent


def _apply_batch(
    session: Session, node: Row[Any], batch: ReportBatch, settings: Settings
) -> dict[str, Any]:
    """Store the batch's content and re-evaluate health; returns changed node columns."""
    th = settings.health
    clock = batch.sent_at
    changes = {
        k: v
        for k, v in (
            ("simulated", batch.simulated),
            ("collector", batch.collector),
            ("agent_version", batch.agent_version),
            ("interval_s", batch.interval_s),
            ("dropped_batches", batch.dropped_batches),
        )
        if getattr(node, k) != v
    }

    gpus = _sync_inventory(session, node.id, batch)
    findings: list[rules.Finding] = []
    evaluated: set[str] = set()
    if batch.samples:
        findings += _store_samples(session, node.id, batch, gpus, th)
        evaluated |= SAMPLE_RULES
    if batch.gpus or batch.samples:
        for index, latest in gpus.items():
            findings += rules.rule_stale_telemetry(
                latest["sample"], index, clock, batch.interval_s, th, clock
            )
        evaluated.add("stale_telemetry")
    findings += _ingest_xids(session, node.id, batch, th)
    findings += _ingest_latency(session, node.id, batch, th)
    if batch.events:
        session.execute(
            insert(EVENTS),
            [
                {
                    "node_id": node.id,
                    "kind": "agent",
                    "gpu_index": ev.gpu,
                    "code": None,
                    "ts": ev.ts,
                    "received_at": clock,
                    "severity": "warning",
                    "message": f"{ev.kind}: {ev.message}" if ev.message else ev.kind,
                    "data": {"agent_kind": ev.kind},
                }
                for ev in batch.events
            ],
        )
    changes |= _update_reasons(session, node, findings, clock, th, evaluated)
    return changes


def _sync_inventory(session: Session, node_id: int, batch: ReportBatch) -> dict[int, dict]:
    """Load the node's GPUs, creating the ones seen for the first time.

    Returns:
        index -> {"id", "uuid", "name", "sample": latest GpuSample or None, "dirty": bool}.
    """
    rows = session.execute(select(GPUS).where(GPUS.c.node_id == node_id)).all()
    gpus = {
        r.index: {
            "id": r.id,
            "uuid": r.uuid,
            "name": r.name,
            "sample": gpu_row_to_sample(r),
            "dirty": False,
        }
        for r in rows
    }
    wanted = {g.index: (g.uuid, g.name, g.memory_total_mib) for g in batch.gpus}
    for s in batch.samples:
        wanted.setdefault(s.index, ("", "", None))
    new = [i for i in wanted if i not in gpus]
    if new:
        session.execute(
            insert(GPUS),
            [
                {
                    "node_id": node_id,
                    "index": i,
                    "uuid": wanted[i][0],
                    "name": wanted[i][1],
                    "memory_total_mib": wanted[i][2],
                }
                for i in new
            ],
        )
        for r in session.execute(
            select(GPUS.c.index, GPUS.c.id).where(GPUS.c.node_id == node_id, GPUS.c.index.in_(new))
        ):
            gpus[r.index] = {
                "id": r.id,
                "uuid": wanted[r.index][0],
                "name": wanted[r.index][1],
                "sample": None,
                "dirty": False,
            }
    for g in batch.gpus:
        entry = gpus[g.index]
        if (entry["uuid"], entry["name"]) != (g.uuid, g.name):
            entry.update(uuid=g.uuid, name=g.name, dirty=True)
    return gpus


def _store_samples(
    session: Session,
    node_id: int,
    batch: ReportBatch,
    gpus: dict[int, dict],
    th: rules.HealthThresholds,
) -> list[rules.Finding]:
    """Insert raw samples, evaluate each GPU's rules, and update the latest-value rows."""
    session.execute(
        insert(GpuSampleRow),
        [
            {
                "node_id": node_id,
                "gpu_index": s.index,
                "ts": s.ts,
                **{f: getattr(s, f) for f in METRIC_FIELDS},
            }
            for s in batch.samples
        ],
    )
    by_gpu: dict[int, list[GpuSample]] = defaultdict(list)
    for s in batch.samples:
        by_gpu[s.index].append(s)
    findings: list[rules.Finding] = []
    for index, samples in by_gpu.items():
        entry = gpus[index]
        prev = entry["sample"]
        for cur in sorted(samples, key=lambda s: s.ts):
            if prev is not None and cur.ts <= prev.ts:
                continue  # a late replay of older history: stored, not evaluated
            findings += rules.evaluate_gpu(prev, cur, th)
            prev = cur
            entry["sample"] = cur
            entry["dirty"] = True
    updates = [
        {
            "b_id": e["id"],
            "b_uuid": e["uuid"],
            "b_name": e["name"],
            "b_ts": e["sample"].ts if e["sample"] else None,
            **{f"b_{f}": getattr(e["sample"], f) if e["sample"] else None for f in METRIC_FIELDS},
        }
        for e in gpus.values()
        if e["dirty"]
    ]
    if updates:
        session.execute(_UPDATE_GPU, updates)
    return findings


def _upsert_counts(session: Session, rows: list[dict[str, Any]]) -> None:
    """Add to XID occurrence counters (insert, or increment on conflict)."""
    dialect = session.get_bind().dialect.name
    insert_fn = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert_fn(XID_COUNTS)
    stmt = stmt.on_conflict_do_update(
        index_elements=[XID_COUNTS.c.node_id, XID_COUNTS.c.gpu_index, XID_COUNTS.c.xid],
        set_={
            "count": XID_COUNTS.c.count + stmt.excluded.count,
            "last_ts": func.coalesce(stmt.excluded.last_ts, XID_COUNTS.c.last_ts),
        },
    )
    session.execute(stmt, rows)


def _ingest_xids(
    session: Session, node_id: int, batch: ReportBatch, th: rules.HealthThresholds
) -> list[rules.Finding]:
    if not batch.xids:
        return []
    new: list[rules.XidRecord] = []
    events = []
    counts: Counter[tuple[int, int]] = Counter()
    last_ts: dict[tuple[int, int], datetime] = {}
    for x in batch.xids:
        info = lookup_xid(x.xid)
        data: dict[str, Any] = (
            {"mnemonic": info.mnemonic, "action": info.action, "fatal": info.fatal}
            if info
            else {"mnemonic": "UNKNOWN", "action": "UNEXPECTED_ERR_REPORT_ISSUE", "fatal": None}
        )
        if x.message:
            data["driver_message"] = x.message
        events.append(
            {
                "node_id": node_id,
                "kind": "xid",
                "gpu_index": x.gpu,
                "code": x.xid,
                "ts": x.ts,
                "received_at": batch.sent_at,
                "severity": "unhealthy" if info and info.fatal else "degraded",
                "message": f"XID {x.xid} {data['mnemonic']} on GPU {x.gpu}",
                "data": data,
            }
        )
        key = (x.gpu, x.xid)
        counts[key] += 1
        last_ts[key] = max(last_ts.get(key, x.ts), x.ts)
        new.append(rules.XidRecord(gpu=x.gpu, xid=x.xid, ts=x.ts))

    latest = max(r.ts for r in new)
    window_start = latest - timedelta(seconds=th.xid_repeat_window_s)
    acks = dict(
        session.execute(
            select(Acknowledgement.gpu_index, func.max(Acknowledgement.acked_at))
            .where(Acknowledgement.node_id == node_id, Acknowledgement.rule.in_(XID_RULES))
            .group_by(Acknowledgement.gpu_index)
        ).all()
    )
    stored = session.execute(
        select(EVENTS.c.gpu_index, EVENTS.c.code, EVENTS.c.ts).where(
            EVENTS.c.node_id == node_id, EVENTS.c.kind == "xid", EVENTS.c.ts >= window_start
        )
    ).all()
    recent = []
    for gpu, code, ts in stored:
        acked = acks.get(gpu) or acks.get(-1)
        if acked is not None and ts <= acked:
            continue
        recent.append(rules.XidRecord(gpu=gpu, xid=code, ts=ts))
    session.execute(insert(EVENTS), events)
    _upsert_counts(
        session,
        [
            {"node_id": node_id, "gpu_index": g, "xid": x, "count": n, "last_ts": last_ts[(g, x)]}
            for (g, x), n in counts.items()
        ],
    )
    return rules.rule_xid(new, recent, th, latest)


def _ingest_latency(
    session: Session, node_id: int, batch: ReportBatch, th: rules.HealthThresholds
) -> list[rules.Finding]:
    if not batch.latency:
        return []
    session.execute(
        insert(LatencySampleRow),
        [
            {
                "job_id": s.job_id,
                "rank": s.rank,
                "world_size": s.world_size,
                "node_id": node_id,
                "ts": s.ts,
                "latency_ms": s.latency_ms,
            }
            for s in batch.latency
        ],
    )
    findings: list[rules.Finding] = []
    my_ranks: dict[str, set[int]] = defaultdict(set)
    for s in batch.latency:
        my_ranks[s.job_id].add(s.rank)
    for job_id, ranks in my_ranks.items():
        latest = max(s.ts for s in batch.latency if s.job_id == job_id)
        cutoff = latest - timedelta(seconds=max(60.0, 20 * batch.interval_s))
        rows = session.execute(
            select(LatencySampleRow.rank, LatencySampleRow.latency_ms)
            .where(LatencySampleRow.job_id == job_id, LatencySampleRow.ts >= cutoff)
            .order_by(LatencySampleRow.ts)
        ).all()
        series: dict[int, list[float]] = defaultdict(list)
        for rank, value in rows:
            series[rank].append(value)
        flagged = rules.straggler_ranks(dict(series), th)
        for rank in ranks & flagged.keys():
            findings.append(rules.rule_straggler(rank, job_id, flagged[rank], latest))
    return findings


def _update_reasons(
    session: Session,
    node: Row[Any],
    findings: list[rules.Finding],
    clock: datetime,
    th: rules.HealthThresholds,
    evaluated: set[str],
) -> dict[str, Any]:
    """Merge findings into the node's stored reasons; returns changed node columns.

    Writes only what changed: a healthy node with no findings costs one SELECT.
    """
    rows = session.execute(select(REASONS).where(REASONS.c.node_id == node.id)).all()
    if not rows and not findings:
        merged: list[rules.Reason] = []
    else:
        previous = [reason_from_row(r) for r in rows]
        merged = rules.merge_reasons(previous, findings, clock, th, evaluated)
        by_identity = {(r.rule, r.gpu_index if r.gpu_index >= 0 else None, r.key): r for r in rows}
        inserts, updates = [], []
        for reason in merged:
            values = {f: getattr(reason, f) for f in REASON_FIELDS}
            row = by_identity.pop(reason.identity, None)
            if row is None:
                inserts.append(
                    {
                        "node_id": node.id,
                        "rule": reason.rule,
                        "gpu_index": -1 if reason.gpu is None else reason.gpu,
                        "key": reason.key,
                        **values,
                    }
                )
            elif any(getattr(row, f) != v for f, v in values.items()):
                updates.append({"b_id": row.id, **{f"b_{f}": v for f, v in values.items()}})
        if inserts:
            session.execute(insert(REASONS), inserts)
        if updates:
            session.execute(_UPDATE_REASON, updates)
        if by_identity:
            gone = [r.id for r in by_identity.values()]
            session.execute(delete(REASONS).where(REASONS.c.id.in_(gone)))
    state = rules.node_state(merged, unreachable=False)
    if state == node.state and node.state_since is not None:
        return {}
    if state != node.state:
        session.execute(
            insert(EVENTS),
            [fleet_service.state_change_event(node.id, node.state, state, merged, clock)],
        )
    return {"state": state, "state_since": clock}

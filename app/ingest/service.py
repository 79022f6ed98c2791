"""Ingest of agent reports: store a batch once, update latest values, re-evaluate health.

One report is one transaction. The health clock for a node is the agent's own clock
(``batch.sent_at`` and sample timestamps), so clock skew between agent and server cannot
fake stale telemetry; reachability uses the server's receive time.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, insert, select
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

XID_RULES = ("xid", "xid_repeat")


def get_or_create_node(session: Session, name: str, now: datetime) -> Node:
    """The node row for ``name``, created on first sight (safe against a concurrent insert)."""
    node = session.scalar(select(Node).where(Node.name == name))
    if node is None:
        insert_ignore(session, Node.__table__, {"name": name, "first_seen": now})
        node = session.scalar(select(Node).where(Node.name == name))
        assert node is not None
    return node


def gpu_row_to_sample(row: Gpu) -> GpuSample | None:
    """The latest values of a GPU row as a wire sample (None before its first sample)."""
    if row.ts is None:
        return None
    return GpuSample(index=row.index, ts=row.ts, **{f: getattr(row, f) for f in METRIC_FIELDS})


def reason_from_row(row: ReasonRow) -> rules.Reason:
    """A stored reason as the rules engine sees it."""
    return rules.Reason(
        rule=row.rule,
        severity=row.severity,  # type: ignore[arg-type]
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
        ReportReceipt.__table__,
        {
            "node_id": node.id,
            "epoch": batch.epoch,
            "seq": batch.seq,
            "sent_at": batch.sent_at,
            "received_at": now,
        },
    )
    node.last_seen = now
    if node.first_seen is None:
        node.first_seen = now
    if stored:
        _apply_batch(session, node, batch, settings)
    if batch.epoch == node.epoch:
        node.last_seq = max(node.last_seq, batch.seq)
        acked = node.last_seq
    elif stored and _is_newer_epoch(session, node, batch):
        node.epoch, node.last_seq = batch.epoch, batch.seq
        acked = batch.seq
    else:
        acked = (
            session.scalar(
                select(func.max(ReportReceipt.seq)).where(
                    ReportReceipt.node_id == node.id, ReportReceipt.epoch == batch.epoch
                )
            )
            or batch.seq
        )
    session.commit()
    return ReportAck(epoch=batch.epoch, acked_seq=acked, stored=stored)


def _is_newer_epoch(session: Session, node: Node, batch: ReportBatch) -> bool:
    """True when ``batch`` belongs to an agent start later than the node's current epoch."""
    current_sent = session.scalar(
        select(ReportReceipt.sent_at).where(
            ReportReceipt.node_id == node.id,
            ReportReceipt.epoch == node.epoch,
            ReportReceipt.seq == node.last_seq,
        )
    )
    return current_sent is None or batch.sent_at >= current_sent


def _apply_batch(session: Session, node: Node, batch: ReportBatch, settings: Settings) -> None:
    th = settings.health
    clock = batch.sent_at
    node.simulated = batch.simulated
    node.collector = batch.collector
    node.agent_version = batch.agent_version
    node.interval_s = batch.interval_s
    node.dropped_batches = batch.dropped_batches

    gpus = {g.index: g for g in session.scalars(select(Gpu).where(Gpu.node_id == node.id))}
    for info in batch.gpus:
        row = gpus.get(info.index)
        if row is None:
            row = Gpu(node_id=node.id, index=info.index, uuid=info.uuid, name=info.name)
            session.add(row)
            gpus[info.index] = row
        elif (row.uuid, row.name) != (info.uuid, info.name):
            row.uuid, row.name = info.uuid, info.name
        if info.memory_total_mib is not None and row.memory_total_mib is None:
            row.memory_total_mib = info.memory_total_mib

    findings: list[rules.Finding] = []
    evaluated: set[str] = set()
    if batch.samples:
        session.execute(
            insert(GpuSampleRow),
            [
                {"node_id": node.id, "gpu_index": s.index, **s.model_dump(exclude={"index"})}
                for s in batch.samples
            ],
        )
        by_gpu: dict[int, list[GpuSample]] = defaultdict(list)
        for s in batch.samples:
            by_gpu[s.index].append(s)
        for index, samples in by_gpu.items():
            row = gpus.get(index)
            if row is None:  # a sample for a GPU missing from the inventory
                row = Gpu(node_id=node.id, index=index, uuid="", name="")
                session.add(row)
                gpus[index] = row
            prev = gpu_row_to_sample(row)
            for cur in sorted(samples, key=lambda s: s.ts):
                if prev is not None and cur.ts <= prev.ts:
                    continue  # a late replay of older history: stored, not evaluated
                findings += rules.evaluate_gpu(prev, cur, th)
                prev = cur
                row.ts = cur.ts
                for f in METRIC_FIELDS:
                    setattr(row, f, getattr(cur, f))
        evaluated |= {"temperature", "ecc_uncorrectable", "row_remap", "throttling"}
        evaluated |= {"pcie_replay", "nvlink"}
    if batch.gpus or batch.samples:
        for index, row in gpus.items():
            findings += rules.rule_stale_telemetry(
                gpu_row_to_sample(row), index, clock, batch.interval_s, th, clock
            )
        evaluated.add("stale_telemetry")

    findings += _ingest_xids(session, node, batch, th)
    findings += _ingest_latency(session, node, batch, th)
    for ev in batch.events:
        session.add(
            Event(
                node_id=node.id,
                kind="agent",
                gpu_index=ev.gpu,
                ts=ev.ts,
                received_at=clock,
                severity="warning",
                message=f"{ev.kind}: {ev.message}" if ev.message else ev.kind,
                data={"agent_kind": ev.kind},
            )
        )
    _update_reasons(session, node, findings, clock, th, evaluated)


def _ingest_xids(
    session: Session, node: Node, batch: ReportBatch, th: rules.HealthThresholds
) -> list[rules.Finding]:
    if not batch.xids:
        return []
    new: list[rules.XidRecord] = []
    for x in batch.xids:
        info = lookup_xid(x.xid)
        data: dict[str, Any] = (
            {"mnemonic": info.mnemonic, "action": info.action, "fatal": info.fatal}
            if info
            else {"mnemonic": "UNKNOWN", "action": "UNEXPECTED_ERR_REPORT_ISSUE", "fatal": None}
        )
        if x.message:
            data["driver_message"] = x.message
        session.add(
            Event(
                node_id=node.id,
                kind="xid",
                gpu_index=x.gpu,
                code=x.xid,
                ts=x.ts,
                received_at=batch.sent_at,
                severity="unhealthy" if info and info.fatal else "degraded",
                message=f"XID {x.xid} {data['mnemonic']} on GPU {x.gpu}",
                data=data,
            )
        )
        counter = session.get(XidCount, (node.id, x.gpu, x.xid))
        if counter is None:
            session.add(
                XidCount(node_id=node.id, gpu_index=x.gpu, xid=x.xid, count=1, last_ts=x.ts)
            )
        else:
            counter.count += 1
            counter.last_ts = max(counter.last_ts or x.ts, x.ts)
        new.append(rules.XidRecord(gpu=x.gpu, xid=x.xid, ts=x.ts))

    latest = max(r.ts for r in new)
    window_start = latest - timedelta(seconds=th.xid_repeat_window_s)
    acks = dict(
        session.execute(
            select(Acknowledgement.gpu_index, func.max(Acknowledgement.acked_at))
            .where(Acknowledgement.node_id == node.id, Acknowledgement.rule.in_(XID_RULES))
            .group_by(Acknowledgement.gpu_index)
        ).all()
    )
    session.flush()
    stored = session.execute(
        select(Event.gpu_index, Event.code, Event.ts).where(
            Event.node_id == node.id, Event.kind == "xid", Event.ts >= window_start
        )
    ).all()
    new_keys = {(r.gpu, r.xid, r.ts) for r in new}
    recent = []
    for gpu, code, ts in stored:
        if (gpu, code, ts) in new_keys:
            continue
        acked = acks.get(gpu) or acks.get(-1)
        if acked is not None and ts <= acked:
            continue
        recent.append(rules.XidRecord(gpu=gpu, xid=code, ts=ts))
    return rules.rule_xid(new, recent, th, latest)


def _ingest_latency(
    session: Session, node: Node, batch: ReportBatch, th: rules.HealthThresholds
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
                "node_id": node.id,
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
    node: Node,
    findings: list[rules.Finding],
    clock: datetime,
    th: rules.HealthThresholds,
    evaluated: set[str],
) -> None:
    rows = list(session.scalars(select(ReasonRow).where(ReasonRow.node_id == node.id)))
    previous = [reason_from_row(r) for r in rows]
    merged = rules.merge_reasons(previous, findings, clock, th, evaluated)
    by_identity = {(r.rule, r.gpu_index if r.gpu_index >= 0 else None, r.key): r for r in rows}
    keep = set()
    for reason in merged:
        keep.add(reason.identity)
        row = by_identity.get(reason.identity)
        if row is None:
            row = ReasonRow(
                node_id=node.id,
                rule=reason.rule,
                gpu_index=-1 if reason.gpu is None else reason.gpu,
                key=reason.key,
            )
            session.add(row)
        row.severity = reason.severity
        row.message = reason.message
        row.action = reason.action
        row.evidence = reason.evidence
        row.first_seen = reason.first_seen
        row.last_seen = reason.last_seen
    gone = [r.id for ident, r in by_identity.items() if ident not in keep]
    if gone:
        session.execute(delete(ReasonRow).where(ReasonRow.id.in_(gone)))
    fleet_service.set_state(
        session, node, rules.node_state(merged, unreachable=False), merged, clock
    )

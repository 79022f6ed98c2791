"""The fleet's ingest of agent reports: store each batch once, update latest values,
re-evaluate health, and hand each report's other content to its domain.

Reports are stored in groups (``ingest_reports``): one transaction and a fixed handful of
SQL statements for the whole group (SQLAlchemy Core, no ORM objects), so the cost per report
is mostly the Python that evaluates it. This is the hot path: 2,048 nodes reporting every
10 s are about 200 reports/s. ``IngestWriter`` (``tierwatch.server.ingest.writer``) forms the
groups from concurrent requests (group commit); the checkpoint ledger
(``checkpoints.ingest``) and command results (``actions.ingest``) are stored in the same
transaction. A report with nothing wrong writes only its seq range (``fleet.seqranges``), its
samples, its GPUs' latest values and its node row; XIDs, latency samples, agent events and reason
changes add statements only for the reports that carry them.

The health clock for a node is the agent's own clock (``batch.sent_at`` and sample
timestamps), so clock skew between agent and server cannot fake stale telemetry;
reachability uses the server's receive time.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Row, bindparam, delete, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tierwatch.agent.protocol import GpuSample, ReportAck, ReportBatch, XidEvent
from tierwatch.server.actions import ingest as actions_ingest
from tierwatch.server.actions import notify, queue
from tierwatch.server.checkpoints import ingest as checkpoint_ingest
from tierwatch.server.checkpoints.scoping import Refusal
from tierwatch.server.config import Settings
from tierwatch.server.db import insert_ignore
from tierwatch.server.fleet import rules, seqranges
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
    ReportRange,
    XidCount,
)
from tierwatch.server.fleet.xid_catalog import lookup as lookup_xid
from tierwatch.server.ingest.refusals import (
    DEFAULT_REFUSAL_LOG,
    RefusalLog,
    store_refusal_events,
)

NODES = Node.__table__
GPUS = Gpu.__table__
REASONS = ReasonRow.__table__
EVENTS = Event.__table__
XID_COUNTS = XidCount.__table__
RANGES = ReportRange.__table__
GPU_SAMPLES = GpuSampleRow.__table__

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
        acked_xid=bindparam("b_acked_xid"),
        **{f: bindparam(f"b_{f}") for f in METRIC_FIELDS},
    )
)
_UPDATE_REASON = (
    update(REASONS)
    .where(REASONS.c.id == bindparam("b_id"))
    .values(**{f: bindparam(f"b_{f}") for f in REASON_FIELDS})
)


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


@dataclass(frozen=True, slots=True)
class _Stamp:
    """A GPU's latest reading as the stale rule sees it (``rules.Stamped``)."""

    index: int
    ts: datetime


# A latest-value row not yet turned into a GpuSample (``_latest``): most reports are
# heartbeats (``agent.sampling``), whose rules need only the row's time.
_UNREAD: Any = object()


def _latest(entry: dict[str, Any]) -> GpuSample | None:
    """The GPU's latest reading as a sample, converted from its row on first use."""
    if entry["sample"] is _UNREAD:
        entry["sample"] = gpu_row_to_sample(entry["row"])
    sample: GpuSample | None = entry["sample"]
    return sample


def _latest_stamp(entry: dict[str, Any]) -> rules.Stamped | None:
    """The GPU and time of its latest reading, without building the sample."""
    if entry["sample"] is not _UNREAD:
        sample: GpuSample | None = entry["sample"]
        return sample
    row = entry["row"]
    return None if row.ts is None else _Stamp(row._mapping["index"], row.ts)


EARLIEST_TS = datetime(2000, 1, 1, tzinfo=UTC)


def timestamp_errors(
    batch: ReportBatch, *, now: datetime, max_ahead_s: float
) -> list[dict[str, Any]]:
    """Times in a batch that cannot be right: later than ``now + max_ahead_s`` or before 2000.

    A reading from the future would become a GPU's latest value and hide every real one
    until the clock caught up; a time before 2000 is an unset clock. Old but plausible
    times are fine (a spool replays hours-old batches after an outage).

    Returns:
        Validation errors (``loc``, ``msg``, ``type``) in FastAPI's shape, empty when all fine.
    """
    latest = now + timedelta(seconds=max_ahead_s)
    items: list[tuple[tuple[Any, ...], datetime]] = [(("sent_at",), batch.sent_at)]
    items += [(("samples", i, "ts"), s.ts) for i, s in enumerate(batch.samples)]
    items += [(("xids", i, "ts"), x.ts) for i, x in enumerate(batch.xids)]
    items += [(("latency", i, "ts"), x.ts) for i, x in enumerate(batch.latency)]
    items += [(("events", i, "ts"), x.ts) for i, x in enumerate(batch.events)]
    items += [(("checkpoint_events", i, "ts"), x.ts) for i, x in enumerate(batch.checkpoint_events)]
    items += [(("progress", i, "ts"), x.ts) for i, x in enumerate(batch.progress)]
    items += [(("restores", i, "ts"), x.ts) for i, x in enumerate(batch.restores)]
    errors = []
    for loc, ts in items:
        try:
            ok = EARLIEST_TS <= ts <= latest
        except OverflowError:  # e.g. year 1 with a positive UTC offset
            ok = False
        if not ok:
            errors.append(
                {
                    "loc": ("body", *loc),
                    "msg": f"time {ts.isoformat()} is not between 2000-01-01 and "
                    f"{max_ahead_s:g} s ahead of the server's clock ({now.isoformat()}): "
                    "check the node's clock (NTP)",
                    "type": "clock_skew",
                }
            )
    return errors


def ingest_reports(
    session: Session,
    *,
    batches: list[ReportBatch],
    settings: Settings,
    now: datetime,
    refusal_log: RefusalLog | None = None,
) -> list[ReportAck]:
    """Store a group of agent batches in one transaction; returns one ack per batch.

    Idempotent on (node, epoch, seq): a replayed batch changes nothing but ``last_seen``.
    The group must hold at most one batch per node (the writer defers a second one to the
    next group), so each node's reports are evaluated in order. Checkpoint events,
    progress, restore reports and latency samples that the node may not report for their
    job (``checkpoints.scoping``) are dropped; the batch is still stored and acked, the
    node gets a rate-limited agent event saying so, and ``refusal_log`` counts them (for
    ``/metrics``) and logs a rate-limited warning once the group has committed.

    Args:
        session: open session; committed here.
        batches: validated reports (each node already checked against its token).
        settings: server settings (health thresholds).
        now: server receive time (UTC).
        refusal_log: where refusals are counted (default: this process's shared log).

    Raises:
        ValueError: two batches of one node in the group.
    """
    names = [b.node for b in batches]
    if len(set(names)) != len(names):
        raise ValueError("a group may hold one batch per node")
    nodes = _load_or_create_nodes(session, names, now)
    stored = _store_ranges(session, batches, nodes, now)
    changes: dict[int, dict[str, Any]] = {}
    for b in batches:
        node = nodes[b.node]
        c = changes[node.id] = {"last_seen": now}
        if node.first_seen is None:
            c["first_seen"] = now
    fresh = [b for b in batches if (nodes[b.node].id, b.epoch, b.seq) in stored]
    refusals: list[Refusal] = []
    if fresh:
        # Job content a node may not report (checkpoints.scoping) is dropped before anything
        # is stored; the batch is still acked, and the refusal recorded.
        scoped = checkpoint_ingest.scope_reports(session, batches=fresh)
        refusals = scoped.refusals
        node_ids = {b.node: nodes[b.node].id for b in fresh}
        _apply_batches(session, scoped.batches, nodes, changes, settings)
        checkpoint_ingest.store_checkpoint_content(
            session, scoped=scoped, node_ids=node_ids, now=now
        )
        for b in scoped.batches:
            actions_ingest.apply_report(
                session, b, node_id=nodes[b.node].id, settings=settings, now=now
            )
        if refusals:
            store_refusal_events(session, refusals, node_ids=node_ids, now=now)
    commands = queue.deliver(
        session, [nodes[b.node].id for b in batches], now=now, settings=settings.commands
    )
    acks = []
    for b in batches:
        node = nodes[b.node]
        c = changes[node.id]
        is_stored = (node.id, b.epoch, b.seq) in stored
        if b.epoch == node.epoch:
            c["last_seq"] = acked = max(node.last_seq, b.seq)
        elif is_stored and _is_newer_epoch(session, node, b):
            c["epoch"], c["last_seq"] = b.epoch, b.seq
            acked = b.seq
        else:
            acked = (
                session.scalar(
                    select(func.max(RANGES.c.last_seq)).where(
                        RANGES.c.node_id == node.id, RANGES.c.epoch == b.epoch
                    )
                )
                or b.seq
            )
        acks.append(
            ReportAck(epoch=b.epoch, acked_seq=acked, stored=is_stored, commands=commands[node.id])
        )
    _update_nodes(session, nodes, changes)
    session.commit()
    if refusals:
        (refusal_log or DEFAULT_REFUSAL_LOG).record(refusals)
    return acks


def _load_or_create_nodes(session: Session, names: list[str], now: datetime) -> dict[str, Row[Any]]:
    """Node rows by name, creating the ones never seen (safe against a concurrent insert)."""
    nodes = {r.name: r for r in session.execute(select(NODES).where(NODES.c.name.in_(names)))}
    missing = [n for n in names if n not in nodes]
    if missing:
        for name in missing:
            insert_ignore(session, NODES, {"name": name, "first_seen": now, "state": "healthy"})
        for r in session.execute(select(NODES).where(NODES.c.name.in_(missing))):
            nodes[r.name] = r
    return nodes


def _store_ranges(
    session: Session, batches: list[ReportBatch], nodes: dict[str, Row[Any]], now: datetime
) -> set[tuple[int, str, int]]:
    """Record the group's batches in ``report_ranges``; returns the (node_id, epoch, seq)
    keys that were new (the others are replays).

    The ranges of the group's node epochs are read ``FOR UPDATE`` (PostgreSQL), in key
    order: a replay racing its original on another worker waits here, then finds its seq
    stored. A range that does not exist yet cannot be locked, so two first batches of one
    epoch both insert; the primary key keeps one of a replayed seq, and the other finds its
    insert refused (``ON CONFLICT DO NOTHING``) and counts as a replay.
    """
    ids = {b.node: nodes[b.node].id for b in batches}
    q = (
        select(RANGES)
        .where(RANGES.c.node_id.in_(set(ids.values())))
        .where(RANGES.c.epoch.in_({b.epoch for b in batches}))
        .order_by(RANGES.c.node_id, RANGES.c.epoch, RANGES.c.first_seq)
    )
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        q = q.with_for_update()
    held: dict[tuple[int, str], list[seqranges.SeqRange]] = defaultdict(list)
    for r in session.execute(q):
        held[(r.node_id, r.epoch)].append(
            seqranges.SeqRange(r.first_seq, r.last_seq, r.last_sent_at)
        )
    stored: set[tuple[int, str, int]] = set()
    updates: list[dict[str, Any]] = []
    deletes: list[dict[str, Any]] = []
    inserts: list[dict[str, Any]] = []
    for b in batches:
        node_id = ids[b.node]
        plan = seqranges.place(held[(node_id, b.epoch)], b.seq, b.sent_at)
        if plan is None:
            continue
        key = {"b_node": node_id, "b_epoch": b.epoch}
        for old_first, r in plan.update:
            updates.append(
                key
                | {"b_old": old_first, "b_first": r.first, "b_last": r.last}
                | {"b_sent": r.last_sent_at, "b_now": now}
            )
        deletes += [key | {"b_old": first} for first in plan.delete]
        if plan.insert is None:
            stored.add((node_id, b.epoch, b.seq))
        else:
            inserts.append(
                {"node_id": node_id, "epoch": b.epoch, "first_seq": b.seq, "last_seq": b.seq}
                | {"last_sent_at": b.sent_at, "received_at": now}
            )
    if deletes:
        session.execute(_DELETE_RANGE, deletes)
    if updates:
        session.execute(_UPDATE_RANGE, updates)
    if inserts:
        insert_fn = postgresql.insert if dialect == "postgresql" else sqlite.insert
        stmt = (
            insert_fn(RANGES)
            .values(inserts)
            .on_conflict_do_nothing()
            .returning(RANGES.c.node_id, RANGES.c.epoch, RANGES.c.first_seq)
        )
        stored |= {(r[0], r[1], r[2]) for r in session.execute(stmt)}
    return stored


_RANGE_KEY = (
    (RANGES.c.node_id == bindparam("b_node"))
    & (RANGES.c.epoch == bindparam("b_epoch"))
    & (RANGES.c.first_seq == bindparam("b_old"))
)
_UPDATE_RANGE = (
    update(RANGES)
    .where(_RANGE_KEY)
    .values(
        first_seq=bindparam("b_first"),
        last_seq=bindparam("b_last"),
        last_sent_at=bindparam("b_sent"),
        received_at=bindparam("b_now"),
    )
)
_DELETE_RANGE = delete(RANGES).where(_RANGE_KEY)


_NODE_COLUMNS = (
    "last_seen",
    "first_seen",
    "simulated",
    "collector",
    "agent_version",
    "interval_s",
    "sample_every",
    "dropped_batches",
    "epoch",
    "last_seq",
    "state",
    "state_since",
)
_UPDATE_NODE = (
    update(NODES)
    .where(NODES.c.id == bindparam("b_id"))
    .values(**{c: bindparam(f"b_{c}") for c in _NODE_COLUMNS})
)


def _update_nodes(
    session: Session, nodes: dict[str, Row[Any]], changes: dict[int, dict[str, Any]]
) -> None:
    """One executemany UPDATE of every node in the group (unchanged columns rewritten)."""
    rows = []
    for node in nodes.values():
        c = changes.get(node.id, {})
        rows.append(
            {"b_id": node.id, **{f"b_{k}": c.get(k, getattr(node, k)) for k in _NODE_COLUMNS}}
        )
    session.execute(_UPDATE_NODE, rows)


def _is_newest(session: Session, node: Row[Any], batch: ReportBatch) -> bool:
    """True when ``batch`` is newer than every batch stored for the node before this group:
    a later seq of the node's epoch, or the first batch of a later agent start."""
    if batch.epoch == node.epoch:
        return batch.seq > node.last_seq
    return not node.epoch or _is_newer_epoch(session, node, batch)


def _is_newer_epoch(session: Session, node: Row[Any], batch: ReportBatch) -> bool:
    """True when ``batch`` belongs to an agent start later than the node's current epoch."""
    current_sent = session.scalar(
        select(RANGES.c.last_sent_at).where(
            RANGES.c.node_id == node.id,
            RANGES.c.epoch == node.epoch,
            RANGES.c.last_seq == node.last_seq,
        )
    )
    return current_sent is None or batch.sent_at >= current_sent


def _apply_batches(
    session: Session,
    batches: list[ReportBatch],
    nodes: dict[str, Row[Any]],
    changes: dict[int, dict[str, Any]],
    settings: Settings,
) -> None:
    """Store the new batches' content and re-evaluate health, node by node."""
    th = settings.health
    gpus = _sync_inventories(session, batches, nodes)
    findings: dict[int, list[rules.Finding]] = defaultdict(list)
    evaluated: dict[int, set[str]] = defaultdict(set)
    with_latency: list[tuple[int, ReportBatch]] = []
    samples_rows: list[dict[str, Any]] = []
    events_rows: list[dict[str, Any]] = []
    for b in batches:
        node = nodes[b.node]
        c = changes[node.id]
        if _is_newest(session, node, b):
            for k, v in (
                ("simulated", b.simulated),
                ("collector", b.collector),
                ("agent_version", b.agent_version),
                ("interval_s", b.interval_s),
                ("sample_every", b.sample_every),
                ("dropped_batches", b.dropped_batches),
            ):
                if getattr(node, k) != v:
                    c[k] = v
        elif b.epoch == node.epoch and b.dropped_batches > node.dropped_batches:
            # a backfilled batch (agents send the newest first after an outage) describes
            # the agent as it was; only its drop count, which only grows, can be news
            c["dropped_batches"] = b.dropped_batches
        node_gpus = gpus[node.id]
        if b.samples:
            samples_rows += [
                {
                    "node_id": node.id,
                    "gpu_index": s.index,
                    "ts": s.ts,
                    **{f: getattr(s, f) for f in METRIC_FIELDS},
                }
                for s in b.samples
            ]
            findings[node.id] += _evaluate_samples(b, node_gpus, th)
            evaluated[node.id] |= rules.GPU_SAMPLE_RULES
        if b.gpus or b.samples:
            for index, entry in node_gpus.items():
                # samples come at least every sample_every reports (agent.sampling)
                findings[node.id] += rules.rule_stale_telemetry(
                    _latest_stamp(entry),
                    index,
                    b.sent_at,
                    b.interval_s * b.sample_every,
                    th,
                    b.sent_at,
                )
            evaluated[node.id].add(rules.RULE_STALE_TELEMETRY)
        findings[node.id] += _ingest_xids(session, node.id, b, node_gpus, th)
        if b.latency:
            _insert_latency(session, node.id, b)
            with_latency.append((node.id, b))
        events_rows += [
            {
                "node_id": node.id,
                "kind": "agent",
                "gpu_index": ev.gpu,
                "code": None,
                "ts": ev.ts,
                "received_at": b.sent_at,
                "severity": "warning",
                "message": f"{ev.kind}: {ev.message}" if ev.message else ev.kind,
                "data": {"agent_kind": ev.kind},
            }
            for ev in b.events
        ]
    for node_id, found in _straggler_findings(session, with_latency, th).items():
        findings[node_id] += found
    _insert_samples(session, samples_rows)
    _write_gpu_latest(session, gpus)
    if events_rows:
        session.execute(insert(EVENTS), events_rows)
    state_events = _update_reasons(session, batches, nodes, findings, evaluated, changes, th)
    names = {n.id: n.name for n in nodes.values()}
    for e in state_events:
        notify.node_state_changed(
            session,
            settings,
            node=names[e["node_id"]],
            old=e["data"]["from"],
            new=e["data"]["to"],
            message=e["message"],
            now=e["received_at"],
        )


_SAMPLE_COLUMNS = ("node_id", "gpu_index", "ts", *METRIC_FIELDS)
_COPY_SAMPLES = f"COPY gpu_samples ({', '.join(_SAMPLE_COLUMNS)}) FROM STDIN"


def _insert_samples(session: Session, rows: list[dict[str, Any]]) -> None:
    """Append raw samples: PostgreSQL's COPY (no SQL to compile or parse per row group),
    an executemany INSERT elsewhere. Both run in the session's transaction."""
    if not rows:
        return
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        dbapi = connection.connection.driver_connection
        with dbapi.cursor() as cur, cur.copy(_COPY_SAMPLES) as copy:  # type: ignore[union-attr]
            for row in rows:
                copy.write_row([row[c] for c in _SAMPLE_COLUMNS])
    else:
        session.execute(insert(GPU_SAMPLES), rows)


def _sync_inventories(
    session: Session, batches: list[ReportBatch], nodes: dict[str, Row[Any]]
) -> dict[int, dict[int, dict[str, Any]]]:
    """Load the group's GPUs, creating the ones seen for the first time.

    Returns:
        node_id -> GPU index -> {"id", "uuid", "name", "sample": latest GpuSample or None
        (``_UNREAD`` until :func:`_latest` converts ``"row"``, the latest-value row),
        "acked_xid": the XID code last acknowledged on it (None: none), "dirty": whether the
        latest-value row must be written}. A GPU whose UUID changed forgets ``acked_xid``.
    """
    node_ids = [nodes[b.node].id for b in batches]
    gpus: dict[int, dict[int, dict[str, Any]]] = {nid: {} for nid in node_ids}
    for r in session.execute(select(GPUS).where(GPUS.c.node_id.in_(node_ids))):
        # (a column named "index": Row's attribute, which the Sequence stubs take for .index())
        gpus[r.node_id][r._mapping["index"]] = {
            "id": r.id,
            "uuid": r.uuid,
            "name": r.name,
            "sample": _UNREAD,
            "row": r,
            "acked_xid": r.acked_xid,
            "dirty": False,
        }
    new_rows = []
    for b in batches:
        node_id = nodes[b.node].id
        wanted = {g.index: (g.uuid, g.name, g.memory_total_mib) for g in b.gpus}
        for s in b.samples:
            wanted.setdefault(s.index, ("", "", None))
        new_rows += [
            {"node_id": node_id, "index": i, "uuid": u, "name": n, "memory_total_mib": m}
            for i, (u, n, m) in wanted.items()
            if i not in gpus[node_id]
        ]
        for g in b.gpus:
            entry = gpus[node_id].get(g.index)
            if entry is not None and (entry["uuid"], entry["name"]) != (g.uuid, g.name):
                if entry["uuid"] != g.uuid:
                    entry["acked_xid"] = None  # another GPU: its acknowledgement is not ours
                entry.update(uuid=g.uuid, name=g.name, dirty=True)
    if new_rows:
        session.execute(insert(GPUS), new_rows)
        created = {r["node_id"] for r in new_rows}
        for node_id, index, gpu_id, uuid, name in session.execute(
            select(GPUS.c.node_id, GPUS.c.index, GPUS.c.id, GPUS.c.uuid, GPUS.c.name).where(
                GPUS.c.node_id.in_(created)
            )
        ):
            gpus[node_id].setdefault(
                index,
                {
                    "id": gpu_id,
                    "uuid": uuid,
                    "name": name,
                    "sample": None,
                    "acked_xid": None,
                    "dirty": False,
                },
            )
    return gpus


def _evaluate_samples(
    batch: ReportBatch, node_gpus: dict[int, dict[str, Any]], th: rules.HealthThresholds
) -> list[rules.Finding]:
    """Run each GPU's sample rules against its previous reading, oldest sample first."""
    by_gpu: dict[int, list[GpuSample]] = defaultdict(list)
    for s in batch.samples:
        by_gpu[s.index].append(s)
    findings: list[rules.Finding] = []
    for index, samples in by_gpu.items():
        entry = node_gpus[index]
        prev = _latest(entry)
        for cur in sorted(samples, key=lambda s: s.ts):
            if prev is not None and cur.ts <= prev.ts:
                continue  # a late replay of older history: stored, not evaluated
            findings += rules.evaluate_gpu(prev, cur, th)
            prev = cur
            entry["sample"] = cur
            entry["dirty"] = True
    return findings


def _write_gpu_latest(session: Session, gpus: dict[int, dict[int, dict[str, Any]]]) -> None:
    """One executemany UPDATE of the latest-value rows that changed."""
    updates = []
    for node_gpus in gpus.values():
        for e in node_gpus.values():
            if not e["dirty"]:
                continue
            sample = _latest(e)
            updates.append(
                {
                    "b_id": e["id"],
                    "b_uuid": e["uuid"],
                    "b_name": e["name"],
                    "b_ts": sample.ts if sample else None,
                    "b_acked_xid": e["acked_xid"],
                    **{f"b_{f}": getattr(sample, f) if sample else None for f in METRIC_FIELDS},
                }
            )
    if updates:
        session.execute(_UPDATE_GPU, updates)


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


def _xid_event_row(
    node_id: int, batch: ReportBatch, x: XidEvent, *, raised: bool | None = None
) -> dict[str, Any]:
    """The ``events`` row of one XID (kind ``xid``, ``data`` the catalog entry).

    A pre-start value (``x.before_start``) is marked ``data.before_start``, with severity
    ``unhealthy`` only when it raised a reason (``raised``), else ``info``.
    """
    info = lookup_xid(x.xid)
    data: dict[str, Any] = (
        {"mnemonic": info.mnemonic, "action": info.action, "fatal": info.fatal}
        if info
        else {"mnemonic": "UNKNOWN", "action": rules.ACTION_UNKNOWN_XID, "fatal": None}
    )
    if x.message:
        data["driver_message"] = x.message
    message = f"XID {x.xid} {data['mnemonic']} on GPU {x.gpu}"
    if x.before_start:
        data["before_start"] = True
        severity = "unhealthy" if raised else "info"
        message += ", seen before the agent started"
    else:
        severity = "unhealthy" if info and info.fatal else "degraded"
    return {
        "node_id": node_id,
        "kind": "xid",
        "gpu_index": x.gpu,
        "code": x.xid,
        "ts": x.ts,
        "received_at": batch.sent_at,
        "severity": severity,
        "message": message,
        "data": data,
    }


def _ingest_xids(
    session: Session,
    node_id: int,
    batch: ReportBatch,
    node_gpus: dict[int, dict[str, Any]],
    th: rules.HealthThresholds,
) -> list[rules.Finding]:
    """Store a batch's XIDs as events and classify them.

    Live occurrences are counted (``xid_counts``), go through :func:`rules.rule_xid` and make
    the GPU forget its acknowledged code (``gpus.acked_xid``: the gauge has moved on since).
    Pre-start values (``before_start``) are stored as events only, never counted (the same
    old value comes at every agent start), and go through :func:`rules.rule_xid_before_start`
    against each GPU's ``acked_xid``.
    """
    if not batch.xids:
        return []
    live = [x for x in batch.xids if not x.before_start]
    before = [x for x in batch.xids if x.before_start]
    findings: list[rules.Finding] = []
    events: list[dict[str, Any]] = []
    if before:
        acked = {i: e["acked_xid"] for i, e in node_gpus.items()}
        found = rules.rule_xid_before_start(
            [rules.XidRecord(gpu=x.gpu, xid=x.xid, ts=x.ts) for x in before], acked, th
        )
        raised = {(f.gpu, int(f.key)) for f in found}
        events += [
            _xid_event_row(node_id, batch, x, raised=(x.gpu, x.xid) in raised) for x in before
        ]
        findings += found
    if live:
        findings += _ingest_live_xids(session, node_id, live, th)
        events += [_xid_event_row(node_id, batch, x) for x in live]
        for x in live:
            entry = node_gpus.get(x.gpu)
            if entry is not None and entry["acked_xid"] is not None:
                entry.update(acked_xid=None, dirty=True)
    session.execute(insert(EVENTS), events)
    return findings


def _ingest_live_xids(
    session: Session,
    node_id: int,
    live: list[XidEvent],
    th: rules.HealthThresholds,
) -> list[rules.Finding]:
    """Count live XID occurrences and run :func:`rules.rule_xid` over them and the recent
    stored ones (after the last acknowledgement; pre-start values do not count)."""
    new: list[rules.XidRecord] = []
    counts: Counter[tuple[int, int]] = Counter()
    last_ts: dict[tuple[int, int], datetime] = {}
    for x in live:
        key = (x.gpu, x.xid)
        counts[key] += 1
        last_ts[key] = max(last_ts.get(key, x.ts), x.ts)
        new.append(rules.XidRecord(gpu=x.gpu, xid=x.xid, ts=x.ts))

    latest = max(r.ts for r in new)
    window_start = latest - timedelta(seconds=th.xid_repeat_window_s)
    acks: dict[int | None, datetime] = dict(
        session.execute(
            select(Acknowledgement.gpu_index, func.max(Acknowledgement.acked_at))
            .where(Acknowledgement.node_id == node_id, Acknowledgement.rule.in_(rules.XID_RULES))
            .group_by(Acknowledgement.gpu_index)
        ).all()
    )
    stored = session.execute(
        select(EVENTS.c.gpu_index, EVENTS.c.code, EVENTS.c.ts, EVENTS.c.data).where(
            EVENTS.c.node_id == node_id, EVENTS.c.kind == "xid", EVENTS.c.ts >= window_start
        )
    ).all()
    recent = []
    for gpu, code, ts, data in stored:
        if data and data.get("before_start"):
            continue  # a value read at an agent start, not an occurrence
        acked = acks.get(gpu) or acks.get(-1)
        if acked is not None and ts <= acked:
            continue
        recent.append(rules.XidRecord(gpu=gpu, xid=code, ts=ts))
    _upsert_counts(
        session,
        [
            {"node_id": node_id, "gpu_index": g, "xid": x, "count": n, "last_ts": last_ts[(g, x)]}
            for (g, x), n in counts.items()
        ],
    )
    return rules.rule_xid(new, recent, th, latest)


def _insert_latency(session: Session, node_id: int, batch: ReportBatch) -> None:
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


def _straggler_findings(
    session: Session, reported: list[tuple[int, ReportBatch]], th: rules.HealthThresholds
) -> dict[int, list[rules.Finding]]:
    """Straggler findings of a group's latency samples: each job evaluated once per group.

    A job's ranks report from many nodes, and a group holds many of their reports: the
    job's recent samples are read and :func:`rules.straggler_ranks` runs once for the
    group, not once per report (at 1,000 ranks on 125 nodes, 125 reads of ~12,000 rows and
    125 evaluations became one). Each node gets the findings of the ranks it reported, at
    the time of its newest sample of that job. The window is the last
    ``max(60 s, 20 × interval)`` before the group's newest sample of the job.

    Returns:
        node id -> its straggler findings (only nodes that have some).
    """
    jobs: dict[str, dict[int, tuple[set[int], datetime]]] = defaultdict(dict)
    window: dict[str, tuple[datetime, float]] = {}
    for node_id, batch in reported:
        for s in batch.latency:
            ranks, latest = jobs[s.job_id].get(node_id, (set(), s.ts))
            ranks.add(s.rank)
            jobs[s.job_id][node_id] = (ranks, max(latest, s.ts))
            newest, interval = window.get(s.job_id, (s.ts, batch.interval_s))
            window[s.job_id] = (max(newest, s.ts), max(interval, batch.interval_s))
    out: dict[int, list[rules.Finding]] = defaultdict(list)
    for job_id, by_node in jobs.items():
        newest, interval = window[job_id]
        cutoff = newest - timedelta(seconds=max(60.0, 20 * interval))
        rows = session.execute(
            select(LatencySampleRow.rank, LatencySampleRow.latency_ms)
            .where(LatencySampleRow.job_id == job_id, LatencySampleRow.ts >= cutoff)
            .order_by(LatencySampleRow.ts)
        ).all()
        series: dict[int, list[float]] = defaultdict(list)
        for rank, value in rows:
            series[rank].append(value)
        flagged = rules.straggler_ranks(dict(series), th)
        for node_id, (ranks, latest) in by_node.items():
            for rank in sorted(ranks & flagged.keys()):
                out[node_id].append(rules.rule_straggler(rank, job_id, flagged[rank], latest))
    return dict(out)


def _update_reasons(
    session: Session,
    batches: list[ReportBatch],
    nodes: dict[str, Row[Any]],
    findings: dict[int, list[rules.Finding]],
    evaluated: dict[int, set[str]],
    changes: dict[int, dict[str, Any]],
    th: rules.HealthThresholds,
) -> list[dict[str, Any]]:
    """Merge each node's findings into its stored reasons and derive its state.

    One SELECT for the group; writes only what changed (a healthy node with no findings
    writes nothing here). Returns the state-change events written.
    """
    # A node's state is the worst severity of its reasons, so a healthy node has none:
    # only nodes that are not healthy, or have new findings, need their reasons read.
    node_ids = [
        nodes[b.node].id
        for b in batches
        if nodes[b.node].state != "healthy" or findings.get(nodes[b.node].id)
    ]
    stored: dict[int, list[Row[Any]]] = defaultdict(list)
    if node_ids:
        for r in session.execute(select(REASONS).where(REASONS.c.node_id.in_(node_ids))):
            stored[r.node_id].append(r)
    inserts: list[dict[str, Any]] = []
    updates: list[dict[str, Any]] = []
    gone: list[int] = []
    state_events: list[dict[str, Any]] = []
    for b in batches:
        node = nodes[b.node]
        rows, found = stored.get(node.id, []), findings.get(node.id, [])
        merged: list[rules.Reason] = []
        if rows or found:
            previous = [rules.Reason(**fleet_service.reason_fields(r)) for r in rows]
            merged = rules.merge_reasons(previous, found, b.sent_at, th, evaluated[node.id])
            by_identity = {
                (r.rule, r.gpu_index if r.gpu_index >= 0 else None, r.key): r for r in rows
            }
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
            gone += [r.id for r in by_identity.values()]
        state = rules.node_state(merged, unreachable=False)
        if state == node.state and node.state_since is not None:
            continue
        changes[node.id] |= {"state": state, "state_since": b.sent_at}
        if state != node.state:
            state_events.append(
                fleet_service.state_change_event(node.id, node.state, state, merged, b.sent_at)
            )
    if inserts:
        session.execute(insert(REASONS), inserts)
    if updates:
        session.execute(_UPDATE_REASON, updates)
    if gone:
        session.execute(delete(REASONS).where(REASONS.c.id.in_(gone)))
    if state_events:
        session.execute(insert(EVENTS), state_events)
    return state_events

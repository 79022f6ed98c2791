"""Fleet tables: nodes, GPUs (with their latest values), raw samples, events, reasons.

``gpus`` is the latest-value table the dashboard and ``/metrics`` read; they never scan
``gpu_samples`` (raw history, pruned after ``sample_retention_s``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import Mapped, mapped_column

from tierwatch.agent.protocol import GPU_METRIC_TYPES, GPU_METRICS
from tierwatch.server.db import Base, UTCDateTime

# BIGINT on PostgreSQL, INTEGER (a rowid alias, so it autoincrements) on SQLite.
BigId = BigInteger().with_variant(Integer(), "sqlite")

# Metric columns shared by the latest-value table and the raw samples: the wire model's
# metrics (``GpuSample``), by the same names; tests/fleet/test_metric_fields.py holds the
# columns of ``_Metrics`` to them.
METRIC_FIELDS: tuple[str, ...] = GPU_METRICS
BOOL_METRICS = frozenset(name for name, kind in GPU_METRIC_TYPES.items() if kind is bool)


class _Metrics:
    """Mixin: one nullable column per metric of :data:`METRIC_FIELDS` (None = not supported
    on that GPU): ``Float`` for float metrics, ``BigInteger`` for counts, ``Boolean`` flags."""

    temperature_c: Mapped[float | None] = mapped_column(Float)
    slowdown_temp_c: Mapped[float | None] = mapped_column(Float)
    shutdown_temp_c: Mapped[float | None] = mapped_column(Float)
    power_w: Mapped[float | None] = mapped_column(Float)
    power_limit_w: Mapped[float | None] = mapped_column(Float)
    utilization_pct: Mapped[float | None] = mapped_column(Float)
    memory_used_mib: Mapped[float | None] = mapped_column(Float)
    memory_total_mib: Mapped[float | None] = mapped_column(Float)
    ecc_sbe_volatile: Mapped[int | None] = mapped_column(BigInteger)
    ecc_dbe_volatile: Mapped[int | None] = mapped_column(BigInteger)
    ecc_sbe_aggregate: Mapped[int | None] = mapped_column(BigInteger)
    ecc_dbe_aggregate: Mapped[int | None] = mapped_column(BigInteger)
    remapped_rows_correctable: Mapped[int | None] = mapped_column(BigInteger)
    remapped_rows_uncorrectable: Mapped[int | None] = mapped_column(BigInteger)
    row_remap_pending: Mapped[bool | None] = mapped_column(Boolean)
    row_remap_failure: Mapped[bool | None] = mapped_column(Boolean)
    pcie_replay_count: Mapped[int | None] = mapped_column(BigInteger)
    throttle_reasons: Mapped[int | None] = mapped_column(BigInteger)
    nvlink_crc_errors: Mapped[int | None] = mapped_column(BigInteger)
    nvlink_replay_errors: Mapped[int | None] = mapped_column(BigInteger)
    nvlink_recovery_errors: Mapped[int | None] = mapped_column(BigInteger)


class Node(Base):
    """A GPU node, created by its agent's first report (or its first token).

    ``state`` is the health state from the node's reasons (healthy | degraded | unhealthy);
    ``unreachable`` is derived at read time from ``last_seen`` and ``interval_s``.
    ``isolated`` is the operator's (or the policy's) overlay, with who/when/why; it holds
    whatever the health state until the node is released (``released_at``).
    """

    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    state: Mapped[str] = mapped_column(String(16), default="healthy")
    isolated: Mapped[bool] = mapped_column(Boolean, default=False)
    isolated_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    isolated_by: Mapped[str] = mapped_column(String(128), default="")
    isolated_reason: Mapped[str] = mapped_column(Text, default="")
    released_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    simulated: Mapped[bool] = mapped_column(Boolean, default=False)
    collector: Mapped[str] = mapped_column(String(32), default="")
    agent_version: Mapped[str] = mapped_column(String(32), default="")
    interval_s: Mapped[float] = mapped_column(Float, default=5.0)
    # GPU samples come at least every this many reports (ReportBatch.sample_every)
    sample_every: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    first_seen: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_seen: Mapped[datetime | None] = mapped_column(UTCDateTime)
    state_since: Mapped[datetime | None] = mapped_column(UTCDateTime)
    epoch: Mapped[str] = mapped_column(String(64), default="")
    last_seq: Mapped[int] = mapped_column(BigInteger, default=0)
    dropped_batches: Mapped[int] = mapped_column(BigInteger, default=0)


class Gpu(_Metrics, Base):
    """One GPU: identity plus its latest values (the latest-value table)."""

    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    uuid: Mapped[str] = mapped_column(String(96), default="")
    name: Mapped[str] = mapped_column(String(128), default="")
    ts: Mapped[datetime | None] = mapped_column(UTCDateTime)  # when the latest values were read
    # The code of the newest XID reason an operator acknowledged on this GPU; forgotten at the
    # GPU's next live XID or when another GPU (UUID) takes its index. A pre-start XID value
    # equal to it is the one already acknowledged (rules.rule_xid_before_start).
    acked_xid: Mapped[int | None] = mapped_column(Integer)


class GpuSampleRow(_Metrics, Base):
    """Raw history: one row per GPU per reading (append-only).

    On PostgreSQL the table is partitioned by hour of ``ts`` (``fleet.partitions``; migration
    0012 declares it, since SQLAlchemy's DDL here stays dialect-neutral); on SQLite it is one
    table with the same columns. No surrogate key: nothing refers to a sample row, and the
    8-byte id plus its index were a quarter of the row's size. The ORM maps
    (node_id, gpu_index, ts) as the identity; the database does not enforce it (a replayed
    batch is refused earlier, by its report seq range). ``ts`` has a BRIN index (btree on
    SQLite): rows arrive nearly in time order, so a block range summary is enough for the
    rollups' and retention's range scans, at a few KiB instead of 30 B/row.
    """

    __tablename__ = "gpu_samples"
    __table_args__ = (
        Index("ix_gpu_samples_node_gpu_ts", "node_id", "gpu_index", "ts"),
        Index("ix_gpu_samples_ts", "ts", postgresql_using="brin"),
    )
    __mapper_args__ = {"primary_key": ["node_id", "gpu_index", "ts"]}

    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    gpu_index: Mapped[int] = mapped_column(Integer)
    ts: Mapped[datetime] = mapped_column(UTCDateTime)


class GpuSampleRollup(_Metrics, Base):
    """5-minute rollups of ``gpu_samples`` for long chart ranges (``fleet.rollups``).

    One row per GPU per :data:`~tierwatch.server.fleet.rollups.ROLLUP_S` bucket: gauges are
    the bucket's mean, counters and flags its maximum, ``samples`` how many raw rows it
    summarises (the weight when buckets are merged). Kept for ``rollup_retention_s``.
    """

    __tablename__ = "gpu_sample_rollups"
    __table_args__ = (Index("ix_gpu_sample_rollups_bucket", "bucket"),)

    node_id: Mapped[int] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket: Mapped[datetime] = mapped_column(UTCDateTime, primary_key=True)
    samples: Mapped[int] = mapped_column(Integer)


class Event(Base):
    """Something that happened on a node: an XID, a state change, an agent event.

    ``kind`` is ``xid`` (``code`` holds the XID, ``data`` the catalog entry), ``state`` (a
    node state change), ``agent`` (reported by the agent), or ``ack``.
    """

    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_node_ts", "node_id", "ts"),
        Index("ix_events_kind_ts", "kind", "ts"),
        Index("ix_events_ts", "ts"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(32))
    gpu_index: Mapped[int | None] = mapped_column(Integer)
    code: Mapped[int | None] = mapped_column(Integer)
    ts: Mapped[datetime] = mapped_column(UTCDateTime)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)
    severity: Mapped[str] = mapped_column(String(16), default="info")
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class XidCount(Base):
    """Monotonic count of XID occurrences per (node, GPU, code), for ``/metrics``."""

    __tablename__ = "xid_counts"

    node_id: Mapped[int] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    gpu_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    xid: Mapped[int] = mapped_column(Integer, primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger, default=0)
    last_ts: Mapped[datetime | None] = mapped_column(UTCDateTime)


class ReasonRow(Base):
    """An active reason behind a node's state (see ``fleet.rules.Reason``).

    ``gpu_index`` is -1 for node-level reasons so the unique key works on every database.
    """

    __tablename__ = "reasons"
    __table_args__ = (UniqueConstraint("node_id", "rule", "gpu_index", "key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    rule: Mapped[str] = mapped_column(String(32))
    gpu_index: Mapped[int] = mapped_column(Integer, default=-1)
    key: Mapped[str] = mapped_column(String(64), default="")
    severity: Mapped[str] = mapped_column(String(16))
    message: Mapped[str] = mapped_column(Text)
    action: Mapped[str] = mapped_column(String(64))
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime)


class Acknowledgement(Base):
    """An operator's acknowledgement of a reason: earlier occurrences no longer count."""

    __tablename__ = "acknowledgements"
    __table_args__ = (Index("ix_acknowledgements_node_rule", "node_id", "rule", "gpu_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    rule: Mapped[str] = mapped_column(String(32))
    gpu_index: Mapped[int] = mapped_column(Integer, default=-1)
    key: Mapped[str] = mapped_column(String(64), default="")
    acked_at: Mapped[datetime] = mapped_column(UTCDateTime)
    actor: Mapped[str] = mapped_column(String(128))
    note: Mapped[str] = mapped_column(Text, default="")


class ReportRange(Base):
    """Consecutive stored batches ``first_seq..last_seq`` of one agent epoch: the record that
    makes ingest idempotent (``fleet.seqranges``).

    ``last_sent_at`` is the ``sent_at`` of the ``last_seq`` batch; ``received_at`` when the
    range last grew (the pruner drops ranges that stopped growing before the sample cut).
    """

    __tablename__ = "report_ranges"

    node_id: Mapped[int] = mapped_column(
        ForeignKey("nodes.id", ondelete="CASCADE"), primary_key=True
    )
    epoch: Mapped[str] = mapped_column(String(64), primary_key=True)
    first_seq: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    last_seq: Mapped[int] = mapped_column(BigInteger)
    last_sent_at: Mapped[datetime] = mapped_column(UTCDateTime)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)


class LatencySampleRow(Base):
    """A collective-latency sample of one rank of one job (ms)."""

    __tablename__ = "latency_samples"
    __table_args__ = (
        Index("ix_latency_samples_job_ts", "job_id", "ts"),
        Index("ix_latency_samples_ts", "ts"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(String(128))
    rank: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int | None] = mapped_column(Integer)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    ts: Mapped[datetime] = mapped_column(UTCDateTime)
    latency_ms: Mapped[float] = mapped_column(Float)

"""Checkpoint tables: jobs, the ledger per (job, step, tier), per-rank commits, event,
progress and restore history.

- ``jobs``: one row per training job, created when the job registers: its registered
  nodes, world_size, pinned rank→node layout, current step (the highest step reported) and
  latest step time.
- ``checkpoint_ledger``: one row per (job, step, tier) with the completeness the server
  derived from ``committed`` events (see ``ledger.completeness``), the step's size and
  commit time, and whether retention evicted it. Kept while it is young or the newest
  complete step of its tier; pruned with the event retention otherwise.
- ``checkpoint_rank_commits``: which ranks committed a ledger row (the truth completeness
  is computed from; idempotent on (ledger row, rank)).
- ``checkpoint_events``: every reported event (staged / committed / failed / evicted),
  pruned with the event retention.
- ``job_progress``: progress history for charts, pruned with the sample retention.
- ``job_restores``: restore outcomes, pruned with the event retention.

Units: ``bytes`` bytes, ``*_s`` and ``seconds`` seconds, steps are training steps.
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

from tierwatch.server.db import Base, UTCDateTime
from tierwatch.server.fleet.models import BigId


class Job(Base):
    """A training job, created when it registers (``credentials.service.register_job``).

    Reports are accepted for registered jobs only, from the nodes the registration names
    (``checkpoints.scoping``).

    Attributes:
        job_id: the job's id as the training library names it.
        world_size: number of ranks: the registered one, else the one pinned with the
            layout, else (while neither is known) the newest progress report's.
        layout: node name per rank (index = rank): the registered one, else the first
            accepted from rank 0 after the registration. Pinned once set: only the job's
            next registration (its restart) changes it.
        step: the current training step: the highest step reported in progress or
            checkpoint events.
        step_ts: when ``step`` was reported done (the reporting rank's clock).
        step_time_s: the newest reported step time (seconds per step).
        progress_ts: time of the newest progress report applied (orders world_size/layout).
        first_seen, last_seen: when the job registered first, and server receive time of
            the latest report.
        registered_nodes: the nodes the job's registration names (its agents' reports
            are the only ones accepted for it); None: never registered.
        registered_world_size: world size given at registration (None: not given).
        registered_at, registered_by: when and by whom (the actor) it last registered.
        credential_expires_at: expiry of the newest job credential issued.
    """

    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    job_id: Mapped[str] = mapped_column(String(128), unique=True)
    world_size: Mapped[int | None] = mapped_column(Integer)
    layout: Mapped[list[str] | None] = mapped_column(JSON)
    step: Mapped[int | None] = mapped_column(BigInteger)
    step_ts: Mapped[datetime | None] = mapped_column(UTCDateTime)
    step_time_s: Mapped[float | None] = mapped_column(Float)
    progress_ts: Mapped[datetime | None] = mapped_column(UTCDateTime)
    first_seen: Mapped[datetime] = mapped_column(UTCDateTime)
    last_seen: Mapped[datetime] = mapped_column(UTCDateTime)
    registered_nodes: Mapped[list[str] | None] = mapped_column(JSON)
    registered_world_size: Mapped[int | None] = mapped_column(Integer)
    registered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    registered_by: Mapped[str | None] = mapped_column(String(128))
    credential_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class LedgerRow(Base):
    """What the server knows of one step of a job in one tier.

    Attributes:
        world_size: ranks that must commit (from the events, else the job).
        ranks_committed: distinct ranks with a ``committed`` event.
        whole_step: a ``committed`` event with rank None committed the whole step.
        complete: the step is committed in this tier (``ledger.completeness``).
        committed_at: newest time among the counted ``committed`` events (when complete:
            when the step became committed).
        bytes: size of the step in this tier (sum over ranks; bytes).
        seconds: the tier's time to commit the step (slowest rank; seconds).
        evicted: retention removed the step from the tier (an ``evicted`` event).
        failures: ``failed`` events for this step and tier.
    """

    __tablename__ = "checkpoint_ledger"
    __table_args__ = (
        UniqueConstraint("job_pk", "step", "tier"),
        Index("ix_checkpoint_ledger_job_tier_step", "job_pk", "tier", "step"),
        Index("ix_checkpoint_ledger_updated_at", "updated_at"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_pk: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    tier: Mapped[str] = mapped_column(String(16))
    world_size: Mapped[int | None] = mapped_column(Integer)
    ranks_committed: Mapped[int] = mapped_column(Integer, default=0)
    whole_step: Mapped[bool] = mapped_column(Boolean, default=False)
    complete: Mapped[bool] = mapped_column(Boolean, default=False)
    committed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    seconds: Mapped[float | None] = mapped_column(Float)
    evicted: Mapped[bool] = mapped_column(Boolean, default=False)
    evicted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failures: Mapped[int] = mapped_column(Integer, default=0)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)


class RankCommit(Base):
    """One rank's ``committed`` event for a ledger row (rank -1: the whole step)."""

    __tablename__ = "checkpoint_rank_commits"

    ledger_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoint_ledger.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[datetime] = mapped_column(UTCDateTime)
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    seconds: Mapped[float | None] = mapped_column(Float)


class CheckpointEventRow(Base):
    """One reported checkpoint event (``agent.protocol.CheckpointEvent``)."""

    __tablename__ = "checkpoint_events"
    __table_args__ = (
        Index("ix_checkpoint_events_job_ts", "job_pk", "ts"),
        Index("ix_checkpoint_events_job_tier_kind_ts", "job_pk", "tier", "kind", "ts"),
        Index("ix_checkpoint_events_ts", "ts"),
        # the job page's per-step aggregation (checkpoints.step_events) reads a job's newest
        # steps; without it each view scans the job's whole retained history
        Index("ix_checkpoint_events_job_step", "job_pk", "step"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_pk: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    step: Mapped[int] = mapped_column(BigInteger)
    tier: Mapped[str] = mapped_column(String(16))
    kind: Mapped[str] = mapped_column(String(16))
    rank: Mapped[int | None] = mapped_column(Integer)
    world_size: Mapped[int | None] = mapped_column(Integer)
    ts: Mapped[datetime] = mapped_column(UTCDateTime)
    received_at: Mapped[datetime] = mapped_column(UTCDateTime)
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    seconds: Mapped[float | None] = mapped_column(Float)
    blocking_s: Mapped[float | None] = mapped_column(Float)
    message: Mapped[str] = mapped_column(Text, default="")


class ProgressRow(Base):
    """One progress report of one rank (``agent.protocol.JobProgress``), for charts."""

    __tablename__ = "job_progress"
    __table_args__ = (
        Index("ix_job_progress_job_ts", "job_pk", "ts"),
        Index("ix_job_progress_job_step", "job_pk", "step"),
        Index("ix_job_progress_ts", "ts"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_pk: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    rank: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    step_time_s: Mapped[float | None] = mapped_column(Float)
    ts: Mapped[datetime] = mapped_column(UTCDateTime)


class RestoreRow(Base):
    """One rank's restore outcome (``agent.protocol.RestoreReport``)."""

    __tablename__ = "job_restores"
    __table_args__ = (
        Index("ix_job_restores_job_ts", "job_pk", "ts"),
        Index("ix_job_restores_ts", "ts"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_pk: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    node_id: Mapped[int | None] = mapped_column(ForeignKey("nodes.id", ondelete="SET NULL"))
    rank: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    step: Mapped[int | None] = mapped_column(BigInteger)
    ts: Mapped[datetime] = mapped_column(UTCDateTime)
    seconds: Mapped[float] = mapped_column(Float)
    steps_lost: Mapped[int | None] = mapped_column(BigInteger)
    files_by_tier: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    sources: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    ok: Mapped[bool] = mapped_column(Boolean, default=True)
    message: Mapped[str] = mapped_column(Text, default="")

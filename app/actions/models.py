"""Operator-action tables: the durable command queue, restore requests, the audit log and the
auto-isolation policy's stored settings.

- ``commands``: one row per command, ``pending → delivered → running → succeeded | failed |
  expired``. ``executor`` says who runs it: ``agent`` (delivered in the answer to the node
  agent's next report: the node-local ``command`` driver, restores) or ``server`` (the
  cluster drivers ``slurm`` / ``kubernetes``, run by the leader replica so a node whose agent
  is dead can still be drained). The primary key is the command id the agent deduplicates on.
- ``restore_requests`` + ``restore_rank_progress``: an operator's (or the policy's) request to
  roll a job back to a step, with each rank's phase (pending, staging, loaded, failed).
- ``audit_log``: every action with actor, time, target, reason and outcome.
- ``policy_settings``: one row (id 1) once an admin changed the policy; until then the
  ``TIERWATCH_POLICY__*`` settings apply.

The isolation overlay itself lives on ``nodes`` (``isolated``, ``isolated_at``, ``isolated_by``,
``isolated_reason``, ``released_at``).
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
)
from sqlalchemy.orm import Mapped, mapped_column

from tierwatch.server.db import Base, UTCDateTime
from tierwatch.server.fleet.models import BigId

COMMAND_STATES = ("pending", "delivered", "running", "succeeded", "failed", "expired")
TERMINAL_STATES = frozenset({"succeeded", "failed", "expired"})


class CommandRow(Base):
    """One queued command (see the module docstring for the states).

    Attributes:
        id: the command id (32 hex characters), what the agent deduplicates on.
        kind: ``isolate`` | ``release`` | ``restore``.
        executor: ``agent`` | ``server``.
        driver: the isolation driver that runs it (``command``, ``slurm``, ``kubernetes``), or
            ``restore``.
        args: the command's arguments as sent to the agent (``Command.args``).
        attempts: how many times it was delivered to the agent (or started on the server).
        exit_code, output: the driver's exit code (or HTTP status) and output tail.
    """

    __tablename__ = "commands"
    __table_args__ = (
        Index("ix_commands_node_state", "node_id", "state"),
        Index("ix_commands_state_expires", "state", "expires_at"),
        Index("ix_commands_created", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    executor: Mapped[str] = mapped_column(String(8))
    driver: Mapped[str] = mapped_column(String(16))
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    restore_id: Mapped[int | None] = mapped_column(
        ForeignKey("restore_requests.id", ondelete="CASCADE")
    )
    state: Mapped[str] = mapped_column(String(16), default="pending")
    args: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    actor: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    output: Mapped[str] = mapped_column(Text, default="")


class RestoreRequest(Base):
    """A request to roll a job back to ``step``.

    Attributes:
        id: the request id the ranks agree on (increases with each request).
        job_pk: ``jobs.id``; ``job_id`` the job's name.
        step: the target step (resolved at request time: never None).
        tier: the tier asked for (None: the fastest that holds the step).
        state: ``running`` (commands out, ranks not all done), ``succeeded`` (every rank
            loaded), ``failed`` (a rank failed) or ``expired`` (no rank answered in time).
        world_size, layout: the job's ranks and their nodes when the request was made.
        seconds: the slowest rank's restore time once done; ``steps_lost`` the most steps a
            rank lost.
    """

    __tablename__ = "restore_requests"
    __table_args__ = (Index("ix_restore_requests_job", "job_pk", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_pk: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    job_id: Mapped[str] = mapped_column(String(128))
    step: Mapped[int] = mapped_column(BigInteger)
    tier: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(128))
    state: Mapped[str] = mapped_column(String(16), default="running")
    world_size: Mapped[int] = mapped_column(Integer)
    layout: Mapped[list[str]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    seconds: Mapped[float | None] = mapped_column(Float)
    steps_lost: Mapped[int | None] = mapped_column(BigInteger)
    message: Mapped[str] = mapped_column(Text, default="")


class RestoreRankProgress(Base):
    """One rank's progress on a restore request (phase pending → staging → loaded | failed).

    ``tier`` is the tier most of the rank's files came from; ``files_by_tier`` the counts.
    """

    __tablename__ = "restore_rank_progress"

    request_id: Mapped[int] = mapped_column(
        ForeignKey("restore_requests.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(128))
    phase: Mapped[str] = mapped_column(String(16), default="pending")
    step: Mapped[int | None] = mapped_column(BigInteger)
    tier: Mapped[str | None] = mapped_column(String(16))
    files_by_tier: Mapped[dict[str, int]] = mapped_column(JSON, default=dict)
    seconds: Mapped[float | None] = mapped_column(Float)
    steps_lost: Mapped[int | None] = mapped_column(BigInteger)
    message: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class AuditEntry(Base):
    """One action: who did what to which target, why, and what came of it.

    Attributes:
        actor: ``token:<id>`` (API or dashboard), ``policy``, or ``cli``.
        role: the actor's role (``policy`` for the policy).
        action: ``isolate`` | ``release`` | ``restore`` | ``ack`` | ``policy_update`` |
            ``breaker_trip`` | ``breaker_reset`` | ``token_create`` | ``token_revoke`` |
            ``command`` (a driver run finished) | ``job_register`` (a job registered and got
            its credential).
        target_kind: ``node`` | ``job`` | ``policy`` | ``token`` | ``cluster``.
        outcome: ``ok`` | ``noop`` (already in that state) | ``refused`` | ``succeeded`` |
            ``failed`` | ``expired``.
    """

    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_ts", "ts"),
        Index("ix_audit_log_target", "target_kind", "target", "ts"),
        Index("ix_audit_log_action_ts", "action", "ts"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = mapped_column(UTCDateTime)
    actor: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(32))
    target_kind: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(128))
    reason: Mapped[str] = mapped_column(Text, default="")
    outcome: Mapped[str] = mapped_column(String(16))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class PolicySettingsRow(Base):
    """The auto-isolation policy's stored state (one row, id 1).

    A setting column holds an admin's override; None means the ``TIERWATCH_POLICY__*``
    setting applies. ``breaker_tripped_at`` is set while the circuit breaker holds.
    """

    __tablename__ = "policy_settings"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    enabled: Mapped[bool | None] = mapped_column(Boolean)
    unreachable_s: Mapped[float | None] = mapped_column(Float)
    breaker_pct: Mapped[float | None] = mapped_column(Float)
    breaker_window_s: Mapped[float | None] = mapped_column(Float)
    restore_jobs: Mapped[bool | None] = mapped_column(Boolean)
    updated_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    updated_by: Mapped[str] = mapped_column(String(128), default="")
    breaker_tripped_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    breaker_message: Mapped[str] = mapped_column(Text, default="")


MAINTENANCE_SCOPES = ("node", "cluster")


class MaintenanceWindow(Base):
    """A maintenance window: a node (or the whole cluster) silenced for a time.

    While a window covers a node, the policy does not isolate it automatically and its
    alerts are recorded but not delivered (:mod:`~tierwatch.server.actions.maintenance`).

    Attributes:
        scope: ``node`` | ``cluster``.
        node: the node's name (scope ``node``); None for the cluster.
        starts_at, ends_at: the window (timezone-aware UTC; ``starts_at < ends_at``).
        reason: why (shown with every alert it silences).
        created_by, created_at: who opened it (``token:<id>``), and when.
        ended_at, ended_by: set when an operator ended it early (None: runs to ``ends_at``).
    """

    __tablename__ = "maintenance_windows"
    __table_args__ = (
        Index("ix_maintenance_windows_ends_at", "ends_at"),
        Index("ix_maintenance_windows_node_ends_at", "node", "ends_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    scope: Mapped[str] = mapped_column(String(16))
    node: Mapped[str | None] = mapped_column(String(128))
    starts_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ends_at: Mapped[datetime] = mapped_column(UTCDateTime)
    reason: Mapped[str] = mapped_column(Text)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    ended_by: Mapped[str] = mapped_column(String(128), default="")

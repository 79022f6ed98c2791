"""Alert tables: the alerts raised and their delivery outbox (one row per alert per webhook).

- ``alerts``: one row per alert *sent* (a firing or resolved notice). An alert that fires
  again within the dedup window is not a new row: its ``count`` and ``last_fired_at`` are
  bumped instead (see ``service.raise_alert``).
- ``alert_deliveries``: the durable outbox. A row is written in the same transaction as its
  alert, so a restart loses nothing; ``delivery.deliver_due`` sends the rows that are due.

States: ``pending`` (due at ``next_attempt_at``), ``delivered`` (a 2xx answer, at
``delivered_at``), ``failed`` (a permanent error or ``max_attempts`` used up; ``last_error``
says why). Times are timezone-aware UTC.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from tierwatch.server.db import Base, UTCDateTime
from tierwatch.server.fleet.models import BigId

# The kinds raised today (the dashboard's filter chips); the column takes any kind.
KINDS = (
    "node_state",
    "policy_isolate",
    "isolation",
    "breaker",
    "command_failed",
    "restore_failed",
)
SEVERITIES = ("info", "warning", "critical")
STATUSES = ("firing", "resolved")
DELIVERY_STATES = ("pending", "delivered", "failed")


class Alert(Base):
    """An alert notice (firing or resolved) for a dedup ``key``.

    Attributes:
        key: the dedup key, e.g. ``node_state:gpu-node-03:unhealthy``.
        kind: what raised it: ``node_state``, ``policy_isolate``, ``isolation``, ``breaker``,
            ``command_failed``, ``restore_failed`` (free text beyond those; ≤ 32 characters).
        severity: ``info`` | ``warning`` | ``critical``.
        status: ``firing`` | ``resolved``.
        summary: one line for people (plain text; escaped wherever it is shown).
        labels: string labels (``node``, ``job`` ...), sent as Alertmanager labels.
        details: free-form JSON context.
        created_at: when the notice was raised (and its deliveries queued).
        starts_at: when the condition began: ``created_at`` for a firing notice, the newest
            firing notice's ``starts_at`` for a resolved one (Alertmanager ``startsAt``).
        ends_at: when the condition ended (resolved notices only; Alertmanager ``endsAt``).
        last_fired_at: the newest time the same notice was raised (dedup bumps it).
        count: how many times it was raised (1 + the deduplicated repeats).
        silenced_by: the maintenance window that covered the alert's node (or the cluster)
            when it was raised: recorded, not delivered. A resolved notice carries its
            firing notice's window, so a receiver never gets a resolution it never saw fire.
    """

    __tablename__ = "alerts"
    __table_args__ = (
        Index("ix_alerts_key_created_at", "key", "created_at"),
        Index("ix_alerts_created_at", "created_at"),
        Index("ix_alerts_kind_created_at", "kind", "created_at"),
        Index("ix_alerts_silenced_by", "silenced_by"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(255))
    kind: Mapped[str] = mapped_column(String(32))
    severity: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    summary: Mapped[str] = mapped_column(Text, default="")
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    starts_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ends_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_fired_at: Mapped[datetime] = mapped_column(UTCDateTime)
    count: Mapped[int] = mapped_column(Integer, default=1)
    silenced_by: Mapped[int | None] = mapped_column(Integer)

    deliveries: Mapped[list[AlertDelivery]] = relationship(
        back_populates="alert", order_by="AlertDelivery.id", passive_deletes=True
    )


class AlertDelivery(Base):
    """One alert's delivery to one webhook (the outbox row).

    Attributes:
        url: the webhook URL, as configured when the alert was raised.
        state: ``pending`` | ``delivered`` | ``failed``.
        attempts: HTTP attempts made so far.
        next_attempt_at: when a pending delivery is due (None once delivered or failed).
            ``deliver_due`` moves it forward by a lease while a request is in flight, so a
            crash mid-request retries after the lease instead of never.
        last_attempt_at: when the newest attempt started.
        last_status_code: HTTP status of the newest attempt (None: no answer).
        last_error: why the newest attempt failed ("" when it did not).
        delivered_at: when a 2xx answer arrived.
    """

    __tablename__ = "alert_deliveries"
    __table_args__ = (
        Index("ix_alert_deliveries_state_next_attempt_at", "state", "next_attempt_at"),
        Index("ix_alert_deliveries_alert_id", "alert_id"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    alert_id: Mapped[int] = mapped_column(BigId, ForeignKey("alerts.id", ondelete="CASCADE"))
    url: Mapped[str] = mapped_column(String(2048))
    state: Mapped[str] = mapped_column(String(16), default="pending")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_attempt_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str] = mapped_column(Text, default="")
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    alert: Mapped[Alert] = relationship(back_populates="deliveries")

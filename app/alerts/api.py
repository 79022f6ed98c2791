"""Alerts REST API under /api/v1: the alerts raised and their delivery status."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import AwareDatetime, BaseModel, Field

from tierwatch.server.alerts import service
from tierwatch.server.alerts.models import Alert, AlertDelivery
from tierwatch.server.deps import SessionDep
from tierwatch.server.security import ReaderDep, error_responses

router = APIRouter(prefix="/api/v1", tags=["alerts"], responses=error_responses(401, 422))


class DeliveryOut(BaseModel):
    """One alert's delivery to one webhook.

    ``url`` is redacted to ``scheme://host[:port]/…`` (webhook paths often carry secrets);
    ``webhook`` is the URL's position among the alert's deliveries (1-based).
    """

    id: int
    webhook: int
    url: str
    state: str
    attempts: int
    next_attempt_at: AwareDatetime | None
    last_attempt_at: AwareDatetime | None
    last_status_code: int | None
    last_error: str
    delivered_at: AwareDatetime | None


class AlertOut(BaseModel):
    """An alert notice with its deliveries (see ``alerts.models.Alert`` for the fields)."""

    id: int
    key: str
    kind: str
    severity: str
    status: str
    summary: str
    labels: dict[str, str]
    details: dict[str, Any]
    created_at: AwareDatetime
    starts_at: AwareDatetime
    ends_at: AwareDatetime | None
    last_fired_at: AwareDatetime
    count: int
    silenced_by: int | None = Field(
        description="the maintenance window that silenced it (recorded, not delivered)"
    )
    deliveries: list[DeliveryOut]


class AlertList(BaseModel):
    """Alerts newest first."""

    alerts: list[AlertOut]


def delivery_out(delivery: AlertDelivery, webhook: int) -> DeliveryOut:
    """The API shape of a delivery (URL redacted)."""
    return DeliveryOut(
        id=delivery.id,
        webhook=webhook,
        url=service.redact_url(delivery.url),
        state=delivery.state,
        attempts=delivery.attempts,
        next_attempt_at=delivery.next_attempt_at,
        last_attempt_at=delivery.last_attempt_at,
        last_status_code=delivery.last_status_code,
        last_error=delivery.last_error,
        delivered_at=delivery.delivered_at,
    )


def alert_out(alert: Alert) -> AlertOut:
    """The API shape of an alert with its deliveries."""
    return AlertOut(
        id=alert.id,
        key=alert.key,
        kind=alert.kind,
        severity=alert.severity,
        status=alert.status,
        summary=alert.summary,
        labels=alert.labels,
        details=alert.details,
        created_at=alert.created_at,
        starts_at=alert.starts_at,
        ends_at=alert.ends_at,
        last_fired_at=alert.last_fired_at,
        count=alert.count,
        silenced_by=alert.silenced_by,
        deliveries=[delivery_out(d, i) for i, d in enumerate(alert.deliveries, start=1)],
    )


@router.get("/alerts", response_model=AlertList)
def list_alerts(
    _: ReaderDep,
    session: SessionDep,
    kind: Annotated[
        str | None, Query(max_length=service.MAX_KIND_LENGTH, description="only this kind")
    ] = None,
    status: Annotated[
        str | None, Query(pattern="^(firing|resolved)$", description="firing or resolved")
    ] = None,
    delivery: Annotated[
        str | None,
        Query(
            pattern="^(pending|delivered|failed)$",
            description="only alerts with a delivery in this state",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=service.LIST_LIMIT_MAX)] = 100,
) -> AlertList:
    """Alerts newest first, each with its per-webhook delivery state (any role).

    Filters: ``kind``, ``status`` (firing | resolved), ``delivery`` (alerts with at least one
    delivery pending | delivered | failed), ``limit`` (1 to 1000, default 100). Invalid
    filters are answered with 422 and a message naming the field.
    """
    alerts = service.list_alerts(
        session, kind=kind, status=status, delivery_state=delivery, limit=limit
    )
    return AlertList(alerts=[alert_out(a) for a in alerts])

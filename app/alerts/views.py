"""The alerts dashboard page: alerts newest first with their per-webhook delivery status.

Route:
    GET /alerts    alerts page; ``kind``, ``status`` and ``delivery`` filter; the ``live``
                   block alone for htmx polling (see ``tierwatch.server.web.deps.render_page``)
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request, Response

from tierwatch.agent.protocol import utcnow
from tierwatch.server.alerts import service
from tierwatch.server.alerts.models import DELIVERY_STATES, KINDS, STATUSES
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.web.deps import ViewerPageDep, WebRoute, render_page

router = APIRouter(include_in_schema=False, route_class=WebRoute)

PAGE_LIMIT = 200


@router.get("/alerts")
def alerts_page(
    request: Request,
    viewer: ViewerPageDep,
    session: SessionDep,
    settings: SettingsDep,
    kind: Annotated[str | None, Query()] = None,
    status: Annotated[str | None, Query()] = None,
    delivery: Annotated[str | None, Query()] = None,
) -> Response:
    """The newest alerts (kind, severity, summary, count) and each webhook's delivery state:
    delivered, pending (next attempt and when) or failed (why). Unknown filter values are
    ignored, as on the cluster page."""
    kind = (kind or "").strip()[: service.MAX_KIND_LENGTH] or None
    status = status if status in STATUSES else None
    delivery = delivery if delivery in DELIVERY_STATES else None
    alert_settings: service.AlertSettings = request.app.state.settings.alerts
    filters = {k: v for k, v in (("kind", kind), ("status", status), ("delivery", delivery)) if v}

    def link(**change: str | None) -> str:
        query = {k: v for k, v in {**filters, **change}.items() if v}
        return "/alerts" + (f"?{urlencode(query)}" if query else "")

    return render_page(
        request,
        "pages/alerts.html",
        {
            "principal": viewer,
            "now": utcnow(),
            "refresh_s": settings.dashboard_refresh_s,
            "alerts": service.list_alerts(
                session, kind=kind, status=status, delivery_state=delivery, limit=PAGE_LIMIT
            ),
            "limit": PAGE_LIMIT,
            "kind": kind,
            "status": status,
            "delivery": delivery,
            "kinds": KINDS,
            "statuses": STATUSES,
            "delivery_states": DELIVERY_STATES,
            "link": link,
            "poll_url": link(),
            # Alertmanagers are listed with the webhooks, each marked so (its rows are theirs)
            "webhooks": [service.redact_url(u) for u in alert_settings.webhooks]
            + [
                f"{service.redact_url(u)} (Alertmanager API)"
                for u in alert_settings.alertmanager_urls
            ],
            "format": alert_settings.format,
            "max_attempts": alert_settings.max_attempts,
            "redact": service.redact_url,
        },
    )

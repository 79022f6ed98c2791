"""The demo report page: ``make demo``'s ``var/demo-report.json`` on the dashboard.

The file is named by ``TIERWATCH_DEMO_REPORT`` (:attr:`Settings.demo_report
<tierwatch.server.config.Settings>`) and read again at every request (see
:mod:`tierwatch.server.demo.report`; the same report as JSON: :mod:`tierwatch.server.demo.api`).
The page polls its ``live`` block every :data:`POLL_S` seconds with htmx while the demo runs,
while the file is absent and while it is unreadable; a finished report stops polling.

Route:
    GET /demo                 the report page (viewer or above); 404 page when no report is
                              configured, a waiting page while the file is absent, a 503 page
                              naming the file and what is wrong when it cannot be used;
                              the ``live`` block alone for htmx
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from tierwatch.agent.protocol import utcnow
from tierwatch.server.demo import report as demo_report
from tierwatch.server.deps import SettingsDep
from tierwatch.server.web.deps import PAGE_HEADERS, ViewerPageDep, WebError, WebRoute, is_htmx
from tierwatch.server.web.templating import templates

router = APIRouter(include_in_schema=False, route_class=WebRoute)

POLL_S = 5.0
STALE_AFTER_S = 60.0


@router.get("/demo")
def demo_page(request: Request, viewer: ViewerPageDep, settings: SettingsDep) -> Response:
    """The demo's headline numbers, tiers, measured costs, failures and loss curve.

    Raises:
        WebError: 404 when ``TIERWATCH_DEMO_REPORT`` is not set.
    """
    path = settings.demo_report
    if path is None:
        raise WebError(404, "No demo report", demo_report.NOT_CONFIGURED)
    now = utcnow()
    context: dict[str, Any] = {
        "principal": viewer,
        "now": now,
        "path": str(path),
        "poll_s": POLL_S,
        "report": None,
        "problem": None,
        "errors": [],
        "stale_s": None,
        "chart": [],
    }
    status_code = 200
    headers = dict(PAGE_HEADERS)
    try:
        report = demo_report.read_report(path)
    except demo_report.ReportAbsent:
        context["state"] = "absent"
    except demo_report.ReportInvalid as exc:
        context.update(
            state="invalid", problem=exc.problem, errors=exc.errors, hint=demo_report.MID_WRITE_HINT
        )
        status_code = 503
        headers["Retry-After"] = str(demo_report.RETRY_AFTER_S)
    else:
        age_s = (now - report.updated_at).total_seconds()
        context.update(
            state="ok",
            report=report,
            chart=demo_report.chart_points(report.loss_curve),
            stale_s=age_s if report.status == "running" and age_s > STALE_AFTER_S else None,
        )
    return templates.TemplateResponse(
        request,
        "pages/demo.html",
        context,
        status_code=status_code,
        headers=headers,
        block_names=["live"] if is_htmx(request) else [],
    )

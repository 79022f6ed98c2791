"""The demo report: ``make demo``'s ``var/demo-report.json`` as a dashboard page and as JSON.

The file is named by ``TIERWATCH_DEMO_REPORT`` (:attr:`Settings.demo_report
<tierwatch.server.config.Settings>`) and read again at every request (see
:mod:`tierwatch.server.web.demo_report`). The page polls its ``live`` block every
:data:`POLL_S` seconds with htmx while the demo runs, while the file is absent and while it is
unreadable; a finished report stops polling.

Routes:
    GET /demo                 the report page (viewer or above); 404 page when no report is
                              configured, a waiting page while the file is absent, a 503 page
                              naming the file and what is wrong when it cannot be used;
                              the ``live`` block alone for htmx
    GET /api/v1/demo/report   the validated report (viewer or above); 404 when no report is
                              configured or the file is absent, 503 when it cannot be used
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, Response

from tierwatch.agent.protocol import utcnow
from tierwatch.server.deps import SettingsDep
from tierwatch.server.security import ErrorOut, Principal, error_responses, require_role
from tierwatch.server.web import demo_report
from tierwatch.server.web.deps import ViewerPageDep, WebError, WebRoute, is_htmx
from tierwatch.server.web.templating import templates

router = APIRouter(include_in_schema=False, route_class=WebRoute)
api_router = APIRouter(prefix="/api/v1", tags=["demo"], responses=error_responses(401, 403))

POLL_S = 5.0
STALE_AFTER_S = 60.0
RETRY_AFTER_S = 5
HEADERS = {"Vary": "HX-Request", "Cache-Control": "no-store"}
NOT_CONFIGURED = (
    "This server shows no demo report: start `make demo` (it runs the server with "
    "TIERWATCH_DEMO_REPORT=var/demo-report.json), or set TIERWATCH_DEMO_REPORT to the "
    "report's path and restart the server."
)

ViewerDep = Annotated[Principal, Depends(require_role("viewer"))]


@router.get("/demo")
def demo_page(request: Request, viewer: ViewerPageDep, settings: SettingsDep) -> Response:
    """The demo's headline numbers, tiers, measured costs, failures and loss curve.

    Raises:
        WebError: 404 when ``TIERWATCH_DEMO_REPORT`` is not set.
    """
    path = settings.demo_report
    if path is None:
        raise WebError(404, "No demo report", NOT_CONFIGURED)
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
    headers = dict(HEADERS)
    try:
        report = demo_report.read_report(path)
    except demo_report.ReportAbsent:
        context["state"] = "absent"
    except demo_report.ReportInvalid as exc:
        context.update(state="invalid", problem=exc.problem, errors=exc.errors,
                       hint=demo_report.MID_WRITE_HINT)
        status_code = 503
        headers["Retry-After"] = str(RETRY_AFTER_S)
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


def _report_path(settings: SettingsDep) -> Path:
    if settings.demo_report is None:
        raise HTTPException(status_code=404, detail=NOT_CONFIGURED)
    return settings.demo_report


@api_router.get(
    "/demo/report",
    response_model=demo_report.DemoReport,
    responses={
        **error_responses(404),
        503: {"model": ErrorOut, "description": "the report file is unreadable, not JSON or "
              "not a demo report: the detail names the file and what is wrong (retry: the "
              "demo rewrites it while it runs)"},
    },
)
def get_demo_report(_: ViewerDep, path: Annotated[Path, Depends(_report_path)]) -> Any:
    """The report ``make demo`` writes (``TIERWATCH_DEMO_REPORT``), read now and validated
    against the version-1 schema; fields the schema does not know are passed through.

    Raises:
        HTTPException: 404 when no report is configured or the file does not exist yet; 503
            (with ``Retry-After``) when it cannot be read or is not a valid report.
    """
    try:
        return demo_report.read_report(path)
    except demo_report.ReportAbsent as exc:
        raise HTTPException(
            status_code=404,
            detail=f"the demo has not written its report yet: {exc.path} does not exist "
            "(it appears once `make demo` has started training)",
        ) from exc
    except demo_report.ReportInvalid as exc:
        raise HTTPException(
            status_code=503,
            detail=f"{exc} ({demo_report.MID_WRITE_HINT})",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from exc

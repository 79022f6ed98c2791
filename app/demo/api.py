"""The demo report as JSON: ``make demo``'s ``var/demo-report.json``, read and validated.

The file is named by ``TIERWATCH_DEMO_REPORT`` and read again at every request (see
:mod:`tierwatch.server.demo.report`); the same report as a page: :mod:`tierwatch.server.demo.views`.

Route:
    GET /api/v1/demo/report   the validated report (viewer or above); 404 when no report is
                              configured or the file is absent, 503 when it cannot be used
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException

from tierwatch.server.demo import report as demo_report
from tierwatch.server.deps import SettingsDep
from tierwatch.server.security import ErrorOut, Principal, error_responses, require_role

router = APIRouter(prefix="/api/v1", tags=["demo"], responses=error_responses(401, 403))

ViewerDep = Annotated[Principal, Depends(require_role("viewer"))]


def _report_path(settings: SettingsDep) -> Path:
    if settings.demo_report is None:
        raise HTTPException(status_code=404, detail=demo_report.NOT_CONFIGURED)
    return settings.demo_report


@router.get(
    "/demo/report",
    response_model=demo_report.DemoReport,
    responses={
        **error_responses(404),
        503: {
            "model": ErrorOut,
            "description": "the report file is unreadable, not JSON or "
            "not a demo report: the detail names the file and what is wrong (retry: the "
            "demo rewrites it while it runs)",
        },
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
            headers={"Retry-After": str(demo_report.RETRY_AFTER_S)},
        ) from exc

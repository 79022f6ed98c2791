"""The checkpoint domain's dashboard page: one job's tiers, lag, advice and restores.

Route:
    GET  /jobs/{job_id}    job page (checkpoint tiers, lag, advice, events, restores);
                           fragment for htmx; 404 page for an unknown job
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import restores
from tierwatch.server.checkpoints import ledger, service
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.web.deps import (
    CHART_REFRESH_MIN_S,
    ViewerPageDep,
    WebRoute,
    render_page,
)

router = APIRouter(include_in_schema=False, route_class=WebRoute)


@router.get("/jobs/{job_id}")
def job_page(
    request: Request,
    job_id: str,
    viewer: ViewerPageDep,
    session: SessionDep,
    settings: SettingsDep,
) -> Response:
    """One job: tiers side by side (newest committed step, lag, size, speed, interval
    advice), work at risk, a chart of training vs committed step, events and restores.

    Raises:
        NotFoundError: no job has that id (answered with the 404 page).
    """
    job = service.get_job(session, job_id)
    return render_page(
        request,
        "pages/job.html",
        {
            "principal": viewer,
            "now": utcnow(),
            "refresh_s": settings.dashboard_refresh_s,
            "chart_refresh_s": max(CHART_REFRESH_MIN_S, settings.dashboard_refresh_s),
            "job": service.job_status(session, job),
            "tiers": ledger.TIERS,
            "restore_requests": [
                restores.request_out(session, r) for r in restores.recent_requests(session, job, 5)
            ],
            "restorable": restores.restorable_steps(session, job),
        },
        fragment=("live", "events"),
    )

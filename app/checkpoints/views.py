"""The checkpoint domain's dashboard pages: one job's tiers, lag, advice, events and
restores, and one step's events rank by rank.

Routes:
    GET  /jobs/{job_id}                      job page (checkpoint tiers, lag, advice, events
                                             per step and tier, restores); ``before_step``
                                             pages to older steps; fragment for htmx; 404
                                             page for an unknown job
    GET  /jobs/{job_id}/steps/{step}/{tier}  one step of one tier rank by rank (``show``,
                                             ``from_rank``); 404 page when the job has no
                                             such events, 422 page for a bad parameter
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Path, Query, Request, Response

from tierwatch.agent.protocol import TierName, utcnow
from tierwatch.server.actions import restores
from tierwatch.server.checkpoints import ledger, service, step_events
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.security import invalid_request
from tierwatch.server.web.deps import (
    CHART_REFRESH_MIN_S,
    ViewerPageDep,
    WebRoute,
    render_page,
)

router = APIRouter(include_in_schema=False, route_class=WebRoute)

DEFAULTS: dict[str, object] = {"show": "all", "from_rank": 0}
BeforeStep = Annotated[
    int | None,
    Query(
        ge=0,
        le=step_events.MAX_STEP,
        description="show the newest steps below this one (older steps)",
    ),
]


def job_url(job_id: str, **params: object) -> str:
    """``/jobs/<job_id>`` with the query ``params`` that are not None."""
    query = urlencode({k: v for k, v in params.items() if v is not None})
    return f"/jobs/{quote(job_id, safe='')}" + (f"?{query}" if query else "")


@router.get("/jobs/{job_id}")
def job_page(
    request: Request,
    job_id: str,
    viewer: ViewerPageDep,
    session: SessionDep,
    settings: SettingsDep,
    before_step: BeforeStep = None,
) -> Response:
    """One job: tiers side by side (newest committed step, lag, size, speed, interval
    advice), work at risk, a chart of training vs committed step, checkpoint events per
    (step, tier, kind) for the newest ``step_events.STEPS_SHOWN`` steps (below
    ``before_step`` when given), the failed ranks of the newest steps with failures, and
    restores.

    Raises:
        NotFoundError: no job has that id (answered with the 404 page).
        RequestValidationError: ``before_step`` is not a whole number 0 … 2**62 (the 422
            page).
    """
    job = service.get_job(session, job_id)
    steps = step_events.step_summaries(session, job, before_step=before_step)
    return render_page(
        request,
        "pages/job.html",
        {
            "principal": viewer,
            "now": utcnow(),
            "refresh_s": settings.dashboard_refresh_s,
            "chart_refresh_s": max(CHART_REFRESH_MIN_S, settings.dashboard_refresh_s),
            "job": service.job_status(session, job, events=False),
            "tiers": ledger.TIERS,
            "poll_url": job_url(job.job_id, before_step=before_step),
            "before_step": before_step,
            "steps": steps,
            "older_url": (
                job_url(job.job_id, before_step=steps["older_before_step"])
                if steps["older_before_step"] is not None
                else None
            ),
            "failures": step_events.failure_summaries(session, job),
            "restore_requests": [
                restores.request_out(session, r) for r in restores.recent_requests(session, job, 5)
            ],
            "restorable": restores.restorable_steps(session, job),
        },
        fragment=("live", "events"),
    )


@router.get("/jobs/{job_id}/steps/{step}/{tier}")
def step_page(
    request: Request,
    job_id: str,
    step: Annotated[int, Path(ge=0, le=step_events.MAX_STEP, description="the training step")],
    tier: Annotated[TierName, Path(description="memory, peer or persistent")],
    viewer: ViewerPageDep,
    session: SessionDep,
    show: Annotated[
        step_events.Show,
        Query(description="all ranks, the failed ones, or those without a committed event"),
    ] = "all",
    from_rank: Annotated[
        int, Query(ge=0, le=step_events.MAX_RANK, description="first rank shown")
    ] = 0,
) -> Response:
    """One step of one tier of a job, rank by rank, :data:`step_events.RANKS_PAGE` ranks a
    page: each rank's staged, committed, failed and evicted events (time, seconds,
    blocking time, size, message), above them the step's per-kind summary.

    Raises:
        NotFoundError: no such job, or it has no events of that step in that tier (the
            404 page).
        RequestValidationError: a step, tier, ``show`` or ``from_rank`` out of range, or
            ``from_rank`` at or beyond the step's world size (the 422 page names it).
    """
    job = service.get_job(session, job_id)
    try:
        page = step_events.rank_events(
            session, job, step=step, tier=tier, show=show, from_rank=from_rank
        )
    except step_events.BadQuery as exc:
        raise invalid_request(("query", "from_rank"), str(exc)) from exc
    base = f"{job_url(job.job_id)}/steps/{step}/{tier}"

    def page_url(**params: object) -> str:
        """This page's URL with other ``show``/``from_rank`` (defaults left out)."""
        merged = {"show": show, "from_rank": 0, **params}
        query = urlencode(
            {k: v for k, v in merged.items() if v is not None and v != DEFAULTS.get(k)}
        )
        return base + (f"?{query}" if query else "")

    return render_page(
        request,
        "pages/job_step.html",
        {
            "principal": viewer,
            "now": utcnow(),
            "job_id": job.job_id,
            "job_url": job_url(job.job_id),
            "page": page,
            "page_url": page_url,
            "shows": step_events.SHOWS,
            "next_url": page_url(from_rank=page["next_from_rank"])
            if page["next_from_rank"] is not None
            else None,
        },
        fragment=("ranks",),
    )

"""Jobs REST API under /api/v1: checkpoint tiers, lag, interval advice, chart history, and
checkpoint events per (step, tier, kind) and per rank.

People read (``ReaderDep``: viewer, operator or admin); agent tokens get 403, as on every read.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from pydantic import AwareDatetime

from tierwatch.agent.protocol import TierName, utcnow
from tierwatch.server.checkpoints import service, step_events
from tierwatch.server.checkpoints.models import Job
from tierwatch.server.checkpoints.schemas import (
    JobHistoryOut,
    JobOut,
    JobStepsOut,
    JobSummaryOut,
    StepRanksOut,
)
from tierwatch.server.deps import SessionDep
from tierwatch.server.security import ReaderDep, error_responses, invalid_request

router = APIRouter(prefix="/api/v1", tags=["jobs"], responses=error_responses(401, 422))

JobIdPath = Annotated[
    str,
    Path(
        pattern=service.JOB_ID_PATTERN,
        max_length=128,
        description="job id: 1-128 letters, digits, '.', '_' or '-', starting with a letter "
        "or digit",
    ),
]
HISTORY_MAX_RANGE = timedelta(days=31)


def valid_job(job_id: JobIdPath, session: SessionDep) -> Job:
    """The job named in the path.

    Raises:
        HTTPException: 404 for an unknown job (a malformed id is a 422 from the path check).
    """
    try:
        return service.get_job(session, job_id)
    except service.NotFoundError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc


JobDep = Annotated[Job, Depends(valid_job)]


@router.get("/jobs", response_model=list[JobSummaryOut])
def list_jobs(_: ReaderDep, session: SessionDep) -> list[dict]:
    """Every job: current step and each tier's newest committed step and lag, worst lag."""
    return service.list_jobs(session)


@router.get("/jobs/{job_id}", response_model=JobOut, responses=error_responses(404))
def get_job(_: ReaderDep, job: JobDep, session: SessionDep) -> dict:
    """One job: per tier (memory, peer, persistent) newest committed step, lag in steps
    and seconds, size, blocking time, throughput and interval advice (Young τ = √(2δM),
    Daly 2006); work at risk per failure class; recent checkpoint events and restores."""
    return service.job_status(session, job)


@router.get("/jobs/{job_id}/history", response_model=JobHistoryOut, responses=error_responses(404))
def get_history(
    _: ReaderDep,
    job: JobDep,
    session: SessionDep,
    since: AwareDatetime | None = None,
    until: AwareDatetime | None = None,
) -> dict:
    """Training step and newest committed step per tier over ``[since, until]`` (default:
    the last 15 minutes; at most 31 days), for the job page's chart.

    Raises:
        RequestValidationError: 422 when ``since`` is after ``until`` or the range exceeds
            31 days.
    """
    until = until or utcnow()
    since = since or until - timedelta(minutes=15)
    if since > until:
        raise invalid_request(("query", "since"), "since must not be after until")
    if until - since > HISTORY_MAX_RANGE:
        raise invalid_request(
            ("query", "since"), "the range from since to until may span at most 31 days"
        )
    return service.job_history(session, job, since=since, until=until)


@router.get("/jobs/{job_id}/steps", response_model=JobStepsOut, responses=error_responses(404))
def get_steps(
    _: ReaderDep,
    job: JobDep,
    session: SessionDep,
    before_step: Annotated[
        int | None, Query(ge=0, le=step_events.MAX_STEP, description="only steps below this one")
    ] = None,
    limit: Annotated[
        int, Query(ge=1, le=step_events.STEPS_MAX, description="steps (newest first)")
    ] = step_events.STEPS_SHOWN,
) -> dict:
    """The job's checkpoint events of its newest ``limit`` steps (below ``before_step``),
    aggregated per (step, tier, kind): ranks that reported out of world_size, the missing
    (or failed) ranks as ranges, the slowest rank, min/median/max ``seconds``, median/max
    ``blocking_s``, size, first/last time. Pass ``older_before_step`` back as
    ``before_step`` for older steps."""
    out = step_events.step_summaries(session, job, before_step=before_step, limit=limit)
    return {"job_id": job.job_id, **out}


@router.get(
    "/jobs/{job_id}/steps/{step}/{tier}",
    response_model=StepRanksOut,
    responses=error_responses(404),
)
def get_step_ranks(
    _: ReaderDep,
    job: JobDep,
    session: SessionDep,
    step: Annotated[int, Path(ge=0, le=step_events.MAX_STEP, description="the training step")],
    tier: Annotated[TierName, Path(description="memory, peer or persistent")],
    show: Annotated[
        step_events.Show,
        Query(description="all ranks, the failed ones, or those without a committed event"),
    ] = "all",
    from_rank: Annotated[int, Query(ge=0, le=step_events.MAX_RANK, description="first rank")] = 0,
) -> dict:
    """One step of one tier rank by rank, ``step_events.RANKS_PAGE`` ranks a page (pass
    ``next_from_rank`` back as ``from_rank``), with the step's per-kind summary.

    Raises:
        HTTPException: 404 when the job has no events of that step in that tier.
        RequestValidationError: 422 for ``from_rank`` at or beyond the step's world size.
    """
    try:
        return step_events.rank_events(
            session, job, step=step, tier=tier, show=show, from_rank=from_rank
        )
    except service.NotFoundError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc
    except step_events.BadQuery as exc:
        raise invalid_request(("query", "from_rank"), str(exc)) from exc

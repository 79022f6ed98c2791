"""Jobs REST API under /api/v1: checkpoint tiers, lag, interval advice, chart history.

Any valid token may read (agent tokens included), like the fleet reads.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path
from pydantic import AwareDatetime

from tierwatch.agent.protocol import utcnow
from tierwatch.server.checkpoints import service
from tierwatch.server.checkpoints.models import Job
from tierwatch.server.checkpoints.schemas import JobHistoryOut, JobOut, JobSummaryOut
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

"""The agent-facing API: reports in, acks (and later commands) out."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from tierwatch.agent.protocol import ReportAck, ReportBatch, utcnow
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.ingest import service
from tierwatch.server.security import AgentDep

router = APIRouter(prefix="/api/v1/ingest", tags=["ingest"])


@router.post("/report", response_model=ReportAck)
def report(
    batch: ReportBatch, principal: AgentDep, session: SessionDep, settings: SettingsDep
) -> ReportAck:
    """Store one agent batch (idempotent on node + epoch + seq).

    Raises:
        HTTPException: 403 when the token is bound to another node.
    """
    if batch.node != principal.node:
        raise HTTPException(
            status_code=403,
            detail=f"this agent token is bound to node {principal.node!r} and cannot report "
            f"for {batch.node!r}: create a token with `tierwatch-server token create "
            f"--role agent --node {batch.node}`",
        )
    return service.ingest_report(session, batch=batch, settings=settings, now=utcnow())

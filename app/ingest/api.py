"""The agent-facing API: reports in; acks, with the node's pending commands, out."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from tierwatch.agent.protocol import ReportAck, ReportBatch, utcnow
from tierwatch.server.checkpoints import ingest as checkpoint_ingest
from tierwatch.server.config import Settings
from tierwatch.server.fleet import ingest as fleet_ingest
from tierwatch.server.ingest.writer import IngestUnavailable, IngestWriter
from tierwatch.server.security import AgentDep, error_responses

router = APIRouter(prefix="/api/v1/ingest", tags=["ingest"])


_BODY_SCHEMA = {
    "required": True,
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReportBatch"}}},
}


@router.post(
    "/report",
    response_model=ReportAck,
    responses=error_responses(401, 403, 413, 422, 503),
    openapi_extra={"requestBody": _BODY_SCHEMA},
)
async def report(principal: AgentDep, request: Request) -> ReportAck | Response:
    """Store one agent batch (idempotent on node + epoch + seq); answers once it is stored.

    The body is a ``ReportBatch``, parsed straight from the raw bytes by pydantic (this is
    the hot path; FastAPI's own body handling would parse the JSON twice over).

    Raises:
        RequestValidationError: 422 with each wrong field's path.
        HTTPException: 403 when the token is bound to another node; 503 with
            ``Retry-After`` (seconds) when the server is stopping, could not store the batch,
            or holds ``TIERWATCH_INGEST_MAX_QUEUE`` reports already (the batch is shed).
    """
    try:
        body = await request.body()
    except ClientDisconnect:
        # The agent gave up before its body was read (it retries from its spool): no error.
        return Response(status_code=499)
    try:
        batch = ReportBatch.model_validate_json(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        ) from exc
    settings: Settings = request.app.state.settings
    errors = fleet_ingest.timestamp_errors(
        batch, now=utcnow(), max_ahead_s=settings.max_clock_skew_s
    )
    errors += checkpoint_ingest.report_errors(batch)
    if errors:
        raise RequestValidationError(errors)
    if batch.node != principal.node:
        raise HTTPException(
            status_code=403,
            detail=f"this agent token is bound to node {principal.node!r} and cannot report "
            f"for {batch.node!r}: create a token with `tierwatch-server token create "
            f"--role agent --node {batch.node}`",
        )
    writer: IngestWriter = request.app.state.ingest_writer
    try:
        return await writer.submit(batch)
    except IngestUnavailable as exc:
        raise HTTPException(
            status_code=503, detail=str(exc), headers={"Retry-After": str(exc.retry_after_s)}
        ) from exc

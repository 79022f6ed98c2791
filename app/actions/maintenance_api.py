"""Maintenance-window REST API under /api/v1 (see :mod:`~tierwatch.server.actions.maintenance`).

Roles: any person's token reads the windows; opening and ending one needs operator. Agents
may do neither.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query
from pydantic import AfterValidator

from tierwatch.agent.protocol import _no_nul, utcnow
from tierwatch.server.actions import maintenance
from tierwatch.server.actions.schemas import MaintenanceList, MaintenanceOut, ReasonIn
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.security import OperatorDep, ReaderDep, error_responses

router = APIRouter(prefix="/api/v1", tags=["maintenance"], responses=error_responses(401, 422))
NodeFilter = Annotated[str, AfterValidator(_no_nul)]
WindowId = Annotated[int, Path(ge=1, le=2**31 - 1)]


@router.get("/maintenance", response_model=MaintenanceList)
def list_maintenance(
    _: ReaderDep,
    session: SessionDep,
    node: Annotated[NodeFilter | None, Query(max_length=128)] = None,
    include_over: bool = False,
) -> dict:
    """Maintenance windows newest first: the scheduled and active ones (``include_over``:
    the 200 newest of all); ``node`` keeps that node's windows and the cluster's."""
    now = utcnow()
    windows = maintenance.list_windows(session, now=now, node=node, include_over=include_over)
    return {"windows": [maintenance.window_out(w, now) for w in windows]}


@router.post(
    "/maintenance",
    response_model=MaintenanceOut,
    status_code=201,
    responses=error_responses(400, 403, 404, 409, 413),
)
def start_maintenance(
    principal: OperatorDep,
    body: maintenance.MaintenanceIn,
    session: SessionDep,
    settings: SettingsDep,
) -> dict:
    """Open a maintenance window on a node (``node``) or the whole cluster (no ``node``):
    while it is active the policy does not isolate the node and its alerts are recorded but
    not delivered. Needs operator; audited (``maintenance_start``).

    Raises:
        HTTPException: 404 unknown node; 409 a start in the past, an end before the start
            or a window longer than ``TIERWATCH_POLICY__MAINTENANCE_MAX_S``; 422 bad body
            (exactly one of ``ends_at`` and ``duration_s``).
    """
    now = utcnow()
    try:
        window = maintenance.start(
            session,
            body,
            actor=principal.actor,
            role=principal.role,
            now=now,
            max_s=settings.policy.maintenance_max_s,
        )
    except LookupError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc
    except maintenance.MaintenanceRefused as exc:
        session.commit()  # keep the audit entry of the refusal
        raise HTTPException(status_code=409, detail=str(exc)) from exc
    session.commit()
    return maintenance.window_out(window, now)


@router.post(
    "/maintenance/{window_id}/end",
    response_model=MaintenanceOut,
    responses=error_responses(400, 403, 404, 413),
)
def end_maintenance(
    principal: OperatorDep, window_id: WindowId, body: ReasonIn, session: SessionDep
) -> dict:
    """End a window now (one already over changes nothing, audited ``noop``). Needs operator;
    audited (``maintenance_end``).

    Raises:
        HTTPException: 404 unknown window; 422 missing reason.
    """
    now = utcnow()
    try:
        window, _ = maintenance.end(
            session,
            window_id,
            actor=principal.actor,
            role=principal.role,
            reason=body.reason,
            now=now,
        )
    except LookupError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc
    session.commit()
    return maintenance.window_out(window, now)

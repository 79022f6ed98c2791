"""Actions REST API under /api/v1: isolate, release, restore, commands, audit, policy.

Roles: reading (commands, audit, policy, restore requests) needs any token; isolate,
release and restore need operator; changing the policy needs admin.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request
from pydantic import AfterValidator, AwareDatetime
from sqlalchemy import select

from tierwatch.agent.protocol import _no_nul, utcnow
from tierwatch.server.actions import audit, isolation, policy, queue, restores
from tierwatch.server.actions.models import CommandRow, RestoreRequest
from tierwatch.server.actions.schemas import (
    AuditOut,
    CommandOut,
    IsolationOut,
    PolicyOut,
    ReasonIn,
    RestoreIn,
    RestoreRequestOut,
)
from tierwatch.server.actions.settings import PolicyUpdate
from tierwatch.server.checkpoints import service as checkpoint_service
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.fleet import service as fleet_service
from tierwatch.server.fleet.api import NodeDep
from tierwatch.server.fleet.models import Node
from tierwatch.server.fleet.schemas import node_out
from tierwatch.server.security import (
    AdminDep,
    OperatorDep,
    Principal,
    ReaderDep,
    error_responses,
    invalid_request,
)

router = APIRouter(prefix="/api/v1", tags=["actions"], responses=error_responses(401, 422))
# Filters hold no NUL (no stored name or value does; PostgreSQL refuses one in a query).
Filter = Annotated[str, AfterValidator(_no_nul)]
BODY_ERRORS = error_responses(400, 403, 404, 413)


def _wake_drivers(request: Request) -> None:
    work = getattr(request.app.state, "background", None)
    if work is not None:
        work.wake_drivers()


def _isolation(
    request: Request,
    principal: Principal,
    node: Node,
    isolated: bool,
    body: ReasonIn,
    session: SessionDep,
    settings: SettingsDep,
) -> IsolationOut:
    now = utcnow()
    outcome = isolation.set_isolated(
        session,
        node,
        isolated,
        actor=principal.actor,
        role=principal.role,
        reason=body.reason,
        now=now,
        settings=settings,
    )
    command = queue.command_out(outcome.command, node.name) if outcome.command else None
    session.commit()
    if outcome.command is not None and outcome.command.executor == "server":
        _wake_drivers(request)
    view = fleet_service.get_node_view(session, node.name, now=now, th=settings.health)
    return IsolationOut(changed=outcome.changed, node=node_out(view), command=command)


@router.post("/nodes/{name}/isolate", response_model=IsolationOut, responses=BODY_ERRORS)
def isolate(
    request: Request,
    principal: OperatorDep,
    node: NodeDep,
    body: ReasonIn,
    session: SessionDep,
    settings: SettingsDep,
) -> IsolationOut:
    """Isolate a node: takes effect at once (the answer shows ``isolated`` with who/when/
    why) and queues the configured driver's run (``command``; ``None`` for driver
    ``none``). Isolating an isolated node changes nothing (``changed`` false, audited as
    ``noop``). Needs operator.

    Raises:
        HTTPException: 404 unknown node; 422 missing/empty reason.
    """
    return _isolation(request, principal, node, True, body, session, settings)


@router.post("/nodes/{name}/release", response_model=IsolationOut, responses=BODY_ERRORS)
def release(
    request: Request,
    principal: OperatorDep,
    node: NodeDep,
    body: ReasonIn,
    session: SessionDep,
    settings: SettingsDep,
) -> IsolationOut:
    """Release an isolated node back into service (and queue the driver's undo). Needs
    operator.

    Raises:
        HTTPException: 404 unknown node; 422 missing/empty reason.
    """
    return _isolation(request, principal, node, False, body, session, settings)


@router.get("/commands", response_model=list[CommandOut])
def list_commands(
    _: ReaderDep,
    session: SessionDep,
    node: Annotated[Filter | None, Query(max_length=128)] = None,
    state: Annotated[
        str | None, Query(pattern="^(pending|delivered|running|succeeded|failed|expired)$")
    ] = None,
    kind: Annotated[str | None, Query(pattern="^(isolate|release|restore)$")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[dict]:
    """Commands newest first, with state, attempts, exit code and output."""
    q = select(CommandRow, Node.name).join(Node, Node.id == CommandRow.node_id)
    if node:
        q = q.where(Node.name == node)
    if state:
        q = q.where(CommandRow.state == state)
    if kind:
        q = q.where(CommandRow.kind == kind)
    rows = session.execute(q.order_by(CommandRow.created_at.desc()).limit(limit)).all()
    return [queue.command_out(row, name) for row, name in rows]


@router.get("/commands/{command_id}", response_model=CommandOut, responses=error_responses(404))
def get_command(
    _: ReaderDep,
    command_id: Annotated[str, Path(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")],
    session: SessionDep,
) -> dict:
    """One command.

    Raises:
        HTTPException: 404 unknown command id.
    """
    row = session.get(CommandRow, command_id)
    if row is None:
        raise HTTPException(status_code=404, detail=f"no command has id {command_id!r}")
    node = session.get(Node, row.node_id)
    return queue.command_out(row, node.name if node else None)


def _job(session: SessionDep, job_id: str):  # noqa: ANN202 - a Job
    try:
        return checkpoint_service.get_job(session, job_id)
    except checkpoint_service.NotFoundError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc


@router.post(
    "/jobs/{job_id}/restore",
    response_model=RestoreRequestOut,
    status_code=202,
    responses={**BODY_ERRORS, **error_responses(409)},
)
def restore(
    principal: OperatorDep,
    job_id: str,
    body: RestoreIn,
    session: SessionDep,
    settings: SettingsDep,
) -> dict:
    """Roll a job back to a committed step (default: the newest some tier holds whole).

    The job's agents get a ``restore`` command; running ranks roll back in-process at one
    step boundary they agree on, ranks that are down restore the step at their next start.
    Follow it with ``GET /api/v1/restores/{id}``. Needs operator.

    Raises:
        HTTPException: 404 unknown job; 409 the step is not restorable (the message lists the
            steps that are) or the job's layout is unknown; 422 bad body.
    """
    job = _job(session, job_id)
    try:
        req = restores.request_restore(
            session,
            job,
            step=body.step,
            tier=body.tier,
            reason=body.reason,
            actor=principal.actor,
            role=principal.role,
            now=utcnow(),
            settings=settings,
        )
    except restores.RestoreRefused as exc:
        session.commit()  # keep the audit entry of the refusal
        raise HTTPException(status_code=409, detail=str(exc)) from exc
    session.commit()
    return restores.request_out(session, req)


@router.get(
    "/jobs/{job_id}/restores",
    response_model=list[RestoreRequestOut],
    responses=error_responses(404),
)
def list_restores(
    _: ReaderDep,
    job_id: str,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 20,
) -> list[dict]:
    """A job's restore requests, newest first, with per-rank progress."""
    job = _job(session, job_id)
    return [restores.request_out(session, r) for r in restores.recent_requests(session, job, limit)]


@router.get(
    "/restores/{request_id}", response_model=RestoreRequestOut, responses=error_responses(404)
)
def get_restore(
    _: ReaderDep, request_id: Annotated[int, Path(ge=1, le=2**31 - 1)], session: SessionDep
) -> dict:
    """One restore request with each rank's phase (pending, staging, loaded, failed).

    Raises:
        HTTPException: 404 unknown request.
    """
    req = session.get(RestoreRequest, request_id)
    if req is None:
        raise HTTPException(status_code=404, detail=f"no restore request has id {request_id}")
    return restores.request_out(session, req)


@router.get("/audit", response_model=list[AuditOut])
def list_audit(
    _: ReaderDep,
    session: SessionDep,
    actor: Annotated[Filter | None, Query(max_length=128)] = None,
    action: Annotated[Filter | None, Query(max_length=32)] = None,
    target_kind: Annotated[str | None, Query(pattern="^(node|job|policy|token|cluster)$")] = None,
    target: Annotated[Filter | None, Query(max_length=128)] = None,
    outcome: Annotated[Filter | None, Query(max_length=16)] = None,
    since: AwareDatetime | None = None,
    until: AwareDatetime | None = None,
    before_id: Annotated[int | None, Query(ge=1, le=2**62)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> list[dict]:
    """The audit log newest first, filtered by exact actor/action/target/outcome and a time
    range; page with ``before_id`` (the smallest id of the previous page). Every role may
    read it."""
    if since and until and since > until:
        raise invalid_request(("query", "since"), "since must not be after until")
    return [
        audit.entry_out(e)
        for e in audit.query(
            session,
            actor=actor,
            action=action,
            target_kind=target_kind,
            target=target,
            outcome=outcome,
            since=since,
            until=until,
            before_id=before_id,
            limit=limit,
        )
    ]


@router.get("/policy", response_model=PolicyOut)
def get_policy(_: ReaderDep, session: SessionDep, settings: SettingsDep) -> dict:
    """The auto-isolation policy: settings in force, the circuit breaker, recent actions."""
    return policy.status(session, settings, now=utcnow())


@router.put("/policy", response_model=PolicyOut, responses=error_responses(400, 403, 413))
def put_policy(
    principal: AdminDep, body: PolicyUpdate, session: SessionDep, settings: SettingsDep
) -> dict:
    """Change the policy (fields left out keep their value, ``null`` returns a field to its
    ``TIERWATCH_POLICY__*`` setting). Needs admin; audited.

    Raises:
        HTTPException: 422 bad values.
    """
    now = utcnow()
    policy.update(session, body, actor=principal.actor, role=principal.role, now=now)
    session.commit()
    return policy.status(session, settings, now=now)

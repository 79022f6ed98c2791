"""Fleet REST API under /api/v1: nodes, samples, events, acknowledgements."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import AwareDatetime
from pydantic_core import to_json
from starlette.responses import Response

from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import audit
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.fleet import prom_history, service
from tierwatch.server.fleet.models import METRIC_FIELDS, Node
from tierwatch.server.fleet.schemas import (
    AckIn,
    AckOut,
    EventOut,
    NodeDetailOut,
    NodeList,
    NodeOut,
    node_out,
)
from tierwatch.server.security import (
    OperatorDep,
    ReaderDep,
    error_responses,
    invalid_request,
)

router = APIRouter(prefix="/api/v1", tags=["fleet"], responses=error_responses(401, 422))

StateFilter = Annotated[
    str | None,
    Query(pattern="^(healthy|degraded|unhealthy|unreachable)$", description="effective state"),
]


def valid_node(name: str, session: SessionDep) -> Node:
    """The node named in the path.

    Raises:
        HTTPException: 404 for an unknown node.
    """
    try:
        return service.get_node(session, name)
    except service.NotFoundError as exc:
        raise HTTPException(status_code=404, detail=str(exc)) from exc


NodeDep = Annotated[Node, Depends(valid_node)]


@router.get("/nodes", response_model=NodeList)
def list_nodes(
    _: ReaderDep,
    session: SessionDep,
    settings: SettingsDep,
    state: StateFilter = None,
    name: Annotated[str | None, Query(max_length=128, description="name contains")] = None,
    limit: Annotated[
        int, Query(ge=1, le=service.NODE_PAGE_MAX, description="most nodes in this page")
    ] = service.NODE_PAGE_DEFAULT,
    cursor: Annotated[
        str | None,
        Query(max_length=256, description="the previous page's next_cursor"),
    ] = None,
) -> Response:
    """Nodes in name order, one page at a time, with effective state, reasons and their
    GPUs' latest values.

    ``counts`` has the number of nodes per state (after the name filter, before the state
    filter and the paging). ``next_cursor`` (None on the last page) fetches the next page
    with the same filters: pass it back as ``cursor``. Serialised straight from database
    rows (the shape is ``NodeList``).

    Raises:
        HTTPException: 422 for a cursor this API did not give out.
    """
    try:
        after = service.decode_cursor(cursor) if cursor else None
    except service.BadCursor as exc:
        raise invalid_request(("query", "cursor"), str(exc)) from exc
    payload = service.node_list_payload(
        session,
        now=utcnow(),
        th=settings.health,
        state=state,
        name_contains=name,
        limit=limit,
        after=after,
    )
    return Response(content=to_json(payload), media_type="application/json")


@router.get("/nodes/{name}", response_model=NodeDetailOut, responses=error_responses(404))
def get_node(_: ReaderDep, node: NodeDep, session: SessionDep, settings: SettingsDep) -> NodeOut:
    """One node, with report bookkeeping (epoch, seq range, missing batches)."""
    view = service.get_node_view(session, node.name, now=utcnow(), th=settings.health)
    return node_out(view, detail=service.report_stats(session, node))


def get_prom_history(request: Request) -> prom_history.PromHistory | None:
    """The app's Prometheus for the node charts (None: ``TIERWATCH_PROMETHEUS_URL`` unset)."""
    return getattr(request.app.state, "prom_history", None)


PromHistoryDep = Annotated[prom_history.PromHistory | None, Depends(get_prom_history)]


# The times a samples query may name (a naive year-1 or year-9999 bound overflows in UTC).
SAMPLES_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
SAMPLES_LATEST = datetime(9999, 1, 1, tzinfo=UTC)


@router.get("/nodes/{name}/samples", responses=error_responses(404))
def get_samples(
    _: ReaderDep,
    node: NodeDep,
    session: SessionDep,
    settings: SettingsDep,
    prometheus: PromHistoryDep,
    gpu: Annotated[int | None, Query(ge=0, le=255)] = None,
    metric: Annotated[str | None, Query(description="one of: " + ", ".join(METRIC_FIELDS))] = None,
    since: AwareDatetime | None = None,
    until: AwareDatetime | None = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 20_000,
    step: Annotated[
        float | None, Query(ge=1, le=3600, description="average into buckets of this many s")
    ] = None,
) -> dict:
    """Samples of a node, oldest first (default: the last 15 minutes).

    With ``step`` the rows are averaged per GPU into ``step``-second buckets (for charts of
    long ranges; counters and flags are the bucket's maximum); without it they are raw. A
    bucketed range that starts before ``TIERWATCH_SAMPLE_RETENTION_S`` reads the 5-minute
    rollups up to their newest bucket, raw rows after it (``fleet.rollups``).

    With ``TIERWATCH_PROMETHEUS_URL`` set, the history comes from Prometheus' ``query_range``
    (``source: "prometheus"``, always in buckets: ``step`` is the width used, derived from
    the range when not given; see ``fleet.prom_history``). While Prometheus is unreachable,
    slow or answers an error, and for a metric it has no DCGM series of, the rows come from
    the database instead (``source: "database"``, ``source_error`` says why).

    Returns:
        ``{"node", "metric", "step", "since", "until", "source": "prometheus" | "database",
        "samples": [{"gpu", "ts", <metrics>…}]}``, plus ``source_error`` (why not from the
        configured Prometheus) or ``source_note`` (why there are no rows from it).

    Raises:
        HTTPException: 404 for an unknown node; 422 for an unknown metric or ``since``
            after ``until``.
    """
    for loc, t in (("since", since), ("until", until)):
        # (aware comparisons never overflow; converting year 1 at +14:00 to UTC would)
        if t is not None and not SAMPLES_EARLIEST <= t <= SAMPLES_LATEST:
            raise invalid_request(
                ("query", loc), f"{loc} must be between 1970-01-01 and 9999-01-01 UTC"
            )
    until = until or utcnow()
    since = since or until - timedelta(minutes=15)
    if since > until:
        raise invalid_request(("query", "since"), "since must not be after until")
    try:
        prom_history.check_metric(metric)
    except ValueError as exc:
        raise invalid_request(("query", "metric"), str(exc)) from exc
    head = {"node": node.name, "metric": metric, "since": since, "until": until}
    source_error = None
    if prometheus is not None and not prom_history.covers(metric):
        source_error = f"Prometheus has no DCGM series of {metric}"
    elif prometheus is not None:
        try:
            history = prometheus.samples(
                node=node.name,
                gpu=gpu,
                metric=metric,
                since=since,
                until=until,
                limit=limit,
                step_s=step,
            )
        except prom_history.PrometheusError as exc:
            source_error = str(exc)
        else:
            note = {"source_note": history.note} if history.note else {}
            return {
                **head,
                "step": history.step,
                "source": "prometheus",
                **note,
                "samples": history.samples,
            }
    try:
        rows = service.query_samples(
            session,
            node,
            gpu=gpu,
            metric=metric,
            since=since,
            until=until,
            limit=limit,
            step_s=step,
            # older than this the raw rows are gone: long ranges read the 5-minute rollups
            raw_since=utcnow() - timedelta(seconds=settings.sample_retention_s),
        )
    except ValueError as exc:
        raise invalid_request(("query", "metric"), str(exc)) from exc
    error = {"source_error": source_error} if source_error else {}
    return {**head, "step": step, "source": "database", **error, "samples": rows}


@router.get("/events", response_model=list[EventOut], responses=error_responses(404))
def list_events(
    _: ReaderDep,
    session: SessionDep,
    node: Annotated[str | None, Query(max_length=128)] = None,
    kind: Annotated[str | None, Query(pattern="^(xid|state|agent|ack)$")] = None,
    since: AwareDatetime | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
) -> list[EventOut]:
    """Events newest first: XIDs (with catalog mnemonic/action), state changes, agent events."""
    node_row = valid_node(node, session) if node else None
    return [
        EventOut(
            id=e.id,
            node=name,
            kind=e.kind,
            gpu=e.gpu_index,
            code=e.code,
            ts=e.ts,
            severity=e.severity,
            message=e.message,
            data=e.data or {},
        )
        for e, name in service.query_events(
            session, node=node_row, kind=kind, since=since, limit=limit
        )
    ]


@router.post(
    "/nodes/{name}/ack", response_model=AckOut, responses=error_responses(400, 403, 404, 413)
)
def acknowledge(
    principal: OperatorDep,
    node: NodeDep,
    session: SessionDep,
    settings: SettingsDep,
    body: AckIn | None = None,
) -> AckOut:
    """Acknowledge (clear) a node's reasons; needs the operator role. No body: all of them."""
    body = body or AckIn()
    now = utcnow()
    cleared = service.acknowledge(
        session, node, rule=body.rule, gpu=body.gpu, actor=principal.actor, note=body.note, now=now
    )
    audit.record(
        session,
        actor=principal.actor,
        role=principal.role,
        action="ack",
        target_kind="node",
        target=node.name,
        reason=body.note,
        outcome="ok" if cleared else "noop",
        now=now,
        detail={"cleared": cleared, "rule": body.rule, "gpu": body.gpu},
    )
    session.commit()
    view = service.get_node_view(session, node.name, now=now, th=settings.health)
    return AckOut(cleared=cleared, node=node_out(view))

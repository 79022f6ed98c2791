"""The fleet's dashboard pages: the cluster grid and the node page (htmx fragments too).

Routes hold no logic: they check who is asking, call the fleet service and render a
template; each page URL also serves its ``live`` part as an htmx fragment
(:func:`~tierwatch.server.web.deps.render_page`).

Routes:
    GET  /                 cluster page; ``state`` and ``name`` filter; fragment for htmx,
                           and for its poll (``since``) only what changed
    GET  /nodes/{name}     node page; fragment for htmx; 404 page for an unknown node
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request, Response

from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import maintenance, policy, queue
from tierwatch.server.checkpoints import service as checkpoint_service
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.fleet import cluster_live, rules, schemas, service
from tierwatch.server.web.deps import (
    CHART_REFRESH_MIN_S,
    ViewerPageDep,
    WebRoute,
    render_page,
)

router = APIRouter(include_in_schema=False, route_class=WebRoute)

NAME_FILTER_MAX = 128


# --- cluster page --------------------------------------------------------------------------


@router.get("/")
def cluster_page(
    request: Request,
    viewer: ViewerPageDep,
    session: SessionDep,
    settings: SettingsDep,
    state: Annotated[str | None, Query()] = None,
    name: Annotated[str | None, Query()] = None,
    since: Annotated[str | None, Query(max_length=cluster_live.SINCE_MAX)] = None,
) -> Response:
    """Counts per state that filter, the nodes that need attention, a grid of nodes coloured
    by state (filtered by state and name), and the jobs with their worst checkpoint lag.

    ``since`` is the version the polling page shows: its htmx poll gets 204 when nothing
    changed, or only the changed parts (:mod:`~tierwatch.server.fleet.cluster_live`).
    """
    state = state if state in service.STATES else None
    name = (name or "").strip()[:NAME_FILTER_MAX] or None
    now = utcnow()
    counts, tiles = service.cluster_tiles(
        session, now=now, th=settings.health, state=state, name_contains=name
    )
    filters = {k: v for k, v in (("state", state), ("name", name)) if v}
    return cluster_live.cluster_response(
        request,
        since=since,
        state=state,
        name=name,
        counts=counts,
        tiles=tiles,
        context={
            "principal": viewer,
            "now": now,
            "refresh_s": settings.dashboard_refresh_s,
            "states": service.STATES,
            "poll_url": "/" + (f"?{urlencode(filters)}" if filters else ""),
            "name_query": urlencode({"name": name}) if name else "",
            "jobs": checkpoint_service.list_jobs(session),
            "policy": policy.status(session, settings, now=now),
        },
    )


# --- node page -----------------------------------------------------------------------------


@router.get("/nodes/{name}")
def node_page(
    request: Request,
    name: str,
    viewer: ViewerPageDep,
    session: SessionDep,
    settings: SettingsDep,
) -> Response:
    """One node: state, reasons with actions, GPU table, charts, XID and state events.

    Raises:
        NotFoundError: no node has that name (answered with the 404 page).
    """
    now = utcnow()
    view = service.get_node_view(session, name, now=now, th=settings.health)
    node = schemas.node_out(view)  # the fields GET /api/v1/nodes/{name} shows
    return render_page(
        request,
        "pages/node.html",
        {
            "principal": viewer,
            "now": now,
            "refresh_s": settings.dashboard_refresh_s,
            "chart_refresh_s": max(CHART_REFRESH_MIN_S, settings.dashboard_refresh_s),
            # where the charts' history comes from (node-charts.js updates it per answer)
            "chart_source": "prometheus" if settings.prometheus_url else "database",
            "node": node,
            "maintenance": maintenance.active(session, now).covering(view.node.name),
            "reasons": service.sort_reasons(node.reasons),
            "describe_action": rules.describe_action,
            "xids": service.xid_rows(session, view.node),
            "state_events": service.recent_events(
                session, view.node, "state", service.STATE_EVENT_LIMIT
            ),
            "agent_events": service.recent_events(
                session, view.node, "agent", service.AGENT_EVENT_LIMIT
            ),
            "commands": queue.recent_node_commands(session, view.node),
        },
        fragment=("live", "events"),
    )

"""Dashboard pages and htmx fragments: sign-in, the cluster grid and the node page.

Routes hold no logic: they check who is asking, call the fleet and web services and render a
template. A page URL also serves its live part as a fragment: an htmx request (``HX-Request``
without ``HX-Boosted``/history restore) gets only the page's ``live`` block, rendered with
jinja2-fragments, and every such response carries ``Vary: HX-Request``.

Routes:
    GET  /login            sign-in form (``next`` = page to return to)
    POST /login            check the token, start the session (CSRF-checked)
    POST /logout           end the session (CSRF-checked)
    GET  /                 cluster page; ``state`` and ``name`` filter; fragment for htmx
    GET  /nodes/{name}     node page; fragment for htmx; 404 page for an unknown node
    GET  /jobs/{job_id}    job page (checkpoint tiers, lag, advice, events, restores);
                           fragment for htmx; 404 page for an unknown job
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Query, Request, Response
from fastapi.responses import RedirectResponse

from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import policy, restores
from tierwatch.server.checkpoints import ledger
from tierwatch.server.checkpoints import service as checkpoint_service
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.fleet import rules
from tierwatch.server.fleet import service as fleet_service
from tierwatch.server.security import SESSION_TOKEN_KEY, principal_from_request
from tierwatch.server.tokens import lookup_token
from tierwatch.server.web import service
from tierwatch.server.web.csrf import CsrfDep, rotate_csrf_token
from tierwatch.server.web.deps import ViewerPageDep, WebRoute, is_htmx, safe_next
from tierwatch.server.web.templating import templates

router = APIRouter(include_in_schema=False, route_class=WebRoute)

NAME_FILTER_MAX = 128
CHART_REFRESH_MIN_S = 5.0
VARY = {"Vary": "HX-Request", "Cache-Control": "no-store"}


def _render(
    request: Request,
    name: str,
    context: dict[str, Any],
    *,
    fragment: tuple[str, ...] = ("live",),
) -> Response:
    """The whole page, or only its ``fragment`` blocks for an htmx fragment request."""
    if is_htmx(request):
        return templates.TemplateResponse(
            request, name, context, headers=VARY, block_names=list(fragment)
        )
    return templates.TemplateResponse(request, name, context, headers=VARY)


# --- sign-in -------------------------------------------------------------------------------


def _login_form(
    request: Request, *, next_url: str, error: str | None = None, status_code: int = 200
) -> Response:
    return templates.TemplateResponse(
        request,
        "pages/login.html",
        {"next": next_url, "error": error, "principal": None},
        status_code=status_code,
        headers={"Cache-Control": "no-store"},
    )


@router.get("/login")
def login_page(
    request: Request,
    next_url: Annotated[str | None, Query(alias="next", max_length=2048)] = None,
) -> Response:
    """The sign-in form; a caller already signed in goes straight on to ``next``."""
    target = safe_next(next_url)
    if principal_from_request(request) is not None:
        return RedirectResponse(target, status_code=303)
    return _login_form(request, next_url=target)


@router.post("/login")
def login(
    request: Request,
    session: SessionDep,
    _: CsrfDep,
    token: Annotated[str, Form(max_length=512)] = "",
    next_url: Annotated[str, Form(alias="next", max_length=2048)] = "/",
) -> Response:
    """Check the token and keep it in the signed session cookie.

    Answers 303 to ``next`` on success; the form again with 401 and a message otherwise;
    429 once a client address failed ``login_attempts`` times within ``login_window_s``.
    """
    target = safe_next(next_url)
    limiter = request.app.state.login_limiter
    client = request.client.host if request.client else "unknown"
    if limiter.blocked(client):
        return _login_form(
            request,
            next_url=target,
            error=f"Too many failed sign-ins from this address: wait {limiter.window_s} s "
            "and try again.",
            status_code=429,
        )
    token = token.strip()
    if not token:
        return _login_form(request, next_url=target, error="Enter an API token.", status_code=401)
    row = lookup_token(session, token)
    if row is None or row.role == "agent":
        limiter.failed(client)
    if row is None:
        return _login_form(
            request,
            next_url=target,
            error="That token is not valid: it is unknown or has been revoked. "
            "Create one with `tierwatch-server token create --role viewer`.",
            status_code=401,
        )
    if row.role == "agent":
        return _login_form(
            request,
            next_url=target,
            error="Agent tokens cannot sign in to the dashboard; use a viewer, operator or "
            "admin token.",
            status_code=401,
        )
    request.session.clear()
    request.session[SESSION_TOKEN_KEY] = token
    rotate_csrf_token(request)
    return RedirectResponse(target, status_code=303)


@router.post("/logout")
def logout(request: Request, _: CsrfDep) -> Response:
    """End the dashboard session."""
    request.session.clear()
    rotate_csrf_token(request)
    return RedirectResponse("/login", status_code=303)


# --- cluster page --------------------------------------------------------------------------


@router.get("/")
def cluster_page(
    request: Request,
    viewer: ViewerPageDep,
    session: SessionDep,
    settings: SettingsDep,
    state: Annotated[str | None, Query()] = None,
    name: Annotated[str | None, Query()] = None,
) -> Response:
    """Counts per state, a grid of nodes coloured by state (filtered by state and name), and
    the jobs with their worst checkpoint lag."""
    state = state if state in fleet_service.STATES else None
    name = (name or "").strip()[:NAME_FILTER_MAX] or None
    now = utcnow()
    counts, tiles = service.cluster_tiles(
        session, now=now, th=settings.health, state=state, name_contains=name
    )
    filters = {k: v for k, v in (("state", state), ("name", name)) if v}
    return _render(
        request,
        "pages/cluster.html",
        {
            "principal": viewer,
            "now": now,
            "refresh_s": settings.dashboard_refresh_s,
            "counts": counts,
            "total": sum(counts.values()),
            "tiles": tiles,
            "state": state,
            "name": name or "",
            "states": fleet_service.STATES,
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
    view = fleet_service.get_node_view(session, name, now=now, th=settings.health)
    node = view.node
    return _render(
        request,
        "pages/node.html",
        {
            "principal": viewer,
            "now": now,
            "refresh_s": settings.dashboard_refresh_s,
            "chart_refresh_s": max(CHART_REFRESH_MIN_S, settings.dashboard_refresh_s),
            "view": view,
            "node": node,
            "reasons": service.sort_reasons(view.reasons),
            "describe_action": rules.describe_action,
            "throttle_names": fleet_service.throttle_names,
            "xids": service.xid_rows(session, node),
            "state_events": service.recent_events(
                session, node, "state", service.STATE_EVENT_LIMIT
            ),
            "agent_events": service.recent_events(
                session, node, "agent", service.AGENT_EVENT_LIMIT
            ),
            "commands": service.recent_commands(session, node),
        },
        fragment=("live", "events"),
    )


# --- job page ------------------------------------------------------------------------------


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
    job = checkpoint_service.get_job(session, job_id)
    return _render(
        request,
        "pages/job.html",
        {
            "principal": viewer,
            "now": utcnow(),
            "refresh_s": settings.dashboard_refresh_s,
            "chart_refresh_s": max(CHART_REFRESH_MIN_S, settings.dashboard_refresh_s),
            "job": checkpoint_service.job_status(session, job),
            "tiers": ledger.TIERS,
            "restore_requests": [
                restores.request_out(session, r) for r in restores.recent_requests(session, job, 5)
            ],
            "restorable": restores.restorable_steps(session, job),
        },
        fragment=("live", "events"),
    )

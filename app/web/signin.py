"""Signing in to the dashboard and out again: the session every page relies on.

A viewer, operator or admin token submitted to the form starts a server-side session
(:mod:`tierwatch.server.web.sessions`): the signed cookie gets only its opaque id, never the
token. Agent tokens, and revoked or expired ones, cannot sign in. Signing out deletes the
session, so a copy of the cookie stops working too. Each sign-in and sign-out rotates the
session's CSRF token. Failed sign-ins are counted per client address (``LoginLimiter``).

Routes:
    GET  /login            sign-in form (``next`` = page to return to)
    POST /login            check the token, start the session (CSRF-checked)
    POST /logout           end the session (CSRF-checked)
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query, Request, Response
from fastapi.responses import RedirectResponse

from tierwatch.agent.protocol import utcnow
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.security import SESSION_ID_KEY, principal_from_request
from tierwatch.server.tokens import find_token
from tierwatch.server.web import sessions as web_sessions
from tierwatch.server.web.csrf import CsrfDep, rotate_csrf_token
from tierwatch.server.web.deps import WebRoute, safe_next
from tierwatch.server.web.templating import templates

router = APIRouter(include_in_schema=False, route_class=WebRoute)


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
    settings: SettingsDep,
    _: CsrfDep,
    token: Annotated[str, Form(max_length=512)] = "",
    next_url: Annotated[str, Form(alias="next", max_length=2048)] = "/",
) -> Response:
    """Check the token and start a session (its id goes into the signed cookie).

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
    now = utcnow()
    row = find_token(session, token)
    status = row.status(now) if row is not None else "unknown"
    if status != "active" or (row is not None and row.role == "agent"):
        limiter.failed(client)
    if row is None or status == "revoked":
        return _login_form(
            request,
            next_url=target,
            error="That token is not valid: it is unknown or has been revoked. "
            "Create one with `tierwatch-server token create --role viewer`.",
            status_code=401,
        )
    if status == "expired":
        return _login_form(
            request,
            next_url=target,
            error=f"That token expired at {row.expires_at:%Y-%m-%d %H:%M} UTC. Create a new "
            "one with `tierwatch-server token create --role viewer`.",
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
    previous = request.session.get(SESSION_ID_KEY)
    if isinstance(previous, str) and previous:
        web_sessions.end_session(session, previous)
    request.session.clear()
    request.session[SESSION_ID_KEY] = web_sessions.start_session(
        session,
        token_id=row.id,
        ttl_s=settings.session_ttl_s,
        now=now,
        token_expires_at=row.expires_at,
    )
    session.commit()  # before the redirect: the next request must find the session
    rotate_csrf_token(request)
    return RedirectResponse(target, status_code=303)


@router.post("/logout")
def logout(request: Request, session: SessionDep, _: CsrfDep) -> Response:
    """End the dashboard session: its row is deleted, so a copy of the cookie is refused."""
    session_id = request.session.get(SESSION_ID_KEY)
    if isinstance(session_id, str) and session_id:
        web_sessions.end_session(session, session_id)
        session.commit()  # ended before the answer says so
    request.session.clear()
    rotate_csrf_token(request)
    return RedirectResponse("/login", status_code=303)

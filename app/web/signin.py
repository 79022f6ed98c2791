"""Signing in to the dashboard and out again: the session every page relies on.

A viewer, operator or admin token submitted to the form is kept in the signed session
cookie (agent tokens cannot sign in); each sign-in and sign-out rotates the session's CSRF
token. Failed sign-ins are counted per client address (``LoginLimiter``).

Routes:
    GET  /login            sign-in form (``next`` = page to return to)
    POST /login            check the token, start the session (CSRF-checked)
    POST /logout           end the session (CSRF-checked)
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query, Request, Response
from fastapi.responses import RedirectResponse

from tierwatch.server.deps import SessionDep
from tierwatch.server.security import SESSION_TOKEN_KEY, principal_from_request
from tierwatch.server.tokens import lookup_token
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

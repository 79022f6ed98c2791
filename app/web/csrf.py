"""CSRF protection for the dashboard's state-changing requests (synchronizer token).

A random token lives in the signed session cookie (``request.session["csrf"]``); every page
renders it into its forms as the hidden field ``csrf_token`` and into ``hx-headers`` as
``X-CSRF-Token``, so plain form posts and htmx requests both carry it. A POST route opts in
with one dependency::

    @router.post("/nodes/{name}/isolate")
    def isolate(..., _: CsrfDep) -> Response: ...

A missing or different token raises :class:`CsrfError`, which the web routes answer with a
403 page that says what to do (when the browser sent no session cookie at all over plain
HTTP to a server that marks the cookie ``Secure``, the page says that is why).
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Request

#: The signed session cookie (Starlette's SessionMiddleware; see main.create_app).
SESSION_COOKIE = "tierwatch_session"
SESSION_CSRF_KEY = "csrf"
FORM_FIELD = "csrf_token"
HEADER = "X-CSRF-Token"


class CsrfError(Exception):
    """A state-changing request without the session's CSRF token (answered as 403)."""


def ensure_csrf_token(request: Request) -> str:
    """The session's CSRF token, created on first use."""
    token = request.session.get(SESSION_CSRF_KEY)
    if not token:
        token = secrets.token_urlsafe(32)
        request.session[SESSION_CSRF_KEY] = token
    return token


def rotate_csrf_token(request: Request) -> str:
    """Replace the session's CSRF token (call on sign-in and sign-out)."""
    token = secrets.token_urlsafe(32)
    request.session[SESSION_CSRF_KEY] = token
    return token


async def verify_csrf(request: Request) -> None:
    """Dependency: the request carries the session's CSRF token (header or form field).

    Raises:
        CsrfError: no session token, no token in the request, or a different one.
    """
    expected = request.session.get(SESSION_CSRF_KEY)
    sent = request.headers.get(HEADER)
    if sent is None:
        content_type = request.headers.get("content-type", "")
        if content_type.startswith(("application/x-www-form-urlencoded", "multipart/form-data")):
            value = (await request.form()).get(FORM_FIELD)
            sent = value if isinstance(value, str) else None
    if not expected or not sent or not secrets.compare_digest(expected.encode(), sent.encode()):
        raise CsrfError(
            "This form has expired or did not come from this dashboard (CSRF check failed). "
            "Reload the page and try again." + _insecure_transport_hint(request)
        )


def _insecure_transport_hint(request: Request) -> str:
    """Why a browser may have sent no session cookie: it is ``Secure`` and this is HTTP."""
    settings = getattr(request.app.state, "settings", None)
    if (
        SESSION_COOKIE in request.cookies
        or request.url.scheme != "http"
        or settings is None
        or not settings.cookie_secure
    ):
        return ""
    return (
        " Your browser sent no session cookie: this server marks it Secure, so browsers "
        "send it over HTTPS only. Open the dashboard at an https:// address (a TLS proxy in "
        "front of the server), or, on a network you trust, set "
        "TIERWATCH_SESSION_COOKIE_SECURE=0."
    )


CsrfDep = Annotated[None, Depends(verify_csrf)]

"""Who may see the dashboard, and how the web routes answer refusals.

Pages declare ``viewer: ViewerPageDep``. A caller without a bearer token or a signed-in
session is sent to ``/login?next=<this page>`` (a 303 for a browser, ``HX-Redirect`` for an
htmx request, which would otherwise swap a login form into a fragment). The routes of
:data:`router` use :class:`WebRoute`, which turns the web domain's exceptions into HTML pages:
:class:`LoginRequired` into that redirect, :class:`~tierwatch.server.web.csrf.CsrfError` into
a 403 page, :class:`WebError` into a page with its status, and the fleet's
``NotFoundError`` into a 404 page.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Annotated, Any
from urllib.parse import urlencode, urlsplit

from fastapi import Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from fastapi.routing import APIRoute

from tierwatch.server.fleet.service import NotFoundError
from tierwatch.server.security import Principal, optional_principal
from tierwatch.server.web.csrf import CsrfError
from tierwatch.server.web.templating import templates


class LoginRequired(Exception):
    """The page needs a signed-in viewer (answered with a redirect to /login)."""

    def __init__(self, next_url: str) -> None:
        super().__init__(next_url)
        self.next_url = next_url


class WebError(Exception):
    """A refusal shown as an HTML page with ``status`` (the message says what to do)."""

    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.title = title
        self.message = message


def is_htmx(request: Request) -> bool:
    """True for an htmx request that expects a fragment (not a boosted or history request)."""
    h = request.headers
    return (
        h.get("hx-request") == "true"
        and h.get("hx-boosted") != "true"
        and h.get("hx-history-restore-request") != "true"
    )


def safe_next(value: str | None) -> str:
    """A same-site path to return to after sign-in (``/`` for anything else).

    Refuses absolute URLs, scheme-relative ``//host`` and backslash tricks so ``next`` can
    never send a user to another site.
    """
    if not value or not value.startswith("/") or value.startswith(("//", "/\\")):
        return "/"
    parts = urlsplit(value)
    if parts.scheme or parts.netloc:
        return "/"
    return value


def login_url(next_url: str | None) -> str:
    """``/login`` with ``next`` when it is somewhere other than the cluster page."""
    target = safe_next(next_url)
    return "/login" if target == "/" else "/login?" + urlencode({"next": target})


def _page_path(request: Request) -> str:
    """The page to come back to: for htmx, the page the browser shows, not the fragment."""
    current = request.headers.get("hx-current-url")
    if current:
        parts = urlsplit(current)
        return parts.path + (f"?{parts.query}" if parts.query else "")
    url = request.url
    return url.path + (f"?{url.query}" if url.query else "")


def viewer_page(
    request: Request,
    principal: Annotated[Principal | None, Depends(optional_principal)],
) -> Principal:
    """Dependency: a signed-in caller with at least the viewer role.

    Raises:
        LoginRequired: no bearer token and no signed-in session.
        WebError: 403 for an agent token (agents report; people read the dashboard).
    """
    if principal is None:
        raise LoginRequired(_page_path(request))
    if not principal.has_role("viewer"):
        raise WebError(
            403,
            "Not allowed",
            f"The dashboard needs a viewer, operator or admin token; this one has the "
            f"{principal.role} role"
            + (
                " (agent tokens may only report for their own node)."
                if principal.role == "agent"
                else "."
            ),
        )
    return principal


ViewerPageDep = Annotated[Principal, Depends(viewer_page)]


def role_page(minimum: str):  # noqa: ANN201 - returns a dependency
    """Dependency factory: a signed-in caller with at least ``minimum`` (operator, admin).

    Raises:
        LoginRequired: not signed in.
        WebError: 403 when the role is too low (the message names the role needed).
    """

    def dependency(principal: ViewerPageDep) -> Principal:
        if not principal.has_role(minimum):
            raise WebError(
                403,
                "Not allowed",
                f"This action needs the {minimum} role; you are signed in as "
                f"{principal.role}. Sign in with an {minimum} token.",
            )
        return principal

    return dependency


OperatorPageDep = Annotated[Principal, Depends(role_page("operator"))]
AdminPageDep = Annotated[Principal, Depends(role_page("admin"))]


def flash(request: Request, message: str, kind: str = "ok") -> None:
    """Keep a one-time message for the next page the session shows (post/redirect/get)."""
    request.session.setdefault("flash", []).append({"kind": kind, "message": message[:2000]})
    request.session["flash"] = request.session["flash"][-5:]


#: The node and job pages' charts refresh at most this often (s).
CHART_REFRESH_MIN_S = 5.0
#: Headers of every page whose URL also serves its live part as an htmx fragment.
PAGE_HEADERS = {"Vary": "HX-Request", "Cache-Control": "no-store"}


def render_page(
    request: Request,
    name: str,
    context: dict[str, Any],
    *,
    fragment: tuple[str, ...] = ("live",),
) -> Response:
    """The whole page ``name``, or only its ``fragment`` blocks for an htmx fragment request.

    A page URL serves its live part as a fragment: an htmx request (``HX-Request`` without
    ``HX-Boosted``/history restore) gets only those blocks, rendered with jinja2-fragments.
    Both carry :data:`PAGE_HEADERS` (``Vary: HX-Request``, so no cache mixes them up).
    """
    if is_htmx(request):
        return templates.TemplateResponse(
            request, name, context, headers=PAGE_HEADERS, block_names=list(fragment)
        )
    return templates.TemplateResponse(request, name, context, headers=PAGE_HEADERS)


def error_page(request: Request, status: int, title: str, message: str) -> Response:
    """An HTML error page (a bare fragment for htmx requests)."""
    return templates.TemplateResponse(
        request,
        "pages/error.html",
        {"status": status, "title": title, "message": message},
        status_code=status,
        block_name="content" if is_htmx(request) else None,
    )


def _login_redirect(request: Request, exc: LoginRequired) -> Response:
    target = login_url(exc.next_url)
    if request.headers.get("hx-request") == "true":
        return Response(status_code=401, headers={"HX-Redirect": target})
    return RedirectResponse(target, status_code=303)


class WebRoute(APIRoute):
    """An APIRoute whose handler answers the web domain's exceptions with HTML."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def web_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except LoginRequired as exc:
                return _login_redirect(request, exc)
            except CsrfError as exc:
                return error_page(request, 403, "Request refused", str(exc))
            except NotFoundError as exc:
                return error_page(request, 404, "Not found", str(exc))
            except WebError as exc:
                return error_page(request, exc.status, exc.title, exc.message)
            except RequestValidationError as exc:
                fields = "; ".join(
                    f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'input'}: "
                    f"{e.get('msg', '')}"
                    for e in exc.errors()[:5]
                )
                advice = (
                    "Fix the address and try again"
                    if request.method in ("GET", "HEAD")
                    else "Nothing was changed. Fix and try again"
                )
                return error_page(request, 422, "Invalid input", f"{advice}: {fields}.")

        return web_handler

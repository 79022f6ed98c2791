"""Request body limits for the agent's local API: a pure ASGI middleware and the limits table.

Every endpoint of the agent (``agent/server.py``, ``agent/checkpoint/tierstore/api.py``) has
a body limit in :data:`AGENT_LIMITS`; a path the table does not list gets
:data:`DEFAULT_LIMIT`. :class:`BodyLimit` enforces them before the route reads a byte:

- a ``Content-Length`` over the route's limit: **413** at once, the body unread, with a
  message that names the endpoint and the limit;
- a ``PUT`` without ``Content-Length`` (a chunked body): **411**. The replica upload has no
  fixed limit; its ``Content-Length`` is the size the memory store reserves against the
  node's memory budget before it writes a byte (507 when it does not fit:
  :meth:`~tierwatch.agent.checkpoint.tierstore.store.MemoryStore.begin_replica`);
- a body that turns out longer than its limit or than its own ``Content-Length`` (chunked, or
  a lying client): the bytes are counted as they arrive and the body is cut at the limit;
  the client gets **413** (if the route has not answered yet) and the route sees the client
  disconnect, so it stores nothing (its own answer is dropped).

The limits are sized to the largest body the agent's own clients send (the trainer's event
batches of at most 1000 events, 1000 progress reports and 200 restore reports; a stage
request for every file of a large job), with headroom; a control endpoint whose body is a
few fields gets a few KiB, and an endpoint without a body gets 0.

Wiring (``agent/server.py`` ``create_app``): ``app.add_middleware(BodyLimit)``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

KiB = 1024
MiB = 1024 * 1024
DEFAULT_LIMIT = 64 * KiB


@dataclass(frozen=True)
class RouteLimit:
    """The body limit of one endpoint.

    Attributes:
        method: HTTP method (``POST``, ``PUT``, …).
        path: The route's path template, as FastAPI declares it (``{name}`` matches one path
            segment).
        max_bytes: Most bytes of body (0: the endpoint takes no body). None: no fixed limit,
            the route checks the ``Content-Length`` itself (the replica upload, against the
            memory budget); a PUT must then send ``Content-Length``.
        hint: What a client over the limit should do (goes into the 413 message).
    """

    method: str
    path: str
    max_bytes: int | None
    hint: str = ""
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        regex = re.sub(r"\\\{[^}/]+\\\}", "[^/]+", re.escape(self.path))
        object.__setattr__(self, "_pattern", re.compile(f"^{regex}$"))

    def matches(self, method: str, path: str) -> bool:
        """Whether a request of ``method`` to ``path`` is this endpoint's."""
        return method == self.method and self._pattern.match(path) is not None


AGENT_LIMITS: tuple[RouteLimit, ...] = (
    RouteLimit("GET", "/v1/status", 0),
    RouteLimit("GET", "/metrics", 0),
    RouteLimit("POST", "/v1/inject", 4 * KiB),
    RouteLimit("POST", "/v1/trainer/latency", 2 * MiB, "send at most 4096 samples per request"),
    RouteLimit("GET", "/v1/ckpt/info", 0),
    RouteLimit(
        "POST",
        "/v1/ckpt/events",
        16 * MiB,
        "send fewer events, progress and restore reports per request",
    ),
    RouteLimit("POST", "/v1/ckpt/notify", 4 * KiB),
    RouteLimit("GET", "/v1/ckpt/jobs/{job_id}/available", 0),
    RouteLimit(
        "POST", "/v1/ckpt/jobs/{job_id}/stage", 32 * MiB, "stage the files in several requests"
    ),
    RouteLimit("GET", "/v1/ckpt/jobs/{job_id}/restore-requests", 0),
    RouteLimit("DELETE", "/v1/ckpt/jobs/{job_id}/restore-requests/{request_id}", 0),
    RouteLimit("POST", "/v1/ckpt/jobs/{job_id}/rollback", 4 * KiB),
    RouteLimit("PUT", "/v1/peer/replicas/{src_node}/{job_id}/{step}/{name}", None),
    RouteLimit("DELETE", "/v1/peer/replicas/{src_node}/{job_id}/{step}", 0),
    RouteLimit("GET", "/v1/peer/files/{job_id}/{step}/{name}", 0),
)
"""Every endpoint of the agent and its body limit (bytes)."""

PUT_NEEDS_LENGTH = {
    "/v1/peer/replicas/{src_node}/{job_id}/{step}/{name}": (
        "the agent reserves the file's size against its memory budget before it stores a byte"
    ),
}


class BodyLimit:
    """ASGI middleware: refuse request bodies over their endpoint's limit (see the module).

    Args:
        app: The ASGI app to guard.
        routes: The limits per endpoint (first match wins).
        default_bytes: The limit of a request no entry matches.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        routes: Sequence[RouteLimit] = AGENT_LIMITS,
        default_bytes: int = DEFAULT_LIMIT,
    ) -> None:
        self.app = app
        self.routes = tuple(routes)
        self.default_bytes = default_bytes

    def limit_for(self, method: str, path: str) -> RouteLimit:
        """The entry of ``method path`` (the default limit when none matches)."""
        for r in self.routes:
            if r.matches(method, path):
                return r
        return RouteLimit(method, path, self.default_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        route = self.limit_for(method, scope["path"])
        endpoint = f"{method} {route.path}"
        lengths = {v for k, v in scope["headers"] if k == b"content-length"}
        declared: int | None = None
        if lengths:
            value = lengths.pop()
            if lengths or not value.isdigit():
                await _answer(scope, receive, send, 400, f"{endpoint}: invalid Content-Length")
                return
            declared = int(value)
        limit = route.max_bytes
        if method == "PUT" and declared is None:
            why = PUT_NEEDS_LENGTH.get(route.path, "")
            await _answer(
                scope,
                receive,
                send,
                411,
                f"{endpoint} needs Content-Length (the body's size in bytes)"
                + (f": {why}" if why else "")
                + "; a chunked body is refused",
            )
            return
        if limit is not None and declared is not None and declared > limit:
            detail = _too_large(endpoint, limit, route.hint, declared=declared)
            await _answer(scope, receive, send, 413, detail)
            return
        caps = [c for c in (limit, declared) if c is not None]
        if not caps:
            await self.app(scope, receive, send)
            return
        cap = min(caps)
        seen = 0
        refused = False
        started = False

        async def counting_receive() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] != "http.request":
                return message
            seen += len(message.get("body", b""))
            if seen <= cap:
                return message
            refused = True
            if not started:
                if limit is not None and seen > limit:
                    detail = _too_large(endpoint, limit, route.hint, seen=seen)
                else:
                    detail = (
                        f"{endpoint}: the body is longer than its Content-Length of "
                        f"{declared} bytes (reading stopped after {seen}); nothing was stored"
                    )
                await _answer(scope, receive, send, 413, detail)
            return {"type": "http.disconnect"}

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # answered 413 already: the route's answer to the disconnect is moot
            started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not refused:
                raise
            # the route failed on the disconnect it was fed after the 413: expected


def _too_large(
    endpoint: str, limit: int, hint: str, *, declared: int | None = None, seen: int | None = None
) -> str:
    """The 413 message: the endpoint, its limit, what came, what to do."""
    what = "takes no request body" if limit == 0 else f"takes at most {limit} bytes of body"
    if declared is not None:
        got = f"; this request's Content-Length is {declared} bytes"
    elif seen is not None:
        got = f"; reading stopped after {seen} bytes"
    else:
        got = ""
    return f"{endpoint} {what}{got}" + (f"; {hint}" if hint else "")


async def _answer(scope: Scope, receive: Receive, send: Send, status: int, detail: str) -> None:
    await JSONResponse({"detail": detail}, status_code=status)(scope, receive, send)

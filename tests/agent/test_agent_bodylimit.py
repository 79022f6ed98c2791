"""The agent's body-limit middleware (agent/bodylimit.py), on apps of its own: a plain ASGI app
that reads its whole body (so what reached the route can be counted) and a small FastAPI app
with the agent's route shapes. Driven through the ASGI interface directly, so bodies can
arrive in chunks, without Content-Length, or longer than their Content-Length."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from tierwatch.agent.bodylimit import AGENT_LIMITS, DEFAULT_LIMIT, BodyLimit, RouteLimit

REPLICA = "/v1/peer/replicas/node-b/job-1/3/__1_0.distcp"


class Reader:
    """An ASGI app that reads its body to the end (or a disconnect), then answers 200."""

    def __init__(self) -> None:
        self.got = 0
        self.disconnected = False
        self.called = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.called = True
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                break
            self.got += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = json.dumps({"got": self.got}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def call(
    app: Any,
    method: str,
    path: str,
    chunks: Sequence[bytes] = (),
    *,
    length: int | str | None = None,
) -> tuple[int, dict[str, Any], int]:
    """One request through ``app``: the body as ``chunks`` (one message each), with
    ``Content-Length: length`` when given. Returns (status, JSON answer, messages read)."""
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 80),
    }
    pending = list(chunks)
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        if not pending:
            return {"type": "http.request", "body": b"", "more_body": False}
        read += 1
        body = pending.pop(0)
        return {"type": "http.request", "body": body, "more_body": bool(pending)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return starts[0]["status"], json.loads(body or b"{}"), read


def test_a_content_length_over_the_limit_is_413_before_a_byte_is_read() -> None:
    inner = Reader()
    status, out, read = call(
        BodyLimit(inner), "POST", "/v1/ckpt/notify", [b"x" * 5000], length=5000
    )
    assert status == 413
    assert out["detail"] == (
        "POST /v1/ckpt/notify takes at most 4096 bytes of body; this request's "
        "Content-Length is 5000 bytes"
    )
    assert read == 0
    assert not inner.called


def test_a_chunked_body_is_cut_at_the_limit_and_the_route_sees_a_disconnect() -> None:
    inner = Reader()
    chunks = [b"x" * 1000] * 50  # 50 000 bytes, no Content-Length
    status, out, read = call(BodyLimit(inner), "POST", "/v1/ckpt/notify", chunks)
    assert status == 413
    assert out["detail"] == (
        "POST /v1/ckpt/notify takes at most 4096 bytes of body; reading stopped after 5000 bytes"
    )
    assert read == 5  # the rest of the body is never read
    assert inner.got == 4000  # the chunk past the limit never reached the route
    assert inner.disconnected  # ... which saw the client go, and its 200 was dropped


def test_a_body_longer_than_its_content_length_is_cut() -> None:
    inner = Reader()
    status, out, read = call(BodyLimit(inner), "PUT", REPLICA, [b"x" * 100] * 3, length=150)
    assert status == 413
    assert "longer than its Content-Length of 150 bytes" in out["detail"]
    assert read == 2
    assert inner.got == 100


def test_a_put_without_content_length_is_411() -> None:
    inner = Reader()
    status, out, read = call(BodyLimit(inner), "PUT", REPLICA, [b"x" * 10])
    assert status == 411
    assert out["detail"] == (
        "PUT /v1/peer/replicas/{src_node}/{job_id}/{step}/{name} needs Content-Length (the "
        "body's size in bytes): the agent reserves the file's size against its memory "
        "budget before it stores a byte; a chunked body is refused"
    )
    assert read == 0
    assert not inner.called


def test_bodies_within_their_limits_reach_the_route_whole() -> None:
    inner = Reader()
    assert call(BodyLimit(inner), "POST", "/v1/ckpt/notify", [b"x" * 4096], length=4096)[:2] == (
        200,
        {"got": 4096},
    )
    inner = Reader()
    chunks = [b"x" * 1000] * 4  # chunked, within the limit
    assert call(BodyLimit(inner), "POST", "/v1/ckpt/notify", chunks)[:2] == (200, {"got": 4000})
    inner = Reader()  # the replica PUT has no fixed limit: its Content-Length is the budget's
    chunks = [b"x" * (1024 * 1024)] * 20
    assert call(BodyLimit(inner), "PUT", REPLICA, chunks, length=20 * 1024 * 1024)[:2] == (
        200,
        {"got": 20 * 1024 * 1024},
    )


def test_an_endpoint_without_a_body_takes_none() -> None:
    inner = Reader()
    status, out, _ = call(BodyLimit(inner), "GET", "/v1/ckpt/info", [b"{}"], length=2)
    assert status == 413
    assert out["detail"].startswith("GET /v1/ckpt/info takes no request body")
    assert call(BodyLimit(Reader()), "GET", "/v1/ckpt/info", length=0)[0] == 200
    status, out, _ = call(BodyLimit(Reader()), "GET", "/v1/ckpt/info", [b"{}"])  # chunked
    assert status == 413
    assert "reading stopped after 2 bytes" in out["detail"]


def test_an_unlisted_path_gets_the_default_limit() -> None:
    inner = Reader()
    status, out, _ = call(BodyLimit(inner), "POST", "/v1/other", [b"x"], length=DEFAULT_LIMIT + 1)
    assert status == 413
    assert out["detail"].startswith(f"POST /v1/other takes at most {DEFAULT_LIMIT} bytes")
    assert call(BodyLimit(Reader()), "POST", "/v1/other", [b"x" * 10], length=10)[0] == 200


@pytest.mark.parametrize("length", ["12x", "-1", ""])
def test_an_invalid_content_length_is_400(length: str) -> None:
    inner = Reader()
    status, out, _ = call(BodyLimit(inner), "POST", "/v1/ckpt/notify", [b"{}"], length=length)
    assert status == 400
    assert out["detail"] == "POST /v1/ckpt/notify: invalid Content-Length"
    assert not inner.called


def test_limits_and_hints_are_configurable() -> None:
    routes = [RouteLimit("POST", "/v1/things/{id}", 10, "send fewer things")]
    status, out, _ = call(
        BodyLimit(Reader(), routes=routes), "POST", "/v1/things/7", [b"x" * 11], length=11
    )
    assert status == 413
    assert out["detail"] == (
        "POST /v1/things/{id} takes at most 10 bytes of body; this request's Content-Length "
        "is 11 bytes; send fewer things"
    )


def test_the_table_names_every_route_once_with_a_limit_or_the_budget() -> None:
    keys = [(r.method, r.path) for r in AGENT_LIMITS]
    assert len(keys) == len(set(keys))
    unlimited = [r for r in AGENT_LIMITS if r.max_bytes is None]
    assert [(r.method, r.path) for r in unlimited] == [
        ("PUT", "/v1/peer/replicas/{src_node}/{job_id}/{step}/{name}")
    ]
    assert all(r.max_bytes == 0 for r in AGENT_LIMITS if r.method in ("GET", "DELETE"))
    assert all(
        0 < (r.max_bytes or 0) <= 32 * 1024 * 1024 for r in AGENT_LIMITS if r.method == "POST"
    )


# -- a FastAPI app: its body parsing fails on the disconnect, quietly -----------------------
class Notify(BaseModel):
    job_id: str
    step: int


def fastapi_app() -> tuple[FastAPI, list[Any]]:
    seen: list[Any] = []
    app = FastAPI()

    @app.post("/v1/ckpt/notify")
    def notify(body: Notify) -> dict[str, Any]:
        seen.append(body)
        return {"ok": True}

    @app.put("/v1/peer/replicas/{src_node}/{job_id}/{step}/{name}")
    async def put(request: Request) -> dict[str, Any]:
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
        seen.append(n)
        return {"got": n}

    app.add_middleware(BodyLimit)
    return app, seen


def test_a_fastapi_route_never_runs_on_a_cut_body() -> None:
    app, seen = fastapi_app()
    assert call(app, "POST", "/v1/ckpt/notify", [b'{"job_id": "j", "step": 1}'])[:2] == (
        200,
        {"ok": True},
    )
    padded = b'{"job_id": "j", "step": 1' + b" " * 5000 + b"}"
    chunks = [padded[i : i + 1000] for i in range(0, len(padded), 1000)]
    status, out, _ = call(app, "POST", "/v1/ckpt/notify", chunks)
    assert status == 413  # not FastAPI's 400 for the body it could not read, not a 500
    assert "takes at most 4096 bytes" in out["detail"]
    assert len(seen) == 1
    status, _, _ = call(app, "PUT", REPLICA, [b"x" * 10] * 3, length=20)
    assert status == 413
    assert len(seen) == 1  # the streaming route saw a disconnect (ClientDisconnect), no body

"""Helpers for alert tests: a recording webhook receiver and one delivery round."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.server.alerts.delivery import deliver_due
from tierwatch.server.alerts.service import AlertSettings


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1 that records each POST and answers from a script.

    ``script`` holds (status, headers, body) answers used in order; once it is empty every
    request gets 200. ``stop()``/``start()`` take it down and bring it back on the same port.
    """

    port: int = 0
    requests: list[Received] = field(default_factory=list)
    script: list[tuple[int, dict[str, str], str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def answer(self, *answers: int | tuple[int, dict[str, str], str]) -> None:
        with self.lock:
            for a in answers:
                self.script.append((a, {}, f"receiver says {a}") if isinstance(a, int) else a)

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver.lock:
                    receiver.requests.append(
                        Received(self.path, dict(self.headers.items()), json.loads(raw))
                    )
                    status, headers, body = (
                        receiver.script.pop(0) if receiver.script else (200, {}, "ok")
                    )
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            assert self._thread is not None
            self._thread.join(timeout=10)
            self._server = None


def deliver(
    factory: sessionmaker[Session], settings: AlertSettings, now: datetime, limit: int = 100
) -> int:
    """One delivery round at ``now`` with a fresh client (no proxies from the environment)."""

    async def main() -> int:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await deliver_due(factory, settings, client, now=now, limit=limit)

    return asyncio.run(main())

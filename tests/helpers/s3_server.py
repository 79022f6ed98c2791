"""A real S3 API on loopback for the persistent-tier tests: ``moto_server`` (PyPI's
``moto[server]``) as a child process, and a throttling TCP proxy in front of it.

Fixtures (registered for the whole suite by tests/conftest.py's ``pytest_plugins``):

- ``s3_server`` (one per test session, i.e. per xdist worker): the moto process on
  127.0.0.1 and a free port, stopped at the end. Its request log (one werkzeug line per
  request, in the order the responses were sent) is how tests see the order of writes.
- ``s3_bucket``: a fresh bucket per test, with the storage options and the environment an
  agent needs to use it (dummy credentials, the moto endpoint, no instance-metadata lookups:
  nothing leaves the machine).
"""

from __future__ import annotations

import re
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from procs import BIN, Proc, base_env, free_port, wait_for

REGION = "us-east-1"
# Dummy credentials: moto accepts any; botocore must never look further (no IMDS, no files).
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": "/dev/null",
    "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
}
_REQUEST = re.compile(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})')


@dataclass(frozen=True)
class S3Request:
    """One request as moto logged it: method, path (with query) and status."""

    method: str
    path: str
    status: int


@dataclass
class MotoServer:
    """A running ``moto_server`` on ``127.0.0.1:<port>``."""

    port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[S3Request]:
        """Every request moto answered so far, in order."""
        text = self.proc.log_path.read_text(errors="replace")
        return [
            S3Request(m[1], m[2], int(m[3]))
            for line in text.splitlines()
            if (m := _REQUEST.search(line))
        ]

    def client(self) -> Any:
        """A boto3 S3 client on this server (dummy credentials)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        )


def start_moto(workdir: Path, timeout: float = 30) -> MotoServer:
    """Start ``moto_server`` on a free loopback port and wait until it answers.

    Raises:
        TimeoutError: it did not answer within ``timeout`` seconds (its log is in the message).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    proc = Proc(
        "moto",
        [str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        base_env(**AWS_ENV),
        workdir / "moto.log",
    ).start()
    server = MotoServer(port, proc)
    wait_for(
        lambda: httpx.get(f"{server.url}/moto-api/", timeout=1).status_code == 200,
        timeout=timeout,
        interval=0.05,
        what=f"moto_server on port {port}\n{proc.log_tail()}",
    )
    return server


@dataclass
class S3Bucket:
    """A bucket of the test's own on the moto server."""

    server: MotoServer
    name: str

    def url(self, prefix: str = "ckpt") -> str:
        """``s3://<bucket>/<prefix>``."""
        return f"s3://{self.name}/{prefix}"

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """Storage options for an in-process :class:`PersistentTier` (explicit dummy
        credentials and region, so botocore reads no environment or file)."""
        return {
            "endpoint_url": endpoint or self.server.url,
            "key": AWS_ENV["AWS_ACCESS_KEY_ID"],
            "secret": AWS_ENV["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"region_name": REGION},
        }

    def agent_env(self, endpoint: str | None = None) -> dict[str, str]:
        """Environment of an agent process using this bucket (the agent's own settings for
        the endpoint and region; the credentials through botocore's chain)."""
        return {
            **AWS_ENV,
            "TIERWATCH_S3_ENDPOINT_URL": endpoint or self.server.url,
            "TIERWATCH_S3_REGION": REGION,
        }

    def keys(self, prefix: str = "") -> list[str]:
        """Object keys under ``prefix``, sorted."""
        c = self.server.client()
        out: list[str] = []
        for page in c.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def multipart_uploads(self) -> list[dict[str, Any]]:
        """Multipart uploads started and neither completed nor aborted."""
        return self.server.client().list_multipart_uploads(Bucket=self.name).get("Uploads", [])


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One ``moto_server`` per test session (per xdist worker), on loopback."""
    server = start_moto(tmp_path_factory.mktemp("moto"))
    yield server
    server.proc.stop()


@pytest.fixture
def s3_bucket(s3_server: MotoServer) -> S3Bucket:
    """A fresh, empty bucket on the session's moto server."""
    name = f"tw-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return S3Bucket(s3_server, name)


@dataclass
class ThrottledProxy:
    """A TCP proxy on 127.0.0.1 in front of ``target_port``, standing for a slow or stalled
    network between one agent and the store.

    - :attr:`rate`: bytes per second per connection from clients (None: full speed);
    - :attr:`hold`: while set, client bytes are read but not forwarded (a stalled link);
      :attr:`hold_on`: a connection stalls from the first request line this returns True
      for (until both are cleared); :meth:`drop` closes every connection and discards what
      was held, so nothing of it ever reaches the server;
    - :attr:`seen`: the request lines (``"PUT /bucket/key"``) clients started sending, so a
      test knows an upload is under way.
    """

    target_port: int
    rate: float | None = None
    hold: bool = False
    hold_on: Callable[[str], bool] | None = None
    port: int = 0
    seen: list[str] = field(default_factory=list)
    _sock: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _conns: list[socket.socket] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ThrottledProxy:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True, name="s3-proxy").start()
        return self

    def drop(self) -> None:
        """Close every open connection; held bytes are discarded."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _close(s)

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
        self.drop()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                client, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, outgoing: bool) -> None:
        tail = b""
        held: list[bytes] = []
        stalled = False
        try:
            while not self._stop.is_set():
                rate = self.rate if outgoing else None
                data = src.recv(16384 if rate else 65536)
                if not data:
                    break
                if outgoing:
                    text = tail + data
                    lines = [  # a line wholly inside the tail was counted before
                        f"{m[1].decode()} {m[2].decode()}"
                        for m in re.finditer(rb"(PUT|POST|GET|DELETE|HEAD) (/\S*) HTTP/1", text)
                        if m.end() > len(tail)
                    ]
                    self.seen += lines
                    tail = text[-200:]
                    held.append(data)
                    hold_on = self.hold_on
                    stalled = stalled or bool(hold_on and any(hold_on(x) for x in lines))
                    while (
                        (self.hold or (stalled and self.hold_on is not None))
                        and not self._stop.is_set()
                        and src.fileno() != -1
                    ):
                        self._stop.wait(0.01)  # held until the test releases it (or stops)
                    stalled = stalled and self.hold_on is not None
                    if src.fileno() == -1:  # dropped while held
                        break
                    data, held = b"".join(held), []
                if rate:
                    self._stop.wait(len(data) / rate)  # the link's pace; a stop cuts it short
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(src)
            _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


@pytest.fixture
def throttled_proxy(s3_server: MotoServer) -> Iterator[ThrottledProxy]:
    """A :class:`ThrottledProxy` in front of the session's moto server (full speed until a
    test sets ``rate``)."""
    proxy = ThrottledProxy(s3_server.port).start()
    yield proxy
    proxy.stop()

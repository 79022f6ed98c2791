"""Real processes for end-to-end tests: a tierwatch-server and tierwatch-agents on loopback.

Every process gets an ephemeral port and its own temp dir, and is stopped by its fixture.
Output goes to a log file whose tail is shown when a wait times out.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tierwatch.agent.netutil import free_port

BIN = Path(sys.executable).parent
REPO_ROOT = Path(__file__).resolve().parents[2]


def port_block(count: int, attempts: int = 50) -> int:
    """The first of ``count`` consecutive free ports on 127.0.0.1.

    Raises:
        RuntimeError: no free block was found.
    """
    for _ in range(attempts):
        first = free_port()
        if first + count > 65535:
            continue
        socks = []
        try:
            for p in range(first, first + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {count} free ports found")


def wait_for(
    predicate: Callable[[], Any], *, timeout: float, interval: float = 0.1, what: str = "condition"
) -> Any:
    """Poll ``predicate`` until it returns a truthy value; that value is returned.

    Raises:
        TimeoutError: the condition did not hold within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (httpx.HTTPError, OSError, KeyError, ValueError) as exc:
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_exc})")


@dataclass
class Proc:
    """A child process with its log file."""

    name: str
    args: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    _log: Any = field(default=None, repr=False)

    def start(self) -> Proc:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        return self

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        """Signal the process and wait for it; SIGKILL if it does not exit in ``timeout``."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        if self._log:
            self._log.close()
        return self.popen.returncode

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
    env.update(extra)
    return env


@dataclass
class Server:
    """A running tierwatch-server (uvicorn) on an ephemeral loopback port."""

    url: str
    database_url: str
    proc: Proc
    port: int
    workdir: Path

    def cli(self, *args: str) -> str:
        """Run ``tierwatch-server ARGS`` against this server's database; returns stdout."""
        out = subprocess.run(
            [str(BIN / "tierwatch-server"), *args],
            env=base_env(TIERWATCH_DATABASE_URL=self.database_url),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return out.stdout.strip()

    def token(self, role: str, node: str | None = None) -> str:
        return self.cli("token", "create", "--role", role, *(["--node", node] if node else []))

    def job_credential(self, job_id: str, nodes: list[str]) -> str:
        """Register ``job_id`` on ``nodes`` and return its job credential, as a launcher does
        (``tierwatch-server job credential``)."""
        args = ["job", "credential", job_id]
        for n in dict.fromkeys(nodes):
            args += ["--node", n]
        return self.cli(*args)

    def start(self) -> None:
        self.proc.start()
        wait_for(
            lambda: httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200,
            timeout=30,
            what=f"server on {self.url}\n{self.proc.log_tail()}",
        )

    def stop(self) -> int | None:
        return self.proc.stop()


def make_server(workdir: Path, database_url: str, port: int | None = None, **env: str) -> Server:
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    proc = Proc(
        "server",
        [str(BIN / "tierwatch-server"), "serve", "--host", "127.0.0.1", "--port", str(port)],
        base_env(
            TIERWATCH_DATABASE_URL=database_url,
            TIERWATCH_SECRET_KEY="e2e-" + "k" * 40,
            # Plain HTTP on loopback: httpx's cookie jar never returns a Secure cookie over
            # http (tests/web/test_sessions.py covers the Secure flag in-process).
            TIERWATCH_SESSION_COOKIE_SECURE="0",
            TIERWATCH_PRUNE_INTERVAL_S="0",
            # tests scrape right after a change; the cache has its own test
            TIERWATCH_METRICS_CACHE_S="0",
            **env,
        ),
        workdir / "server.log",
    )
    return Server(f"http://127.0.0.1:{port}", database_url, proc, port, workdir)


@dataclass
class Agent:
    """A running tierwatch-agent with a simulated collector."""

    node: str
    url: str
    proc: Proc
    token: str = ""

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return self.proc.stop(sig)

    def inject(self, *fault: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``tierwatch-agent inject FAULT...`` into this agent, as the node's operator does
        (its agent token in ``TIERWATCH_TOKEN``, not argv)."""
        return subprocess.run(
            [str(BIN / "tierwatch-agent"), "inject", "--agent", self.url, *fault],
            env=base_env(TIERWATCH_TOKEN=self.token),
            check=check,
            capture_output=True,
            text=True,
            timeout=30,
        )


def make_agent(
    workdir: Path,
    *,
    node: str,
    server_url: str,
    token: str,
    interval: float = 1.0,
    extra_args: list[str] | None = None,
) -> Agent:
    port = free_port()
    d = workdir / node
    d.mkdir(parents=True, exist_ok=True)
    args = [
        str(BIN / "tierwatch-agent"),
        "run",
        "--node",
        node,
        "--server",
        server_url,
        "--token",
        token,
        "--collector",
        "simulated",
        "--interval",
        str(interval),
        "--listen",
        f"127.0.0.1:{port}",
        "--spool-dir",
        str(d / "spool"),
        "--sim-gpus",
        "8",
        "--sim-seed",
        "7",
        "--memory-dir",
        str(d / "memory"),
        "--state-dir",
        str(d / "state"),
        *(extra_args or []),
    ]
    proc = Proc(node, args, base_env(), d / "agent.log")
    return Agent(node, f"http://127.0.0.1:{port}", proc, token)

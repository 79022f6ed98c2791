"""A PostgreSQL server of a test's own (Debian's postgresql binaries: initdb + postgres), on
loopback and an ephemeral port, so that the test can pause it (SIGSTOP to every process of the
cluster, as a hung database host would look) without touching the shared test server.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from executables import REQUIRE_ENV
from procs import wait_for

from tierwatch.agent.netutil import free_port


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    message = f"{name} not found under /usr/lib/postgresql/*/bin (Debian's postgresql)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


@dataclass
class OwnPostgres:
    """A running cluster: ``url`` reaches its ``postgres`` database as user ``postgres``."""

    root: Path
    port: int
    proc: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _pids(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer, walwriter, …)."""
        out = subprocess.run(
            ["ps", "-o", "pid=", "--ppid", str(self.proc.pid)],
            capture_output=True,
            text=True,
            check=False,
        )
        return [self.proc.pid, *(int(p) for p in out.stdout.split())]

    def pause(self) -> None:
        """SIGSTOP every process of the cluster: connections stay open, nothing answers."""
        for pid in self._pids():
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self._pids():
            os.kill(pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> OwnPostgres:
    """initdb a fresh cluster (trust auth, loopback only) and start it; waits until ready."""
    initdb, postgres, isready = _bin("initdb"), _bin("postgres"), _bin("pg_isready")
    user = pwd.getpwnam("postgres")
    root = Path(tempfile.mkdtemp(prefix="tw-pg-"))
    root.chmod(0o755)
    data = root / "data"
    data.mkdir(mode=0o700)
    sock = root / "sock"
    sock.mkdir(mode=0o755)
    for path in (data, sock):
        os.chown(path, user.pw_uid, user.pw_gid)
    # As root, run as the postgres user directly (no runuser: it stops itself when its
    # child is stopped, and pause() stops the postmaster).
    who: dict = (
        {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if os.geteuid() == 0 else {}
    )
    subprocess.run(
        [initdb, "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"],
        check=True,
        capture_output=True,
        timeout=120,
        cwd=root,
        **who,
    )
    port = free_port()
    log = root / "postgres.log"
    log.touch()
    os.chown(log, user.pw_uid, user.pw_gid)
    proc = subprocess.Popen(
        [
            postgres,
            "-D",
            str(data),
            "-p",
            str(port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"unix_socket_directories={sock}",
            "-c",
            "fsync=off",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        cwd=root,
        **who,
    )
    pg = OwnPostgres(root, port, proc)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"postgres exited: {log.read_text()[-2000:]}")
        ok = subprocess.run(
            [isready, "-h", "127.0.0.1", "-p", str(port), "-q"], check=False, timeout=10
        )
        return ok.returncode == 0

    try:
        wait_for(ready, timeout=60, what=f"postgres on port {port}")
    except BaseException:
        pg.stop()
        raise
    return pg

"""The leader lock's connection: TCP keepalives on both ends (so a vanished leader's lock is
freed in under a minute), and the lock behind a real PgBouncer: it works in session pooling
mode and is refused, with an error saying what to change, in transaction pooling mode.

PgBouncer runs once for the module on 127.0.0.1 (an ephemeral port) in front of the test
PostgreSQL, as the unprivileged ``postgres`` user (it refuses to run as root), with two
databases: ``tw_session`` (pool_mode = session) and ``tw_transaction`` (pool_mode =
transaction), both the PostgreSQL database of ``TIERWATCH_TEST_DATABASE_URL``.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from executables import require_executable
from procs import wait_for
from sqlalchemy import text
from sqlalchemy.engine import make_url

from tierwatch.agent.netutil import free_port
from tierwatch.server.db import make_engine
from tierwatch.server.leader import (
    CLIENT_KEEPALIVES,
    SERVER_KEEPALIVES,
    LeaderLock,
)

pytestmark = pytest.mark.postgres

TIMEOUT_S = 30.0


def _random_key() -> int:
    """A lock class of this test's own: the PgBouncer databases reach the ``public`` schema,
    which other processes may use."""
    return random.randrange(1 << 20, 1 << 30)


@dataclass
class Bouncer:
    """A running PgBouncer: ``url(db)`` is a SQLAlchemy URL through it."""

    port: int
    log: Path

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"


def _start_pgbouncer(exe: str, folder: Path, backend: str) -> tuple[subprocess.Popen[bytes], int]:
    """PgBouncer on a free port (another one when the port drawn was taken meanwhile)."""
    user = pwd.getpwnam("postgres")
    log = folder / "pgbouncer.log"
    for _ in range(3):
        port = free_port()
        (folder / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"tw_session = {backend} pool_mode=session\n"
            f"tw_transaction = {backend} pool_mode=transaction\n"
            "[pgbouncer]\n"
            "listen_addr = 127.0.0.1\n"
            f"listen_port = {port}\n"
            "unix_socket_dir =\n"
            "auth_type = trust\n"
            f"auth_file = {folder / 'users.txt'}\n"
            "pool_mode = session\n"
            # (the default, spelled out: it runs when a session-mode client disconnects,
            # and DISCARD ALL releases the session's advisory locks)
            "server_reset_query = DISCARD ALL\n"
            # what docs/operations.md recommends for tierwatch's pool
            "tcp_keepalive = 1\ntcp_keepidle = 10\ntcp_keepintvl = 5\ntcp_keepcnt = 3\n"
            "tcp_user_timeout = 25000\n"
        )
        (folder / "pgbouncer.ini").chmod(0o644)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [exe, str(folder / "pgbouncer.ini")],
                stdout=out,
                stderr=subprocess.STDOUT,
                user=user.pw_uid,
                group=user.pw_gid,
                extra_groups=[],
            )

        def _up(proc: subprocess.Popen[bytes] = proc, port: int = port) -> str:
            if proc.poll() is not None:
                return "exited"
            try:
                with psycopg.connect(
                    host="127.0.0.1", port=port, dbname="tw_session", user="postgres"
                ) as conn:
                    return "up" if conn.execute("SELECT 1").fetchone() == (1,) else ""
            except psycopg.OperationalError:
                return ""

        state = wait_for(_up, timeout=TIMEOUT_S, interval=0.05, what="pgbouncer to start")
        if state == "up":
            return proc, port
        if "Address already in use" not in log.read_text():
            break
    raise AssertionError(f"pgbouncer did not start: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def pgbouncer(pg_url: str) -> Iterator[Bouncer]:
    exe = require_executable("pgbouncer", "pgbouncer")
    target = make_url(pg_url)
    folder = Path(tempfile.mkdtemp(prefix="tw-pgbouncer-"))
    folder.chmod(0o755)  # the postgres user reads its files; it writes none (logs to stderr)
    (folder / "users.txt").write_text('"postgres" ""\n')
    (folder / "users.txt").chmod(0o644)
    backend = (
        f"host={target.host or '127.0.0.1'} port={target.port or 5432} "
        f"dbname={target.database} user={target.username or 'postgres'}"
    )
    try:
        proc, port = _start_pgbouncer(exe, folder, backend)
        try:
            yield Bouncer(port=port, log=folder / "pgbouncer.log")
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _socket_options(fd: int) -> dict[str, int]:
    sock = socket.socket(fileno=os.dup(fd))
    try:
        return {
            "keepalives": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "keepalives_idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            "keepalives_interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            "keepalives_count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            "tcp_user_timeout": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        }
    finally:
        sock.close()


def test_the_lock_connection_has_keepalives_on_both_ends(pg_url):
    engine = make_engine(pg_url, pool_size=1, max_overflow=0)
    lock = LeaderLock(engine, key=_random_key())
    try:
        assert lock.check()
        conn = lock._conn  # noqa: SLF001 - the connection that holds the lock
        assert conn is not None
        # Server side: the session holding the lock (pg_locks) has the keepalive settings.
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
        shown = {
            name: int(conn.execute(text(f"SHOW {name}")).scalar() or 0)
            for name in SERVER_KEEPALIVES
        }
        conn.commit()
        assert shown == SERVER_KEEPALIVES
        with engine.connect() as admin:
            holder = admin.execute(
                text(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND classid = :k AND objsubid = 2"
                ),
                {"k": lock._key},  # noqa: SLF001
            ).scalar()
        assert holder == pid
        # Client side: the kernel's options on this end of the lock's TCP connection.
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        options = _socket_options(dbapi.pgconn.socket)  # type: ignore[attr-defined]
        want = {k: v for k, v in CLIENT_KEEPALIVES.items() if k != "connect_timeout"}
        assert options == want
        # The arithmetic of leader.py: the server frees the lock within a minute, after the
        # old leader's own connection has given up.
        server_s = min(
            SERVER_KEEPALIVES["tcp_keepalives_idle"]
            + SERVER_KEEPALIVES["tcp_keepalives_count"]
            * SERVER_KEEPALIVES["tcp_keepalives_interval"],
            SERVER_KEEPALIVES["tcp_user_timeout"] / 1000,
        )
        assert CLIENT_KEEPALIVES["tcp_user_timeout"] / 1000 < server_s < 60
    finally:
        lock.release()
        engine.dispose()


def test_session_pooling_one_leader_and_takeover(pgbouncer):
    key = _random_key()
    through = make_engine(pgbouncer.url("tw_session"), pool_size=1, max_overflow=0)
    first, second = LeaderLock(through, key=key), LeaderLock(through, key=key)
    try:
        assert first.check()
        assert not second.check()
        assert first.check()  # kept
        assert first.refused is None
        first.release()
        assert second.check()  # released explicitly: free at once
        # The holder's connection to PgBouncer closes without an unlock (a crashed replica):
        # PgBouncer's reset query (DISCARD ALL) frees the lock of the session it goes back to.
        second._drop()  # noqa: SLF001 - what a crash does: the connection just closes
        third = LeaderLock(through, key=key)
        try:
            wait_for(third.check, timeout=TIMEOUT_S, interval=0.05, what="the lock to be free")
            assert third.refused is None
        finally:
            third.release()
    finally:
        first.release()
        second.release()
        through.dispose()


def test_transaction_pooling_is_detected_and_refused(pgbouncer, pg_url, caplog):
    key = _random_key()
    through = make_engine(pgbouncer.url("tw_transaction"), pool_size=1, max_overflow=0)
    direct = make_engine(pg_url, pool_size=1, max_overflow=0)
    lock = LeaderLock(through, key=key)
    witness = LeaderLock(direct, key=key)
    try:
        assert lock.check() is False
        assert lock.refused is not None
        assert "pool_mode = session" in lock.refused
        assert any(
            r.levelname == "ERROR" and "refusing to lead" in r.getMessage() for r in caplog.records
        )
        assert lock.check() is False  # for good, without trying again
        # It gave the lock back: nothing holds it on PostgreSQL (the public schema of the
        # same database is the same lock, reached directly).
        assert witness.check()
    finally:
        lock.release()
        witness.release()
        through.dispose()
        direct.dispose()


def test_a_lock_connection_that_moves_to_another_session_is_refused(pgbouncer, pg_url, monkeypatch):
    """The backstop when the check at lock time misses a shared session (it reached another
    idle session of the pool): the lock's next check finds its connection on another
    session than the one that took the lock."""
    key = _random_key()
    monkeypatch.setattr(LeaderLock, "_session_is_ours", lambda *_: True)
    through = make_engine(pgbouncer.url("tw_transaction"), pool_size=1, max_overflow=0)
    lock = LeaderLock(through, key=key)
    other = psycopg.connect(
        host="127.0.0.1", port=pgbouncer.port, dbname="tw_transaction", user="postgres"
    )
    try:
        assert lock.check()  # (nothing to see yet: the lock's session went back to the pool)
        # Another client's transaction takes that idle session, so the lock's next
        # transaction gets a session of its own.
        took = other.execute(
            "SELECT pg_advisory_unlock(%s, hashtext(current_database() || '.' || "
            "coalesce(current_schema(), '')))",
            (key,),
        ).fetchone()
        assert took == (True,)  # it is the session that holds the lock
        assert lock.check() is False
        assert lock.refused is not None
        assert "no longer this connection's" in lock.refused
    finally:
        other.rollback()
        other.close()
        lock.release()
        through.dispose()

"""Leader election between server replicas that share one database.

Background work (the auto-isolation policy, cluster-driver runs, command expiry, alert
delivery, pruning) must run in exactly one replica. On PostgreSQL the leader holds a
session-level advisory lock (``pg_try_advisory_lock``) on a connection of its own for as
long as it lives: the lock is released by the database when that connection closes (the
process exits or crashes, or the network drops it), so another replica takes over at its
next attempt. Source: PostgreSQL manual, "Advisory Locks" (explicit locking) — session-level
locks are held until explicitly released or the session ends.

The lock's connection comes from an engine of its own (:func:`make_lock_engine`) with TCP
keepalives on both ends, so the lock of a leader that vanished without closing its connection
(power loss, a network partition) is free within 26 s, not after the kernel's two hours (the
arithmetic is at :data:`SERVER_KEEPALIVES`).

Behind PgBouncer the lock works in session pooling mode only: in transaction (or statement)
mode a server session serves many clients in turn, so the session that took the lock goes on
holding it for whichever client it serves next (PgBouncer, "Features": session-level advisory
locks are never supported in transaction pooling). :meth:`LeaderLock.check` detects a shared
session (a second connection reaches the very session that took the lock, or the lock's own
connection reaches another one) and refuses to lead, with an error saying what to change.

On SQLite there is one server per database file (docs/design.md "Scale-out"), so the process is
always the leader.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.engine import URL

from tierwatch.server.db import make_engine

log = logging.getLogger(__name__)

# The lock is (class, object) = ("tw", hash of database + schema): one per tierwatch
# deployment, so two deployments in different schemas of one database never block each other.
LOCK_CLASS = int.from_bytes(b"tw", "big")
# The object half of every tierwatch advisory lock (this one, and the migration lock in
# migrate.py). coalesce: a search_path that names no existing schema makes current_schema()
# NULL, and the advisory lock functions are strict (NULL in, no lock taken, NULL out).
LOCK_OBJECT_SQL = "hashtext(current_database() || '.' || coalesce(current_schema(), ''))"
LOCK_SQL = f"SELECT pg_try_advisory_lock(:k, {LOCK_OBJECT_SQL}), pg_backend_pid()"
UNLOCK_SQL = f"SELECT pg_advisory_unlock(:k, {LOCK_OBJECT_SQL})"
SESSION_SQL = "SELECT pg_backend_pid()"

#: Server side (frees the lock): SET on the lock's session (PostgreSQL manual, "Connection
#: Settings": tcp_keepalives_idle/interval/count in s, tcp_user_timeout in ms; context
#: ``user``, so a session may set its own). The backend of a vanished leader is idle: it
#: probes after 10 s of silence, then every 5 s, and ends after 3 unanswered probes,
#: 10 + 3 × 5 = 25 s; tcp_user_timeout ends it when data it sent stays unacknowledged for
#: 25 s (when set, it also decides when keepalive probes give up; tcp(7), TCP_USER_TIMEOUT).
#: The lock is free ≤ 25 s after the leader vanished and a follower takes it at its next
#: check (every ``background_tick_s``, 1 s): ≤ 26 s, under a minute. (The kernel's defaults,
#: which PostgreSQL uses when these are 0: 7,200 s + 9 × 75 s, over two hours.)
SERVER_KEEPALIVES = {
    "tcp_keepalives_idle": 10,
    "tcp_keepalives_interval": 5,
    "tcp_keepalives_count": 3,
    "tcp_user_timeout": 25_000,
}
#: Client side (the old leader stops leading): libpq connection parameters (libpq manual,
#: "Parameter Key Words"). The leader's check sends a query every tick, and one left
#: unacknowledged fails after tcp_user_timeout = 15 s, so a leader cut off from the database
#: stops leading (≤ 15 s + one tick) before the server frees the lock for another (25 s).
#: keepalives (10 + 3 × 5 s) cover a connection with no check in flight; connect_timeout
#: (s) keeps a check during an outage from hanging for the kernel's connect timeout.
CLIENT_KEEPALIVES = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 15_000,
    "connect_timeout": 10,
}

SHARED_SESSION_ERROR = (
    "refusing to lead: PostgreSQL session {pid}, which took the leader lock, {how}, so a "
    "connection pooler between this server and PostgreSQL shares sessions between clients "
    "(PgBouncer pool_mode = transaction or statement). A session-level advisory lock stays "
    "with the shared session, and whichever client it serves next would hold it too. Point "
    "TIERWATCH_DATABASE_URL at PostgreSQL itself or at a PgBouncer pool with pool_mode = "
    "session, and restart; until then this replica runs no background work (policy, command "
    "expiry, cluster drivers, alerts, pruning). See docs/operations.md, 'Running several "
    "replicas'."
)


def make_lock_engine(url: str | URL) -> Engine:
    """The leader lock's own engine: at most 2 connections (the lock's, and a second one
    opened only while taking the lock, to check that its session is not shared), with the
    keepalives of :data:`CLIENT_KEEPALIVES` and, on each new session,
    :data:`SERVER_KEEPALIVES`.

    Raises:
        sqlalchemy.exc.ArgumentError: for a malformed URL.
    """
    engine = make_engine(
        url, pool_size=1, max_overflow=1, pre_ping=False, connect_args=dict(CLIENT_KEEPALIVES)
    )

    @event.listens_for(engine, "connect")
    def _server_keepalives(dbapi_conn: Any, _record: Any) -> None:
        # SET, not the libpq ``options`` startup parameter: PgBouncer refuses unknown startup
        # parameters. Committed, so the pool's reset (a rollback) does not undo it.
        with dbapi_conn.cursor() as cur:
            for name, value in SERVER_KEEPALIVES.items():
                cur.execute(f"SET {name} = {int(value)}")
        dbapi_conn.commit()

    return engine


class LeaderLock:
    """Try to become, and check whether we still are, the leader.

    Args:
        engine: the server's engine; the lock opens its own engine on the same URL
            (:func:`make_lock_engine`, at most 2 connections).
        key: the advisory lock's class (the object is the database + schema).
    """

    def __init__(self, engine: Engine, key: int = LOCK_CLASS) -> None:
        self._key = key
        self._conn: Connection | None = None
        self._pid: int | None = None
        self._refused: str | None = None
        self.is_postgres = engine.dialect.name == "postgresql"
        self._engine = make_lock_engine(engine.url) if self.is_postgres else None
        # check() and release() run on threadpool threads: a check still connecting when
        # the server stops must not take the lock after release() gave it up (the lock
        # would then be held by a connection nobody closes, and no replica could lead).
        self._mutex = threading.Lock()
        self._released = False

    @property
    def held(self) -> bool:
        """Whether this process held the lock at the last check."""
        return not self.is_postgres or self._conn is not None

    @property
    def engine(self) -> Engine | None:
        """The lock's own engine (None on SQLite, where there is no lock)."""
        return self._engine

    @property
    def refused(self) -> str | None:
        """Why this process refuses to lead for good (a pooler that shares sessions), or None."""
        return self._refused

    def check(self) -> bool:
        """Keep or try to take the lock; True when this process is the leader now.

        A broken lock connection means the lock is gone: it is dropped and retaken on a new
        connection if no other replica holds it. Never raises (a database outage makes this
        process a follower until it is back). After ``release``, and once a shared session
        was detected (:attr:`refused`, logged as an error), it is always False.
        """
        if not self.is_postgres:
            return True
        with self._mutex:
            if self._released:
                return False
            return self._check()

    def _check(self) -> bool:
        assert self._engine is not None
        if self._refused is not None:
            return False
        if self._conn is not None:
            try:
                # Committed each time: a session left idle in a transaction would be ended by
                # idle_in_transaction_session_timeout, and the lock with it.
                pid = self._conn.execute(text(SESSION_SQL)).scalar()
                self._conn.commit()
            except Exception:  # noqa: BLE001 - the session (and its lock) is gone
                log.warning("lost the leader lock connection; trying to take the lock again")
                self._drop()
            else:
                if pid == self._pid:
                    return True
                # The same client connection reaches another session: a pooler hands
                # sessions out per transaction. The lock stays with the first one.
                self._refuse(self._pid, f"is no longer this connection's (now session {pid})")
                self._drop()
                return False
        try:
            conn = self._engine.connect()
        except Exception:  # noqa: BLE001
            log.warning("cannot reach the database to take the leader lock", exc_info=True)
            return False
        try:
            got, pid = conn.execute(text(LOCK_SQL), {"k": self._key}).one()
            conn.commit()
        except Exception:  # noqa: BLE001
            log.warning("taking the leader lock failed", exc_info=True)
            conn.invalidate()
            conn.close()
            return False
        if not got:
            conn.close()
            return False
        if not self._session_is_ours(conn, pid):
            return False
        self._conn, self._pid = conn, pid
        log.info("this replica is now the leader (runs policy, expiry, drivers, alerts, pruning)")
        return True

    def _session_is_ours(self, conn: Connection, pid: int) -> bool:
        """Whether session ``pid`` (which has just taken the lock on ``conn``) serves ``conn``
        alone. A second connection opened now reaches another session when nothing shares
        sessions (a direct connection, PgBouncer's session mode: a session belongs to one
        client while it is connected). A pooler in transaction mode hands the idle session
        to the next client, so the second connection reaches ``pid`` itself: the lock is
        unlocked from there and the lock refused for good. If the check cannot be made the
        lock is given back (tried again at the next check)."""
        assert self._engine is not None
        try:
            probe = self._engine.connect()
        except Exception:  # noqa: BLE001
            log.warning("cannot check the leader lock's session; not leading yet", exc_info=True)
            self._give_back(conn)
            return False
        try:
            # One transaction: a transaction-mode pooler keeps one session for all of it.
            other = probe.execute(text(SESSION_SQL)).scalar()
            if other == pid:
                probe.execute(text(UNLOCK_SQL), {"k": self._key})
            probe.commit()
        except Exception:  # noqa: BLE001
            log.warning("cannot check the leader lock's session; not leading yet", exc_info=True)
            self._give_back(conn)
            return False
        finally:
            probe.detach()  # closed for good, not kept idle beside the lock's connection
            probe.close()
        if other != pid:
            return True
        self._refuse(pid, "also serves another connection of this server")
        conn.close()
        return False

    def _refuse(self, pid: int | None, how: str) -> None:
        self._refused = SHARED_SESSION_ERROR.format(pid=pid, how=how)
        log.error(self._refused)

    def _give_back(self, conn: Connection) -> None:
        try:
            conn.execute(text(UNLOCK_SQL), {"k": self._key})
            conn.commit()
            conn.close()
        except Exception:  # noqa: BLE001 - closing the session frees the lock too
            conn.invalidate()
            conn.close()

    def _drop(self) -> None:
        conn, self._conn, self._pid = self._conn, None, None
        if conn is not None:
            try:
                conn.invalidate()
                conn.close()
            except Exception:  # noqa: BLE001
                pass

    def release(self) -> None:
        """Give the lock up for good (on shutdown): later ``check`` calls return False.

        Waits for a ``check`` in progress on another thread to finish first.
        """
        with self._mutex:
            self._released = True
            self._unlock()
            if self._engine is not None:
                self._engine.dispose()

    def _unlock(self) -> None:
        if self._conn is not None:
            try:
                self._conn.execute(text(UNLOCK_SQL), {"k": self._key})
                self._conn.commit()
            except Exception:  # noqa: BLE001
                pass
            self._drop()

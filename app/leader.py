"""Leader election between server replicas that share one database.

Background work (the auto-isolation policy, cluster-driver runs, command expiry, alert
delivery, pruning) must run in exactly one replica. On PostgreSQL the leader holds a
session-level advisory lock (``pg_try_advisory_lock``) on a connection of its own for as
long as it lives: the lock is released by the database when that connection closes (the
process exits or crashes, or the network drops it), so another replica takes over at its
next attempt. Source: PostgreSQL manual, "Advisory Locks" (explicit locking) — session-level
locks are held until explicitly released or the session ends.

On SQLite there is one server per database file (docs/design.md "Scale-out"), so the process is
always the leader.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import Connection, Engine, text

log = logging.getLogger(__name__)

# The lock is (class, object) = ("tw", hash of database + schema): one per tierwatch
# deployment, so two deployments in different schemas of one database never block each other.
LOCK_CLASS = int.from_bytes(b"tw", "big")
LOCK_SQL = (
    "SELECT pg_try_advisory_lock(:k, hashtext(current_database() || '.' || current_schema()))"
)
UNLOCK_SQL = (
    "SELECT pg_advisory_unlock(:k, hashtext(current_database() || '.' || current_schema()))"
)


class LeaderLock:
    """Try to become, and check whether we still are, the leader.

    Args:
        engine: the server's engine (a dedicated connection is taken from it).
        key: the advisory lock's class (the object is the database + schema).
    """

    def __init__(self, engine: Engine, key: int = LOCK_CLASS) -> None:
        self._engine = engine
        self._key = key
        self._conn: Connection | None = None
        self.is_postgres = engine.dialect.name == "postgresql"
        # check() and release() run on threadpool threads: a check still connecting when
        # the server stops must not take the lock after release() gave it up (the lock
        # would then be held by a connection nobody closes, and no replica could lead).
        self._mutex = threading.Lock()
        self._released = False

    @property
    def held(self) -> bool:
        """Whether this process held the lock at the last check."""
        return not self.is_postgres or self._conn is not None

    def check(self) -> bool:
        """Keep or try to take the lock; True when this process is the leader now.

        A broken lock connection means the lock is gone: it is dropped and retaken on a new
        connection if no other replica holds it. Never raises (a database outage makes this
        process a follower until it is back). After ``release`` it is always False.
        """
        if not self.is_postgres:
            return True
        with self._mutex:
            if self._released:
                return False
            return self._check()

    def _check(self) -> bool:
        if self._conn is not None:
            try:
                self._conn.execute(text("SELECT 1"))
                return True
            except Exception:  # noqa: BLE001 - the session (and its lock) is gone
                log.warning("lost the leader lock connection; trying to take the lock again")
                self._drop()
        try:
            conn = self._engine.connect()
        except Exception:  # noqa: BLE001
            log.warning("cannot reach the database to take the leader lock", exc_info=True)
            return False
        try:
            got = conn.execute(text(LOCK_SQL), {"k": self._key}).scalar()
            conn.commit()
        except Exception:  # noqa: BLE001
            log.warning("taking the leader lock failed", exc_info=True)
            conn.close()
            return False
        if got:
            self._conn = conn
            log.info(
                "this replica is now the leader (runs policy, expiry, drivers, alerts, pruning)"
            )
            return True
        conn.close()
        return False

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
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

    def _unlock(self) -> None:
        if self._conn is not None:
            try:
                self._conn.execute(text(UNLOCK_SQL), {"k": self._key})
                self._conn.commit()
            except Exception:  # noqa: BLE001
                pass
            self._drop()

"""Run Alembic migrations programmatically (``tierwatch-server migrate``).

Several replicas started at once all migrate first (``tierwatch-server serve`` does unless
``--no-migrate``), so :func:`upgrade` runs under a lock and the others wait, then find the
schema at head and do nothing:

- PostgreSQL: a session-level advisory lock, class ``"tm"`` (the leader lock's is ``"tw"``)
  and object the database + schema (:data:`tierwatch.server.leader.LOCK_OBJECT_SQL`), held
  on the connection the migration runs on. Without it two migrators on a fresh schema both
  see no ``alembic_version`` table and both create it; the second fails on the catalog's
  unique index once the first commits. (PostgreSQL manual, "Advisory Locks": a session
  lock is held until released or the session ends, so a migrator that dies frees it.)
- SQLite: an exclusive ``flock(2)`` on ``<database file>.migrate-lock`` beside the file.
  Alembic runs SQLite DDL outside a transaction (pysqlite begins one only before DML), so
  the database's own locks do not keep two migrators apart. An in-memory database is one
  connection's own: no lock.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, text

from tierwatch.server.db import make_engine
from tierwatch.server.leader import LOCK_OBJECT_SQL
from tierwatch.server.resources import resource_dir

log = logging.getLogger(__name__)

MIGRATION_LOCK_CLASS = int.from_bytes(b"tm", "big")
_TRY_LOCK_SQL = f"SELECT pg_try_advisory_lock(:k, {LOCK_OBJECT_SQL})"
_LOCK_SQL = f"SELECT pg_advisory_lock(:k, {LOCK_OBJECT_SQL})"
_UNLOCK_SQL = f"SELECT pg_advisory_unlock(:k, {LOCK_OBJECT_SQL})"


def alembic_config(database_url: str) -> Config:
    """An Alembic config pointing at the packaged migrations and ``database_url``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(resource_dir("migrations")))
    cfg.attributes["database_url"] = database_url
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    """Upgrade the database at ``database_url`` to ``revision``, under the migration lock
    (waits while another process migrates the same database + schema). Opens one connection.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database cannot be reached or a migration fails
            (the lock is released either way).
        OSError: SQLite: the lock file beside the database cannot be created.
    """
    engine = make_engine(database_url, pool_size=1, max_overflow=0)
    try:
        with migration_lock(engine) as conn:
            cfg = alembic_config(database_url)
            cfg.attributes["connection"] = conn  # migrations/env.py runs on it
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()


@contextmanager
def migration_lock(engine: Engine) -> Iterator[Connection]:
    """Hold the migration lock of ``engine``'s database (+ schema); yields a connection of
    ``engine`` (on PostgreSQL, the one that holds the lock). Blocks while another process
    holds it.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database cannot be reached.
        OSError: SQLite: the lock file cannot be created or locked.
    """
    if engine.dialect.name == "postgresql":
        with engine.connect() as conn:
            got = conn.execute(text(_TRY_LOCK_SQL), {"k": MIGRATION_LOCK_CLASS}).scalar()
            conn.commit()
            if not got:
                log.info("another process is migrating this database schema; waiting for it")
                conn.execute(text(_LOCK_SQL), {"k": MIGRATION_LOCK_CLASS})
                conn.commit()
            try:
                yield conn
            finally:
                _unlock(conn)
        return
    path = sqlite_lock_path(engine)
    if path is None:
        with engine.connect() as conn:
            yield conn
        return
    with path.open("a+b") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file is closed
        with engine.connect() as conn:
            yield conn


def sqlite_lock_path(engine: Engine) -> Path | None:
    """The SQLite migration lock file (``<database file>.migrate-lock``); None for an
    in-memory database."""
    database = engine.url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    db = Path(database)
    return db.with_name(db.name + ".migrate-lock")


def _unlock(conn: Connection) -> None:
    try:
        if conn.in_transaction():
            conn.rollback()
        conn.execute(text(_UNLOCK_SQL), {"k": MIGRATION_LOCK_CLASS})
        conn.commit()
    except Exception:  # noqa: BLE001 - the session ends with engine.dispose(), and the lock with it
        log.warning("could not release the migration lock; closing its connection", exc_info=True)
        conn.invalidate()

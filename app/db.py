"""Database engine, sessions and the declarative base.

SQLite (the embedded default) and PostgreSQL are both supported through plain SQLAlchemy URLs.
Times are stored as UTC and always come back timezone-aware (:class:`UTCDateTime`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from sqlalchemy import DateTime, Engine, MetaData, create_engine, event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, CursorResult, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.pool import QueuePool
from sqlalchemy.types import TypeDecorator

# The request pool of one replica (``TIERWATCH_DB_POOL_SIZE`` / ``TIERWATCH_DB_MAX_OVERFLOW``):
# sized so that three replicas fit PostgreSQL's default max_connections (100) with room to
# spare (docs/operations.md, "Running several replicas": the connection budget).
DEFAULT_POOL_SIZE = 10
DEFAULT_MAX_OVERFLOW = 15

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base with a constraint naming convention (stable Alembic diffs)."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp stored as UTC that is always returned timezone-aware.

    SQLite has no time zone type; values are normalised to UTC on the way in and tagged
    UTC on the way out.

    Raises:
        ValueError: when a naive datetime is bound (ambiguous: refuse rather than guess).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime bound to a UTC column; pass an aware datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:  # noqa: ARG002
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def make_engine(
    url: str | URL,
    *,
    echo: bool = False,
    pool_size: int = DEFAULT_POOL_SIZE,
    max_overflow: int = DEFAULT_MAX_OVERFLOW,
    pre_ping: bool = True,
    connect_args: dict[str, Any] | None = None,
) -> Engine:
    """Create an engine for a plain SQLAlchemy URL.

    SQLite gets WAL mode, foreign keys and a busy timeout, and its parent folder is created;
    PostgreSQL gets a pre-ping pool of ``pool_size`` connections kept open plus up to
    ``max_overflow`` more opened under load (at most ``pool_size + max_overflow`` at once;
    SQLAlchemy's ``QueuePool``), and ``connect_args`` go to ``psycopg.connect`` as libpq
    connection parameters (e.g. ``keepalives_idle``).

    Raises:
        sqlalchemy.exc.ArgumentError: for a malformed URL.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ArgumentError(
            f"unsupported database {parsed.get_backend_name()!r}: tierwatch runs on SQLite or "
            "PostgreSQL"
        )
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            parsed, echo=echo, connect_args={"check_same_thread": False, "timeout": 30}
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    # The request pool is smaller than anyio's 40 worker threads: several replicas must fit
    # max_connections, so under a burst a thread may wait for a connection (pool_timeout, 30 s).
    return create_engine(
        parsed,
        echo=echo,
        pool_pre_ping=pre_ping,
        pool_size=pool_size,
        max_overflow=max_overflow,
        connect_args=connect_args or {},
    )


def pool_capacity(engine: Engine | None) -> int:
    """The most PostgreSQL connections ``engine`` can hold open at once.

    ``pool_size + max_overflow`` of its ``QueuePool`` (every PostgreSQL engine that
    :func:`make_engine` creates); 0 for None and for SQLite (a file has no connection limit).

    Raises:
        TypeError: for a PostgreSQL engine whose pool has no bound (not a ``QueuePool``, or
            one with unlimited overflow).
    """
    if engine is None or engine.dialect.name != "postgresql":
        return 0
    pool = engine.pool
    overflow = getattr(pool, "_max_overflow", -1)  # QueuePool's; -1: unlimited
    if not isinstance(pool, QueuePool) or overflow < 0:
        raise TypeError(f"{type(pool).__name__} (max_overflow {overflow}) has no connection bound")
    return int(pool.size() + overflow)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """A session factory that keeps loaded objects usable after commit."""
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session committed on success and rolled back on error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def execute_dml(session: Session, stmt: Any) -> int:
    """Run an UPDATE or DELETE and return how many rows it matched (the driver's rowcount).

    ``Session.execute`` is typed to return a plain ``Result``; DML gives a ``CursorResult``,
    which carries the count.
    """
    result = cast(CursorResult[Any], session.execute(stmt))
    return int(result.rowcount or 0)


def insert_ignore(session: Session, table: Any, values: dict[str, Any]) -> bool:
    """Insert one row unless it collides with a unique key; True when it was inserted.

    Uses ``INSERT … ON CONFLICT DO NOTHING RETURNING`` on both SQLite and PostgreSQL, so a
    replayed row costs one statement and no savepoint.
    """
    dialect = session.get_bind().dialect.name
    insert_fn = postgresql.insert if dialect == "postgresql" else sqlite.insert
    key = next(iter(table.primary_key.columns))
    stmt = insert_fn(table).values(**values).on_conflict_do_nothing().returning(key)
    # RETURNING, not rowcount: psycopg reports no reliable rowcount for a skipped insert.
    return session.execute(stmt).first() is not None

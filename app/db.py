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
from sqlalchemy.engine import CursorResult, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.types import TypeDecorator

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
    url: str,
    *,
    echo: bool = False,
    pool_size: int = 10,
    max_overflow: int = 40,
    pre_ping: bool = True,
) -> Engine:
    """Create an engine for a plain SQLAlchemy URL.

    SQLite gets WAL mode, foreign keys and a busy timeout, and its parent folder is created;
    PostgreSQL gets a pre-ping pool.

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
    # Room for every worker thread (anyio's default limiter: 40) plus the ingest writer, so
    # threads never queue for a connection behind each other.
    return create_engine(
        parsed, echo=echo, pool_pre_ping=pre_ping, pool_size=pool_size, max_overflow=max_overflow
    )


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

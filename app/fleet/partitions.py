"""Time partitions of ``gpu_samples`` on PostgreSQL: creation ahead of time, retention by drop.

On PostgreSQL ``gpu_samples`` is declared ``PARTITION BY RANGE (ts)`` (migration 0012) with
one partition per UTC hour, named ``gpu_samples_pYYYYMMDDtHH`` after the hour it starts, and
a ``gpu_samples_default`` partition that catches rows no hourly partition covers (a spool
replaying days-old batches, an agent clock far ahead). Hourly, so retention is exact to an
hour without DELETE: an hour whose end is older than the retention cut is dropped whole, which
leaves no dead rows for VACUUM to find. At 20,000 GPUs with full samples every 60 s an hour is
about 1.2 M rows. The PostgreSQL manual ("Table Partitioning", "Partition Maintenance")
recommends exactly this for time-series retention.

SQLite has the same columns in one unpartitioned table; there :func:`drop_expired` is a
``DELETE ... WHERE ts < cut``.

Locking: a partition is built as a plain table and then attached, which takes only a SHARE
UPDATE EXCLUSIVE lock on ``gpu_samples`` (ingest's inserts go on) and an ACCESS EXCLUSIVE
lock on the default partition while PostgreSQL checks it holds no row of the new range (rows
that do are moved first). Dropping a partition takes an ACCESS EXCLUSIVE lock on
``gpu_samples`` for the moment of the drop. Each step runs with ``lock_timeout``
(:data:`LOCK_TIMEOUT_MS`), so a long query holding the table cannot make ingest queue behind a
waiting DDL; a step that times out is retried at the next maintenance pass.

The pure planning functions take and return partition start times (UTC, on the hour).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, text
from sqlalchemy.exc import OperationalError, ProgrammingError

log = logging.getLogger(__name__)

PARENT = "gpu_samples"
DEFAULT_PARTITION = "gpu_samples_default"
PARTITION_S = 3600
WIDTH = timedelta(seconds=PARTITION_S)
# Partitions exist this far ahead of now, so the hour boundary never sends rows to the
# default partition even when maintenance is late by an hour.
AHEAD = timedelta(hours=3)
LOCK_TIMEOUT_MS = 2000
_NAME = re.compile(r"^gpu_samples_p(\d{8})t(\d{2})$")


def partition_start(ts: datetime) -> datetime:
    """The start of the hourly partition holding ``ts`` (UTC, truncated to the hour).

    Raises:
        ValueError: ``ts`` is naive.
    """
    if ts.tzinfo is None:
        raise ValueError("partition_start needs an aware datetime")
    return ts.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def partition_name(start: datetime) -> str:
    """``gpu_samples_pYYYYMMDDtHH`` for the partition starting at ``start`` (UTC hour)."""
    return f"{PARENT}_p{start.astimezone(UTC):%Y%m%d}t{start.astimezone(UTC):%H}"


def parse_partition_name(name: str) -> datetime | None:
    """The start of the hourly partition named ``name``; None for any other name."""
    m = _NAME.match(name)
    if m is None:
        return None
    try:
        return datetime.strptime(m.group(1) + m.group(2), "%Y%m%d%H").replace(tzinfo=UTC)
    except ValueError:
        return None


def is_partition_table(name: str | None) -> bool:
    """True for the hourly and default partitions (alembic's autogenerate skips them: they
    are not in the models, ``gpu_samples`` is)."""
    if name is None:
        return False
    return name == DEFAULT_PARTITION or parse_partition_name(name) is not None


def missing_starts(
    existing: Iterable[datetime], *, since: datetime, until: datetime
) -> list[datetime]:
    """Hour starts in ``[partition_start(since), until)`` with no partition yet, oldest first."""
    have = set(existing)
    out = []
    t = partition_start(since)
    while t < until:
        if t not in have:
            out.append(t)
        t += WIDTH
    return out


def expired_starts(existing: Iterable[datetime], *, cut: datetime) -> list[datetime]:
    """Partitions whose every row is older than ``cut`` (the hour ends at or before it)."""
    return sorted(s for s in existing if s + WIDTH <= cut)


def include_in_autogenerate(
    obj: object, name: str | None, type_: str, _reflected: bool, _compare_to: object
) -> bool:
    """Alembic ``include_object`` hook: leave the partitions (and their indexes) out of
    autogenerate's comparison, which knows only the parent table."""
    if type_ == "table":
        return not is_partition_table(name)
    table = getattr(obj, "table", None)
    return not is_partition_table(getattr(table, "name", None))


# --- I/O (PostgreSQL) ---------------------------------------------------------------------


@dataclass
class MaintenanceResult:
    """What one :func:`maintain` pass did."""

    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    rows_dropped: int = 0
    moved_from_default: int = 0
    skipped: list[str] = field(default_factory=list)  # steps that hit lock_timeout


def existing_partitions(conn: Connection) -> dict[datetime, str]:
    """Hourly partitions of ``gpu_samples`` in the current schema: start -> table name."""
    rows = conn.execute(
        text(
            "SELECT c.relname FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent "
            "JOIN pg_namespace n ON n.oid = p.relnamespace "
            "WHERE p.relname = :parent AND n.nspname = current_schema()"
        ),
        {"parent": PARENT},
    )
    out = {}
    for (name,) in rows:
        start = parse_partition_name(name)
        if start is not None:
            out[start] = name
    return out


def create_partition(conn: Connection, start: datetime) -> int:
    """Create and attach the hourly partition starting at ``start``, moving into it the rows
    of its hour that sit in the default partition. Runs in (and commits) its own transaction
    on ``conn``.

    Returns:
        The number of rows moved from the default partition.

    Raises:
        sqlalchemy.exc.OperationalError: ``lock_timeout`` expired (nothing changed).
    """
    name = partition_name(start)
    end = start + WIDTH
    bounds = {"lo": start, "hi": end}
    with conn.begin():
        conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
        conn.execute(
            text(f'CREATE TABLE "{name}" (LIKE {PARENT} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)')
        )
        moved = conn.execute(
            text(
                f"WITH m AS (DELETE FROM {DEFAULT_PARTITION} WHERE ts >= :lo AND ts < :hi "
                f'RETURNING *) INSERT INTO "{name}" SELECT * FROM m'
            ),
            bounds,
        ).rowcount
        conn.execute(
            text(
                f'ALTER TABLE {PARENT} ATTACH PARTITION "{name}" '
                f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
            )
        )
    return int(moved or 0)


def drop_partition(conn: Connection, name: str) -> int:
    """Drop one partition (its own transaction on ``conn``); returns the rows it held.

    Raises:
        sqlalchemy.exc.OperationalError: ``lock_timeout`` expired (nothing dropped).
    """
    with conn.begin():
        conn.execute(text(f"SET LOCAL lock_timeout = {LOCK_TIMEOUT_MS}"))
        rows = conn.scalar(text(f'SELECT count(*) FROM "{name}"')) or 0
        conn.execute(text(f'DROP TABLE "{name}"'))
    return int(rows)


def maintain(conn: Connection, *, now: datetime, cut: datetime | None) -> MaintenanceResult:
    """One maintenance pass: create the partitions from the previous hour to ``now + AHEAD``,
    then (with a
    ``cut``) drop the ones wholly older than ``cut`` and delete older rows from the default
    partition. Each step has its own transaction; one that hits ``lock_timeout`` is skipped
    (logged, listed in the result) and retried at the next pass.

    ``conn`` must not be inside a transaction. Only for PostgreSQL.
    """
    result = MaintenanceResult()
    existing = existing_partitions(conn)
    conn.commit()
    # From the previous hour (reports of its last minutes may still arrive) on; older gaps
    # are not filled: rows for them, rare, go to the default partition.
    for start in missing_starts(existing, since=now - WIDTH, until=now + AHEAD):
        try:
            result.moved_from_default += create_partition(conn, start)
            result.created.append(partition_name(start))
        except (OperationalError, ProgrammingError) as exc:
            # lock_timeout, or another process (a cron'd `prune`, a second leader pass)
            # created the same hour first (DuplicateTable): either way, next pass
            result.skipped.append(f"create {partition_name(start)}: {exc.orig}")
            log.warning("gpu_samples: creating %s gave up: %s", partition_name(start), exc.orig)
    if cut is None:
        return result
    for start in expired_starts(existing, cut=cut):
        name = existing[start]
        try:
            result.rows_dropped += drop_partition(conn, name)
            result.dropped.append(name)
        except (OperationalError, ProgrammingError) as exc:  # lock_timeout, or dropped already
            result.skipped.append(f"drop {name}: {exc.orig}")
            log.warning("gpu_samples: dropping %s gave up: %s", name, exc.orig)
    with conn.begin():
        result.rows_dropped += int(
            conn.execute(
                text(f"DELETE FROM {DEFAULT_PARTITION} WHERE ts < :cut"), {"cut": cut}
            ).rowcount
            or 0
        )
    return result

"""5-minute rollups of the raw GPU samples, for the long-range node charts.

The leader rolls up every closed bucket: a bucket ``[b, b + ROLLUP_S)`` is closed once
``now >= b + ROLLUP_S + ROLLUP_LAG_S`` (reports arrive up to one interval late; the lag is a
few intervals). Each bucket becomes one ``gpu_sample_rollups`` row per GPU that has samples
in it: the mean of each gauge (temperatures, power, utilization, memory), the maximum of
each counter and flag (counters only grow, so the maximum is the bucket's last value), and
``samples``, the raw rows it summarises. A bucket is written at most once, so raw rows that
arrive later than the lag (a spool backfilled after an outage) are in the raw history but not
in the rollups; the charts read raw rows for every range the raw history still covers
(:func:`tierwatch.server.fleet.service.query_samples`), so this only shows in ranges older
than ``sample_retention_s``.

Work per pass is bounded (:data:`MAX_BUCKETS_PER_PASS`), so a leader that was down catches
up over a few passes instead of one long transaction. At 20,000 GPUs and one sample a minute,
a bucket is 100,000 raw rows grouped into 20,000 rollup rows.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import Integer, cast, delete, func, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tierwatch.server.fleet.models import (
    BOOL_METRICS,
    METRIC_FIELDS,
    GpuSampleRollup,
    GpuSampleRow,
)

ROLLUP_S = 300
ROLLUP_LAG_S = 120
MAX_BUCKETS_PER_PASS = 36  # 3 h of buckets
GAUGES = frozenset(
    {
        "temperature_c",
        "slowdown_temp_c",
        "shutdown_temp_c",
        "power_w",
        "power_limit_w",
        "utilization_pct",
        "memory_used_mib",
        "memory_total_mib",
    }
)
if not GAUGES <= set(METRIC_FIELDS):  # pragma: no cover - a renamed metric
    raise RuntimeError(f"rollup gauges not in METRIC_FIELDS: {sorted(GAUGES - set(METRIC_FIELDS))}")


def bucket_start(ts: datetime) -> datetime:
    """The start of the :data:`ROLLUP_S` bucket holding ``ts`` (UTC, epoch-aligned)."""
    epoch = int(ts.timestamp())
    return datetime.fromtimestamp(epoch - epoch % ROLLUP_S, UTC)


def due_buckets(*, rolled_up_to: datetime | None, now: datetime) -> list[datetime]:
    """Bucket starts to roll up now, oldest first, at most :data:`MAX_BUCKETS_PER_PASS`.

    Args:
        rolled_up_to: the newest bucket already handled; None: none yet, so start with the
            :data:`MAX_BUCKETS_PER_PASS` newest closed buckets (older raw history is still
            charted from the raw rows while it is retained).
        now: the current time (UTC).
    """
    step = timedelta(seconds=ROLLUP_S)
    last_closed = bucket_start(now - timedelta(seconds=ROLLUP_S + ROLLUP_LAG_S))
    if rolled_up_to is None:
        first = last_closed - (MAX_BUCKETS_PER_PASS - 1) * step
    else:
        first = rolled_up_to + step
    out: list[datetime] = []
    b = first
    while b <= last_closed and len(out) < MAX_BUCKETS_PER_PASS:
        out.append(b)
        b += step
    return out


def _aggregate(field: str):  # type: ignore[no-untyped-def]
    col = getattr(GpuSampleRow, field)
    if field in GAUGES:
        return func.avg(col)
    if field in BOOL_METRICS:
        return func.max(cast(col, Integer)) > 0
    return func.max(col)


def roll_up(session: Session, *, now: datetime, after: datetime | None = None) -> datetime | None:
    """Roll up the closed buckets after ``after``; commits once per bucket.

    Args:
        after: the newest bucket this process already handled (what the previous call
            returned); None: resume after the table's newest bucket. A bucket with no raw
            rows writes nothing, so only the caller's value moves past it.

    Returns:
        The newest bucket handled (pass it back next time), or ``after`` if none was due.
    """
    if after is None:
        after = session.scalar(select(func.max(GpuSampleRollup.bucket)))
    cols = ["node_id", "gpu_index", "bucket", "samples", *METRIC_FIELDS]
    dialect = session.get_bind().dialect.name
    insert_fn = postgresql.insert if dialect == "postgresql" else sqlite.insert
    for b in due_buckets(rolled_up_to=after, now=now):
        end = b + timedelta(seconds=ROLLUP_S)
        q = (
            select(
                GpuSampleRow.node_id,
                GpuSampleRow.gpu_index,
                literal(b, GpuSampleRollup.bucket.type),
                func.count(),
                *(_aggregate(f) for f in METRIC_FIELDS),
            )
            .where(GpuSampleRow.ts >= b, GpuSampleRow.ts < end)
            .group_by(GpuSampleRow.node_id, GpuSampleRow.gpu_index)
        )
        # A bucket is written once; a second leader pass over it (leadership moved) is a no-op.
        stmt = insert_fn(GpuSampleRollup).from_select(cols, q).on_conflict_do_nothing()
        session.execute(stmt)
        session.commit()
        after = b
    return after


def prune(session: Session, *, cut: datetime) -> int:
    """Delete rollup rows of buckets older than ``cut``; returns the rows deleted.

    The newest bucket is kept whatever its age: it is the watermark :func:`roll_up` resumes
    from.
    """
    newest = session.scalar(select(func.max(GpuSampleRollup.bucket)))
    if newest is None:
        return 0
    result = session.execute(
        delete(GpuSampleRollup).where(GpuSampleRollup.bucket < cut, GpuSampleRollup.bucket < newest)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]

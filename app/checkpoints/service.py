"""Read side of the checkpoint ledger: job status per tier, lag, work at risk, interval
advice, history for charts, and pruning.

Definitions (see ``ledger`` for the pure rules):

- training step: the job's highest reported step.
- newest committed step of a tier: the newest ledger row that is complete and not abandoned
  by a restore, evicted or not (``ledger.newest_committed_step``); memory's is raised to the
  tiers fed from it (``ledger.with_memory_floor``).
- lag: ``training_step − newest`` steps (``training_step + 1`` with none); in seconds, the
  time between when the two steps were trained (both seen in progress history), else
  ``lag_steps × median step time``.
- size, commit time, throughput of a tier: of its newest committed step; throughput =
  ``bytes / seconds`` (bytes/s), ``seconds`` being the slowest rank's commit time.
- interval advice per tier (``advice.advise``): Young (1974) τ = √(2δM) refined by Daly
  (2006), never below the tier's commit time. δ = median ``blocking_s`` of the job's
  recent ``staged`` events in that tier (when the agent reports none for the tier: of
  all the job's staged events, since every checkpoint starts with one staged save);
  commit floor = median ``seconds`` of the tier's recent ``committed`` events; gpus =
  world_size; M = the observed MTBF of the failures the tier serves when the job has
  seen at least ``ledger.MIN_OBSERVED_FAILURES`` of them (restore incidents classified by
  the slowest tier they read, over the job's observed time; ``mtbf_source`` "observed"),
  else the Llama 3 table's rate for that class scaled to the job's GPUs
  (``llama3_table``). The interval in steps is ``recommended_s / median step time``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session, aliased

from tierwatch.server.checkpoints import advice, ledger
from tierwatch.server.checkpoints.models import (
    CheckpointEventRow,
    Job,
    LedgerRow,
    ProgressRow,
    RankCommit,
    RestoreRow,
)
from tierwatch.server.fleet.models import Node
from tierwatch.server.fleet.service import NotFoundError

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
JOB_ID_RE = re.compile(JOB_ID_PATTERN)

RECENT_EVENTS = 20  # staged/committed events a median is taken over
STEP_TIME_SAMPLES = 50  # progress reports the median step time is taken over
EVENT_LIMIT = 50
RESTORE_LIMIT = 20
MISSING_RANKS_SHOWN = 64
HISTORY_MAX_POINTS = 2000
MTBF_SOURCE = "llama3_table"
FAILURE_LIMIT = 20

__all__ = ["NotFoundError", "get_job", "job_status", "list_jobs", "job_history", "prune"]


def get_job(session: Session, job_id: str) -> Job:
    """The job named ``job_id``.

    Raises:
        NotFoundError: no job has that id (a malformed id is never sent to the database).
    """
    job = None
    if JOB_ID_RE.match(job_id):
        job = session.scalar(select(Job).where(Job.job_id == job_id))
    if job is None:
        raise NotFoundError(
            f"no job {job_id!r}: jobs appear once they register "
            f"(POST /api/v1/jobs/{job_id}/credential or `tierwatch-server job credential`)"
        )
    return job


@dataclass
class _JobFacts:
    """What every tier computation of one job needs, read once."""

    job: Job
    step_time_s: float | None  # median of recent progress reports (s/step)
    step_trained_at: dict[int, datetime]  # step -> earliest progress time reporting it


def _median_step_time(session: Session, job: Job) -> float | None:
    values = session.scalars(
        select(ProgressRow.step_time_s)
        .where(ProgressRow.job_pk == job.id, ProgressRow.step_time_s.is_not(None))
        .order_by(ProgressRow.ts.desc())
        .limit(STEP_TIME_SAMPLES)
    ).all()
    return ledger.median(values) if values else job.step_time_s


def _trained_at(session: Session, job: Job, steps: set[int]) -> dict[int, datetime]:
    if not steps:
        return {}
    q = (
        select(ProgressRow.step, func.min(ProgressRow.ts))
        .where(ProgressRow.job_pk == job.id, ProgressRow.step.in_(steps))
        .group_by(ProgressRow.step)
    )
    return dict(session.execute(q).all())  # type: ignore[arg-type]


def _abandoned() -> Any:
    """SQL for ``ledger.abandoned`` of a ``LedgerRow``: a successful restore of the job
    loaded an older step at or after the row's (newest counted) commit."""
    restore = aliased(RestoreRow)
    return (
        select(restore.id)
        .where(
            restore.job_pk == LedgerRow.job_pk,
            restore.ok.is_(True),
            restore.step.is_not(None),
            restore.step < LedgerRow.step,
            restore.ts >= LedgerRow.committed_at,
        )
        .exists()
    )


def _counted(query: Any) -> Any:
    """``query`` over ``LedgerRow`` restricted to the rows that count as committed: complete
    and not abandoned (``ledger.newest_committed_step``; retention evictions do not matter)."""
    return query.where(LedgerRow.complete.is_(True), ~_abandoned())


@dataclass
class _Newest:
    """A tier's newest committed step and the figures shown with it: when it became
    committed, its size (bytes) and the tier's commit time (seconds).

    For memory raised to a fed tier's step (the ranks' own memory events are late), the
    commit time and size are the fed tier's (memory committed the same files before it) and
    the commit seconds unknown (None)."""

    step: int
    committed_at: datetime | None
    bytes: int | None
    seconds: float | None

    @classmethod
    def of(cls, row: LedgerRow) -> _Newest:
        return cls(row.step, row.committed_at, row.bytes, row.seconds)


def _newest_rows(session: Session, job: Job) -> dict[str, _Newest]:
    """Newest committed step per tier (see the module docstring), with its figures.

    One indexed query per tier: newest step first, the first row that counts."""
    own: dict[str, LedgerRow] = {}
    for tier in ledger.TIERS:
        q = _counted(select(LedgerRow).where(LedgerRow.job_pk == job.id, LedgerRow.tier == tier))
        row = session.scalar(q.order_by(LedgerRow.step.desc()).limit(1))
        if row is not None:
            own[tier] = row
    out = {t: _Newest.of(r) for t, r in own.items()}
    step = ledger.with_memory_floor({t: r.step for t, r in own.items()})["memory"]
    if step is not None and ("memory" not in own or own["memory"].step != step):
        fed = next(r for r in own.values() if r.step == step)
        out["memory"] = _Newest(step, fed.committed_at, fed.bytes, None)
    return out


def _lag(facts: _JobFacts, newest_step: int | None) -> tuple[int | None, float | None]:
    job = facts.job
    steps = ledger.lag_steps(job.step, newest_step)
    gap = None
    if newest_step is not None and job.step is not None:
        t_now, t_then = facts.step_trained_at.get(job.step), facts.step_trained_at.get(newest_step)
        if t_now is not None and t_then is not None:
            gap = (t_now - t_then).total_seconds()
    return steps, ledger.lag_seconds(steps, facts.step_time_s, gap)


def _facts(session: Session, job: Job, newest: dict[str, _Newest]) -> _JobFacts:
    steps = {r.step for r in newest.values()}
    if job.step is not None:
        steps.add(job.step)
    return _JobFacts(job, _median_step_time(session, job), _trained_at(session, job, steps))


def _tier_summary(facts: _JobFacts, row: _Newest | None) -> dict[str, Any]:
    steps, seconds = _lag(facts, row.step if row else None)
    return {
        "newest_step": row.step if row else None,
        "committed_at": row.committed_at if row else None,
        "lag_steps": steps,
        "lag_s": seconds,
    }


def _worst(tiers: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The tier with the largest lag in steps (slowest tier on ties)."""
    worst = None
    for tier in ledger.TIERS:
        t = tiers[tier]
        if t["lag_steps"] is not None and (worst is None or t["lag_steps"] >= worst["steps"]):
            worst = {"tier": tier, "steps": t["lag_steps"], "seconds": t["lag_s"]}
    return worst


def list_jobs(session: Session) -> list[dict[str, Any]]:
    """Every job with its current step and the lag of each tier (``GET /api/v1/jobs``).

    Returns:
        Job summaries by job id: ``job_id, world_size, step, step_time_s, last_seen,
        tiers: {tier: {newest_step, committed_at, lag_steps, lag_s}}, worst_lag:
        {tier, steps, seconds} | None``.
    """
    out = []
    for job in session.scalars(select(Job).order_by(Job.job_id)):
        newest = _newest_rows(session, job)
        facts = _facts(session, job, newest)
        tiers = {t: _tier_summary(facts, newest.get(t)) for t in ledger.TIERS}
        out.append(
            {
                "job_id": job.job_id,
                "world_size": job.world_size,
                "step": job.step,
                "step_time_s": facts.step_time_s,
                "last_seen": job.last_seen,
                "tiers": tiers,
                "worst_lag": _worst(tiers),
            }
        )
    return out


def _recent_event_values(
    session: Session, job: Job, *, kind: str, column: Any, tier: str | None
) -> list[float]:
    q = select(column).where(
        CheckpointEventRow.job_pk == job.id, CheckpointEventRow.kind == kind, column.is_not(None)
    )
    if tier is not None:
        q = q.where(CheckpointEventRow.tier == tier)
    return list(
        session.scalars(
            q.order_by(CheckpointEventRow.ts.desc(), CheckpointEventRow.id.desc()).limit(
                RECENT_EVENTS
            )
        )
    )


def _pending(session: Session, job: Job, tier: str, newest_step: int | None) -> dict | None:
    """The newest step of a tier still waiting for ranks (newer than the newest committed;
    not evicted, not abandoned by a restore)."""
    q = select(LedgerRow).where(
        LedgerRow.job_pk == job.id,
        LedgerRow.tier == tier,
        LedgerRow.complete.is_(False),
        LedgerRow.evicted.is_(False),
        ~_abandoned(),
    )
    if newest_step is not None:
        q = q.where(LedgerRow.step > newest_step)
    row = session.scalar(q.order_by(LedgerRow.step.desc()).limit(1))
    if row is None:
        return None
    ranks = set(
        session.scalars(
            select(RankCommit.rank).where(RankCommit.ledger_id == row.id, RankCommit.rank >= 0)
        )
    )
    done = ledger.completeness(row.world_size, ranks, row.whole_step)
    missing = None if done.missing is None else list(done.missing[:MISSING_RANKS_SHOWN])
    return {
        "step": row.step,
        "world_size": row.world_size,
        "ranks_committed": row.ranks_committed,
        "missing_ranks": missing,
        "missing_count": None if done.missing is None else len(done.missing),
        "failures": row.failures,
    }


def _advice(
    tier: str,
    *,
    cost_s: float | None,
    commit_s: float | None,
    gpus: int | None,
    step_time_s: float | None,
    observed_mtbf_s: float | None = None,
) -> dict[str, Any] | None:
    """Interval advice for one tier, or None without a world size or any measurement."""
    if gpus is None or (cost_s is None and commit_s is None):
        return None
    a = advice.advise(
        tier, cost_s=cost_s or 0.0, commit_s=commit_s or 0.0, gpus=gpus, mtbf_s=observed_mtbf_s
    )
    return {
        "cost_s": a.cost_s,
        "commit_s": a.floor_s,
        "mtbf_s": a.mtbf_s,
        "mtbf_source": MTBF_SOURCE if observed_mtbf_s is None else "observed",
        "young_s": a.young_s,
        "daly_s": a.daly_s,
        "recommended_s": a.recommended_s,
        "recommended_steps": (a.recommended_s / step_time_s if step_time_s else None),
        "bounded_by_commit": a.bounded_by_commit,
    }


def job_status(session: Session, job: Job, *, events: bool = True) -> dict[str, Any]:
    """Everything ``GET /api/v1/jobs/{job_id}`` shows about one job.

    Args:
        events: also read the newest raw events and failures (``events``, ``failures``;
            empty lists when False: the job page shows them per step from ``step_events``).

    Returns:
        ``{job_id, world_size, layout, step, step_ts, step_time_s, first_seen, last_seen,
        tiers: {tier: TierStatus}, worst_lag, at_risk: {failure class: {tier, step,
        steps, seconds}}, events: [...], restores: [...]}`` (see ``schemas.JobOut``).
    """
    newest = _newest_rows(session, job)
    facts = _facts(session, job, newest)
    job_blocking = _recent_event_values(
        session, job, kind="staged", column=CheckpointEventRow.blocking_s, tier=None
    )
    incidents = _incidents(session, job)
    span_s = (
        (job.last_seen - job.first_seen).total_seconds()
        if job.last_seen and job.first_seen
        else 0.0
    )
    tiers: dict[str, dict[str, Any]] = {}
    for tier in ledger.TIERS:
        row = newest.get(tier)
        summary = _tier_summary(facts, row)
        blocking = (
            _recent_event_values(
                session, job, kind="staged", column=CheckpointEventRow.blocking_s, tier=tier
            )
            or job_blocking
        )
        commit_times = _recent_event_values(
            session, job, kind="committed", column=CheckpointEventRow.seconds, tier=tier
        )
        size = row.bytes if row else None
        seconds = row.seconds if row else None
        tiers[tier] = {
            **summary,
            "bytes": size,
            "commit_s": seconds,
            "throughput_bytes_per_s": size / seconds if size is not None and seconds else None,
            "last_blocking_s": blocking[0] if blocking else None,
            "pending": _pending(session, job, tier, row.step if row else None),
            "advice": _advice(
                tier,
                cost_s=ledger.median(blocking),
                commit_s=ledger.median(commit_times),
                gpus=job.world_size,
                step_time_s=facts.step_time_s,
                observed_mtbf_s=ledger.observed_mtbf_s(incidents, span_s, ledger.TIER_SERVES[tier]),
            ),
        }
    newest_steps = {t: tiers[t]["newest_step"] for t in ledger.TIERS}
    at_risk = {}
    for klass in ledger.SURVIVED_BY:
        tier, step = ledger.recovery_tier(klass, newest_steps)
        steps, seconds = _lag(facts, step)
        at_risk[klass] = {"tier": tier, "step": step, "steps": steps, "seconds": seconds}
    return {
        "job_id": job.job_id,
        "world_size": job.world_size,
        "layout": job.layout,
        "step": job.step,
        "step_ts": job.step_ts,
        "step_time_s": facts.step_time_s,
        "first_seen": job.first_seen,
        "last_seen": job.last_seen,
        "tiers": tiers,
        "worst_lag": _worst(tiers),
        "at_risk": at_risk,
        "events": recent_events(session, job) if events else [],
        # failures stay visible when newer commits push them out of ``events``
        "failures": recent_events(session, job, FAILURE_LIMIT, kind="failed") if events else [],
        "restores": recent_restores(session, job),
    }


def _incidents(session: Session, job: Job) -> list[str]:
    """Failure classes of the job's restore incidents (see ``ledger.failure_incidents``)."""
    rows = session.execute(
        select(RestoreRow.ts, RestoreRow.files_by_tier).where(
            RestoreRow.job_pk == job.id, RestoreRow.ok.is_(True), RestoreRow.step.is_not(None)
        )
    ).all()
    return ledger.failure_incidents((ts.timestamp(), by_tier or {}) for ts, by_tier in rows)


def recent_events(
    session: Session, job: Job, limit: int = EVENT_LIMIT, *, kind: str | None = None
) -> list[dict[str, Any]]:
    """The job's newest checkpoint events (all kinds, failures included, or one ``kind``),
    newest first."""
    q = (
        select(CheckpointEventRow, Node.name)
        .join(Node, Node.id == CheckpointEventRow.node_id, isouter=True)
        .where(CheckpointEventRow.job_pk == job.id)
        .order_by(CheckpointEventRow.ts.desc(), CheckpointEventRow.id.desc())
        .limit(limit)
    )
    if kind is not None:
        q = q.where(CheckpointEventRow.kind == kind)
    return [
        {
            "ts": e.ts,
            "kind": e.kind,
            "tier": e.tier,
            "step": e.step,
            "rank": e.rank,
            "world_size": e.world_size,
            "node": node,
            "bytes": e.bytes,
            "seconds": e.seconds,
            "blocking_s": e.blocking_s,
            "message": e.message,
        }
        for e, node in session.execute(q)
    ]


def recent_restores(session: Session, job: Job, limit: int = RESTORE_LIMIT) -> list[dict[str, Any]]:
    """The job's newest restore outcomes (one per rank and restore), newest first."""
    q = (
        select(RestoreRow, Node.name)
        .join(Node, Node.id == RestoreRow.node_id, isouter=True)
        .where(RestoreRow.job_pk == job.id)
        .order_by(RestoreRow.ts.desc(), RestoreRow.id.desc())
        .limit(limit)
    )
    return [
        {
            "ts": r.ts,
            "rank": r.rank,
            "world_size": r.world_size,
            "node": node,
            "step": r.step,
            "seconds": r.seconds,
            "steps_lost": r.steps_lost,
            "files_by_tier": r.files_by_tier or {},
            "ok": r.ok,
            "message": r.message,
        }
        for r, node in session.execute(q)
    ]


def job_history(session: Session, job: Job, *, since: datetime, until: datetime) -> dict[str, Any]:
    """Training step and newest committed step per tier over time, for the job chart.

    Progress reports are reduced to the highest step per time bucket (at most
    ``HISTORY_MAX_POINTS`` buckets over the range). Each tier's series is a step function:
    one point per commit in the range (``ts`` = committed_at, ``step`` = the newest
    committed step at that time), starting with the newest commit before ``since``.

    Returns:
        ``{"job_id", "since", "until", "bucket_s", "progress": [{"ts", "step"}],
        "committed": {tier: [{"ts", "step"}]}}``, oldest first.
    """
    span = max((until - since).total_seconds(), 1.0)
    bucket_s = max(1.0, span / HISTORY_MAX_POINTS)
    buckets: dict[int, tuple[datetime, int]] = {}
    q = (
        select(ProgressRow.ts, ProgressRow.step)
        .where(ProgressRow.job_pk == job.id, ProgressRow.ts >= since, ProgressRow.ts <= until)
        .order_by(ProgressRow.ts)
    )
    for ts, step in session.execute(q):
        key = int((ts - since).total_seconds() // bucket_s)
        best = buckets.get(key)
        if best is None or step > best[1]:
            buckets[key] = (ts, step)
    progress = [{"ts": ts, "step": step} for ts, step in sorted(buckets.values())]
    committed: dict[str, list[dict[str, Any]]] = {}
    for tier in ledger.TIERS:
        base = session.scalar(
            select(func.max(LedgerRow.step)).where(
                LedgerRow.job_pk == job.id,
                LedgerRow.tier == tier,
                LedgerRow.complete.is_(True),
                LedgerRow.committed_at < since,
            )
        )
        points: list[dict[str, Any]] = []
        if base is not None:
            points.append({"ts": since, "step": base})
        newest = base
        rows = session.execute(
            select(LedgerRow.committed_at, LedgerRow.step)
            .where(
                LedgerRow.job_pk == job.id,
                LedgerRow.tier == tier,
                LedgerRow.complete.is_(True),
                LedgerRow.committed_at >= since,
                LedgerRow.committed_at <= until,
            )
            .order_by(LedgerRow.committed_at, LedgerRow.step)
        )
        for ts, step in rows:
            if newest is None or step > newest:
                newest = step
                points.append({"ts": ts, "step": step})
        committed[tier] = points
    return {
        "job_id": job.job_id,
        "since": since,
        "until": until,
        "bucket_s": bucket_s,
        "progress": progress,
        "committed": committed,
    }


def prune(
    session: Session, *, now: datetime, sample_retention_s: float, event_retention_s: float
) -> dict[str, int]:
    """Delete checkpoint history older than the retention windows (not committed here).

    Progress goes with the sample retention; checkpoint events, restores and ledger rows
    with the event retention, except each (job, tier)'s newest committed step, which is
    kept however old (the tier's lag depends on it).

    Returns:
        Rows deleted per table.
    """
    sample_cut = now - timedelta(seconds=sample_retention_s)
    event_cut = now - timedelta(seconds=event_retention_s)
    deleted: dict[str, int] = {}
    for table, col, cut in (
        (ProgressRow, ProgressRow.ts, sample_cut),
        (CheckpointEventRow, CheckpointEventRow.ts, event_cut),
        (RestoreRow, RestoreRow.ts, event_cut),
    ):
        result = session.execute(delete(table).where(col < cut))
        deleted[table.__tablename__] = result.rowcount  # type: ignore[attr-defined]
    newest_steps = (
        _counted(
            select(
                LedgerRow.job_pk.label("job_pk"),
                LedgerRow.tier.label("tier"),
                func.max(LedgerRow.step).label("step"),
            )
        )
        .group_by(LedgerRow.job_pk, LedgerRow.tier)
        .subquery()
    )
    keep = select(LedgerRow.id).join(
        newest_steps,
        (LedgerRow.job_pk == newest_steps.c.job_pk)
        & (LedgerRow.tier == newest_steps.c.tier)
        & (LedgerRow.step == newest_steps.c.step),
    )
    keep_ids = set(session.scalars(keep))
    stale = [
        i
        for i in session.scalars(select(LedgerRow.id).where(LedgerRow.updated_at < event_cut))
        if i not in keep_ids
    ]
    count = 0
    for start in range(0, len(stale), 500):
        chunk = stale[start : start + 500]
        session.execute(delete(RankCommit).where(RankCommit.ledger_id.in_(chunk)))
        result = session.execute(delete(LedgerRow).where(LedgerRow.id.in_(chunk)))
        count += result.rowcount  # type: ignore[attr-defined]
    deleted[LedgerRow.__tablename__] = count
    return deleted

"""Storing the checkpoint part of agent reports: jobs, ledger, events, progress, restores.

Called by ``fleet.ingest.ingest_reports`` inside the group's transaction, so a report's
checkpoint events are stored with the rest of it or not at all (the group-commit writer
retries a failed group report by report). SQLAlchemy Core throughout, a fixed number of
statements per group; a group without checkpoint content (or latency samples) costs nothing
here.

Two steps: :func:`scope_reports` checks every checkpoint event, progress report, restore
report and latency sample against the job's registration (``scoping``: registered nodes,
pinned world size and layout), drops the refused ones and applies the accepted progress
to the job rows in order, so a layout pinned by one report binds the next;
:func:`store_checkpoint_content` then stores what was accepted. Jobs are never created here:
a job exists once it registers (``credentials.service.register_job``).

Ledger updates are idempotent and order-independent: each rank's ``committed`` event is a
row keyed by (ledger row, rank), so a replayed or late event never counts twice, and
``evicted`` is sticky. The aggregates of every touched ledger row are recomputed from
those rows (on PostgreSQL under a row lock, so two server replicas storing ranks of one
step at once cannot lose each other's commits).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import (
    Float,
    bindparam,
    cast,
    delete,
    func,
    insert,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, ReportBatch, RestoreReport
from tierwatch.server.checkpoints import ledger, scoping
from tierwatch.server.checkpoints.models import (
    CheckpointEventRow,
    Job,
    LedgerRow,
    ProgressRow,
    RankCommit,
    RestoreRow,
)

JOBS = Job.__table__
LEDGER = LedgerRow.__table__
RANKS = RankCommit.__table__
CKPT_EVENTS = CheckpointEventRow.__table__
PROGRESS = ProgressRow.__table__
RESTORES = RestoreRow.__table__

MAX_BIGINT = 2**63 - 1
WHOLE_STEP_RANK = -1  # RankCommit.rank of a committed event with rank None
LEDGER_KINDS = ("committed", "evicted", "failed")


def _insert_fn(session: Session) -> Any:
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


def report_errors(batch: ReportBatch) -> list[dict[str, Any]]:
    """Checkpoint content of a batch that is well-formed but impossible, or unstorable.

    Checks: a rank below its world_size (events that name one, progress, restores); a
    layout with one node per rank; restore counts that fit a 64-bit integer; restore
    source names without NUL characters.

    Returns:
        Validation errors (``loc``, ``msg``, ``type``) in FastAPI's shape, empty when fine.
    """
    errors: list[dict[str, Any]] = []

    def err(loc: tuple[Any, ...], msg: str) -> None:
        errors.append({"loc": ("body", *loc), "msg": msg, "type": "value_error"})

    for i, e in enumerate(batch.checkpoint_events):
        if e.rank is not None and e.world_size is not None and e.rank >= e.world_size:
            err(
                ("checkpoint_events", i, "rank"),
                f"rank {e.rank} is not below world_size {e.world_size}",
            )
    for i, p in enumerate(batch.progress):
        if p.rank >= p.world_size:
            err(("progress", i, "rank"), f"rank {p.rank} is not below world_size {p.world_size}")
        if p.layout is not None and len(p.layout) != p.world_size:
            err(
                ("progress", i, "layout"),
                f"layout names {len(p.layout)} node(s) but world_size is {p.world_size}: "
                "send one node name per rank",
            )
    for i, r in enumerate(batch.restores):
        if r.rank >= r.world_size:
            err(("restores", i, "rank"), f"rank {r.rank} is not below world_size {r.world_size}")
        if r.steps_lost is not None and r.steps_lost > MAX_BIGINT:
            err(("restores", i, "steps_lost"), f"steps_lost must be at most {MAX_BIGINT}")
        for tier, n in r.files_by_tier.items():
            if n > MAX_BIGINT:
                err(
                    ("restores", i, "files_by_tier", tier),
                    f"a file count must be at most {MAX_BIGINT}",
                )
        for name, source in r.sources.items():
            if "\x00" in name or "\x00" in source:
                err(
                    ("restores", i, "sources", name.replace("\x00", "\\x00")),
                    "file names and sources must not contain NUL (\\x00) characters",
                )
    return errors


def has_checkpoint_content(batch: ReportBatch) -> bool:
    """True when the batch carries checkpoint events, progress or restores."""
    return bool(batch.checkpoint_events or batch.progress or batch.restores)


def _names_jobs(batch: ReportBatch) -> bool:
    return has_checkpoint_content(batch) or bool(batch.latency)


@dataclass
class ScopedReports:
    """Batches with their refused items removed, and the job rows they touch.

    Attributes:
        batches: the batches, in order; a batch with refused items is a copy without them.
        refusals: what was refused (``scoping.Refusal``), in order.
        jobs: job rows (as dicts) by job id, with the accepted progress applied.
        sized_before: job row id -> world_size as loaded (to find newly sized jobs).
        touched: job ids that an accepted item names (their rows are written).
    """

    batches: list[ReportBatch]
    refusals: list[scoping.Refusal] = field(default_factory=list)
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)
    sized_before: dict[int, int | None] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)


def scope_reports(session: Session, *, batches: list[ReportBatch]) -> ScopedReports:
    """Check the job content of freshly stored batches against the jobs' registrations.

    Each batch's progress is checked and applied oldest first (``scoping.progress_verdict``,
    then :func:`_apply_progress`), then its checkpoint events, restore reports and latency
    samples are checked against the updated job rows; batches are taken in order. On
    PostgreSQL the job rows are locked (in id order) until the group commits, so a
    registration that replaces a job's nodes and layout cannot be undone by a report read
    before it.

    Args:
        session: the ingest group's session (not committed here).
        batches: batches stored for the first time; each one's node is its agent token's.

    Returns:
        The scoped batches, refusals and job rows (nothing is written here).
    """
    if not any(_names_jobs(b) for b in batches):
        return ScopedReports(batches=batches)
    names = {
        x.job_id
        for b in batches
        for x in (*b.checkpoint_events, *b.progress, *b.restores, *b.latency)
    }
    jobs = _load_jobs(session, sorted(names))
    scoped = ScopedReports(
        batches=[], jobs=jobs, sized_before={j["id"]: j["world_size"] for j in jobs.values()}
    )
    for b in batches:
        if not _names_jobs(b):
            scoped.batches.append(b)
            continue
        refused_before = len(scoped.refusals)

        def accepted(item: Any, kind: str, verdict: scoping.Verdict, b: ReportBatch = b) -> bool:
            if verdict is None:
                if kind != scoping.ITEM_LATENCY:  # latency is the fleet's, not the job row's
                    scoped.touched.add(item.job_id)
                return True
            scoped.refusals.append(
                scoping.Refusal(
                    node=b.node,
                    job_id=item.job_id,
                    item=kind,
                    reason=verdict[0],
                    message=verdict[1],
                    rank=getattr(item, "rank", None),
                )
            )
            return False

        progress = []
        for p in sorted(b.progress, key=lambda p: p.ts):
            if accepted(
                p, scoping.ITEM_PROGRESS, scoping.progress_verdict(jobs.get(p.job_id), b.node, p)
            ):
                _apply_progress(jobs[p.job_id], p)
                progress.append(p)
        events = []
        for e in b.checkpoint_events:
            if accepted(
                e, scoping.ITEM_EVENT, scoping.event_verdict(jobs.get(e.job_id), b.node, e)
            ):
                _apply_event(jobs[e.job_id], e)
                events.append(e)
        restores = []
        for r in b.restores:
            if accepted(
                r, scoping.ITEM_RESTORE, scoping.restore_verdict(jobs.get(r.job_id), b.node, r)
            ):
                _apply_restore(jobs[r.job_id], r)
                restores.append(r)
        latency = [
            s
            for s in b.latency
            if accepted(
                s, scoping.ITEM_LATENCY, scoping.latency_verdict(jobs.get(s.job_id), b.node, s)
            )
        ]
        if len(scoped.refusals) > refused_before:
            b = b.model_copy(
                update={
                    "progress": progress,
                    "checkpoint_events": events,
                    "restores": restores,
                    "latency": latency,
                }
            )
        scoped.batches.append(b)
    return scoped


def store_checkpoint_content(
    session: Session, *, scoped: ScopedReports, node_ids: dict[str, int], now: datetime
) -> None:
    """Store the accepted checkpoint events, progress and restores of scoped batches.

    Args:
        session: the ingest group's session (not committed here).
        scoped: :func:`scope_reports`' answer for the group's fresh batches.
        node_ids: node name -> node id of the reporting agents.
        now: server receive time (UTC).
    """
    batches = [b for b in scoped.batches if has_checkpoint_content(b)]
    if not batches:
        return
    jobs = scoped.jobs
    newly_sized = _write_jobs(session, scoped, now)
    event_rows: list[dict[str, Any]] = []
    progress_rows: list[dict[str, Any]] = []
    restore_rows: list[dict[str, Any]] = []
    for b in batches:
        node_id = node_ids[b.node]
        event_rows += [
            {
                "job_pk": jobs[e.job_id]["id"],
                "node_id": node_id,
                "step": e.step,
                "tier": e.tier,
                "kind": e.kind,
                "rank": e.rank,
                "world_size": e.world_size,
                "ts": e.ts,
                "received_at": now,
                "bytes": e.bytes,
                "seconds": e.seconds,
                "blocking_s": e.blocking_s,
                "message": e.message,
            }
            for e in b.checkpoint_events
        ]
        progress_rows += [
            {
                "job_pk": jobs[p.job_id]["id"],
                "node_id": node_id,
                "rank": p.rank,
                "world_size": p.world_size,
                "step": p.step,
                "step_time_s": p.step_time_s,
                "ts": p.ts,
            }
            for p in b.progress
        ]
        restore_rows += [
            {
                "job_pk": jobs[r.job_id]["id"],
                "node_id": node_id,
                "rank": r.rank,
                "world_size": r.world_size,
                "step": r.step,
                "ts": r.ts,
                "seconds": r.seconds,
                "steps_lost": r.steps_lost,
                "files_by_tier": dict(r.files_by_tier),
                "sources": dict(r.sources),
                "ok": r.ok,
                "message": r.message,
            }
            for r in b.restores
            if r.phase != "staging"  # a start notice, not an outcome
        ]
    if event_rows:
        session.execute(insert(CKPT_EVENTS), event_rows)
    if progress_rows:
        session.execute(insert(PROGRESS), progress_rows)
    if restore_rows:
        session.execute(insert(RESTORES), restore_rows)
    _update_ledger(session, batches, jobs, newly_sized, now)


def _load_jobs(session: Session, names: list[str]) -> dict[str, dict[str, Any]]:
    """Job rows (as mutable dicts) by job id; jobs without a row are absent (never created:
    a job's row is made by its registration). Locked on PostgreSQL, in id order."""
    query = select(JOBS).where(JOBS.c.job_id.in_(names))
    if session.get_bind().dialect.name == "postgresql":
        query = query.order_by(JOBS.c.id).with_for_update()
    return {r.job_id: dict(r._mapping) for r in session.execute(query)}


_JOB_COLUMNS = (
    "world_size",
    "layout",
    "step",
    "step_ts",
    "step_time_s",
    "progress_ts",
    "last_seen",
)
_UPDATE_JOB = (
    update(JOBS)
    .where(JOBS.c.id == bindparam("b_id"))
    .values(**{c: bindparam(f"b_{c}") for c in _JOB_COLUMNS})
)


def _apply_progress(job: dict[str, Any], p: JobProgress) -> None:
    """Apply one accepted progress report (world_size, layout, step time, current step).

    A job whose layout is pinned (``scoping.pinned_layout``) keeps its world_size and
    layout: the report was checked against them. Otherwise the newest progress report (by
    its time) sets world_size, layout and step time; an older one (another node's newer
    report came first) only fills in a missing layout of the job's world size. A
    ``starting`` report (rank 0's, before its start was accepted) sets world_size and layout
    only for a job without a world size, else it only fills in a missing layout of that
    world size: a start that is refused (another world size, another model) leaves a known
    job's as they were; the first save's report, which carries the layout too, changes them
    once the start is accepted. The first layout applied pins it (the job is registered:
    ``scoping`` accepts nothing else).
    """
    _raise_step(job, p.step, p.ts)
    newest = job["progress_ts"] is None or p.ts >= job["progress_ts"]
    if scoping.pinned_layout(job) is not None:
        if newest and not p.starting:
            if p.step_time_s is not None:
                job["step_time_s"] = p.step_time_s
            job["progress_ts"] = p.ts
        return
    if (p.starting and job["world_size"] is not None) or not newest:
        # not the newest report (or a start that may still be refused): it only fills in a
        # missing layout of the job's world size
        if p.layout is not None and job["layout"] is None and p.world_size == job["world_size"]:
            job["layout"] = list(p.layout)
        return
    if p.world_size != job["world_size"] and p.layout is None:
        job["layout"] = None  # a layout of another world size no longer applies
    job["world_size"] = p.world_size
    if p.layout is not None:
        job["layout"] = list(p.layout)
    if p.step_time_s is not None:
        job["step_time_s"] = p.step_time_s
    job["progress_ts"] = p.ts


def _apply_event(job: dict[str, Any], e: CheckpointEvent) -> None:
    """An accepted checkpoint event raises the current step and fills in a missing
    world_size."""
    _raise_step(job, e.step, e.ts)
    if job["world_size"] is None and e.world_size is not None:
        job["world_size"] = e.world_size


def _apply_restore(job: dict[str, Any], r: RestoreReport) -> None:
    """An accepted restore report fills in a missing world_size."""
    if job["world_size"] is None:
        job["world_size"] = r.world_size


def _write_jobs(session: Session, scoped: ScopedReports, now: datetime) -> set[int]:
    """Write the touched job rows (``last_seen`` = now).

    Returns:
        Ids of jobs whose world_size is now known (or changed): their ledger rows
        without a world size are re-evaluated.
    """
    touched = [scoped.jobs[name] for name in sorted(scoped.touched)]
    if not touched:
        return set()
    for j in touched:
        j["last_seen"] = now
    session.execute(
        _UPDATE_JOB,
        [{"b_id": j["id"], **{f"b_{c}": j[c] for c in _JOB_COLUMNS}} for j in touched],
    )
    return {
        j["id"]
        for j in touched
        if j["world_size"] is not None and scoped.sized_before[j["id"]] != j["world_size"]
    }


def _raise_step(job: dict[str, Any], step: int, ts: datetime) -> None:
    if job["step"] is None or step > job["step"]:
        job["step"], job["step_ts"] = step, ts


def _update_ledger(
    session: Session,
    batches: list[ReportBatch],
    jobs: dict[str, dict[str, Any]],
    newly_sized: set[int],
    now: datetime,
) -> None:
    """Create/refresh the ledger rows the batches' committed/evicted/failed events touch."""
    events = [e for b in batches for e in b.checkpoint_events if e.kind in LEDGER_KINDS]
    keys: dict[tuple[int, int, str], int | None] = {}
    for e in events:
        key = (jobs[e.job_id]["id"], e.step, e.tier)
        ws = e.world_size if e.world_size is not None else jobs[e.job_id]["world_size"]
        keys[key] = keys.get(key) or ws
    if not keys and not newly_sized:
        return
    insert_fn = _insert_fn(session)
    if keys:
        session.execute(
            insert_fn(LEDGER)
            .values(
                [
                    {
                        "job_pk": j,
                        "step": s,
                        "tier": t,
                        "world_size": ws,
                        "ranks_committed": 0,
                        "whole_step": False,
                        "complete": False,
                        "evicted": False,
                        "failures": 0,
                        "updated_at": now,
                    }
                    for (j, s, t), ws in keys.items()
                ]
            )
            .on_conflict_do_nothing()
        )
    conditions = []
    if keys:
        conditions.append(tuple_(LEDGER.c.job_pk, LEDGER.c.step, LEDGER.c.tier).in_(list(keys)))
    if newly_sized:
        conditions.append(
            LEDGER.c.job_pk.in_(newly_sized)
            & LEDGER.c.world_size.is_(None)
            & LEDGER.c.complete.is_(False)
        )
    query = select(LEDGER).where(or_(*conditions))
    if session.get_bind().dialect.name == "postgresql":
        query = query.order_by(LEDGER.c.id).with_for_update()
    rows = {(r.job_pk, r.step, r.tier): r for r in session.execute(query)}
    ids = {key: r.id for key, r in rows.items()}

    # A step can be evicted and saved again (a rollback drops the steps after its target;
    # training then saves them anew): a committed event newer than the row's eviction starts
    # a new generation of the row, so the old generation's rank commits are dropped first.
    evicted_at: dict[int, datetime] = {
        r.id: r.evicted_at or now for r in rows.values() if r.evicted
    }
    reborn: dict[int, datetime] = {}
    commits = []
    failures: dict[int, int] = defaultdict(int)
    for e in sorted(events, key=lambda x: x.ts):
        lid = ids[(jobs[e.job_id]["id"], e.step, e.tier)]
        if e.kind == "committed":
            if lid in evicted_at and e.ts > evicted_at[lid]:
                reborn[lid] = evicted_at.pop(lid)
            commits.append(
                {
                    "ledger_id": lid,
                    "rank": WHOLE_STEP_RANK if e.rank is None else e.rank,
                    "ts": e.ts,
                    "bytes": e.bytes,
                    "seconds": e.seconds,
                }
            )
        elif e.kind == "evicted":
            evicted_at[lid] = max(evicted_at.get(lid, e.ts), e.ts)
        else:
            failures[lid] += 1
    for lid, cut in reborn.items():
        session.execute(delete(RANKS).where(RANKS.c.ledger_id == lid, RANKS.c.ts <= cut))
    if commits:
        session.execute(insert_fn(RANKS).values(commits).on_conflict_do_nothing())

    job_ws = {j["id"]: j["world_size"] for j in jobs.values()}
    updates = []
    aggregates = _commit_aggregates(session, [r.id for r in rows.values()])
    for (job_pk, _step, _tier), row in rows.items():
        ws = row.world_size if row.world_size is not None else job_ws.get(job_pk)
        agg = aggregates.get(row.id)
        whole = agg is not None and agg["whole"] is not None
        source = (agg["whole"] if whole else agg["ranks"]) if agg else None
        ranks: set[int] = set()
        # Only a row with at least world_size ranks can be complete: read its ranks then.
        if not whole and ws is not None and agg is not None and agg["distinct"] >= ws:
            ranks = set(
                session.scalars(
                    select(RANKS.c.rank).where(RANKS.c.ledger_id == row.id, RANKS.c.rank >= 0)
                )
            )
        done = ledger.completeness(ws, ranks, whole)
        was_complete = row.complete and row.id not in reborn
        updates.append(
            {
                "b_id": row.id,
                "b_world_size": ws,
                "b_ranks_committed": agg["distinct"] if agg else 0,
                "b_whole_step": whole,
                "b_complete": was_complete or done.complete,
                "b_committed_at": source["ts"] if source else None,
                "b_bytes": source["bytes"] if source else None,
                "b_seconds": source["seconds"] if source else None,
                "b_evicted": row.id in evicted_at,
                "b_evicted_at": evicted_at.get(row.id),
                "b_failures": row.failures + failures.get(row.id, 0),
                "b_updated_at": now,
            }
        )
    if updates:
        session.execute(_UPDATE_LEDGER, updates)


_LEDGER_COLUMNS = (
    "world_size",
    "ranks_committed",
    "whole_step",
    "complete",
    "committed_at",
    "bytes",
    "seconds",
    "evicted",
    "evicted_at",
    "failures",
    "updated_at",
)
_UPDATE_LEDGER = (
    update(LEDGER)
    .where(LEDGER.c.id == bindparam("b_id"))
    .values(**{c: bindparam(f"b_{c}") for c in _LEDGER_COLUMNS})
)


def _commit_aggregates(session: Session, ledger_ids: list[int]) -> dict[int, dict[str, Any]]:
    """Per ledger row: the whole-step commit and the per-rank commits, aggregated in SQL.

    Returns:
        ledger id -> {"distinct": ranks committed (whole-step commit aside), "whole":
        {"ts", "bytes", "seconds"} or None, "ranks": {"ts", "bytes" (sum, capped
        at the BIGINT maximum), "seconds" (max)} or None}.
    """
    if not ledger_ids:
        return {}
    whole = RANKS.c.rank == WHOLE_STEP_RANK
    q = (
        select(
            RANKS.c.ledger_id,
            whole.label("whole"),
            func.count(),
            func.max(RANKS.c.ts),
            func.sum(cast(RANKS.c.bytes, Float)),
            func.count(RANKS.c.bytes),
            func.max(RANKS.c.seconds),
        )
        .where(RANKS.c.ledger_id.in_(ledger_ids))
        .group_by(RANKS.c.ledger_id, whole)
    )
    out: dict[int, dict[str, Any]] = {}
    for lid, is_whole, n, ts, total, n_bytes, seconds in session.execute(q):
        entry = out.setdefault(lid, {"distinct": 0, "whole": None, "ranks": None})
        size = None if not n_bytes else min(MAX_BIGINT, int(total))
        part = {"ts": ts, "bytes": size, "seconds": seconds}
        if is_whole:
            entry["whole"] = part
        else:
            entry["ranks"] = part
            entry["distinct"] = int(n)
    return out

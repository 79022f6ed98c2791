"""Restore requests: roll a job back to a committed step, and follow each rank's progress.

A request resolves its target step when it is made (default: the newest step some tier
holds completely; with ``tier``, the newest that tier holds) so every rank rolls back to the
same step, snapshots the job's rank→node layout, queues one ``restore`` command per node of
the job and one progress row per rank (``pending``). Ranks then report ``staging`` and
``loaded`` | ``failed`` (``RestoreReport.phase`` with ``request_id``); a node's command
succeeds once all of its ranks loaded, the request once every rank did, and fails when a
rank fails. A request whose ranks do not all answer within ``restore_ttl_s`` expires.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from tierwatch.agent.protocol import RestoreReport
from tierwatch.server.actions import audit, notify, queue
from tierwatch.server.actions.models import CommandRow, RestoreRankProgress, RestoreRequest
from tierwatch.server.checkpoints.models import Job, LedgerRow
from tierwatch.server.config import Settings
from tierwatch.server.fleet.models import Node

RESTORABLE_SHOWN = 20


class RestoreRefused(ValueError):
    """The request cannot be carried out (answered 409; the message says why and what can be
    restored)."""


def restorable_steps(session: Session, job: Job) -> dict[int, list[str]]:
    """Steps some tier holds completely (not evicted): step → tiers, newest first."""
    rows = session.execute(
        select(LedgerRow.step, LedgerRow.tier).where(
            LedgerRow.job_pk == job.id,
            LedgerRow.complete.is_(True),
            LedgerRow.evicted.is_(False),
        )
    ).all()
    out: dict[int, list[str]] = {}
    for step, tier in sorted(rows, key=lambda r: -r[0]):
        out.setdefault(step, []).append(tier)
    return out


def _describe(steps: dict[int, list[str]]) -> str:
    if not steps:
        return "no step is held completely by any tier yet"
    shown = list(steps.items())[:RESTORABLE_SHOWN]
    text = ", ".join(f"{s} ({'/'.join(sorted(t))})" for s, t in shown)
    more = len(steps) - len(shown)
    return f"steps that can be restored: {text}" + (f" and {more} older" if more > 0 else "")


def resolve_step(steps: dict[int, list[str]], step: int | None, tier: str | None) -> int:
    """The target step of a request (pure).

    Raises:
        RestoreRefused: no complete step (in ``tier``), or ``step`` is not held completely
            (in ``tier``); the message lists the steps that can be restored.
    """
    candidates = {s: t for s, t in steps.items() if tier is None or tier in t}
    where = f" in the {tier} tier" if tier else ""
    if step is None:
        if not candidates:
            raise RestoreRefused(f"nothing to restore{where}: {_describe(steps)}")
        return max(candidates)
    if step not in candidates:
        raise RestoreRefused(
            f"step {step} is not held completely by any tier{where}; {_describe(steps)}"
        )
    return step


def request_restore(
    session: Session,
    job: Job,
    *,
    step: int | None,
    tier: str | None,
    reason: str,
    actor: str,
    role: str,
    now: datetime,
    settings: Settings,
) -> RestoreRequest:
    """Create a restore request and its commands (the caller commits).

    Raises:
        RestoreRefused: nothing to restore, the step is not restorable, or the job's rank
            layout is unknown (its rank 0 has not reported one yet).
    """
    steps = restorable_steps(session, job)
    try:
        target = resolve_step(steps, step, tier)
        if not job.layout or not job.world_size or len(job.layout) != job.world_size:
            raise RestoreRefused(
                f"job {job.job_id} has no known rank layout yet (rank 0 reports it when it "
                "starts): wait for the job to report, then retry"
            )
    except RestoreRefused as exc:
        audit.record(
            session,
            actor=actor,
            role=role,
            action="restore",
            target_kind="job",
            target=job.job_id,
            reason=reason,
            outcome="refused",
            now=now,
            detail={"step": step, "tier": tier, "message": str(exc)},
        )
        raise
    layout = list(job.layout)
    req = RestoreRequest(
        job_pk=job.id,
        job_id=job.job_id,
        step=target,
        tier=tier,
        reason=reason,
        actor=actor,
        state="running",
        world_size=job.world_size,
        layout=layout,
        created_at=now,
        message="",
    )
    session.add(req)
    session.flush()
    nodes = {
        n.name: n for n in session.scalars(select(Node).where(Node.name.in_(sorted(set(layout)))))
    }
    session.add_all(
        RestoreRankProgress(
            request_id=req.id, rank=r, node=name, phase="pending", files_by_tier={}, message=""
        )
        for r, name in enumerate(layout)
    )
    commands = []
    for name in sorted(set(layout)):
        node = nodes.get(name)
        if node is None:
            continue
        commands.append(
            queue.enqueue(
                session,
                kind="restore",
                node_id=node.id,
                executor="agent",
                driver="restore",
                args={
                    "request_id": req.id,
                    "job_id": job.job_id,
                    "step": target,
                    "tier": tier,
                    "reason": reason,
                    "actor": actor,
                    "not_after": (
                        now + timedelta(seconds=settings.commands.restore_ttl_s)
                    ).isoformat(),
                },
                actor=actor,
                reason=reason,
                now=now,
                ttl_s=settings.commands.ttl_s,
                restore_id=req.id,
            )
        )
    audit.record(
        session,
        actor=actor,
        role=role,
        action="restore",
        target_kind="job",
        target=job.job_id,
        reason=reason,
        outcome="ok",
        now=now,
        detail={
            "request_id": req.id,
            "step": target,
            "tier": tier,
            "requested_step": step,
            "nodes": sorted(set(layout)),
            "commands": [c.id for c in commands],
        },
    )
    return req


def _main_tier(files_by_tier: dict[str, int]) -> str | None:
    if not files_by_tier:
        return None
    return Counter(files_by_tier).most_common(1)[0][0]


def apply_rank_reports(
    session: Session,
    reports: Sequence[RestoreReport],
    *,
    now: datetime,
    settings: Settings,
    node: str | None = None,
) -> None:
    """Fold ranks' restore reports (those with a ``request_id``) into the requests' progress,
    and finish node commands and requests whose ranks are done (the caller commits).

    A rank's phase only moves forward (``pending → staging → loaded | failed``); reports for
    unknown requests or ranks are ignored, and so are reports for a rank that the request
    assigned to another node than ``node`` (the reporting agent's; its layout snapshot
    says which node restores each rank).
    """
    reports = [r for r in reports if r.request_id is not None]
    if not reports:
        return
    ids = sorted({r.request_id for r in reports if r.request_id is not None})
    requests = {
        r.id: r for r in session.scalars(select(RestoreRequest).where(RestoreRequest.id.in_(ids)))
    }
    progress = {
        (p.request_id, p.rank): p
        for p in session.scalars(
            select(RestoreRankProgress).where(RestoreRankProgress.request_id.in_(ids))
        )
    }
    order = {"pending": 0, "staging": 1, "loaded": 2, "failed": 2}
    touched: set[int] = set()
    for rep in reports:
        row = progress.get((rep.request_id, rep.rank))
        req = requests.get(rep.request_id)  # type: ignore[arg-type]
        if row is None or req is None or req.job_id != rep.job_id:
            continue
        if node is not None and row.node != node:
            continue
        phase = rep.phase or ("loaded" if rep.ok else "failed")
        if order[phase] <= order[row.phase] and not (phase == row.phase == "staging"):
            continue
        row.phase = phase
        row.updated_at = now
        if phase == "staging":
            row.step = rep.step
            continue
        row.step = rep.step
        row.seconds = rep.seconds
        row.steps_lost = rep.steps_lost
        row.files_by_tier = dict(rep.files_by_tier)
        row.tier = _main_tier(row.files_by_tier)
        row.message = rep.message
        touched.add(req.id)
    for rid in touched:
        _settle(session, requests[rid], now=now, settings=settings)


def _settle(session: Session, req: RestoreRequest, *, now: datetime, settings: Settings) -> None:
    if req.state != "running":
        return
    ranks = list(
        session.scalars(select(RestoreRankProgress).where(RestoreRankProgress.request_id == req.id))
    )
    commands = list(session.scalars(select(CommandRow).where(CommandRow.restore_id == req.id)))
    node_ids = {
        n.name: n.id
        for n in session.scalars(select(Node).where(Node.id.in_([c.node_id for c in commands])))
    }
    for cmd in commands:
        own = [p for p in ranks if node_ids.get(p.node) == cmd.node_id]
        if own and all(p.phase in ("loaded", "failed") for p in own):
            failed = [p for p in own if p.phase == "failed"]
            queue.finish(
                cmd,
                ok=not failed,
                exit_code=None,
                now=now,
                output="; ".join(f"rank {p.rank}: {p.message}" for p in failed)
                if failed
                else f"ranks {', '.join(str(p.rank) for p in own)} loaded step {req.step}",
            )
    failed = [p for p in ranks if p.phase == "failed"]
    if failed:
        req.state = "failed"
        req.message = "; ".join(f"rank {p.rank}: {p.message}" for p in failed)[:2000]
        queue.fail_running_for_restore(
            session, req.id, now=now, message=f"restore request failed: {req.message}"
        )
    elif all(p.phase == "loaded" for p in ranks):
        req.state = "succeeded"
    else:
        return
    req.finished_at = now
    done = [p for p in ranks if p.seconds is not None]
    req.seconds = max((p.seconds for p in done), default=None)  # type: ignore[type-var]
    req.steps_lost = max((p.steps_lost for p in ranks if p.steps_lost is not None), default=None)
    audit.record(
        session,
        actor=req.actor,
        role="system",
        action="restore_done",
        target_kind="job",
        target=req.job_id,
        reason=req.reason,
        outcome=req.state,
        now=now,
        detail={
            "request_id": req.id,
            "step": req.step,
            "seconds": req.seconds,
            "steps_lost": req.steps_lost,
            "tiers": {str(p.rank): p.tier for p in ranks},
        },
    )
    if req.state == "failed":
        notify.restore_failed(
            session, settings, job=req.job_id, request_id=req.id, message=req.message, now=now
        )


def expire_requests(session: Session, *, now: datetime, settings: Settings) -> list[int]:
    """Expire running requests older than ``restore_ttl_s``; returns their ids."""
    cutoff = now - timedelta(seconds=settings.commands.restore_ttl_s)
    rows = session.scalars(
        select(RestoreRequest).where(
            RestoreRequest.state == "running", RestoreRequest.created_at <= cutoff
        )
    ).all()
    for req in rows:
        waiting = session.scalars(
            select(RestoreRankProgress.rank).where(
                RestoreRankProgress.request_id == req.id,
                RestoreRankProgress.phase.in_(("pending", "staging")),
            )
        ).all()
        req.state = "expired"
        req.finished_at = now
        req.message = (
            f"ranks {', '.join(map(str, waiting))} did not report within "
            f"{settings.commands.restore_ttl_s:g} s"
        )
        queue.fail_running_for_restore(
            session, req.id, message=req.message, now=now, state="expired"
        )
        audit.record(
            session,
            actor=req.actor,
            role="system",
            action="restore_done",
            target_kind="job",
            target=req.job_id,
            reason=req.reason,
            outcome="expired",
            now=now,
            detail={"request_id": req.id},
        )
    return [r.id for r in rows]


def request_out(session: Session, req: RestoreRequest) -> dict[str, Any]:
    """A request with its per-rank progress (``schemas.RestoreRequestOut``)."""
    ranks = session.scalars(
        select(RestoreRankProgress)
        .where(RestoreRankProgress.request_id == req.id)
        .order_by(RestoreRankProgress.rank)
    )
    return {
        "id": req.id,
        "job_id": req.job_id,
        "step": req.step,
        "tier": req.tier,
        "reason": req.reason,
        "actor": req.actor,
        "state": req.state,
        "created_at": req.created_at,
        "finished_at": req.finished_at,
        "seconds": req.seconds,
        "steps_lost": req.steps_lost,
        "message": req.message,
        "ranks": [
            {
                "rank": p.rank,
                "node": p.node,
                "phase": p.phase,
                "step": p.step,
                "tier": p.tier,
                "files_by_tier": p.files_by_tier or {},
                "seconds": p.seconds,
                "steps_lost": p.steps_lost,
                "message": p.message,
                "updated_at": p.updated_at,
            }
            for p in ranks
        ],
    }


def recent_requests(session: Session, job: Job, limit: int = 10) -> list[RestoreRequest]:
    """The job's newest restore requests first."""
    return list(
        session.scalars(
            select(RestoreRequest)
            .where(RestoreRequest.job_pk == job.id)
            .order_by(RestoreRequest.id.desc())
            .limit(limit)
        )
    )

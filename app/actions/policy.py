"""The opt-in auto-isolation policy and its circuit breaker.

When enabled, a node is isolated automatically (actor ``policy``, the rule as the reason)
when it is unhealthy with a reason whose recommended action is in ``actions`` (default: the
XID catalog's ``RESET_GPU`` and ``RESTART_BM``, any catalog hardware workflow
``WORKFLOW_*``, and our ``REPLACE_GPU`` for a row-remap failure), or when it stays
unreachable longer than ``unreachable_s``. After an operator releases a node, only a reason
first seen after the release (or a node that reported after the release and then went
silent) triggers the policy again, so a release is not undone by the same finding.

Circuit breaker: at most ``allowed = max(1, floor(breaker_pct / 100 × nodes))`` nodes are
auto-isolated within any ``breaker_window_s``; a further candidate trips the breaker, which
isolates nothing more and raises a cluster-level alert instead (many nodes failing together
is more likely a shared cause — a switch, the file system, a bad driver push — than many sick
nodes, and isolating them all would stop the cluster). The breaker resets itself once the
window no longer holds ``allowed`` auto-isolations. Source: docs/design.md "Actions".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tierwatch.server.actions import (
    audit,
    control_plane,
    isolation,
    maintenance,
    notify,
    restores,
)
from tierwatch.server.actions.control_plane import ControlPlaneFacts, Silent, Suspicion
from tierwatch.server.actions.drivers import SchedulerView
from tierwatch.server.actions.models import AuditEntry, PolicySettingsRow
from tierwatch.server.actions.settings import WORKFLOW_PREFIX, PolicySettings, PolicyUpdate
from tierwatch.server.checkpoints.models import Job
from tierwatch.server.config import Settings
from tierwatch.server.fleet import service as fleet_service
from tierwatch.server.fleet.models import Node

POLICY_ACTOR = audit.POLICY_ACTOR
EDITABLE = ("enabled", "unreachable_s", "breaker_pct", "breaker_window_s", "restore_jobs")
ACTIVE_JOB_S = 600.0  # a job counts as running on a node if it reported this recently


@dataclass
class Candidate:
    """A node the policy would isolate, with the rule and evidence."""

    node_id: int
    name: str
    rule: str
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)


def _row(session: Session, *, create: bool = False) -> PolicySettingsRow | None:
    row = session.get(PolicySettingsRow, 1)
    if row is None and create:
        row = PolicySettingsRow(id=1, updated_by="", breaker_message="")
        session.add(row)
        session.flush()
    return row


def effective(session: Session, settings: Settings) -> tuple[PolicySettings, dict[str, str]]:
    """The policy settings in force and where each editable one comes from (``env`` or
    ``admin``)."""
    base = settings.policy
    row = _row(session)
    values = base.model_dump()
    source = dict.fromkeys(EDITABLE, "env")
    if row is not None:
        for name in EDITABLE:
            value = getattr(row, name)
            if value is not None:
                values[name] = value
                source[name] = "admin"
    return PolicySettings(**values), source


def update(session: Session, change: PolicyUpdate, *, actor: str, role: str, now: datetime) -> None:
    """Store an admin's change (the caller commits) and audit it."""
    row = _row(session, create=True)
    assert row is not None
    before = {n: getattr(row, n) for n in EDITABLE}
    for name in change.model_fields_set:
        setattr(row, name, getattr(change, name))
    row.updated_at = now
    row.updated_by = actor
    audit.record(
        session,
        actor=actor,
        role=role,
        action="policy_update",
        target_kind="policy",
        target="auto-isolation",
        outcome="ok",
        now=now,
        detail={"before": before, "after": {n: getattr(row, n) for n in EDITABLE}},
    )


def allowed_isolations(breaker_pct: float, nodes: int) -> int:
    """Auto-isolations the breaker lets through per window: ``max(1, ⌊pct/100 × nodes⌋)``."""
    return max(1, math.floor(breaker_pct / 100.0 * nodes + 1e-9))


def qualifies(action: str, actions: Sequence[str]) -> bool:
    """Whether a reason's recommended action makes its node a candidate."""
    return action in actions or action.startswith(WORKFLOW_PREFIX)


def candidates(
    views: Sequence[fleet_service.NodeView], policy: PolicySettings, now: datetime
) -> list[Candidate]:
    """Nodes the policy should isolate now, by name (pure: reads the views only)."""
    out = []
    for v in views:
        n = v.node
        if n.isolated or n.last_seen is None:
            continue
        released = n.released_at
        silent_s = (now - n.last_seen).total_seconds()
        if (
            v.unreachable
            and silent_s > policy.unreachable_s
            and (released is None or n.last_seen > released)
        ):
            out.append(
                Candidate(
                    n.id,
                    n.name,
                    "unreachable",
                    f"policy: no report for {silent_s:.0f} s (limit {policy.unreachable_s:g} s)",
                    {"last_seen": n.last_seen.isoformat(), "silent_s": round(silent_s, 1)},
                )
            )
            continue
        if n.state != "unhealthy":
            continue
        for r in v.reasons:
            if r.severity != "unhealthy" or not qualifies(r.action, policy.actions):
                continue
            if released is not None and r.first_seen <= released:
                continue
            gpu = "" if r.gpu_index is None or r.gpu_index < 0 else f" (GPU {r.gpu_index})"
            out.append(
                Candidate(
                    n.id,
                    n.name,
                    r.rule,
                    f"policy: {r.rule}{gpu}: {r.message} → {r.action}",
                    {
                        "rule": r.rule,
                        "gpu": None if r.gpu_index < 0 else r.gpu_index,
                        "action": r.action,
                        "key": r.key,
                    },
                )
            )
            break
    return out


def isolated_in_window(session: Session, now: datetime, window_s: float) -> int:
    """Nodes the policy isolated within the last ``window_s`` seconds."""
    return (
        session.scalar(
            select(func.count(func.distinct(AuditEntry.target))).where(
                AuditEntry.action == "isolate",
                AuditEntry.actor == POLICY_ACTOR,
                AuditEntry.outcome == "ok",
                AuditEntry.ts >= now - timedelta(seconds=window_s),
            )
        )
        or 0
    )


@dataclass
class PolicyRun:
    """What one policy pass did."""

    isolated: list[str] = field(default_factory=list)
    held: list[str] = field(default_factory=list)
    tripped: bool = False
    reset: bool = False
    restores: list[int] = field(default_factory=list)
    suspect: Suspicion | None = None
    """Set when unreachable candidates were held because the control plane is suspect."""
    held_unreachable: list[str] = field(default_factory=list)
    """Unreachable nodes not isolated: the control plane is suspect."""
    agent_silent: list[str] = field(default_factory=list)
    """Unreachable nodes not isolated: the scheduler still hears from them."""
    maintenance: list[str] = field(default_factory=list)
    """Candidates not isolated: a maintenance window covers them (or the cluster)."""


def _jobs_on(session: Session, node: str, now: datetime) -> list[Job]:
    recent = now - timedelta(seconds=ACTIVE_JOB_S)
    jobs = session.scalars(select(Job).where(Job.last_seen >= recent)).all()
    return [j for j in jobs if j.layout and node in j.layout]


def _reset_breaker(
    session: Session,
    settings: Settings,
    row: PolicySettingsRow,
    *,
    now: datetime,
    detail: dict[str, Any],
) -> None:
    row.breaker_tripped_at = None
    row.breaker_message = ""
    audit.record(
        session,
        actor=POLICY_ACTOR,
        role="policy",
        action="breaker_reset",
        target_kind="cluster",
        target="auto-isolation",
        outcome="ok",
        now=now,
        detail=detail,
    )
    notify.breaker_reset(session, settings, now=now)


def run(
    session: Session,
    settings: Settings,
    *,
    now: datetime,
    facts: ControlPlaneFacts | None = None,
    observe: Callable[[str], SchedulerView] | None = None,
) -> PolicyRun:
    """One pass of the policy (call in the leader replica only; the caller commits).

    Args:
        facts: the leader's own health (:class:`~tierwatch.server.actions.control_plane.
            ControlPlaneWatch`); None: only the "many nodes at once" rule guards
            unreachability.
        observe: the cluster driver's ``observe`` (corroborates each isolation with the
            scheduler); None: no scheduler is configured on the server.
    """
    policy, _ = effective(session, settings)
    result = PolicyRun()
    if not policy.enabled:
        row = _row(session)
        if row is not None and row.breaker_tripped_at is not None:  # off: nothing held
            _reset_breaker(session, settings, row, now=now, detail={"policy": "off"})
            result.reset = True
        return result
    views = fleet_service.list_node_views(session, now=now, th=settings.health, with_gpus=False)
    allowed = allowed_isolations(policy.breaker_pct, len(views))
    count = isolated_in_window(session, now, policy.breaker_window_s)
    row = _row(session)
    tripped = row is not None and row.breaker_tripped_at is not None
    if tripped and count < allowed:
        assert row is not None
        _reset_breaker(session, settings, row, now=now, detail={"allowed": allowed, "count": count})
        result.reset = True
        tripped = False
    windows = maintenance.active(session, now)
    todo = _hold_for_maintenance(session, candidates(views, policy, now), windows, result, now)
    # planned silence is not an outage: covered nodes are left out of the control-plane rules
    watched = [v for v in views if windows.covering(v.node.name) is None]
    todo = _guard_unreachable(session, settings, todo, watched, policy, facts, result, now)
    for cand in todo:
        if count >= allowed:
            result.held.append(cand.name)
            continue
        node = session.get(Node, cand.node_id)
        if node is None:
            continue
        if observe is not None and not _corroborated(session, settings, cand, observe, result, now):
            continue
        outcome = isolation.set_isolated(
            session,
            node,
            True,
            actor=POLICY_ACTOR,
            role="policy",
            reason=cand.reason,
            now=now,
            settings=settings,
            detail={"rule": cand.rule, **cand.detail},
        )
        if not outcome.changed:
            continue
        count += 1
        result.isolated.append(cand.name)
        if policy.restore_jobs:
            for job in _jobs_on(session, cand.name, now):
                try:
                    req = restores.request_restore(
                        session,
                        job,
                        step=None,
                        tier=None,
                        actor=POLICY_ACTOR,
                        role="policy",
                        reason=f"node {cand.name} auto-isolated ({cand.rule})",
                        now=now,
                        settings=settings,
                    )
                except restores.RestoreRefused:
                    continue  # audited as refused by request_restore
                result.restores.append(req.id)
    if result.held:
        row = _row(session, create=True)
        assert row is not None
        message = (
            f"auto-isolation circuit breaker tripped: {count} node(s) auto-isolated within "
            f"{policy.breaker_window_s:g} s (limit {allowed} = {policy.breaker_pct:g} % of "
            f"{len(views)} nodes); not isolating {', '.join(result.held[:20])}"
            + (f" and {len(result.held) - 20} more" if len(result.held) > 20 else "")
            + " — check for a shared cause"
        )
        if not tripped:
            row.breaker_tripped_at = now
            audit.record(
                session,
                actor=POLICY_ACTOR,
                role="policy",
                action="breaker_trip",
                target_kind="cluster",
                target="auto-isolation",
                reason=message,
                outcome="ok",
                now=now,
                detail={"held": result.held, "allowed": allowed, "count": count},
            )
            notify.breaker_tripped(session, settings, message=message, held=result.held, now=now)
            result.tripped = True
        row.breaker_message = message  # while it holds: the nodes held now
    return result


def _hold_for_maintenance(
    session: Session,
    todo: list[Candidate],
    windows: maintenance.ActiveMaintenance,
    result: PolicyRun,
    now: datetime,
) -> list[Candidate]:
    """Drop the candidates a maintenance window covers (audited once per window and node)."""
    kept = []
    for cand in todo:
        window = windows.covering(cand.name)
        if window is None:
            kept.append(cand)
            continue
        result.maintenance.append(cand.name)
        maintenance.record_hold(
            session, window, node=cand.name, rule=cand.rule, reason=cand.reason, now=now
        )
    return kept


def _guard_unreachable(
    session: Session,
    settings: Settings,
    todo: list[Candidate],
    views: Sequence[fleet_service.NodeView],
    policy: PolicySettings,
    facts: ControlPlaneFacts | None,
    result: PolicyRun,
    now: datetime,
) -> list[Candidate]:
    """Drop the unreachable candidates when the control plane is suspect, and raise (or
    resolve) the "control plane suspect" alert."""
    unreachable = [c.name for c in todo if c.rule == "unreachable"]
    suspicion = None
    if unreachable or (facts is not None and facts.stall is not None):
        silent = [
            Silent(v.node.name, v.node.last_seen)
            for v in views
            if v.unreachable and v.node.last_seen is not None
        ]
        suspicion = control_plane.assess(
            facts,
            silent,
            nodes=len(views),
            window_s=policy.control_plane_window_s,
            ingest_lag_limit_s=policy.suspect_ingest_lag_s,
            mass_pct=policy.suspect_unreachable_pct,
        )
    if suspicion is None or not suspicion.suspect:
        notify.control_plane_clear(session, settings, now=now)
        return todo
    result.suspect = suspicion
    result.held_unreachable = unreachable
    held = (
        f"not isolating {len(unreachable)} unreachable node(s) "
        f"({', '.join(unreachable[:10])}{' …' if len(unreachable) > 10 else ''})"
        if unreachable
        else f"unreachability is not acted on for {policy.control_plane_window_s:g} s"
    )
    message = f"control plane suspect: {held}: {suspicion.summary()}"
    raised = notify.control_plane_suspect(
        session,
        settings,
        message=message,
        held=unreachable,
        evidence=suspicion.evidence,
        now=now,
    )
    if raised:
        audit.record(
            session,
            actor=POLICY_ACTOR,
            role="policy",
            action="control_plane_suspect",
            target_kind="cluster",
            target="auto-isolation",
            reason=message,
            outcome="ok",
            now=now,
            detail={"held": unreachable, "reasons": suspicion.reasons, **suspicion.evidence},
        )
    return [c for c in todo if c.rule != "unreachable"]


def _corroborated(
    session: Session,
    settings: Settings,
    cand: Candidate,
    observe: Callable[[str], SchedulerView],
    result: PolicyRun,
    now: datetime,
) -> bool:
    """Ask the scheduler about the candidate; record its answer in the reason and detail.

    An unreachable node that the scheduler still hears from is not isolated: its node is up
    and only tierwatch's agent (or the path to the server) is down. A warning alert says so.
    Hardware findings are isolated whatever the scheduler says (the node itself reported
    them). A scheduler that cannot be asked does not stop the isolation; the reason says so.
    """
    view = observe(cand.name)
    cand.detail["scheduler"] = view.detail if view.ok else {"error": view.text}
    if cand.rule == "unreachable" and view.ok and view.responding is True:
        result.agent_silent.append(cand.name)
        notify.agent_silent(
            session, settings, node=cand.name, reason=cand.reason, view=view.text, now=now
        )
        return False
    said = view.text if view.ok else f"scheduler not asked: {view.text}"
    cand.reason = f"{cand.reason}; {' '.join(said.split())[:300]}"
    return True


def status(session: Session, settings: Settings, *, now: datetime) -> dict[str, Any]:
    """The policy as the API and dashboard show it (``schemas.PolicyOut``)."""
    policy, source = effective(session, settings)
    row = _row(session)
    nodes = session.scalar(select(func.count(Node.id))) or 0
    recent = audit.query(session, actor=POLICY_ACTOR, limit=20)
    return {
        "settings": policy.model_dump(),
        "source": source,
        "breaker": {
            "tripped": row is not None and row.breaker_tripped_at is not None,
            "tripped_at": row.breaker_tripped_at if row else None,
            "message": row.breaker_message if row else "",
            "allowed_per_window": allowed_isolations(policy.breaker_pct, nodes),
            "isolated_in_window": isolated_in_window(session, now, policy.breaker_window_s),
            "nodes": nodes,
        },
        "updated_at": row.updated_at if row else None,
        "updated_by": row.updated_by if row else "",
        "recent": [audit.entry_out(e) for e in recent],
    }

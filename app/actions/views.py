"""The actions domain's dashboard pages and forms: isolate / release / acknowledge a node,
restore a job, the audit log and the auto-isolation policy.

Every state-changing route needs a signed-in operator (the policy: admin) and the session's
CSRF token; it answers 303 back to the page it came from with a one-time message (post/
redirect/get), so a reload never repeats an action. The forms sit outside the pages'
live-refreshing blocks (a refresh never wipes a half-typed reason) and open behind a
``<details>`` toggle: the confirm step.

Routes:
    POST /nodes/{name}/isolate   reason → isolate (operator)
    POST /nodes/{name}/release   reason → release (operator)
    POST /nodes/{name}/ack       note → acknowledge all of the node's reasons (operator)
    POST /jobs/{job_id}/restore  step?, tier?, reason → restore request (operator)
    GET  /audit                  the audit log, filterable; fragment for htmx
    GET  /policy                 policy settings, breaker, recent policy actions
    POST /policy                 change the policy (admin)
    GET  /maintenance            maintenance windows (scheduled, active, recent)
    POST /maintenance            node?, hours, reason → open a window (operator)
    POST /maintenance/{id}/end   reason → end a window now (operator)
"""

from __future__ import annotations

import math
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Form, Path, Query, Request, Response
from fastapi.responses import RedirectResponse
from pydantic import ValidationError

from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import audit, isolation, maintenance, policy, restores
from tierwatch.server.actions.settings import PolicyUpdate
from tierwatch.server.checkpoints import service as checkpoint_service
from tierwatch.server.deps import SessionDep, SettingsDep
from tierwatch.server.fleet import service as fleet_service
from tierwatch.server.web.csrf import CsrfDep
from tierwatch.server.web.deps import (
    AdminPageDep,
    OperatorPageDep,
    ViewerPageDep,
    WebRoute,
    flash,
    render_page,
)

router = APIRouter(include_in_schema=False, route_class=WebRoute)

ReasonField = Annotated[str, Form(max_length=1000)]


def _back(path: str) -> Response:
    return RedirectResponse(path, status_code=303)


def _node_path(name: str) -> str:
    return "/nodes/" + quote(name, safe="")


def _reason(request: Request, reason: str) -> str | None:
    text = reason.strip()
    if not text:
        flash(
            request,
            "Give a reason: it goes into the audit log and tells other operators why.",
            "error",
        )
        return None
    if "\x00" in text:
        flash(request, "The reason holds a NUL character; type it again without one.", "error")
        return None
    return text


def _isolation(
    request: Request,
    principal: Any,
    name: str,
    isolated: bool,
    reason: str,
    session: Any,
    settings: Any,
) -> Response:
    node = fleet_service.get_node(session, name)
    text = _reason(request, reason)
    if text is None:
        return _back(_node_path(name))
    outcome = isolation.set_isolated(
        session,
        node,
        isolated,
        actor=principal.actor,
        role=principal.role,
        reason=text,
        now=utcnow(),
        settings=settings,
    )
    session.commit()
    if outcome.command is not None and outcome.command.executor == "server":
        work = getattr(request.app.state, "background", None)
        if work is not None:
            work.wake_drivers()
    verb = "isolated" if isolated else "released"
    if not outcome.changed:
        flash(
            request,
            f"{name} was already {'isolated' if isolated else 'in service'}; nothing changed.",
            "info",
        )
    elif outcome.command is None:
        flash(request, f"{name} {verb} (driver none: recorded only).")
    else:
        flash(
            request,
            f"{name} {verb}; the {outcome.command.driver} driver's run is "
            f"{outcome.command.state} (see Driver runs below).",
        )
    return _back(_node_path(name))


@router.post("/nodes/{name}/isolate")
def isolate_form(
    request: Request,
    name: str,
    principal: OperatorPageDep,
    _: CsrfDep,
    session: SessionDep,
    settings: SettingsDep,
    reason: ReasonField = "",
) -> Response:
    """Isolate a node from its page."""
    return _isolation(request, principal, name, True, reason, session, settings)


@router.post("/nodes/{name}/release")
def release_form(
    request: Request,
    name: str,
    principal: OperatorPageDep,
    _: CsrfDep,
    session: SessionDep,
    settings: SettingsDep,
    reason: ReasonField = "",
) -> Response:
    """Release a node from its page."""
    return _isolation(request, principal, name, False, reason, session, settings)


@router.post("/nodes/{name}/ack")
def ack_form(
    request: Request,
    name: str,
    principal: OperatorPageDep,
    _: CsrfDep,
    session: SessionDep,
    note: Annotated[str, Form(max_length=2000)] = "",
) -> Response:
    """Acknowledge every active reason of a node (clears XID-driven states)."""
    node = fleet_service.get_node(session, name)
    text = _reason(request, note)
    if text is None:
        return _back(_node_path(name))
    now = utcnow()
    cleared = fleet_service.acknowledge(
        session, node, rule=None, gpu=None, actor=principal.actor, note=text, now=now
    )
    audit.record(
        session,
        actor=principal.actor,
        role=principal.role,
        action="ack",
        target_kind="node",
        target=name,
        reason=text,
        outcome="ok" if cleared else "noop",
        now=now,
        detail={"cleared": cleared},
    )
    session.commit()
    flash(
        request,
        f"{cleared} reason(s) of {name} acknowledged."
        if cleared
        else f"{name} had no reasons to acknowledge.",
        "ok" if cleared else "info",
    )
    return _back(_node_path(name))


@router.post("/jobs/{job_id}/restore")
def restore_form(
    request: Request,
    job_id: str,
    principal: OperatorPageDep,
    _: CsrfDep,
    session: SessionDep,
    settings: SettingsDep,
    reason: ReasonField = "",
    step: Annotated[str, Form(max_length=24)] = "",
    tier: Annotated[str, Form(max_length=16)] = "",
) -> Response:
    """Ask for a restore of a job from its page."""
    job = checkpoint_service.get_job(session, job_id)
    path = "/jobs/" + quote(job_id, safe="")
    text = _reason(request, reason)
    if text is None:
        return _back(path)
    step_value: int | None = None
    if step.strip():
        if not step.strip().isdigit():
            flash(request, f"Step must be a whole number (got {step.strip()!r}).", "error")
            return _back(path)
        step_value = int(step.strip())
    if tier and tier not in ("memory", "peer", "persistent"):
        flash(
            request,
            f"Tier must be memory, peer or persistent, or empty for the fastest "
            f"that holds the step (got {tier!r}).",
            "error",
        )
        return _back(path)
    tier_value = tier or None
    try:
        req = restores.request_restore(
            session,
            job,
            step=step_value,
            tier=tier_value,
            reason=text,
            actor=principal.actor,
            role=principal.role,
            now=utcnow(),
            settings=settings,
        )
    except restores.RestoreRefused as exc:
        session.commit()
        flash(request, f"Restore refused: {exc}", "error")
        return _back(path)
    session.commit()
    flash(
        request,
        f"Restore {req.id} of {job_id} to step {req.step} requested: the ranks "
        "roll back at their next step boundary (progress below).",
    )
    return _back(path)


# --- audit ---------------------------------------------------------------------------------


@router.get("/audit")
def audit_page(
    request: Request,
    viewer: ViewerPageDep,
    session: SessionDep,
    settings: SettingsDep,
    actor: Annotated[str | None, Query(max_length=128)] = None,
    action: Annotated[str | None, Query(max_length=32)] = None,
    target: Annotated[str | None, Query(max_length=128)] = None,
    outcome: Annotated[str | None, Query(max_length=16)] = None,
) -> Response:
    """The audit log, newest first, filtered by exact actor, action, target and outcome."""
    filters = {
        k: v.strip()
        for k, v in (("actor", actor), ("action", action), ("target", target), ("outcome", outcome))
        if v and v.strip()
    }
    entries = audit.query(session, limit=300, **filters)
    context = {
        "principal": viewer,
        "now": utcnow(),
        "refresh_s": max(5.0, settings.dashboard_refresh_s),
        "entries": entries,
        "filters": filters,
        "poll_url": "/audit" + (f"?{urlencode(filters)}" if filters else ""),
    }
    return render_page(request, "pages/audit.html", context)


# --- policy --------------------------------------------------------------------------------


@router.get("/policy")
def policy_page(
    request: Request, viewer: ViewerPageDep, session: SessionDep, settings: SettingsDep
) -> Response:
    """The auto-isolation policy: settings (and their source), breaker, recent actions."""
    context = {
        "principal": viewer,
        "now": utcnow(),
        "refresh_s": settings.dashboard_refresh_s,
        "policy": policy.status(session, settings, now=utcnow()),
    }
    return render_page(request, "pages/policy.html", context)


@router.post("/policy")
def policy_form(
    request: Request,
    principal: AdminPageDep,
    _: CsrfDep,
    session: SessionDep,
    enabled: Annotated[str, Form(max_length=8)] = "",
    restore_jobs: Annotated[str, Form(max_length=8)] = "",
    unreachable_s: Annotated[str, Form(max_length=24)] = "",
    breaker_pct: Annotated[str, Form(max_length=24)] = "",
    breaker_window_s: Annotated[str, Form(max_length=24)] = "",
) -> Response:
    """Change the policy from the policy page (checkboxes; empty numbers keep the value)."""
    values: dict[str, Any] = {"enabled": enabled == "on", "restore_jobs": restore_jobs == "on"}
    for name, raw in (
        ("unreachable_s", unreachable_s),
        ("breaker_pct", breaker_pct),
        ("breaker_window_s", breaker_window_s),
    ):
        if raw.strip():
            values[name] = raw.strip()
    try:
        change = PolicyUpdate(**values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        flash(request, f"Policy not changed: {problems}", "error")
        return _back("/policy")
    policy.update(session, change, actor=principal.actor, role=principal.role, now=utcnow())
    session.commit()
    flash(
        request,
        "Policy updated"
        + (" — auto-isolation is ON." if change.enabled else " — auto-isolation is off."),
    )
    return _back("/policy")


# --- maintenance windows -------------------------------------------------------------------


@router.get("/maintenance")
def maintenance_page(
    request: Request, viewer: ViewerPageDep, session: SessionDep, settings: SettingsDep
) -> Response:
    """Maintenance windows: scheduled and active ones first, then the recent ones."""
    now = utcnow()
    windows = maintenance.list_windows(session, now=now, include_over=True)
    context = {
        "principal": viewer,
        "now": now,
        "refresh_s": max(5.0, settings.dashboard_refresh_s),
        "windows": [maintenance.window_out(w, now) for w in windows],
        "max_h": settings.policy.maintenance_max_s / 3600,
    }
    return render_page(request, "pages/maintenance.html", context)


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'window'}: {e['msg'].removeprefix('Value error, ')}"
        for e in exc.errors()
    )


@router.post("/maintenance")
def maintenance_form(
    request: Request,
    principal: OperatorPageDep,
    _: CsrfDep,
    session: SessionDep,
    settings: SettingsDep,
    node: Annotated[str, Form(max_length=128)] = "",
    hours: Annotated[str, Form(max_length=24)] = "",
    reason: ReasonField = "",
    back: Annotated[str, Form(max_length=200)] = "",
) -> Response:
    """Open a maintenance window on a node (or, with no node, the cluster) for some hours."""
    # back to the node page the form came from (built here, never taken from the form)
    target = _node_path(node.strip()) if back and node.strip() else "/maintenance"
    text = _reason(request, reason)
    if text is None:
        return _back(target)
    try:
        duration_s = float(hours.strip()) * 3600
    except ValueError:
        duration_s = math.nan
    if not (math.isfinite(duration_s) and duration_s > 0):
        flash(
            request,
            f"Hours must be a positive number, like 2 or 0.5, not {hours.strip()!r}.",
            "error",
        )
        return _back(target)
    try:
        body = maintenance.MaintenanceIn(
            node=node.strip() or None, reason=text, duration_s=duration_s
        )
    except ValidationError as exc:
        flash(request, f"No window opened: {_problems(exc)}", "error")
        return _back(target)
    now = utcnow()
    try:
        window = maintenance.start(
            session,
            body,
            actor=principal.actor,
            role=principal.role,
            now=now,
            max_s=settings.policy.maintenance_max_s,
        )
    except LookupError as exc:
        flash(request, f"No window opened: {exc}", "error")
        return _back(target)
    except maintenance.MaintenanceRefused as exc:
        session.commit()  # keep the audit entry of the refusal
        flash(request, f"No window opened: {exc}", "error")
        return _back(target)
    session.commit()
    what = f"node {window.node}" if window.node else "the whole cluster"
    flash(
        request,
        f"Maintenance window {window.id} open on {what} until {window.ends_at:%Y-%m-%d %H:%M} "
        "UTC: no automatic isolation, alerts recorded but not delivered.",
    )
    return _back(target)


@router.post("/maintenance/{window_id}/end")
def maintenance_end_form(
    request: Request,
    window_id: Annotated[int, Path(ge=1, le=2**31 - 1)],
    principal: OperatorPageDep,
    _: CsrfDep,
    session: SessionDep,
    reason: ReasonField = "",
) -> Response:
    """End a maintenance window now."""
    text = _reason(request, reason)
    if text is None:
        return _back("/maintenance")
    try:
        window, changed = maintenance.end(
            session,
            window_id,
            actor=principal.actor,
            role=principal.role,
            reason=text,
            now=utcnow(),
        )
    except LookupError as exc:
        flash(request, str(exc), "error")
        return _back("/maintenance")
    session.commit()
    if changed:
        flash(request, f"Maintenance window {window.id} ended: the policy and alerts act again.")
    else:
        flash(request, f"Maintenance window {window.id} was already over; nothing changed.", "info")
    return _back("/maintenance")

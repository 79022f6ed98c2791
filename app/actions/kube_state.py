"""What tierwatch changes on a Kubernetes Node to isolate or release it (pure: the API calls
are :class:`tierwatch.server.actions.drivers.KubernetesDriver`'s).

tierwatch's overlay on a node is two things:

- the taint ``<taint_key>=true:NoSchedule``, which is only ever tierwatch's (identified by key
  and effect, per the Kubernetes "Taints and Tolerations" docs);
- the annotation ``<annotation_key>``, a JSON object ``{"cordoned": bool, "reason": str,
  "at": RFC 3339}``. ``cordoned`` is true only when tierwatch itself set
  ``spec.unschedulable`` (the node was schedulable when it isolated it).

Release removes the taint and the annotation, and uncordons only when the annotation says
tierwatch made the cordon. A node someone else cordoned before tierwatch's isolate (an admin's
``kubectl cordon``, a drain, the GPU Operator's driver upgrade) stays cordoned. The limit: a
cordon is one boolean, so a second cordon someone makes on top of tierwatch's cannot be told
apart from it; such a node is uncordoned on release, as ``kubectl uncordon`` would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TAINT_EFFECT = "NoSchedule"
TAINT_VALUE = "true"
REASON_CHARS = 512
"""Most characters of the reason kept in the annotation."""


@dataclass(frozen=True)
class NodeChange:
    """The merge patch to send, or None when the node already is as wanted.

    Attributes:
        patch: ``{"metadata": {"annotations": …}, "spec": {"unschedulable", "taints"}}`` (no
            ``resourceVersion``: the caller adds the one it read), or None.
        note: what was found and done, and what was left in place, for the operator.
        cordoned_by_us: after this change, tierwatch's own cordon is in place.
    """

    patch: dict[str, Any] | None
    note: str
    cordoned_by_us: bool


def our_mark(node: dict[str, Any], annotation_key: str) -> dict[str, Any] | None:
    """tierwatch's annotation on ``node``, parsed; None when absent or not ours.

    A value that is not a JSON object (someone edited it) counts as absent, so release then
    leaves the cordon alone.
    """
    raw = ((node.get("metadata") or {}).get("annotations") or {}).get(annotation_key)
    if not isinstance(raw, str):
        return None
    try:
        mark = json.loads(raw)
    except ValueError:
        return None
    return mark if isinstance(mark, dict) else None


def ready(node: dict[str, Any]) -> bool | None:
    """The node's ``Ready`` condition: True, False (``False``/``Unknown``), None if absent."""
    for cond in (node.get("status") or {}).get("conditions") or []:
        if isinstance(cond, dict) and cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return None


def plan(
    node: dict[str, Any],
    *,
    isolate: bool,
    taint_key: str,
    annotation_key: str,
    reason: str,
    now_rfc3339: str,
) -> NodeChange:
    """The change that isolates (``isolate=True``) or releases ``node``.

    Args:
        node: the Node object as the API returned it (JSON).
        taint_key: our taint's key.
        annotation_key: our annotation's key.
        reason: the isolation's reason (kept in the annotation on isolate).
        now_rfc3339: the time to record in the annotation.
    """
    spec = node.get("spec") or {}
    taints: list[dict[str, Any]] = list(spec.get("taints") or [])
    cordoned = bool(spec.get("unschedulable"))
    mark = our_mark(node, annotation_key)

    def ours(taint: dict[str, Any]) -> bool:
        return taint.get("key") == taint_key and taint.get("effect") == TAINT_EFFECT

    has_taint = any(ours(t) for t in taints)
    taint = f"{taint_key}={TAINT_VALUE}:{TAINT_EFFECT}"
    if isolate:
        if mark is not None:
            by_us = bool(mark.get("cordoned"))
        else:
            by_us = not cordoned
        if cordoned and has_taint and mark is not None:
            return NodeChange(None, f"already isolated (cordoned, taint {taint})", by_us)
        new_taints = taints if has_taint else [*taints, _taint(taint_key)]
        value = json.dumps(
            {"cordoned": by_us, "reason": reason[:REASON_CHARS], "at": now_rfc3339},
            separators=(",", ":"),
        )
        note = f"cordoned, taint {taint} set" if by_us else f"taint {taint} set"
        if not by_us:
            note += "; the node was already cordoned by someone else: that cordon stays on release"
        return NodeChange(
            {
                "metadata": {"annotations": {annotation_key: value}},
                "spec": {"unschedulable": True, "taints": new_taints},
            },
            note,
            by_us,
        )
    by_us = mark is not None and bool(mark.get("cordoned"))
    new_taints = [t for t in taints if not ours(t)]
    if mark is None and not has_taint:
        state = "cordoned by someone else: left in place" if cordoned else "schedulable"
        return NodeChange(None, f"no tierwatch isolation on the node ({state})", False)
    uncordon = by_us and cordoned
    spec_patch: dict[str, Any] = {"taints": new_taints}
    if uncordon:
        spec_patch["unschedulable"] = False
    parts = [f"taint {taint} removed" if has_taint else f"no taint {taint}"]
    if uncordon:
        parts.insert(0, "uncordoned")
    elif cordoned:
        parts.append("left cordoned: the cordon was not tierwatch's")
    patch: dict[str, Any] = {"spec": spec_patch}
    if mark is not None or annotation_key in (
        (node.get("metadata") or {}).get("annotations") or {}
    ):
        patch["metadata"] = {"annotations": {annotation_key: None}}
    return NodeChange(patch, ", ".join(parts), False)


def _taint(key: str) -> dict[str, Any]:
    return {"key": key, "value": TAINT_VALUE, "effect": TAINT_EFFECT}

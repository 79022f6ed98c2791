"""Checkpoint ledger logic (pure functions, table-tested): completeness, lag, work at risk.

Rules (docs/checkpointing.md, docs/design.md "Checkpoint model"):

- A step is **committed** in a tier when every rank ``0 … world_size − 1`` has a
  ``committed`` event for that (step, tier), or one ``committed`` event with rank None
  committed the whole step. Ranks outside ``0 … world_size − 1`` never count.
- The **newest committed step** of a tier (``newest_committed_step``) is the newest step
  that became complete in it, also after retention evicted it: retention removes a step
  only after a newer one committed in that tier, which the server may not have seen yet
  (a rank's ``committed`` and ``evicted`` of one step often arrive in one report). A step a
  restore abandoned (above the restored step, committed before the restore) no longer
  counts. The memory tier's figure is at least that of every tier fed from it
  (``FED_FROM_MEMORY``): a step those tiers hold was committed in memory first
  (``with_memory_floor``).
- The **lag** of a tier is ``training_step − newest committed step`` (steps); a tier with
  no committed step lags ``training_step + 1`` (every step since step 0 is at risk).
- **Work at risk** of a failure class is the lag of the fastest tier that survives it and
  holds the newest committed step among those tiers: a process failure is recovered from
  memory (or peer, or persistent), a node failure from peer (or persistent), a rack
  failure and a rollback (silent data corruption) from persistent only.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import datetime

TIERS: tuple[str, ...] = ("memory", "peer", "persistent")
# Tiers whose copies are made from the memory tier's files of a committed step (the agents
# replicate and upload only steps the ranks committed in memory: docs/checkpointing.md).
FED_FROM_MEMORY: tuple[str, ...] = ("peer", "persistent")

# Tiers a failure class leaves intact, fastest first (what its recovery may read).
SURVIVED_BY: dict[str, tuple[str, ...]] = {
    "process": ("memory", "peer", "persistent"),
    "node": ("peer", "persistent"),
    "rack": ("persistent",),
    "rollback": ("persistent",),
}


@dataclass(frozen=True)
class Completeness:
    """Whether a (job, step, tier) is committed.

    Attributes:
        complete: every rank committed, or the whole step was committed at once.
        missing: ranks ``0 … world_size − 1`` without a ``committed`` event (empty when
            complete; None when the world size is unknown and the step is not whole).
    """

    complete: bool
    missing: tuple[int, ...] | None


def completeness(
    world_size: int | None, committed_ranks: AbstractSet[int], whole_step: bool
) -> Completeness:
    """Completeness of one (job, step, tier) from the ranks that committed it.

    Args:
        world_size: number of ranks of the job (None: not known yet).
        committed_ranks: ranks with a ``committed`` event for this step and tier.
        whole_step: a ``committed`` event with rank None was reported.

    Returns:
        ``Completeness``; with an unknown world size only ``whole_step`` completes a step.
    """
    if whole_step:
        return Completeness(True, ())
    if world_size is None or world_size < 1:
        return Completeness(False, None)
    missing = tuple(r for r in range(world_size) if r not in committed_ranks)
    return Completeness(not missing, missing)


def lag_steps(training_step: int | None, newest_step: int | None) -> int | None:
    """Steps at risk in a tier: ``training_step − newest_step`` (never negative).

    ``training_step + 1`` when the tier has no committed step; None when the job has not
    reported any step.
    """
    if training_step is None:
        return None
    if newest_step is None:
        return training_step + 1
    return max(0, training_step - newest_step)


def lag_seconds(
    steps: int | None, step_time_s: float | None, trained_gap_s: float | None = None
) -> float | None:
    """Training time at risk (seconds).

    Args:
        steps: lag in steps.
        step_time_s: median step time (seconds per step).
        trained_gap_s: time between when the newest committed step and the current step
            were trained, when both are known from progress reports (preferred).

    Returns:
        ``trained_gap_s`` when known, else ``steps × step_time_s``; 0 for no lag; None when
        neither is known.
    """
    if steps is None:
        return None
    if steps == 0:
        return 0.0
    if trained_gap_s is not None:
        return max(0.0, trained_gap_s)
    if step_time_s is None:
        return None
    return steps * step_time_s


def recovery_tier(
    failure_class: str, newest: Mapping[str, int | None]
) -> tuple[str | None, int | None]:
    """The tier a failure class is recovered from, and the step it gives back.

    Args:
        failure_class: process | node | rack | rollback.
        newest: newest committed step per tier (None: none).

    Returns:
        ``(tier, step)``: the fastest surviving tier holding the newest committed step
        among the surviving tiers; ``(None, None)`` when none of them holds a step.

    Raises:
        ValueError: unknown failure class.
    """
    if failure_class not in SURVIVED_BY:
        raise ValueError(
            f"unknown failure class {failure_class!r}; classes: {', '.join(SURVIVED_BY)}"
        )
    best: tuple[str | None, int | None] = (None, None)
    for tier in SURVIVED_BY[failure_class]:
        step = newest.get(tier)
        if step is not None and (best[1] is None or step > best[1]):
            best = (tier, step)
    return best


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def abandoned(
    step: int, committed_at: datetime | None, restores: Iterable[tuple[int, datetime]]
) -> bool:
    """Whether a restore abandoned a tier's copy of ``step``.

    Args:
        step: the ledger row's step.
        committed_at: when the row became complete (the newest counted ``committed`` event;
            None: unknown, never abandoned).
        restores: ``(restored step, ts)`` of the job's successful restores that loaded a step.

    Returns:
        True when some restore loaded an older step after this copy was committed: the ranks
        went on from the restored step (a rollback also evicts the newer steps), so this copy
        belongs to an abandoned timeline. A copy committed after the restore (the step saved
        again) is not abandoned. Clocks of the job's nodes are assumed to agree within a step.
    """
    if committed_at is None:
        return False
    return any(step > restored and committed_at <= ts for restored, ts in restores)


def newest_committed_step(rows: Sequence[tuple[int, bool, bool]]) -> int | None:
    """The newest committed step of one tier, from ``(step, complete, abandoned)`` rows.

    A step counts once it is complete, whether or not retention evicted it since (a tier's
    newest committed step is evicted only after a newer one committed, so the newest step
    ever complete is never ahead of the tier); an abandoned step (``abandoned``) does not.

    Returns:
        The step, or None when no step counts.
    """
    steps = [step for step, complete, gone in rows if complete and not gone]
    return max(steps) if steps else None


def with_memory_floor(newest: Mapping[str, int | None]) -> dict[str, int | None]:
    """Newest committed step per tier, memory raised to the tiers fed from it.

    Args:
        newest: each tier's own newest committed step (None: none).

    Returns:
        The same mapping, with memory's step ``max(memory, *FED_FROM_MEMORY)``: a step
        complete in peer or persistent was committed in memory first, whose own events
        (sent by the ranks through their agent) often arrive later than the agents' events.
    """
    out = dict(newest)
    fed = [s for t in ("memory", *FED_FROM_MEMORY) if (s := out.get(t)) is not None]
    out["memory"] = max(fed) if fed else None
    return out


# -- observed failures ----------------------------------------------------------------------
INCIDENT_WINDOW_S = 120.0
MIN_OBSERVED_FAILURES = 3
# The failure class a restore reveals, by the slowest tier it had to read: a restore that
# needed the persistent tier lost every memory copy (rack class); one that needed a peer
# replica lost a node; one served from memory alone lost only processes.
_CLASS_BY_TIER = {"persistent": "rack", "peer": "node", "memory": "process"}
TIER_SERVES = {"memory": "process", "peer": "node", "persistent": "rack"}


def failure_incidents(
    restores: Iterable[tuple[float, Mapping[str, int]]], *, window_s: float = INCIDENT_WINDOW_S
) -> list[str]:
    """Failure classes of the restore incidents of one job, oldest first.

    Args:
        restores: ``(ts seconds, files_by_tier)`` of every rank's successful restore that
            loaded a step. The ranks of one restart restore within seconds of each other.
        window_s: restores starting within this many seconds of an incident's first restore
            belong to that incident (seconds).

    Returns:
        One failure class per incident (process | node | rack), from the slowest tier any of
        its ranks read.
    """
    order = {"process": 0, "node": 1, "rack": 2}
    incidents: list[tuple[float, str]] = []
    for ts, by_tier in sorted(restores, key=lambda r: r[0]):
        used = [t for t, n in by_tier.items() if n and t in _CLASS_BY_TIER]
        klass = max((_CLASS_BY_TIER[t] for t in used), key=order.__getitem__, default="process")
        if incidents and ts - incidents[-1][0] <= window_s:
            start, prev = incidents[-1]
            incidents[-1] = (start, max(prev, klass, key=order.__getitem__))
        else:
            incidents.append((ts, klass))
    return [k for _, k in incidents]


def observed_mtbf_s(
    incidents: Sequence[str],
    span_s: float,
    klass: str,
    *,
    min_failures: int = MIN_OBSERVED_FAILURES,
) -> float | None:
    """Observed MTBF (seconds) of one failure class: observed time / incidents of that class.

    None with fewer than ``min_failures`` incidents of the class (too few to estimate; the
    caller falls back to the Llama 3 table) or a non-positive span.
    """
    n = sum(1 for k in incidents if k == klass)
    if n < min_failures or span_s <= 0:
        return None
    return span_s / n

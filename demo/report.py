"""What the demo run kept of its wall time, and what persistent-only checkpointing would
have kept on the same failures (pure functions over the run's logs and measured costs).

Effective training time (goodput as a fraction of wall time)::

    effective = Σ compute_s of the steps that survived / wall time

A step *survived* when no later restart or rollback re-did it (the final lineage of steps in
rank 0's log); ``compute_s`` is the step's time before ``save`` (forward, backward,
optimizer, data), so checkpoint stalls, lost steps and downtime all count against it.

Baseline: the same job checkpointing only to persistent storage, synchronously, every
``τ`` seconds of work, with Young's optimal interval (J. W. Young, "A first order
approximation to the optimum checkpoint interval", CACM 17(9), 1974)::

    τ = √(2 · δ · M)

δ: the measured time to write one step to the persistent tier; M: the demo's MTBF. It is
played on the same failure schedule: each failure loses the work since its last completed
checkpoint (a checkpoint cut short by the failure does not count) and is down for this
run's measured downtime of that failure less this run's restore, plus a restore from the
persistent tier.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

TIER_ORDER = ("memory", "peer", "persistent")  # fastest first


def is_step(entry: dict[str, Any]) -> bool:
    """Whether a log line is a step's (``{"step", "loss", …}``), not an event's
    (``{"event": "sdc", "step", …}``)."""
    return "step" in entry and "event" not in entry


def surviving_steps(entries: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The final lineage: rank 0's step entries, in log order, minus every entry a later
    restart or rollback re-did.

    Args:
        entries: log lines of one rank (``{"step", "compute_s", …}``; lines without
            ``step`` and event lines, e.g. ``{"event": "sdc", "step"}``, are skipped).

    Returns:
        The surviving entries, ascending by step (one per step).
    """
    kept: list[dict[str, Any]] = []
    for e in entries:
        if not is_step(e):
            continue
        while kept and kept[-1]["step"] >= e["step"]:
            kept.pop()
        kept.append(e)
    return kept


def effective_training_time(entries: list[dict[str, Any]], wall_s: float) -> float:
    """Σ ``compute_s`` of the surviving steps / ``wall_s`` (0–1).

    Raises:
        ValueError: ``wall_s`` ≤ 0.
    """
    if wall_s <= 0:
        raise ValueError(f"wall time must be > 0 s, got {wall_s:g}")
    useful = sum(e.get("compute_s", 0.0) for e in surviving_steps(entries))
    return min(1.0, useful / wall_s)


def slowest_tier(tiers: Iterable[str]) -> str | None:
    """The slowest of ``tiers`` (memory < peer < persistent); None for none."""
    known = [t for t in tiers if t in TIER_ORDER]
    return max(known, key=TIER_ORDER.index) if known else None


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval τ = √(2·δ·M), seconds.

    Raises:
        ValueError: ``checkpoint_s`` or ``mtbf_s`` ≤ 0.
    """
    if checkpoint_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"δ and M must be > 0 s (got δ={checkpoint_s:g}, M={mtbf_s:g})")
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


@dataclass(frozen=True)
class BaselineFailure:
    """One failure as the baseline plays it: ``at_s`` (s after training started) and
    ``down_s`` (seconds without training before work resumes, restore included)."""

    at_s: float
    down_s: float


def compute_share(entries: Iterable[dict[str, Any]], max_gap_s: float = 5.0) -> float:
    """ρ: the share of a running job's time, checkpoint stalls aside, that is step compute.

    Over consecutive steps of one incarnation (``step`` = previous + 1, ``t`` less than
    ``max_gap_s`` apart): ``Σ compute_s / Σ (Δt − save_s)``. The rest is the loop's own
    overhead (logging, the rollback check), which a persistent-only job pays too. 1.0 when
    there are no such pairs.
    """
    compute = busy = 0.0
    prev = None
    for e in entries:
        if not is_step(e) or "t" not in e:
            continue
        if (
            prev is not None
            and e["step"] == prev["step"] + 1
            and 0 < e["t"] - prev["t"] < max_gap_s
        ):
            compute += e.get("compute_s", 0.0)
            busy += e["t"] - prev["t"] - e.get("save_s", 0.0)
        prev = e
    return min(1.0, compute / busy) if busy > 0 else 1.0


def shard_tiers(sources: Iterable[dict[str, str]]) -> dict[str, str]:
    """Per rank whose shards were loaded, the fastest tier any rank read them from.

    Args:
        sources: restore reports' ``sources`` (file name → ``"<tier>:<node>"``); shard
            files are ``__<rank>_<i>.distcp``.

    Returns:
        ``{"<rank>": tier}``: the tier that still held that rank's checkpoint (a rank
        reads a copy from the fastest source it has; a replica on its own node may come
        before another node's memory, so the fastest tier over all ranks is the one that
        survived).
    """
    out: dict[str, str] = {}
    for src in sources:
        for name, where in src.items():
            if not (name.startswith("__") and name.endswith(".distcp")):
                continue
            owner = name[2:].split("_", 1)[0]
            tier = where.split(":", 1)[0]
            if tier not in TIER_ORDER:
                continue
            if owner not in out or TIER_ORDER.index(tier) < TIER_ORDER.index(out[owner]):
                out[owner] = tier
    return dict(sorted(out.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))


def persistent_only(
    failures: list[BaselineFailure],
    *,
    wall_s: float,
    checkpoint_s: float,
    mtbf_s: float,
    compute_share: float = 1.0,
) -> tuple[float, float]:
    """Play persistent-only checkpointing at Young's interval over ``failures``.

    The timeline: work accrues at 1 s per s; after every ``τ`` s of work since the last
    checkpoint, training blocks ``checkpoint_s`` to write one, which counts once complete.
    A failure drops the work since the last complete checkpoint and stops training for its
    ``down_s``; a failure that arrives while the job is down extends the outage.

    Args:
        failures: in any order; wall_s: the run's wall time (s); checkpoint_s: δ (s);
            mtbf_s: M (s); compute_share: ρ, the share of running time that is step
            compute (:func:`compute_share` of this run; the loop's overhead is the same).

    Returns:
        (fraction of ``wall_s`` spent on step compute that survived (0–1), τ in seconds).

    Raises:
        ValueError: ``wall_s``, ``checkpoint_s`` or ``mtbf_s`` ≤ 0.
    """
    if wall_s <= 0:
        raise ValueError(f"wall time must be > 0 s, got {wall_s:g}")
    tau = young_interval(checkpoint_s, mtbf_s)
    t = 0.0
    work = 0.0  # work since the start that is done (committed + since the last checkpoint)
    committed = 0.0
    since = 0.0  # work since the last complete checkpoint

    def run_until(end: float) -> None:
        nonlocal t, work, committed, since
        while t < end:
            to_ckpt = tau - since
            if t + to_ckpt >= end:  # no checkpoint starts before `end`
                work += end - t
                since += end - t
                t = end
                return
            work += to_ckpt
            since = tau
            t += to_ckpt
            if t + checkpoint_s > end:  # the checkpoint is cut short
                t = end
                return
            t += checkpoint_s
            committed = work
            since = 0.0

    for f in sorted(failures, key=lambda f: f.at_s):
        if f.at_s >= wall_s:
            break
        if f.at_s > t:
            run_until(f.at_s)
        # lose the work since the last complete checkpoint, then stay down
        work = committed
        since = 0.0
        t = max(t, f.at_s) + f.down_s
    if t < wall_s:
        run_until(wall_s)
    return min(1.0, compute_share * work / wall_s), tau


def median(values: Iterable[float]) -> float | None:
    """The median of ``values``, None when there are none."""
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None

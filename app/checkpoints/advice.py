"""Checkpoint interval advice per tier (pure functions, no I/O but the packaged table).

Formulas:

- Young (1974), "A first order approximation to the optimum checkpoint interval":
  τ = √(2 δ M), with δ the cost of one checkpoint and M the mean time between failures.
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart
  dumps": τ = √(2 δ M) · [1 + ⅓·√(δ / 2M) + ⅑·(δ / 2M)] − δ for δ < 2M, else τ = M.

Which failures count for a tier: a failure is recovered from the fastest tier that survives
it, so the interval of tier T only changes the work lost to failures that T survives and no
faster tier does — memory: process failures; peer: node failures; persistent: rack failures
and silent data corruption (rollback). ``M`` for a tier is the MTBF of that class: the rule
that minimises lost work (docs/design.md "Decisions as built" says why it is not "the
failures the tier cannot survive").

Without observed failures, the rate comes from the Llama 3 table shipped in
``tierwatch/server/data/llama3_interruptions.csv``: 419 unexpected interruptions in 54 days
on 16,384 GPUs, weighted by the counts, scaled to the job's GPU count.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

TIERS = ("memory", "peer", "persistent")
FAILURE_CLASSES = ("process", "node", "rack", "rollback")

# The failure classes whose recovery reads each tier (see the module docstring).
RECOVERED_FROM: dict[str, tuple[str, ...]] = {
    "memory": ("process",),
    "peer": ("node",),
    "persistent": ("rack", "rollback"),
}

LLAMA3_GPUS = 16_384
LLAMA3_HOURS = 54 * 24


class AdviceError(ValueError):
    """Inputs that give no meaningful interval (the message says which)."""


@dataclass(frozen=True)
class FailureTable:
    """Unexpected interruptions per failure class over an observed window.

    Attributes:
        counts: interruptions per failure class.
        gpu_hours: GPU-hours the counts were observed over.
    """

    counts: dict[str, int]
    gpu_hours: float

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def rate_per_gpu_hour(self, classes: tuple[str, ...] | None = None) -> float:
        """Interruptions per GPU-hour, for all classes or the given ones."""
        wanted = classes or tuple(self.counts)
        return sum(self.counts.get(c, 0) for c in wanted) / self.gpu_hours


def parse_failure_table(text: str, *, gpus: int, hours: float) -> FailureTable:
    """Failure counts per class from the interruptions CSV text.

    Raises:
        AdviceError: a missing column, a count that is not a non-negative integer, or an
            unknown failure class.
    """
    counts = dict.fromkeys(FAILURE_CLASSES, 0)
    reader = csv.DictReader(text.splitlines())
    missing = {"interruptions", "failure_class"} - set(reader.fieldnames or ())
    if missing:
        raise AdviceError(f"interruptions table lacks column(s) {sorted(missing)}")
    for line, row in enumerate(reader, start=2):
        klass = row["failure_class"].strip()
        if klass not in counts:
            raise AdviceError(f"line {line}: unknown failure class {klass!r}")
        try:
            n = int(row["interruptions"])
        except ValueError:
            raise AdviceError(f"line {line}: interruptions {row['interruptions']!r}") from None
        if n < 0:
            raise AdviceError(f"line {line}: negative interruptions {n}")
        counts[klass] += n
    return FailureTable(counts=counts, gpu_hours=gpus * hours)


@lru_cache(maxsize=1)
def llama3_table() -> FailureTable:
    """The packaged Llama 3 table: 419 interruptions over 54 days × 16,384 GPUs."""
    try:
        text = (
            resources.files("tierwatch.server") / "data" / "llama3_interruptions.csv"
        ).read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        text = (
            Path(__file__).resolve().parent.parent / "data" / "llama3_interruptions.csv"
        ).read_text()
    return parse_failure_table(text, gpus=LLAMA3_GPUS, hours=LLAMA3_HOURS)


def tier_mtbf_s(tier: str, *, gpus: int, table: FailureTable | None = None) -> float:
    """MTBF (seconds) of the failures recovered from ``tier`` for a job on ``gpus`` GPUs.

    Raises:
        AdviceError: unknown tier, fewer than one GPU, or a table with no such failures.
    """
    if tier not in RECOVERED_FROM:
        raise AdviceError(f"unknown tier {tier!r}; tiers: {', '.join(TIERS)}")
    if gpus < 1:
        raise AdviceError(f"a job has at least one GPU, not {gpus}")
    rate = (table or llama3_table()).rate_per_gpu_hour(RECOVERED_FROM[tier]) * gpus
    if rate <= 0:
        raise AdviceError(f"no failures recovered from the {tier} tier in the table")
    return 3600.0 / rate


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's optimum interval τ = √(2 δ M) (seconds).

    Raises:
        AdviceError: a negative cost or a non-positive MTBF.
    """
    _check(cost_s, mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum interval (seconds); ``M`` when δ ≥ 2M.

    Raises:
        AdviceError: a negative cost or a non-positive MTBF.
    """
    _check(cost_s, mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


@dataclass(frozen=True)
class IntervalAdvice:
    """Recommended checkpoint interval of one tier (seconds).

    Attributes:
        tier: memory | peer | persistent.
        mtbf_s: MTBF of the failures recovered from this tier.
        young_s, daly_s: the two formulas' intervals for the measured cost.
        floor_s: the time the tier needs to commit one step (no interval can be shorter).
        recommended_s: ``max(daly_s, floor_s)``.
        bounded_by_commit: True when the commit time, not the formula, sets the interval.
    """

    tier: str
    cost_s: float
    mtbf_s: float
    young_s: float
    daly_s: float
    floor_s: float
    recommended_s: float
    bounded_by_commit: bool


def advise(
    tier: str,
    *,
    cost_s: float,
    commit_s: float,
    gpus: int,
    mtbf_s: float | None = None,
    table: FailureTable | None = None,
) -> IntervalAdvice:
    """Interval advice for one tier.

    Args:
        tier: memory | peer | persistent.
        cost_s: measured blocking cost of one save to this tier (δ, seconds).
        commit_s: how long the tier takes to commit a step (seconds): the floor, since an
            asynchronous tier with δ ≈ 0 would otherwise get τ → 0.
        gpus: the job's GPU count (scales the table's per-GPU rate).
        mtbf_s: an observed MTBF for this tier's failures; else from ``table`` (default:
            the Llama 3 table).

    Raises:
        AdviceError: unknown tier, negative cost or commit time, non-positive MTBF.
    """
    if commit_s < 0:
        raise AdviceError(f"commit time must be ≥ 0 s, not {commit_s}")
    m = mtbf_s if mtbf_s is not None else tier_mtbf_s(tier, gpus=gpus, table=table)
    if tier not in RECOVERED_FROM:
        raise AdviceError(f"unknown tier {tier!r}; tiers: {', '.join(TIERS)}")
    young, daly = young_interval_s(cost_s, m), daly_interval_s(cost_s, m)
    recommended = max(daly, commit_s)
    return IntervalAdvice(
        tier=tier,
        cost_s=cost_s,
        mtbf_s=m,
        young_s=young,
        daly_s=daly,
        floor_s=commit_s,
        recommended_s=recommended,
        bounded_by_commit=commit_s > daly,
    )


def _check(cost_s: float, mtbf_s: float) -> None:
    if not math.isfinite(cost_s) or cost_s < 0:
        raise AdviceError(f"checkpoint cost must be a finite number ≥ 0 s, not {cost_s}")
    if not math.isfinite(mtbf_s) or mtbf_s <= 0:
        raise AdviceError(f"MTBF must be a finite number > 0 s, not {mtbf_s}")

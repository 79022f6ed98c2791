"""API shapes of jobs and their checkpoint tiers (pydantic v2).

Units are in the field names: ``_s`` seconds, ``bytes`` bytes, ``_bytes_per_s`` bytes per
second, steps are training steps. None means "not known yet" (e.g. no committed step in a
tier, no step time reported).
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class AdviceOut(BaseModel):
    """Recommended checkpoint interval of a tier (Young 1974, Daly 2006; see advice.py).

    Attributes:
        cost_s: δ, the measured blocking cost of a save (median of recent staged events).
        commit_s: the tier's median commit time: the floor of the interval.
        mtbf_s: M, MTBF of the failures this tier serves, for the job's GPU count.
        mtbf_source: ``observed`` (at least 3 restore incidents of the class this tier serves)
            or ``llama3_table``.
        young_s: √(2δM).
        daly_s: Daly's higher-order interval.
        recommended_s: ``max(daly_s, commit_s)``.
        recommended_steps: ``recommended_s`` / median step time (None without step times).
        bounded_by_commit: the commit time, not the formula, sets the interval.
    """

    cost_s: float
    commit_s: float
    mtbf_s: float
    mtbf_source: str
    young_s: float
    daly_s: float
    recommended_s: float
    recommended_steps: float | None
    bounded_by_commit: bool


class PendingOut(BaseModel):
    """The newest step of a tier that some ranks have not committed yet.

    ``missing_ranks`` lists at most 64 of them (``missing_count`` counts all); both are
    None while the job's world size is unknown.
    """

    step: int
    world_size: int | None
    ranks_committed: int
    missing_ranks: list[int] | None
    missing_count: int | None
    failures: int


class TierSummaryOut(BaseModel):
    """A tier's newest committed step and lag."""

    newest_step: int | None
    committed_at: datetime | None
    lag_steps: int | None
    lag_s: float | None


class TierOut(TierSummaryOut):
    """A tier of a job: newest committed step, lag, size, speed and interval advice."""

    bytes: int | None
    commit_s: float | None
    throughput_bytes_per_s: float | None
    last_blocking_s: float | None
    pending: PendingOut | None
    advice: AdviceOut | None


class WorstLagOut(BaseModel):
    """The tier that lags most (in steps)."""

    tier: str
    steps: int
    seconds: float | None


class AtRiskOut(BaseModel):
    """Work lost to one failure class: recovery reads ``tier`` at ``step``.

    ``tier`` and ``step`` are None when no surviving tier holds a committed step (then
    every step is at risk: ``steps`` = training step + 1).
    """

    tier: str | None
    step: int | None
    steps: int | None
    seconds: float | None


class CheckpointEventOut(BaseModel):
    """A reported checkpoint event."""

    ts: datetime
    kind: str
    tier: str
    step: int
    rank: int | None
    world_size: int | None
    node: str | None
    bytes: int | None
    seconds: float | None
    blocking_s: float | None
    message: str


class RestoreOut(BaseModel):
    """One rank's restore outcome."""

    ts: datetime
    rank: int
    world_size: int
    node: str | None
    step: int | None
    seconds: float
    steps_lost: int | None
    files_by_tier: dict[str, int]
    ok: bool
    message: str


class JobSummaryOut(BaseModel):
    """A job in ``GET /api/v1/jobs``."""

    job_id: str
    world_size: int | None
    step: int | None
    step_time_s: float | None
    last_seen: datetime
    tiers: dict[str, TierSummaryOut]
    worst_lag: WorstLagOut | None


class JobOut(BaseModel):
    """``GET /api/v1/jobs/{job_id}``: a job's tiers, lag, work at risk, advice, history."""

    job_id: str
    world_size: int | None
    layout: list[str] | None
    step: int | None
    step_ts: datetime | None
    step_time_s: float | None
    first_seen: datetime
    last_seen: datetime
    tiers: dict[str, TierOut]
    worst_lag: WorstLagOut | None
    at_risk: dict[str, AtRiskOut]
    events: list[CheckpointEventOut]
    failures: list[CheckpointEventOut] = []  # newest failed events, whatever came after
    restores: list[RestoreOut]


class HistoryPoint(BaseModel):
    """A step at a time."""

    ts: datetime
    step: int


class JobHistoryOut(BaseModel):
    """Training step and newest committed step per tier over time (oldest first)."""

    job_id: str
    since: datetime
    until: datetime
    bucket_s: float
    progress: list[HistoryPoint]
    committed: dict[str, list[HistoryPoint]]


class RankListOut(BaseModel):
    """A set of ranks as ranges (``rankset.RankList``): ``ranges`` are inclusive ``[lo,
    hi]`` pairs; when ``partial``, only the first ones (``count`` is exact)."""

    count: int
    ranges: list[tuple[int, int]]
    partial: bool
    text: str  # e.g. "0-511, 513-999", "3, 7 (+40 more)", "none"


class SecondsOut(BaseModel):
    """Min, median and max of a duration (seconds; None when no event carried it)."""

    min: float | None
    median: float | None
    max: float | None


class BlockingOut(BaseModel):
    """Median and max blocking time of the training thread (seconds)."""

    median: float | None
    max: float | None


class StepRowOut(BaseModel):
    """A job's checkpoint events of one (step, tier, kind), aggregated over its ranks
    (``step_events.step_summaries``)."""

    step: int
    tier: str
    kind: str
    world_size: int | None
    events: int
    ranks: int  # distinct ranks that reported it
    whole_step: bool  # an event with rank null (the whole step)
    reported: RankListOut  # for kind "failed": the failed ranks
    missing: RankListOut | None  # staged/committed only; null: world size unknown or whole step
    complete: bool | None  # the ledger's verdict for (step, tier); null: no ledger row
    failed_ranks: int  # ranks with a failed event in the same step and tier
    slowest_rank: int | None
    seconds: SecondsOut
    blocking_s: BlockingOut
    bytes: int | None
    first_ts: datetime
    last_ts: datetime
    message: str
    messages_differ: bool


class JobStepsOut(BaseModel):
    """``GET /api/v1/jobs/{job_id}/steps``: the newest steps' events per (step, tier, kind)."""

    job_id: str
    steps: list[int]  # newest first
    rows: list[StepRowOut]
    older_before_step: int | None  # pass as before_step for the next older page


class RankKindOut(BaseModel):
    """One rank's events of one kind in one step and tier (latest time, largest values)."""

    events: int
    first_ts: datetime
    last_ts: datetime
    seconds: float | None
    blocking_s: float | None
    bytes: int | None
    message: str
    node: str | None  # the reporting node


class RankRowOut(BaseModel):
    """One rank of a step and tier."""

    rank: int
    node: str | None
    kinds: dict[str, RankKindOut | None]  # staged, committed, failed, evicted
    committed: bool
    failed: bool


class WholeStepEventOut(BaseModel):
    """An event of a step with rank null (the whole step)."""

    kind: str
    ts: datetime
    node: str | None
    bytes: int | None
    seconds: float | None
    message: str


class StepRanksOut(BaseModel):
    """``GET /api/v1/jobs/{job_id}/steps/{step}/{tier}``: one step of one tier rank by rank."""

    job_id: str
    step: int
    tier: str
    world_size: int | None
    show: str
    from_rank: int
    next_from_rank: int | None  # pass as from_rank for the next page
    summary: list[StepRowOut]
    whole_step: list[WholeStepEventOut]
    ranks: list[RankRowOut]

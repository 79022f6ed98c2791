"""A job's checkpoint events per (step, tier, kind), and one step's events rank by rank.

At 1,000 ranks every save produces about 1,000 events per tier (``staged`` and ``committed``
in memory, ``committed`` in peer and persistent), so the job page cannot list events. These
reads let the database do the counting and hand over bounded results:

- :func:`step_summaries`: for the newest ``limit`` steps (older ones with ``before_step``),
  one row per (step, tier, kind) from one ``GROUP BY``: how many ranks reported it out of
  world_size, which ranks are missing (or, for ``failed``, which failed) as ranges, the
  slowest rank and min/median/max of ``seconds`` (the tier's wall time of the step's work),
  median/max ``blocking_s``, the size and the first/last event time.
- :func:`failure_summaries`: the same rows for the ``failed`` events of the newest steps
  that have any, whatever steps came after them.
- :func:`rank_events`: one (step, tier) rank by rank, one page of ranks at a time.

Rank ranges never come as one row per rank. A group whose distinct ranks fill its min … max
is one range; for the others, ``rank − dense_rank() OVER (ORDER BY rank)`` is constant over
a run of consecutive ranks ("gaps and islands"), so grouping by it yields one row per range,
and at most :data:`RANGES_READ` ranges are read per group. Medians: PostgreSQL's
``percentile_cont(0.5)``; elsewhere the mean of the middle one or two values numbered by
``row_number()`` (both the mean of the two middle values for an even count).

Cost: each read filters ``checkpoint_events`` by ``job_pk`` and a bounded list of steps, so
the database reads the events of those steps and none of them reach Python. Without an
index on ``(job_pk, step)`` it finds them by scanning the job's rows.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal, get_args

from sqlalchemy import Select, case, distinct, func, literal, select, tuple_, union_all
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.orm import Session

from tierwatch.server.checkpoints import ledger, rankset
from tierwatch.server.checkpoints.models import CheckpointEventRow, Job, LedgerRow
from tierwatch.server.fleet.models import Node
from tierwatch.server.fleet.service import NotFoundError

E = CheckpointEventRow

KINDS: tuple[str, ...] = ("staged", "committed", "failed", "evicted")
#: Steps the job page shows by default, and the most one read may ask for.
STEPS_SHOWN = 10
STEPS_MAX = 100
#: Steps with failures the failures table covers.
FAILED_STEPS_SHOWN = 5
#: Rank ranges read per (step, tier, kind); beyond them a set is partial (count exact).
RANGES_READ = 32
#: Ranks per page of :func:`rank_events`.
RANKS_PAGE = 250
#: Whole-step events (rank None) listed on a rank page.
WHOLE_STEP_SHOWN = 20
#: Kinds whose rows list the ranks that did not report them (every rank stages and commits).
MISSING_KINDS = frozenset({"staged", "committed"})
Show = Literal["all", "failed", "missing"]
SHOWS: tuple[str, ...] = get_args(Show)
#: The largest step and rank a checkpoint event may carry (``agent.protocol.CheckpointEvent``),
#: the bounds of the step and rank parameters.
MAX_STEP = 2**62
MAX_RANK = 2**31 - 1


class BadQuery(ValueError):
    """A query that names something the data rules out (e.g. a rank beyond world_size);
    the message says what to fix. Callers answer 422."""


def _steps(session: Session, job: Job, *, before_step: int | None, limit: int) -> list[int]:
    q = select(E.step).where(E.job_pk == job.id)
    if before_step is not None:
        q = q.where(E.step < before_step)
    return list(session.scalars(q.group_by(E.step).order_by(E.step.desc()).limit(limit)))


def _where(q: Select[Any], job: Job, steps: list[int], tier: str | None, kind: str | None) -> Any:
    q = q.where(E.job_pk == job.id, E.step.in_(steps))
    if tier is not None:
        q = q.where(E.tier == tier)
    if kind is not None:
        q = q.where(E.kind == kind)
    return q


Group = tuple[int, str, str]  # (step, tier, kind)


def _is_postgres(session: Session) -> bool:
    return session.get_bind().dialect.name == "postgresql"


def _group_figures(
    session: Session, job: Job, steps: list[int], tier: str | None, kind: str | None
) -> list[dict[str, Any]]:
    """One dict per (step, tier, kind): counts, distinct ranks and their min/max, times,
    sizes, min/median/max ``seconds``, median/max ``blocking_s`` and the slowest rank (the
    highest ``seconds``; the lowest rank among equals; None when no event has seconds).

    PostgreSQL computes the medians in the same ``GROUP BY`` (``percentile_cont(0.5)``, an
    ordered-set aggregate, sorts each group's values only); elsewhere :func:`_medians` does,
    with a window."""
    message = case((E.message != "", E.message))
    columns = [
        E.step,
        E.tier,
        E.kind,
        func.count().label("events"),
        func.count(distinct(E.rank)).label("ranks"),
        func.min(E.rank).label("min_rank"),
        func.max(E.rank).label("max_rank"),
        func.count(case((E.rank.is_(None), 1))).label("whole_step"),
        func.max(E.world_size).label("world_size"),
        func.min(E.ts).label("first_ts"),
        func.max(E.ts).label("last_ts"),
        func.min(E.seconds).label("min_s"),
        func.max(E.seconds).label("max_s"),
        func.max(E.blocking_s).label("max_blocking_s"),
        func.sum(E.bytes).label("bytes"),
        func.min(message).label("message"),
        func.max(message).label("last_message"),
    ]
    postgres = _is_postgres(session)
    if postgres:
        slowest = func.array_agg(
            aggregate_order_by(E.rank, E.seconds.desc(), E.rank.asc().nulls_last())
        ).filter(E.seconds.is_not(None))
        columns += [
            func.percentile_cont(0.5).within_group(E.seconds).label("median_s"),
            func.percentile_cont(0.5).within_group(E.blocking_s).label("median_blocking_s"),
            slowest[1].label("slowest_rank"),
        ]
    q = _where(select(*columns), job, steps, tier, kind).group_by(E.step, E.tier, E.kind)
    rows = [dict(r._mapping) for r in session.execute(q)]
    if not postgres:
        medians = _medians(session, job, steps, tier, kind)
        for r in rows:
            m = medians.get((r["step"], r["tier"], r["kind"]), {})
            r["median_s"], r["slowest_rank"] = m.get("s", (None, None))
            r["median_blocking_s"] = m.get("b", (None, None))[0]
    return rows


def _medians(
    session: Session, job: Job, steps: list[int], tier: str | None, kind: str | None
) -> dict[Group, dict[str, Any]]:
    """(step, tier, kind) -> {"s": (median seconds, slowest rank), "b": (median
    blocking_s, None)}, in SQL any database runs.

    One window over the narrow rows of both measures (``UNION ALL``): each value numbered
    in ascending order within its group and measure; the median is the mean of the middle
    one or two, the slowest rank the last ``seconds`` row's (ordered by value, then rank
    descending, so the lowest rank wins a tie)."""
    values = union_all(
        _where(
            select(E.step, E.tier, E.kind, E.rank, literal("s").label("m"), E.seconds.label("v")),
            job,
            steps,
            tier,
            kind,
        ).where(E.seconds.is_not(None)),
        _where(
            select(
                E.step, E.tier, E.kind, E.rank, literal("b").label("m"), E.blocking_s.label("v")
            ),
            job,
            steps,
            tier,
            kind,
        ).where(E.blocking_s.is_not(None)),
    ).subquery()
    v = values.c
    part = (v.step, v.tier, v.kind, v.m)
    order = (v.v, case((v.rank.is_(None), 1), else_=0), v.rank.desc())
    numbered = select(
        *part,
        v.rank,
        v.v,
        func.row_number().over(partition_by=part, order_by=order).label("row"),
        func.count().over(partition_by=part).label("n"),
    ).subquery()
    c = numbered.c
    middle = c.row.in_([(c.n + 1) // 2, (c.n + 2) // 2])
    q = select(
        c.step,
        c.tier,
        c.kind,
        c.m,
        func.avg(case((middle, c.v))).label("median"),
        func.max(case((c.row == c.n, c.rank))).label("slowest"),
    ).group_by(c.step, c.tier, c.kind, c.m)
    out: dict[Group, dict[str, Any]] = defaultdict(dict)
    for step, t, k, m, median, slowest in session.execute(q):
        out[(step, t, k)][m] = (median, slowest if m == "s" else None)
    return out


def _rank_ranges(
    session: Session, job: Job, groups: list[Group]
) -> dict[Group, list[rankset.Range]]:
    """(step, tier, kind) -> the first :data:`RANGES_READ` ranges of its reported ranks, for
    ``groups`` (gaps and islands, see the module docstring; ``dense_rank`` makes a rank
    reported twice count once)."""
    if not groups:
        return {}
    d = (
        select(E.step, E.tier, E.kind, E.rank)
        .where(
            E.job_pk == job.id,
            E.step.in_(sorted({g[0] for g in groups})),
            tuple_(E.step, E.tier, E.kind).in_(groups),
            E.rank.is_not(None),
        )
        .subquery()
    )
    dpart = (d.c.step, d.c.tier, d.c.kind)
    islands = select(
        *dpart,
        d.c.rank,
        (d.c.rank - func.dense_rank().over(partition_by=dpart, order_by=d.c.rank)).label("grp"),
    ).subquery()
    ipart = (islands.c.step, islands.c.tier, islands.c.kind)
    ranges = (
        select(*ipart, func.min(islands.c.rank).label("lo"), func.max(islands.c.rank).label("hi"))
        .group_by(*ipart, islands.c.grp)
        .subquery()
    )
    rpart = (ranges.c.step, ranges.c.tier, ranges.c.kind)
    numbered = select(
        *rpart,
        ranges.c.lo,
        ranges.c.hi,
        func.row_number().over(partition_by=rpart, order_by=ranges.c.lo).label("n"),
    ).subquery()
    c = numbered.c
    q = select(c.step, c.tier, c.kind, c.lo, c.hi).where(c.n <= RANGES_READ).order_by(c.lo)
    out: dict[Group, list[rankset.Range]] = defaultdict(list)
    for step, t, k, lo, hi in session.execute(q):
        out[(step, t, k)].append((lo, hi))
    return out


def _all_ranges(
    session: Session, job: Job, *, step: int, tier: str, kind: str
) -> list[rankset.Range]:
    """Every range of the ranks that reported ``kind`` for one step and tier (at most
    world_size / 2 rows), for paging through the ranks a set lacks."""
    d = (
        select(E.rank)
        .where(
            E.job_pk == job.id,
            E.step == step,
            E.tier == tier,
            E.kind == kind,
            E.rank.is_not(None),
        )
        .subquery()
    )
    islands = select(
        d.c.rank, (d.c.rank - func.dense_rank().over(order_by=d.c.rank)).label("grp")
    ).subquery()
    q = (
        select(func.min(islands.c.rank), func.max(islands.c.rank))
        .group_by(islands.c.grp)
        .order_by(func.min(islands.c.rank))
    )
    return [(lo, hi) for lo, hi in session.execute(q)]


def _ledger_flags(session: Session, job: Job, steps: list[int]) -> dict[tuple[int, str], bool]:
    """(step, tier) -> whether the ledger holds the step as complete in the tier."""
    q = select(LedgerRow.step, LedgerRow.tier, LedgerRow.complete).where(
        LedgerRow.job_pk == job.id, LedgerRow.step.in_(steps)
    )
    return {(s, t): c for s, t, c in session.execute(q)}


def _order(row: dict[str, Any]) -> tuple[int, int, int]:
    tier = ledger.TIERS.index(row["tier"]) if row["tier"] in ledger.TIERS else len(ledger.TIERS)
    kind = KINDS.index(row["kind"]) if row["kind"] in KINDS else len(KINDS)
    return (-row["step"], tier, kind)


def _summaries(
    session: Session,
    job: Job,
    steps: list[int],
    *,
    tier: str | None = None,
    kind: str | None = None,
) -> list[dict[str, Any]]:
    """The summary rows of ``steps`` (see :func:`step_summaries`), newest step first."""
    if not steps:
        return []
    figures = _group_figures(session, job, steps, tier, kind)
    # A group whose distinct ranks fill min … max is one range; only the others need SQL.
    gappy = [
        (f["step"], f["tier"], f["kind"])
        for f in figures
        if f["ranks"] and f["ranks"] != f["max_rank"] - f["min_rank"] + 1
    ]
    ranges = _rank_ranges(session, job, gappy)
    complete = _ledger_flags(session, job, steps)
    rows: list[dict[str, Any]] = []
    for f in figures:
        key = (f["step"], f["tier"], f["kind"])
        world_size = f["world_size"] if f["world_size"] is not None else job.world_size
        if key in ranges:
            listed = ranges[key]
        elif f["ranks"]:
            listed = [(f["min_rank"], f["max_rank"])]
        else:
            listed = []
        reported = rankset.RankList.of(listed, f["ranks"])
        whole = f["whole_step"] > 0
        absent = None
        if (
            f["kind"] in MISSING_KINDS
            and world_size is not None
            and not (whole and f["kind"] == "committed")
        ):
            absent = rankset.missing(reported, world_size)
        rows.append(
            {
                "step": f["step"],
                "tier": f["tier"],
                "kind": f["kind"],
                "world_size": world_size,
                "events": f["events"],
                "ranks": f["ranks"],
                "whole_step": whole,
                "reported": reported.out(),
                "missing": None if absent is None else absent.out(),
                "complete": complete.get((f["step"], f["tier"])),
                "failed_ranks": 0,
                "slowest_rank": f["slowest_rank"],
                "seconds": {"min": f["min_s"], "median": f["median_s"], "max": f["max_s"]},
                "blocking_s": {"median": f["median_blocking_s"], "max": f["max_blocking_s"]},
                "bytes": f["bytes"],
                "first_ts": f["first_ts"],
                "last_ts": f["last_ts"],
                "message": f["message"] or "",
                "messages_differ": f["message"] != f["last_message"],
            }
        )
    failed = {
        (r["step"], r["tier"]): r["ranks"] or r["events"] for r in rows if r["kind"] == "failed"
    }
    for r in rows:
        r["failed_ranks"] = failed.get((r["step"], r["tier"]), 0)
    rows.sort(key=_order)
    return rows


def step_summaries(
    session: Session, job: Job, *, before_step: int | None = None, limit: int = STEPS_SHOWN
) -> dict[str, Any]:
    """The job's checkpoint events of its newest ``limit`` steps (below ``before_step`` when
    given), one row per (step, tier, kind).

    Args:
        before_step: only steps below it (the next page of older steps).
        limit: steps, 1 to :data:`STEPS_MAX`.

    Returns:
        ``{"steps": [step, ...] newest first, "rows": [row, ...], "older_before_step": int |
        None}``; ``older_before_step`` is the ``before_step`` of the next older page (None:
        no older step). Rows are ordered by step (newest first), tier (memory, peer,
        persistent), kind (staged, committed, failed, evicted); each is ``{step, tier,
        kind, world_size, events, ranks (distinct ranks reporting), whole_step (an event
        with rank None: the whole step), reported, missing, complete (the ledger's verdict
        for the step and tier; None: no ledger row), failed_ranks (ranks with a failed event
        in the same step and tier), slowest_rank, seconds: {min, median, max},
        blocking_s: {median, max}, bytes (sum), first_ts, last_ts, message (the least
        non-empty one), messages_differ (other events carry other messages)}``.
        ``reported`` and ``missing`` are :meth:`rankset.RankList.out`; for ``failed`` rows
        ``reported`` are the failed ranks; ``missing`` is given for staged and committed
        rows only, and is None when world_size is unknown or the whole step committed.
        Seconds are seconds, bytes bytes.

    Raises:
        ValueError: ``limit`` outside 1 … :data:`STEPS_MAX`.
    """
    if not 1 <= limit <= STEPS_MAX:
        raise ValueError(f"limit must be 1 to {STEPS_MAX} steps, got {limit}")
    steps = _steps(session, job, before_step=before_step, limit=limit + 1)
    older = steps[limit - 1] if len(steps) > limit else None
    steps = steps[:limit]
    return {"steps": steps, "rows": _summaries(session, job, steps), "older_before_step": older}


def failure_summaries(
    session: Session, job: Job, *, limit: int = FAILED_STEPS_SHOWN
) -> list[dict[str, Any]]:
    """The ``failed`` rows (as :func:`step_summaries` gives them) of the newest ``limit``
    steps with a failed event, newest step first, whatever steps came after them."""
    steps = list(
        session.scalars(
            select(E.step)
            .where(E.job_pk == job.id, E.kind == "failed")
            .group_by(E.step)
            .order_by(E.step.desc())
            .limit(limit)
        )
    )
    return _summaries(session, job, steps, kind="failed")


def _page_ranks(
    session: Session,
    job: Job,
    *,
    step: int,
    tier: str,
    show: str,
    from_rank: int,
    world_size: int | None,
    whole_committed: bool,
    limit: int,
) -> tuple[list[int], int | None]:
    """The ranks of one page (at most ``limit``) and the next page's ``from_rank``."""
    if show == "missing":
        if world_size is None or whole_committed:
            return [], None
        committed = _all_ranges(session, job, step=step, tier=tier, kind="committed")
        absent = rankset.complement(committed, world_size)
        ranks = list(rankset.ranks_from(absent, from_rank, limit + 1))
    elif show == "all" and world_size is not None:
        ranks = list(range(from_rank, min(from_rank + limit + 1, world_size)))
    else:
        q = select(E.rank).where(
            E.job_pk == job.id, E.step == step, E.tier == tier, E.rank >= from_rank
        )
        if show == "failed":
            q = q.where(E.kind == "failed")
        ranks = list(session.scalars(q.group_by(E.rank).order_by(E.rank).limit(limit + 1)))
    if len(ranks) > limit:
        return ranks[:limit], ranks[limit]
    return ranks, None


def _per_rank(
    session: Session, job: Job, *, step: int, tier: str, ranks: list[int]
) -> dict[int, dict[str, Any]]:
    """rank -> {kind: figures} for ``ranks`` of one step and tier, and the reporting node."""
    if not ranks:
        return {}
    message = case((E.message != "", E.message))
    q = (
        select(
            E.rank,
            E.kind,
            func.count().label("events"),
            func.min(E.ts).label("first_ts"),
            func.max(E.ts).label("last_ts"),
            func.max(E.seconds).label("seconds"),
            func.max(E.blocking_s).label("blocking_s"),
            func.max(E.bytes).label("bytes"),
            func.max(message).label("message"),
            func.max(Node.name).label("node"),
        )
        .join(Node, Node.id == E.node_id, isouter=True)
        .where(E.job_pk == job.id, E.step == step, E.tier == tier, E.rank.in_(ranks))
        .group_by(E.rank, E.kind)
    )
    out: dict[int, dict[str, Any]] = defaultdict(dict)
    for r in session.execute(q):
        out[r.rank][r.kind] = {
            "events": r.events,
            "first_ts": r.first_ts,
            "last_ts": r.last_ts,
            "seconds": r.seconds,
            "blocking_s": r.blocking_s,
            "bytes": r.bytes,
            "message": r.message or "",
            "node": r.node,
        }
    return out


def _whole_step_events(session: Session, job: Job, *, step: int, tier: str) -> list[dict[str, Any]]:
    q = (
        select(E, Node.name)
        .join(Node, Node.id == E.node_id, isouter=True)
        .where(E.job_pk == job.id, E.step == step, E.tier == tier, E.rank.is_(None))
        .order_by(E.ts, E.id)
        .limit(WHOLE_STEP_SHOWN)
    )
    return [
        {
            "kind": e.kind,
            "ts": e.ts,
            "node": node,
            "bytes": e.bytes,
            "seconds": e.seconds,
            "message": e.message,
        }
        for e, node in session.execute(q)
    ]


def rank_events(
    session: Session,
    job: Job,
    *,
    step: int,
    tier: str,
    show: str = "all",
    from_rank: int = 0,
    limit: int = RANKS_PAGE,
) -> dict[str, Any]:
    """One step of one tier rank by rank, one page of at most ``limit`` ranks.

    Args:
        step, tier: the step and tier (memory, peer, persistent).
        show: ``all`` (every rank 0 … world_size − 1, those that reported nothing
            included; only the reporting ranks when world_size is unknown), ``failed``
            (ranks with a failed event) or ``missing`` (ranks without a committed event).
        from_rank: the page's first rank (the answer's ``next_from_rank`` for the next page).
        limit: ranks per page.

    Returns:
        ``{"job_id", "step", "tier", "world_size", "show", "from_rank", "next_from_rank":
        int | None, "summary": [rows of this step and tier, as step_summaries gives them],
        "whole_step": [{kind, ts, node, bytes, seconds, message}] (rank None events, on the
        first page), "ranks": [{rank, node (the layout's, else the reporting node), kinds:
        {kind: {events, first_ts, last_ts, seconds, blocking_s, bytes, message, node} |
        None for each of KINDS}, committed (a committed event, or the whole step
        committed), failed}]}``; per kind the latest time and the largest values.

    Raises:
        NotFoundError: the job has no event of that step in that tier (none yet, or pruned).
        BadQuery: ``show`` is not one of :data:`SHOWS`, or ``from_rank`` is at or beyond
            the step's world_size.
    """
    if show not in SHOWS:
        raise BadQuery(f"show must be one of {', '.join(SHOWS)}, got {show!r}")
    summary = _summaries(session, job, [step], tier=tier)
    if not summary:
        raise NotFoundError(
            f"job {job.job_id!r} has no {tier} checkpoint events for step {step}: none were "
            "reported, or they are older than TIERWATCH_EVENT_RETENTION_S (the job page "
            "lists the steps it holds)"
        )
    sizes = [r["world_size"] for r in summary if r["world_size"] is not None]
    world_size = max(sizes) if sizes else None
    if world_size is not None and from_rank >= world_size:
        raise BadQuery(
            f"from_rank {from_rank} is beyond step {step}'s ranks 0-{world_size - 1}: "
            f"use a rank below {world_size}"
        )
    whole_committed = any(r["kind"] == "committed" and r["whole_step"] for r in summary)
    ranks, nxt = _page_ranks(
        session,
        job,
        step=step,
        tier=tier,
        show=show,
        from_rank=from_rank,
        world_size=world_size,
        whole_committed=whole_committed,
        limit=limit,
    )
    kinds = _per_rank(session, job, step=step, tier=tier, ranks=ranks)
    layout = job.layout or []
    rows = []
    for rank in ranks:
        of_rank = kinds.get(rank, {})
        reporters = [k["node"] for k in of_rank.values() if k["node"]]
        node = layout[rank] if rank < len(layout) else (reporters[0] if reporters else None)
        rows.append(
            {
                "rank": rank,
                "node": node,
                "kinds": {kind: of_rank.get(kind) for kind in KINDS},
                "committed": "committed" in of_rank or whole_committed,
                "failed": "failed" in of_rank,
            }
        )
    return {
        "job_id": job.job_id,
        "step": step,
        "tier": tier,
        "world_size": world_size,
        "show": show,
        "from_rank": from_rank,
        "next_from_rank": nxt,
        "summary": summary,
        "whole_step": _whole_step_events(session, job, step=step, tier=tier)
        if from_rank == 0
        else [],
        "ranks": rows,
    }

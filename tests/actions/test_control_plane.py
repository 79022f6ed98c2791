"""control_plane: the three "the control plane is the likely cause" rules (pure) and the
leader's listening watch (a fake clock)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tierwatch.server.actions.control_plane import (
    ControlPlaneFacts,
    ControlPlaneWatch,
    Silent,
    assess,
    mass_limit,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
RULES = {"window_s": 300.0, "ingest_lag_limit_s": 10.0, "mass_pct": 5.0}


def silent(n: int, ago_s: float = 60.0) -> list[Silent]:
    return [Silent(f"n{i}", NOW - timedelta(seconds=ago_s)) for i in range(n)]


def facts(listening_s: float = 3600.0, lag_s: float = 0.0) -> ControlPlaneFacts:
    return ControlPlaneFacts(
        now=NOW, listening_since=NOW - timedelta(seconds=listening_s), ingest_lag_s=lag_s
    )


@pytest.mark.parametrize(
    ("pct", "nodes", "limit"),
    [(5, 8, 1), (5, 20, 1), (5, 100, 5), (5, 2500, 125), (50, 10, 5)],
)
def test_mass_limit(pct: float, nodes: int, limit: float) -> None:
    assert mass_limit(pct, nodes) == limit


@pytest.mark.parametrize(
    ("f", "gone", "nodes", "suspect", "says"),
    [
        (facts(), silent(1), 100, False, ""),
        (facts(), silent(5), 100, False, ""),  # 5 % of 100 is tolerated
        (facts(), silent(6), 100, True, "6 of 100 nodes went unreachable"),
        (facts(), silent(2), 20, True, "2 of 20 nodes"),  # more than one in a small cluster
        (facts(), silent(6, ago_s=900), 100, False, ""),  # silent long before the window
        (facts(listening_s=120), silent(1), 100, True, "listening for only 120 s"),
        (facts(lag_s=11), silent(1), 100, True, "ingest lag 11.0 s"),
        (None, silent(1), 100, False, ""),  # no facts: only the mass rule
        (None, silent(3), 20, True, "3 of 20"),
    ],
)
def test_assess(
    f: ControlPlaneFacts | None, gone: list[Silent], nodes: int, suspect: bool, says: str
) -> None:
    got = assess(f, gone, nodes=nodes, **RULES)
    assert got.suspect is suspect
    assert says in got.summary()
    assert got.evidence["unreachable"] == len(gone)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.wall = NOW

    def advance(self, s: float) -> None:
        self.t += s
        self.wall += timedelta(seconds=s)


def watch(clock: Clock, lag: tuple[float, int] = (0.0, 0)) -> ControlPlaneWatch:
    return ControlPlaneWatch(
        tick_s=1.0, ingest_lag=lambda: lag, clock=lambda: clock.t, wall=lambda: clock.wall
    )


def test_listening_runs_from_the_first_pass_and_survives_normal_ticks() -> None:
    clock = Clock()
    w = watch(clock)
    clock.advance(3)
    first = w.facts()
    w.pass_done()
    assert first.listening_since == clock.wall
    for _ in range(10):
        clock.advance(1)
        f = w.facts()
        w.pass_done()
    assert f.listening_since == first.listening_since
    assert f.cause == "started"


def test_a_gap_between_passes_restarts_listening() -> None:
    clock = Clock()
    w = watch(clock)
    w.facts()
    w.pass_done()
    clock.advance(60)  # the process was stopped, or the loop could not run
    f = w.facts()
    assert f.listening_since == clock.wall
    assert f.cause == "resumed after a stall of 60 s"


def test_a_pass_that_waited_on_the_database_restarts_listening() -> None:
    clock = Clock()
    w = watch(clock)
    w.facts()
    w.pass_done()
    clock.advance(1)
    w.facts()
    clock.advance(45)  # the pass hung on a paused database
    w.pass_done()
    clock.advance(1)
    f = w.facts()
    assert f.listening_since == clock.wall - timedelta(seconds=1)
    assert "waited 45 s on the database" in f.cause


def test_losing_the_lead_restarts_listening_as_a_new_leader() -> None:
    clock = Clock()
    w = watch(clock, lag=(2.5, 7))
    w.facts()
    w.pass_done()
    w.lost()
    clock.advance(1)
    f = w.facts()
    assert f.listening_since == clock.wall
    assert f.cause == "became leader"
    assert (f.ingest_lag_s, f.ingest_waiting) == (2.5, 7)


def test_a_stall_is_reported_once_and_holds_verdicts_with_no_node_silent() -> None:
    clock = Clock()
    w = watch(clock)
    w.facts()
    w.pass_done()
    clock.advance(30)
    f = w.facts()
    assert f.stall == "no leader pass completed for 30 s"
    got = assess(f, [], nodes=10, **RULES)
    assert got.suspect
    assert "the control plane stalled: no leader pass completed for 30 s" in got.summary()
    w.pass_done()
    clock.advance(1)
    assert w.facts().stall is None  # reported once; the window still holds verdicts


def test_failed_passes_do_not_count_as_listening() -> None:
    clock = Clock()
    w = watch(clock)
    w.facts()
    w.pass_done()
    for _ in range(10):  # the database refuses every pass for 10 s
        clock.advance(1)
        w.facts()
        w.pass_done(ok=False)
    clock.advance(1)
    f = w.facts()
    assert f.listening_since == clock.wall
    assert f.stall == "no leader pass completed for 11 s"

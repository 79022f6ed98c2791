"""Ledger rules (pure): completeness, newest committed step, lag in steps and seconds,
recovery tier per failure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tierwatch.server.checkpoints.ledger import (
    Completeness,
    abandoned,
    completeness,
    lag_seconds,
    lag_steps,
    median,
    newest_committed_step,
    recovery_tier,
    with_memory_floor,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("world_size", "ranks", "whole", "expected"),
    [
        (4, {0, 1, 2, 3}, False, Completeness(True, ())),
        (4, {0, 1, 3}, False, Completeness(False, (2,))),
        (4, set(), False, Completeness(False, (0, 1, 2, 3))),
        (1, {0}, False, Completeness(True, ())),
        (2, {0, 1, 5}, False, Completeness(True, ())),  # a stray rank changes nothing
        (3, {1, 2, 3}, False, Completeness(False, (0,))),  # rank 3 is not one of 0..2
        (4, set(), True, Completeness(True, ())),  # rank None committed the whole step
        (None, {0, 1}, True, Completeness(True, ())),
        (None, {0, 1}, False, Completeness(False, None)),  # world size unknown: cannot tell
        (0, set(), False, Completeness(False, None)),
    ],
)
def test_completeness(world_size, ranks, whole, expected):
    assert completeness(world_size, ranks, whole) == expected


@pytest.mark.parametrize(
    ("training", "newest", "expected"),
    [
        (35, 20, 15),
        (35, 35, 0),
        (35, None, 36),
        (0, None, 1),
        (10, 12, 0),
        (None, 5, None),
        (None, None, None),
    ],
)
def test_lag_steps(training, newest, expected):
    assert lag_steps(training, newest) == expected


@pytest.mark.parametrize(
    ("steps", "step_time", "gap", "expected"),
    [
        (15, 2.0, None, 30.0),  # steps x median step time
        (15, 2.0, 31.5, 31.5),  # the measured training time wins when known
        (15, None, 31.5, 31.5),
        (15, None, None, None),
        (0, None, None, 0.0),  # no lag, no time at risk
        (3, 2.0, -1.0, 0.0),  # clocks a little apart never give negative time
        (None, 2.0, None, None),
    ],
)
def test_lag_seconds(steps, step_time, gap, expected):
    assert lag_seconds(steps, step_time, gap) == expected


@pytest.mark.parametrize(
    ("klass", "newest", "expected"),
    [
        ("process", {"memory": 30, "peer": 20, "persistent": 10}, ("memory", 30)),
        ("node", {"memory": 30, "peer": 20, "persistent": 10}, ("peer", 20)),
        ("rack", {"memory": 30, "peer": 20, "persistent": 10}, ("persistent", 10)),
        ("rollback", {"memory": 30, "peer": 20, "persistent": 10}, ("persistent", 10)),
        # memory evicted: a process failure falls back to the peer copy
        ("process", {"memory": None, "peer": 20, "persistent": 10}, ("peer", 20)),
        # a fresher persistent step serves even a process failure; fastest tier on a tie
        ("process", {"memory": 10, "peer": None, "persistent": 15}, ("persistent", 15)),
        ("process", {"memory": 15, "peer": 15, "persistent": 15}, ("memory", 15)),
        ("node", {"memory": 30, "peer": None, "persistent": None}, (None, None)),
        ("rack", {}, (None, None)),
    ],
)
def test_recovery_tier(klass, newest, expected):
    assert recovery_tier(klass, newest) == expected


def test_recovery_tier_refuses_unknown_class():
    with pytest.raises(ValueError, match="unknown failure class 'flood'"):
        recovery_tier("flood", {})


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([(10, True, False), (20, True, False), (30, False, False)], 20),
        ([(10, True, False), (20, True, True)], 10),  # abandoned by a restore
        ([(10, False, False)], None),
        ([], None),
    ],
)
def test_newest_committed_step(rows, expected):
    assert newest_committed_step(rows) == expected


@pytest.mark.parametrize(
    ("step", "committed", "restores", "expected"),
    [
        (9, 1.0, [(7, 2.0)], True),  # above the restored step, committed before
        (9, 3.0, [(7, 2.0)], False),  # saved again after the restore
        (7, 1.0, [(7, 2.0)], False),  # the restored step itself
        (9, 1.0, [(9, 2.0), (3, 0.5)], False),  # the older restore came before the commit
        (9, None, [(7, 2.0)], False),  # commit time unknown
    ],
)
def test_abandoned(step, committed, restores, expected):
    restored = [(s, T0 + timedelta(seconds=t)) for s, t in restores]
    when = None if committed is None else T0 + timedelta(seconds=committed)
    assert abandoned(step, when, restored) is expected


@pytest.mark.parametrize(
    ("own", "expected"),
    [
        ({"memory": 4, "peer": 6, "persistent": 5}, {"memory": 6, "peer": 6, "persistent": 5}),
        (
            {"memory": None, "peer": None, "persistent": 5},
            {"memory": 5, "peer": None, "persistent": 5},
        ),
        (
            {"memory": 9, "peer": 6, "persistent": None},
            {"memory": 9, "peer": 6, "persistent": None},
        ),
        ({}, {"memory": None}),
    ],
)
def test_memory_is_never_below_the_tiers_fed_from_it(own, expected):
    assert with_memory_floor(own) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [([1.0, 3.0, 2.0], 2.0), ([1.0, None, 3.0], 2.0), ([None], None), ([], None)],
)
def test_median(values, expected):
    assert median(values) == expected


# -- observed failures ----------------------------------------------------------------------
from tierwatch.server.checkpoints.ledger import (  # noqa: E402
    failure_incidents,
    observed_mtbf_s,
)


@pytest.mark.parametrize(
    ("restores", "classes"),
    [
        ([], []),
        # one restart: four ranks within seconds, all from memory
        (
            [
                (0, {"memory": 2}),
                (1, {"memory": 2}),
                (2, {"memory": 1, "peer": 0}),
                (3, {"memory": 2}),
            ],
            ["process"],
        ),
        # a rank that needed a peer replica makes the incident a node failure
        ([(0, {"memory": 2}), (2, {"memory": 1, "peer": 1})], ["node"]),
        # persistent wins over everything in its incident
        ([(0, {"peer": 3}), (5, {"persistent": 3})], ["rack"]),
        # incidents further apart than the window are separate, in time order
        (
            [(1000, {"memory": 1}), (0, {"persistent": 1}), (500, {"peer": 1})],
            ["rack", "node", "process"],
        ),
        # a restore that read nothing counts as process (the step was all local)
        ([(0, {})], ["process"]),
    ],
)
def test_failure_incidents(restores, classes) -> None:
    assert failure_incidents(restores) == classes


def test_observed_mtbf_needs_enough_failures() -> None:
    incidents = ["process", "process", "node", "process"]
    assert observed_mtbf_s(incidents, 3600.0, "process") == 1200.0
    assert observed_mtbf_s(incidents, 3600.0, "node") is None  # one is too few
    assert observed_mtbf_s(incidents, 0.0, "process") is None
    assert observed_mtbf_s(incidents, 3600.0, "node", min_failures=1) == 3600.0

"""Rank 0's commit decision and a rank's memory evictions (pure, table-tested)."""

from __future__ import annotations

import pytest

from tierwatch.agent.checkpoint.training.commit_decision import (
    CommitDecision,
    History,
    decide_commit,
    memory_evictions,
)

KEEP = {"memory": 2, "peer": 2, "persistent": 3}


@pytest.mark.parametrize(
    ("step", "history", "persist_every", "force", "pinned", "persist", "retain", "after"),
    [
        pytest.param(
            0,
            History(),
            10,
            False,
            [],
            True,
            {"memory": [0], "peer": [0], "persistent": [0]},
            History((0,), (0,)),
            id="first-step-ever-persists",
        ),
        pytest.param(
            3,
            History((1, 2), (0,)),
            10,
            False,
            [],
            False,
            {"memory": [2, 3], "peer": [2, 3], "persistent": [0]},
            History((2, 3), (0,)),
            id="within-the-cadence",
        ),
        pytest.param(
            10,
            History((8, 9), (0,)),
            10,
            False,
            [],
            True,
            {"memory": [9, 10], "peer": [9, 10], "persistent": [0, 10]},
            History((9, 10), (0, 10)),
            id="a-multiple-persists",
        ),
        pytest.param(
            12,
            History((9,), (0,)),
            10,
            False,
            [],
            True,
            {"memory": [9, 12], "peer": [9, 12], "persistent": [0, 12]},
            History((9, 12), (0, 12)),
            id="first-step-past-a-missed-multiple",
        ),
        pytest.param(
            13,
            History((11, 12), (0, 12)),
            10,
            False,
            [],
            False,
            {"memory": [12, 13], "peer": [12, 13], "persistent": [0, 12]},
            History((12, 13), (0, 12)),
            id="same-decade-as-the-last-persisted",
        ),
        pytest.param(
            5,
            History((3, 4), (0,)),
            10,
            True,
            [],
            True,
            {"memory": [4, 5], "peer": [4, 5], "persistent": [0, 5]},
            History((4, 5), (0, 5)),
            id="forced",
        ),
        pytest.param(
            7,
            History((5, 6), (0, 1, 2, 3)),
            1,
            False,
            [],
            True,
            {"memory": [6, 7], "peer": [6, 7], "persistent": [2, 3, 7]},
            History((6, 7), (0, 1, 2, 3, 7)),
            id="persistent-keeps-its-newest-3",
        ),
        pytest.param(
            8,
            History((6, 7), (0,)),
            10,
            False,
            [2, 8, 9],
            False,
            {"memory": [2, 7, 8], "peer": [2, 7, 8], "persistent": [0, 2]},
            History((7, 8), (0,)),
            id="older-pins-are-kept-in-every-tier",
        ),
        pytest.param(
            4,
            History((5, 6), (0, 5)),
            10,
            False,
            [],
            False,
            {"memory": [4], "peer": [4], "persistent": [0, 5]},
            History((4,), (0, 5)),
            id="newer-commits-go-persisted-stay",
        ),
    ],
)
def test_decide_commit(step, history, persist_every, force, pinned, persist, retain, after):
    decision, new = decide_commit(
        step,
        [None, None],
        history,
        persist_every=persist_every,
        keep=KEEP,
        force_persist=force,
        pinned=pinned,
    )
    assert decision == CommitDecision(committed=True, persist=persist, retain=retain)
    assert new == after


@pytest.mark.parametrize(
    ("outcomes", "why"),
    [
        (["disk full", None], "rank 0: disk full"),
        ([None, "x", "y"], "rank 1: x; rank 2: y"),
        (["e" * 2000], "rank 0: " + "e" * 1792),
    ],
)
def test_a_failed_rank_means_no_commit_and_no_change(outcomes, why):
    history = History((1, 2), (0,))
    decision, new = decide_commit(3, outcomes, history, persist_every=10, keep=KEEP)
    assert decision == CommitDecision(committed=False, why=why)
    assert new is history


def test_keep_sizes_per_tier():
    keep = {"memory": 1, "peer": 3, "persistent": 1}
    decision, new = decide_commit(4, [None], History((1, 2, 3), (0,)), persist_every=10, keep=keep)
    assert decision.retain == {"memory": [4], "peer": [2, 3, 4], "persistent": [0]}
    assert new.committed == (2, 3, 4)  # max(keep memory, keep peer)


def test_history_seeded_and_cut_back():
    h = History.seeded([5, 3, 3, 9], [0, 5])
    assert h == History((3, 5, 9), (0, 5))
    assert h.up_to(5) == History((3, 5), (0, 5))


@pytest.mark.parametrize(
    ("steps", "retained", "newest", "pinned", "uploading", "evicted"),
    [
        ([1, 2, 3, 4], [3, 4], 4, [], None, [1, 2]),
        ([1, 2, 3, 4], [3, 4], 4, [1], None, [2]),
        ([1, 2, 3, 4], [3, 4], 4, [], 2, [1]),
        ([1, 2, 3, 4, 5], [3], 3, [], None, [1, 2]),  # newer steps (a later save) stay
        ([2], [2], 2, [], None, []),
        ([], [5], 5, [], None, []),
    ],
)
def test_memory_evictions(steps, retained, newest, pinned, uploading, evicted):
    assert (
        memory_evictions(
            steps, retained=retained, newest=newest, pinned=pinned, uploading=uploading
        )
        == evicted
    )

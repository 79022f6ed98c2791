"""Stored report seqs as ranges (fleet.seqranges): placement, merging, replays."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest

from tierwatch.server.fleet.seqranges import SeqRange, apply, contains, place, stored_count

T0 = datetime(2026, 12, 3, tzinfo=UTC)


def at(seq: int) -> datetime:
    return T0 + timedelta(seconds=10 * seq)


def spans(ranges: list[SeqRange]) -> list[tuple[int, int]]:
    return [(r.first, r.last) for r in ranges]


def test_in_order_seqs_keep_one_range_with_the_newest_send_time():
    ranges: list[SeqRange] = []
    for seq in range(1, 6):
        plan = place(ranges, seq, at(seq))
        assert plan is not None
        ranges = apply(ranges, plan)
    assert spans(ranges) == [(1, 5)]
    assert ranges[0].last_sent_at == at(5)


def test_a_replay_is_recognised_inside_any_range():
    ranges = [SeqRange(1, 5, at(5)), SeqRange(9, 9, at(9))]
    for seq in (1, 3, 5, 9):
        assert place(ranges, seq, at(seq)) is None
        assert contains(ranges, seq)
    assert not contains(ranges, 7)


def test_newest_first_then_the_backlog_fills_and_merges():
    # seqs 1-3 stored, an outage, then 8 (newest) first and 4..7 behind it
    ranges = [SeqRange(1, 3, at(3))]
    ranges = apply(ranges, place(ranges, 8, at(8)))
    assert spans(ranges) == [(1, 3), (8, 8)]
    for seq in (4, 5, 6):
        ranges = apply(ranges, place(ranges, seq, at(seq)))
    assert spans(ranges) == [(1, 6), (8, 8)]
    plan = place(ranges, 7, at(7))
    assert plan is not None
    assert plan.delete == (8,)  # the range above is merged away
    ranges = apply(ranges, plan)
    assert spans(ranges) == [(1, 8)]
    assert ranges[0].last_sent_at == at(8)  # still the newest batch's


def test_a_seq_just_below_a_range_extends_it_downwards():
    ranges = [SeqRange(5, 9, at(9))]
    plan = place(ranges, 4, at(4))
    assert plan is not None
    assert plan.update == ((5, SeqRange(4, 9, at(9))),)
    assert plan.insert is None


def test_an_empty_range_is_refused():
    with pytest.raises(ValueError, match="empty"):
        SeqRange(5, 4, T0)


def test_any_arrival_order_stores_each_seq_once_and_ends_as_one_range():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 40)
        arrivals = [rng.randint(1, n) for _ in range(3 * n)] + list(range(1, n + 1))
        rng.shuffle(arrivals)
        ranges: list[SeqRange] = []
        new = 0
        for seq in arrivals:
            plan = place(ranges, seq, at(seq))
            if plan is not None:
                new += 1
                ranges = apply(ranges, plan)
            # disjoint, with a gap between neighbours (a seq that closes a gap merges)
            for a, b in zip(ranges, ranges[1:], strict=False):
                assert a.last + 1 < b.first
        assert new == n
        assert spans(ranges) == [(1, n)]
        assert stored_count(ranges) == n
        assert ranges[0].last_sent_at == at(n)

"""Rank sets as compact ranges (app/checkpoints/rankset.py): table tests of the pure helpers
the job page uses to say which of 1,000 ranks are missing or failed."""

from __future__ import annotations

import pytest

from tierwatch.server.checkpoints import rankset
from tierwatch.server.checkpoints.rankset import RankList


@pytest.mark.parametrize(
    ("ranks", "ranges"),
    [
        ([], []),
        ([5], [(5, 5)]),
        ([3, 0, 1, 2, 7, 9, 8, 3], [(0, 3), (7, 9)]),
        (list(range(512)) + list(range(513, 1000)), [(0, 511), (513, 999)]),
        ([0, 2, 4], [(0, 0), (2, 2), (4, 4)]),
    ],
)
def test_to_ranges(ranks, ranges):
    assert rankset.to_ranges(ranks) == ranges


@pytest.mark.parametrize(
    ("ranges", "merged"),
    [
        ([(5, 9), (0, 3)], [(0, 3), (5, 9)]),
        ([(0, 3), (4, 6)], [(0, 6)]),  # adjacent
        ([(0, 10), (2, 3), (9, 12)], [(0, 12)]),  # overlapping and nested
    ],
)
def test_merge(ranges, merged):
    assert rankset.merge(ranges) == merged


def test_merge_refuses_a_backwards_range():
    with pytest.raises(ValueError, match=r"range \(4, 2\) starts above its end"):
        rankset.merge([(4, 2)])


@pytest.mark.parametrize(
    ("ranges", "upto", "missing"),
    [
        ([], 4, [(0, 3)]),
        ([(0, 3)], 4, []),
        ([(0, 511), (513, 998)], 1000, [(512, 512), (999, 999)]),
        ([(1, 2), (5, 5)], 7, [(0, 0), (3, 4), (6, 6)]),
        ([(0, 1), (10, 20)], 5, [(2, 4)]),  # ranks at or above upto are ignored
        ([(2, 3)], 0, []),
    ],
)
def test_complement(ranges, upto, missing):
    assert rankset.complement(ranges, upto) == missing


@pytest.mark.parametrize(
    ("ranges", "start", "limit", "ranks"),
    [
        ([(0, 2), (10, 11)], 0, 10, [0, 1, 2, 10, 11]),
        ([(0, 2), (10, 11)], 2, 2, [2, 10]),
        ([(0, 2), (10, 11)], 5, 10, [10, 11]),
        ([(0, 999)], 250, 3, [250, 251, 252]),
        ([(0, 2)], 3, 5, []),
        ([(0, 2)], 0, 0, []),
    ],
)
def test_ranks_from(ranges, start, limit, ranks):
    assert list(rankset.ranks_from(ranges, start, limit)) == ranks


def test_format_ranges():
    assert rankset.format_ranges([(0, 511), (513, 999)]) == "0-511, 513-999"
    assert rankset.format_ranges([(3, 3), (5, 6)]) == "3, 5-6"
    assert rankset.format_ranges([]) == ""
    assert rankset.format_ranges([(0, 0), (2, 2), (4, 4)], limit=2) == "0, 2"
    with pytest.raises(ValueError, match="limit must be at least 1"):
        rankset.format_ranges([(0, 0)], limit=0)


@pytest.mark.parametrize(
    ("ranges", "count", "text", "partial"),
    [
        ([], None, "none", False),
        ([(0, 511), (513, 999)], None, "0-511, 513-999", False),
        # more ranges than the text lists: the rest are counted
        ([(r, r) for r in range(0, 20, 2)], None, "0, 2, 4, 6, 8, 10, 12, 14 (+2 more)", False),
        # only the first ranges were read: the count says how many there are
        ([(0, 0), (2, 2)], 500, "0, 2 (+498 more)", True),
        # nothing read of a non-empty set
        ([], 7, "7 ranks", True),
    ],
)
def test_rank_list_text(ranges, count, text, partial):
    ranks = RankList.of(ranges, count)
    assert ranks.text == text
    assert ranks.partial is partial
    out = ranks.out()
    assert out["ranges"] == [list(r) for r in ranges]
    assert out["text"] == text
    assert out["count"] == (rankset.size(ranges) if count is None else count)


def test_missing_of_a_complete_read():
    got = rankset.missing(RankList.of([(0, 511), (513, 998)]), 1000)
    assert got == RankList(2, ((512, 512), (999, 999)), False)
    assert got.text == "512, 999"
    assert rankset.missing(RankList.of([(0, 999)]), 1000).text == "none"
    assert rankset.missing(RankList.of([]), 4).text == "0-3"


def test_missing_of_a_partial_read_lists_what_it_can_and_counts_the_rest():
    # even ranks 0..998 reported, only the first 3 ranges read
    reported = RankList.of([(0, 0), (2, 2), (4, 4)], 500)
    got = rankset.missing(reported, 1000)
    assert got.count == 500
    assert got.ranges == ((1, 1), (3, 3))  # known only up to the last range read
    assert got.partial
    assert got.text == "1, 3 (+498 more)"

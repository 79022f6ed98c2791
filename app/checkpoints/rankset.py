"""Sets of ranks as compact ranges, for pages and APIs that speak of 1,000 ranks at once (pure).

A set of ranks is a sorted list of disjoint, non-adjacent inclusive ranges ``(lo, hi)``:
ranks 0…511 and 513…999 are ``[(0, 511), (513, 999)]`` and read ``"0-511, 513-999"``.
The database hands ranges over already (``step_events`` finds them with the gaps-and-islands
``rank − row_number()`` grouping), so a page never holds one row per rank; these functions
only combine and format them.

A list of ranges may be *partial*: only its first ranges were read (the database caps them
per group). :class:`RankList` carries the exact count beside the ranges it lists, and its
text says how many ranks it leaves out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

Range = tuple[int, int]
#: Ranges a :class:`RankList`'s text lists before "+N more".
RANGES_SHOWN = 8


def to_ranges(ranks: Iterable[int]) -> list[Range]:
    """The ranges of a collection of ranks (any order, duplicates allowed).

    >>> to_ranges([3, 0, 1, 2, 7, 9, 8, 3])
    [(0, 3), (7, 9)]
    """
    out: list[Range] = []
    for r in sorted(set(ranks)):
        if out and r == out[-1][1] + 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return out


def merge(ranges: Iterable[Range]) -> list[Range]:
    """Sorted ranges with overlapping and adjacent ones joined.

    Raises:
        ValueError: a range whose ``lo`` is above its ``hi``.
    """
    out: list[Range] = []
    for lo, hi in sorted(ranges):
        if lo > hi:
            raise ValueError(f"range ({lo}, {hi}) starts above its end")
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(hi, out[-1][1]))
        else:
            out.append((lo, hi))
    return out


def size(ranges: Iterable[Range]) -> int:
    """How many ranks the (disjoint) ranges hold."""
    return sum(hi - lo + 1 for lo, hi in ranges)


def complement(ranges: Iterable[Range], upto: int) -> list[Range]:
    """The ranks in ``0 … upto − 1`` that ``ranges`` do not hold (e.g. the missing ranks of
    a step, ``upto`` being its world_size). Ranges beyond ``upto`` are ignored.

    >>> complement([(0, 511), (513, 998)], 1000)
    [(512, 512), (999, 999)]
    """
    out: list[Range] = []
    nxt = 0
    for lo, hi in merge(ranges):
        if lo >= upto:
            break
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = max(nxt, hi + 1)
    if nxt < upto:
        out.append((nxt, upto - 1))
    return out


def ranks_from(ranges: Iterable[Range], start: int, limit: int) -> Iterator[int]:
    """Up to ``limit`` ranks of ``ranges`` at or above ``start``, in order."""
    left = limit
    for lo, hi in merge(ranges):
        for r in range(max(lo, start), hi + 1):
            if left <= 0:
                return
            yield r
            left -= 1


def format_ranges(ranges: Sequence[Range], *, limit: int = RANGES_SHOWN) -> str:
    """``"0-511, 513-999"``: the first ``limit`` ranges (``""`` for none).

    Raises:
        ValueError: ``limit`` below 1.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in ranges[:limit])


@dataclass(frozen=True)
class RankList:
    """A set of ranks as a page shows it: its exact ``count`` and the ranges read.

    Attributes:
        count: how many ranks the set holds (exact, even when ``ranges`` is partial).
        ranges: the set's ranges in order; when ``partial``, only the first ones.
        partial: ranges beyond the last listed one were not read.
    """

    count: int
    ranges: tuple[Range, ...]
    partial: bool = False

    @classmethod
    def of(cls, ranges: Sequence[Range], count: int | None = None) -> RankList:
        """The set of exactly ``ranges`` (``count`` None), or their first part of a set of
        ``count`` ranks (partial when ``count`` exceeds what the ranges hold)."""
        held = size(ranges)
        total = held if count is None else max(count, held)
        return cls(total, tuple(ranges), total > held)

    @property
    def text(self) -> str:
        """``"0-511, 513-999"``, then ``" (+N more)"`` for the ranks the text leaves out
        (beyond :data:`RANGES_SHOWN` ranges, or not read); ``"none"`` for an empty set."""
        if self.count == 0:
            return "none"
        shown = self.ranges[:RANGES_SHOWN]
        text = format_ranges(shown) if shown else ""
        left = self.count - size(shown)
        if left > 0:
            text = f"{text} (+{left} more)" if text else f"{left} ranks"
        return text

    def out(self) -> dict[str, Any]:
        """The API shape: ``{count, ranges: [[lo, hi], ...], partial, text}``."""
        return {
            "count": self.count,
            "ranges": [list(r) for r in self.ranges],
            "partial": self.partial,
            "text": self.text,
        }


def missing(reported: RankList, world_size: int) -> RankList:
    """The ranks of ``0 … world_size − 1`` missing from ``reported``.

    When ``reported`` is partial, the missing ranks are listed only up to its last range,
    and counted as ``world_size − reported.count`` (exact when every reported rank is below
    world_size, as the ingest scoping enforces for a pinned world size).
    """
    if not reported.partial:
        return RankList.of(complement(reported.ranges, world_size))
    upto = min(reported.ranges[-1][1] + 1 if reported.ranges else 0, world_size)
    listed = complement(reported.ranges, upto)
    return RankList.of(listed, max(world_size - reported.count, size(listed)))

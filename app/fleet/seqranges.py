"""Which report sequence numbers of an agent epoch the server has stored, as ranges.

Ingest is idempotent on (node, epoch, seq): an agent resends a batch whose answer it never
got, and after an outage it sends its newest batch first and the backlog after it
(``agent.sendorder``). The server used to keep one receipt row per stored batch: at 2,500
nodes reporting every 10 s that is 900,000 rows (about 160 MiB with their indexes) an hour.
Kept as ranges of consecutive seqs instead, an epoch is one row while its reports arrive in
order, a few rows while a backlog fills in, and one row again once it has: the table stops
growing with the report rate.

A range is ``[first, last]`` inclusive, with the ``sent_at`` of its ``last`` seq (the
newest batch of the range: what tells a newer agent start from an older one). The planning
here is pure; ``fleet.ingest`` loads a node's ranges under a row lock and applies the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class SeqRange:
    """Stored seqs ``first..last`` (inclusive) of one node epoch."""

    first: int
    last: int
    last_sent_at: datetime

    def __post_init__(self) -> None:
        if self.last < self.first:
            raise ValueError(f"range {self.first}..{self.last} is empty")


@dataclass(frozen=True)
class Placement:
    """How one new seq changes a node epoch's ranges.

    ``update``: (first seq of the range as stored, the range it becomes); ``delete``: first
    seqs of ranges merged away; ``insert``: a new one-seq range.
    """

    update: tuple[tuple[int, SeqRange], ...] = ()
    delete: tuple[int, ...] = ()
    insert: SeqRange | None = None


def contains(ranges: Sequence[SeqRange], seq: int) -> bool:
    """True when ``seq`` is in one of ``ranges`` (already stored)."""
    return any(r.first <= seq <= r.last for r in ranges)


def place(ranges: Sequence[SeqRange], seq: int, sent_at: datetime) -> Placement | None:
    """The change that records ``seq``; None when it is already stored.

    A seq next to a range extends it; one that closes the gap between two ranges merges
    them; any other seq starts a range of its own.

    Args:
        ranges: the epoch's stored ranges (disjoint, any order).
        seq: the batch's sequence number.
        sent_at: the batch's send time (kept when ``seq`` becomes a range's last).
    """
    if contains(ranges, seq):
        return None
    below = next((r for r in ranges if r.last == seq - 1), None)
    above = next((r for r in ranges if r.first == seq + 1), None)
    if below is not None and above is not None:
        merged = SeqRange(below.first, above.last, above.last_sent_at)
        return Placement(update=((below.first, merged),), delete=(above.first,))
    if below is not None:
        return Placement(update=((below.first, SeqRange(below.first, seq, sent_at)),))
    if above is not None:
        grown = SeqRange(seq, above.last, above.last_sent_at)
        return Placement(update=((above.first, grown),))
    return Placement(insert=SeqRange(seq, seq, sent_at))


def apply(ranges: Sequence[SeqRange], placement: Placement) -> list[SeqRange]:
    """``ranges`` after ``placement``, sorted by ``first`` (for tests and bookkeeping)."""
    by_first = {r.first: r for r in ranges}
    for old_first, new in placement.update:
        del by_first[old_first]
        by_first[new.first] = new
    for first in placement.delete:
        del by_first[first]
    if placement.insert is not None:
        by_first[placement.insert.first] = placement.insert
    return sorted(by_first.values(), key=lambda r: r.first)


def stored_count(ranges: Sequence[SeqRange]) -> int:
    """How many seqs ``ranges`` hold."""
    return sum(r.last - r.first + 1 for r in ranges)

"""Which spooled batch the reporter sends next: the newest state first, the backlog behind it.

After an outage (or while the server is slower than the report interval) the spool holds
more than one batch. Replaying it oldest first kept the node's health on the server as old
as the backlog is long: a 10-minute outage at a 10 s interval is 60 batches to replay before
the server learns how the node is now. So the order is (:func:`next_to_send`):

1. **Ahead of the server.** While some batch is newer than the newest one delivered (the
   *head*), the newest of them goes first. When that newest one is a heartbeat (no samples;
   ``agent.sampling``) the newest batch *with* samples among them goes just before it: the
   server's stale-telemetry rule compares a report's time with the GPU's newest stored
   sample, so a heartbeat arriving first after a long outage would flag every GPU of a
   working node as stale for one interval (``fleet.rules.rule_stale_telemetry``).
2. **Backfill.** Once nothing is ahead, the older batches go: first the urgent ones (XIDs
   and command results, pushed at once when they happened; a fatal XID during the outage
   must become a reason now, not after the whole backlog), then the rest, each oldest
   first. A batch spooled meanwhile is ahead again and jumps the queue, so the server is
   never more than one interval behind while the link is up.

Why the backfill goes oldest first: once the newest samples are on the server, every
backfilled sample is older than the GPU's latest and is stored, not evaluated
(``fleet.ingest._evaluate_samples``), so the order inside the backfill cannot make stale
findings either way; oldest first means the last backfilled batch, whose node fields
(``dropped_batches``, agent version, interval) the server keeps until the next report, is
the newest of the backlog, and a state change a backfilled XID causes is dated in order.

Everything else the server does with a batch is order-independent: it is stored once per
(node, epoch, seq) and ``acked_seq`` is the epoch's highest seq; XID events are stored and
classified whatever their age (the repeat rule counts stored occurrences on both sides of
the new one); checkpoint ledger rows are idempotent, job progress keeps the newest by time,
and command and restore states only move forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar


class Spooled(Protocol):
    """What the order needs to know of a spooled batch."""

    @property
    def ordinal(self) -> int:
        """Position in age order (grows with every batch spooled, across agent runs)."""
        ...

    @property
    def has_samples(self) -> bool:
        """Whether the batch carries GPU samples (False: a heartbeat)."""
        ...

    @property
    def urgent(self) -> bool:
        """Whether the batch was pushed at once (XIDs, command results)."""
        ...


T = TypeVar("T", bound=Spooled)


def next_to_send(items: Sequence[T], head: int) -> T | None:
    """The batch to send next (see the module docs for the order and its reasons).

    Args:
        items: The spooled batches, oldest first (ascending ``ordinal``, as
            ``Spool.items()`` lists them).
        head: The ``ordinal`` of the newest batch delivered so far, 0 before any. A batch
            with a higher ordinal is ahead of the server; the others are backfill.

    Returns:
        The batch to send, or None when ``items`` is empty.
    """
    if not items:
        return None
    newest = items[-1]
    if newest.ordinal > head:
        if newest.has_samples:
            return newest
        for item in reversed(items):
            if item.ordinal <= head:
                break
            if item.has_samples:
                return item
        return newest
    return next((item for item in items if item.urgent), items[0])

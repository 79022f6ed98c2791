"""The reporter's sending order (agent.sendorder): newest state first, backlog behind it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tierwatch.agent.sendorder import next_to_send


@dataclass(frozen=True)
class B:
    """A spooled batch as the order sees it: ``s`` with samples, ``h`` heartbeat, ``x`` an
    urgent heartbeat (XIDs)."""

    ordinal: int
    kind: str = "s"

    @property
    def has_samples(self) -> bool:
        return self.kind == "s"

    @property
    def urgent(self) -> bool:
        return self.kind == "x"


def spool(kinds: str, first: int = 1) -> list[B]:
    return [B(first + i, k) for i, k in enumerate(kinds)]


@pytest.mark.parametrize(
    ("kinds", "head", "expected", "why"),
    [
        ("s", 0, 1, "one batch: no order to choose"),
        ("ssss", 0, 4, "nothing delivered yet: the newest"),
        ("ssss", 1, 4, "after an outage: the newest"),
        ("shsh", 0, 3, "newest is a heartbeat: the newest with samples goes just before it"),
        ("xhhh", 0, 4, "no samples ahead: the newest heartbeat"),
        ("shhh", 1, 4, "the batch with samples is behind the head: it does not count"),
        ("ssss", 4, 1, "nothing ahead: backfill, oldest first"),
        ("shxhx", 5, 3, "backfill: urgent ones first, oldest first"),
        ("ssh", 2, 3, "a batch newer than the head jumps the backfill"),
        ("hhs", 2, 3, "ahead with samples: itself"),
    ],
)
def test_next_to_send(kinds: str, head: int, expected: int, why: str) -> None:
    got = next_to_send(spool(kinds), head)
    assert got is not None, why
    assert got.ordinal == expected, why


def test_empty_spool_sends_nothing() -> None:
    assert next_to_send([], 0) is None
    assert next_to_send([], 7) is None


def drain(items: list[B], head: int, arrivals: dict[int, list[B]] | None = None) -> list[int]:
    """Deliver everything as the sender does; ``arrivals[n]`` are spooled after the n-th
    delivery. Returns the ordinals in delivery order."""
    items, sent = list(items), []
    arrivals = arrivals or {}
    while items:
        item = next_to_send(items, head)
        assert item is not None
        items.remove(item)
        sent.append(item.ordinal)
        head = max(head, item.ordinal)
        items += arrivals.get(len(sent), [])
    return sent


def test_an_outage_drains_newest_state_first_then_urgent_then_the_rest_oldest_first() -> None:
    # delivered up to 10; during the outage: samples every 3rd report, two XID pushes
    backlog = spool("shhxshxhsh", first=11)  # 11..20, newest (20) a heartbeat
    assert drain(backlog, head=10) == [19, 20, 14, 17, 11, 12, 13, 15, 16, 18]


def test_batches_spooled_during_the_backfill_jump_the_queue() -> None:
    backlog = spool("ssss", first=11)
    # after the 2nd delivery a new report (15) arrives, after the 4th an XID push (16)
    sent = drain(backlog, head=10, arrivals={2: [B(15, "s")], 4: [B(16, "x")]})
    assert sent == [14, 11, 15, 12, 16, 13]


def test_every_batch_is_sent_exactly_once_whatever_the_mix() -> None:
    import random

    rng = random.Random(14)
    for _ in range(200):
        n = rng.randint(1, 30)
        backlog = [B(i + 1, rng.choice("shx")) for i in range(n)]
        head = rng.randint(0, n)
        when = sorted(rng.sample(range(1, n + 1), min(n, rng.randint(0, 3))))
        arrivals = {k: [B(n + 1 + j, rng.choice("shx"))] for j, k in enumerate(when)}
        sent = drain(backlog, head, arrivals)
        spooled = [b.ordinal for b in backlog] + [b.ordinal for a in arrivals.values() for b in a]
        assert sorted(sent) == sorted(spooled)
        # the first batch sent is the newest, or the newest with samples just before it
        ahead = [b for b in backlog if b.ordinal > head]
        if ahead:
            newest = ahead[-1]
            with_samples = [b.ordinal for b in ahead if b.has_samples]
            if newest.has_samples or not with_samples:
                assert sent[0] == newest.ordinal
            else:
                assert sent[0] == with_samples[-1]
                if 1 not in arrivals:  # (a batch spooled meanwhile is newer still)
                    assert sent[1] == newest.ordinal

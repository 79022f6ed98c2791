"""The live-page diff: digests, snapshots and their tokens, changed keys, the LRU, the plan."""

from __future__ import annotations

import threading

import pytest

from tierwatch.server.web import delta
from tierwatch.server.web.delta import Snapshot, SnapshotCache, changed_keys, plan


def snap(scope: str = "cluster", **parts: str) -> Snapshot:
    """A snapshot of ``key=content`` parts, in the order given."""
    return Snapshot.of(scope, [(k, delta.digest(v)) for k, v in parts.items()])


def test_digest_is_short_and_deterministic():
    assert len(delta.digest("tile")) == delta.DIGEST_SIZE
    assert delta.digest("tile") == delta.digest("tile")
    assert delta.digest("tile") != delta.digest("tile ")
    # BLAKE2b, not Python's per-process hash(): every worker derives the same digest
    assert delta.digest("") == bytes.fromhex("e4a6a0577479b2b4")


def test_token_names_scope_keys_and_content():
    base = snap(a="1", b="2")
    assert len(base.token) == delta.TOKEN_LENGTH
    assert snap(a="1", b="2").token == base.token
    others = [
        snap("other", a="1", b="2"),  # scope
        snap(a="1", b="3"),  # content
        snap(b="2", a="1"),  # order
        snap(a="1", c="2"),  # key
        snap(a="1"),  # a part fewer
    ]
    assert len({base.token, *(s.token for s in others)}) == 1 + len(others)


def test_token_keeps_scope_and_keys_apart():
    """Scope and keys are length-prefixed: moving text between them changes the token."""
    assert snap("a", b="x").token != snap("ab", **{"": "x"}).token


@pytest.mark.parametrize(
    ("keys", "digests", "message"),
    [
        (("a", "b"), b"\0" * delta.DIGEST_SIZE, "8 digest bytes per key: 2 keys, 8 bytes"),
        (("a", "a"), b"\0" * 2 * delta.DIGEST_SIZE, "part keys must be unique"),
    ],
)
def test_snapshot_refuses_inconsistent_parts(keys, digests, message):
    with pytest.raises(ValueError, match=message):
        Snapshot("cluster", keys, digests)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (snap(a="1", b="2", c="3"), snap(a="1", b="2", c="3"), []),
        (snap(a="1", b="2", c="3"), snap(a="1", b="9", c="3"), ["b"]),
        (snap(a="1", b="2", c="3"), snap(a="0", b="2", c="9"), ["a", "c"]),  # page order
        (snap(a="1", b="2"), snap("other", a="1", b="2"), None),  # another scope
        (snap(a="1", b="2"), snap(a="1", b="2", c="3"), None),  # added
        (snap(a="1", b="2"), snap(a="1"), None),  # removed
        (snap(a="1", b="2"), snap(b="2", a="1"), None),  # reordered
        (snap(), snap(), []),
    ],
)
def test_changed_keys(old, new, expected):
    assert changed_keys(old, new) == expected


def test_changed_keys_at_scale():
    names = [f"node-{i:04d}" for i in range(2500)]
    old = snap(**dict.fromkeys(names, "healthy"))
    new = snap(**{**dict.fromkeys(names, "healthy"), "node-0042": "unhealthy"})
    assert changed_keys(old, new) == ["node-0042"]


def test_cache_evicts_the_least_recently_used():
    cache = SnapshotCache(2)
    one, two, three = snap(a="1"), snap(a="2"), snap(a="3")
    cache.put(one)
    cache.put(two)
    assert cache.get(one.token) is one  # now the most recently used
    cache.put(three)
    assert len(cache) == 2
    assert cache.get(two.token) is None
    assert cache.get(one.token) is one
    assert cache.get(three.token) is three


def test_cache_put_again_refreshes_without_growing():
    cache = SnapshotCache(2)
    one, two = snap(a="1"), snap(a="2")
    cache.put(one)
    cache.put(two)
    cache.put(one)
    cache.put(snap(a="3"))
    assert len(cache) == 2
    assert cache.get(one.token) is one
    assert cache.get(two.token) is None


def test_cache_shares_equal_keys_with_the_newest_entry():
    cache = SnapshotCache(4)
    first, second = snap(a="1", b="2"), snap(a="1", b="3")
    assert first.keys is not second.keys
    cache.put(first)
    cache.put(second)
    assert cache.get(second.token).keys is first.keys  # type: ignore[union-attr]
    assert changed_keys(first, second) == ["b"]


def test_cache_needs_room():
    with pytest.raises(ValueError, match="max_entries must be >= 1, got 0"):
        SnapshotCache(0)


def test_cache_stays_bounded_under_concurrent_use():
    cache = SnapshotCache(8)
    snaps = [snap(a=str(i)) for i in range(400)]

    def work(offset: int) -> None:
        for s in snaps[offset::4]:
            cache.put(s)
            cache.get(snaps[0].token)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 8


def test_plan():
    cache = SnapshotCache(4)
    old = snap(head="3 nodes", a="healthy", b="healthy")
    assert plan(None, old, cache) is None  # no version: the whole part
    assert cache.get(old.token) is old
    assert plan(old.token, old, cache) == []
    new = snap(head="3 nodes, 1 unhealthy", a="healthy", b="unhealthy")
    assert plan(old.token, new, cache) == ["head", "b"]
    assert plan("0" * delta.TOKEN_LENGTH, new, cache) is None  # unknown
    assert plan(old.token, snap(head="", a="healthy"), cache) is None  # other keys


def test_plan_knows_a_current_version_it_never_stored():
    """Equal content gives an equal token, so another worker's current version is current."""
    current = snap(a="1")
    assert plan(snap(a="1").token, current, SnapshotCache(1)) == []

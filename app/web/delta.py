"""What changed on a live page since the version a browser shows: digests, snapshots, an LRU.

A live page is split into keyed parts (``"head"``, ``"n:gpu-node-01"``), each with a short
digest of its content. A :class:`Snapshot` holds one render's keys and digests, in page
order, and its scope (the page and its filters). Its :attr:`~Snapshot.token` is a digest of
all of that, so equal content gives the same token in every process and worker. The page
carries the token; its poll sends it back; :func:`plan` answers with what to send:

- ``None``: the whole live part (no token, an unknown one, another scope, or parts added,
  removed or reordered: those cannot be patched in place);
- ``[]``: nothing changed;
- the keys of the changed parts, in page order.

Known snapshots live in a :class:`SnapshotCache`, a bounded LRU per process. A token that
another worker made, that was evicted, or that a restart forgot is simply unknown: the
caller sends the whole live part again and the browser is back in step.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

#: Bytes per part digest (BLAKE2b): a changed part is missed only on a 64-bit collision.
DIGEST_SIZE = 8
#: Length of a token (hex characters of an 8-byte BLAKE2b digest).
TOKEN_LENGTH = 16


def digest(content: str) -> bytes:
    """The :data:`DIGEST_SIZE`-byte BLAKE2b digest of ``content`` (UTF-8)."""
    return hashlib.blake2b(content.encode(), digest_size=DIGEST_SIZE).digest()


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One render of a live page: its scope and its parts' keys and digests, in page order.

    Attributes:
        scope: What the render shows (page and filters); only a snapshot of the same scope
            can be patched.
        keys: Part keys in page order, each once.
        digests: The parts' digests concatenated, :data:`DIGEST_SIZE` bytes per key.
        token: Hex digest of scope, keys and digests (:data:`TOKEN_LENGTH` characters).

    Raises:
        ValueError: ``digests`` does not hold one digest per key, or a key repeats.
    """

    scope: str
    keys: tuple[str, ...]
    digests: bytes
    token: str = field(init=False)

    def __post_init__(self) -> None:
        if len(self.digests) != DIGEST_SIZE * len(self.keys):
            raise ValueError(
                f"a snapshot needs {DIGEST_SIZE} digest bytes per key: {len(self.keys)} keys, "
                f"{len(self.digests)} bytes"
            )
        if len(set(self.keys)) != len(self.keys):
            raise ValueError("a snapshot's part keys must be unique")
        h = hashlib.blake2b(digest_size=TOKEN_LENGTH // 2)
        for piece in (self.scope.encode(), "\0".join(self.keys).encode()):
            h.update(len(piece).to_bytes(8, "big"))
            h.update(piece)
        h.update(self.digests)
        object.__setattr__(self, "token", h.hexdigest())

    @classmethod
    def of(cls, scope: str, parts: Iterable[tuple[str, bytes]]) -> Snapshot:
        """A snapshot from ``(key, digest)`` pairs in page order (digests from :func:`digest`)."""
        keys: list[str] = []
        chunks: list[bytes] = []
        for key, d in parts:
            keys.append(key)
            chunks.append(d)
        return cls(scope, tuple(keys), b"".join(chunks))


def changed_keys(old: Snapshot, new: Snapshot) -> list[str] | None:
    """The keys whose digest differs between ``old`` and ``new``, in page order.

    Returns:
        The changed keys (``[]`` when none), or None when ``new`` cannot be reached by
        replacing parts of ``old``: another scope, or other keys (added, removed, reordered).
    """
    if old.scope != new.scope or old.keys != new.keys:
        return None
    a, b = old.digests, new.digests
    if a == b:
        return []
    n = DIGEST_SIZE
    return [k for i, k in enumerate(new.keys) if a[i * n : (i + 1) * n] != b[i * n : (i + 1) * n]]


class SnapshotCache:
    """A bounded, thread-safe LRU of snapshots by token (one per process).

    Consecutive snapshots of a page usually have the same keys; a new entry shares the
    keys tuple of the newest entry when they are equal, so an entry costs little more than
    its digests (8 bytes per part).

    Args:
        max_entries: Snapshots kept; the least recently used one goes first.

    Raises:
        ValueError: ``max_entries`` is below 1.
    """

    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Snapshot] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, token: str) -> Snapshot | None:
        """The snapshot with ``token`` (now the most recently used), or None."""
        with self._lock:
            snap = self._entries.get(token)
            if snap is not None:
                self._entries.move_to_end(token)
            return snap

    def put(self, snap: Snapshot) -> None:
        """Keep ``snap`` as the most recently used entry, evicting beyond ``max_entries``."""
        with self._lock:
            if snap.token in self._entries:
                self._entries.move_to_end(snap.token)
                return
            if self._entries:
                newest = next(reversed(self._entries.values()))
                if newest.keys is not snap.keys and newest.keys == snap.keys:
                    object.__setattr__(snap, "keys", newest.keys)  # same value: share it
            self._entries[snap.token] = snap
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)


def plan(since: str | None, current: Snapshot, cache: SnapshotCache) -> list[str] | None:
    """What a poll that shows version ``since`` needs to reach ``current``; keeps ``current``.

    Args:
        since: The token the browser's page carries (None: it sent none).
        current: The snapshot of this render.
        cache: The snapshots this process knows; ``current`` is added to it.

    Returns:
        None to send the whole live part, ``[]`` when nothing changed, else the changed keys
        in page order.
    """
    cache.put(current)
    if since is None:
        return None
    if since == current.token:  # known or not: equal tokens mean equal content
        return []
    old = cache.get(since)
    return None if old is None else changed_keys(old, current)

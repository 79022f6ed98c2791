"""Peer placement and the HTTP client agents use to talk to each other's peer endpoints.

Placement (docs/checkpointing.md): rank ``r``'s files go to the agents of the next
``replication`` distinct nodes after its own in rank order (``r+1, r+2, …`` wrapping around),
skipping its own node; with the usual contiguous layout that is the node of rank
``r + ranks_per_node`` first. A job on one node has no peer tier.

Pushes stream each file from disk (never whole files in memory) with its xxh3-64 in
``X-Tierwatch-Xxh3`` and the peer token; the holder verifies before renaming into place.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

import httpx

from tierwatch.agent.checkpoint.format.manifest import CHUNK
from tierwatch.agent.httputil import error_detail

XXH3_HEADER = "X-Tierwatch-Xxh3"


class PeerError(Exception):
    """A peer request failed (unreachable, refused); the message names the file and peer."""


def peer_targets(layout: list[str], rank: int, replication: int) -> list[str]:
    """Nodes that hold replicas of rank ``rank``'s files.

    Args:
        layout: Node of every rank (index = rank).
        rank: The source rank.
        replication: How many distinct peer nodes.

    Returns:
        Up to ``replication`` distinct nodes other than ``layout[rank]``, in rank order after
        ``rank`` (wrapping); empty for a job on one node.

    Raises:
        ValueError: ``rank`` is outside the layout.
    """
    if not 0 <= rank < len(layout):
        raise ValueError(f"rank {rank} is outside the layout of {len(layout)} ranks")
    own = layout[rank]
    out: list[str] = []
    world = len(layout)
    for i in range(1, world):
        node = layout[(rank + i) % world]
        if node != own and node not in out:
            out.append(node)
            if len(out) >= replication:
                break
    return out


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            yield chunk


class PeerClient:
    """HTTP client for other agents' ``/v1/peer/*`` endpoints.

    Args:
        token: The peer token.
        timeout_s: Connect/read timeout per request, seconds.
    """

    def __init__(self, token: str, timeout_s: float = 60.0) -> None:
        self._client = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            headers={"Authorization": f"Bearer {token}"},
        )

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def push_file(
        self,
        *,
        url: str,
        peer: str,
        src_node: str,
        job_id: str,
        step: int,
        name: str,
        path: Path,
        size: int,
        xxh3: str,
    ) -> None:
        """PUT one file into ``peer``'s replicas of ``src_node``.

        Raises:
            PeerError: unreachable, or the peer refused (its message is included).
        """
        target = (
            f"{url.rstrip('/')}/v1/peer/replicas/{quote(src_node)}/{quote(job_id)}/"
            f"{step}/{quote(name)}"
        )
        headers = {
            XXH3_HEADER: xxh3,
            "Content-Length": str(size),
            "Content-Type": "application/octet-stream",
        }
        try:
            resp = self._client.put(target, content=_file_chunks(path), headers=headers)
        except (httpx.HTTPError, OSError) as exc:
            raise PeerError(f"{name}: cannot push to {peer} at {url}: {exc!r}") from None
        if resp.status_code != 200:
            raise PeerError(
                f"{name}: {peer} refused the replica (HTTP {resp.status_code}): "
                f"{error_detail(resp)}"
            )

    def fetch_to(
        self,
        *,
        url: str,
        holder: str,
        job_id: str,
        step: int,
        name: str,
        tier: str,
        src: str | None,
        out: BinaryIO,
    ) -> int:
        """GET one file from ``holder``'s memory tier (tier ``memory``) or from a replica it
        holds for ``src`` (tier ``peer``), writing it to ``out``.

        Returns:
            Bytes written.

        Raises:
            PeerError: unreachable or refused.
        """
        target = f"{url.rstrip('/')}/v1/peer/files/{quote(job_id)}/{step}/{quote(name)}"
        params = {"tier": tier}
        if src:
            params["src"] = src
        n = 0
        try:
            with self._client.stream("GET", target, params=params) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise PeerError(
                        f"{name}: {holder} answered HTTP {resp.status_code}: {error_detail(resp)}"
                    )
                for chunk in resp.iter_bytes(CHUNK):
                    out.write(chunk)
                    n += len(chunk)
        except (httpx.HTTPError, OSError) as exc:
            raise PeerError(f"{name}: cannot fetch from {holder} at {url}: {exc!r}") from None
        return n

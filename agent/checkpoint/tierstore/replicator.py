"""Peer placement and the HTTP client agents use to talk to each other's peer endpoints.

Placement (docs/checkpointing.md): rank ``r``'s files go to the agents of the next
``replication`` distinct nodes after its own in rank order (``r+1, r+2, …`` wrapping around),
skipping its own node; with the usual contiguous layout that is the node of rank
``r + ranks_per_node`` first. A job on one node has no peer tier.

Pushes stream each file from an open file (never whole files in memory; the caller opens it
without following links, :func:`~tierwatch.agent.fsutil.open_regular`) with its size in
``Content-Length`` and its xxh3-64 in ``X-Tierwatch-Xxh3``; the holder reserves the size,
verifies and renames into place. Every request is signed as this node for the node it goes
to (:mod:`tierwatch.agent.peer_identity`); the caller takes the URL from the server's
registry (:class:`~tierwatch.agent.registry.PeerRegistry`), never from the ranks.

Fetches ask for the bytes as they are (``Accept-Encoding: identity``), read the raw body
(never decoded: a compressed answer is refused, so a small gzip bomb cannot expand on this
node), and stop with an error as soon as more bytes arrive than the manifest lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO
from urllib.parse import quote, unquote, urlencode, urlsplit

import httpx

from tierwatch.agent.checkpoint.format.manifest import CHUNK
from tierwatch.agent.fsutil import iter_file
from tierwatch.agent.httputil import error_detail
from tierwatch.agent.registry import PeerRegistry, RegistryError

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


class PeerClient:
    """HTTP client for other agents' ``/v1/peer/*`` endpoints.

    Args:
        registry: Signs the requests as this node, and says where peers are.
        timeout_s: Connect/read timeout per request, seconds.
    """

    def __init__(self, registry: PeerRegistry, timeout_s: float = 60.0) -> None:
        self.registry = registry
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)))

    def url_of(self, node: str) -> str:
        """Where ``node``'s agent listens, by its server-issued certificate.

        Raises:
            PeerError: the server's registry does not know the node.
        """
        cert = self.registry.peer(node)
        if cert is None:
            raise PeerError(
                f"{node} is not in the server's registry (its agent never registered, or "
                "the server is unreachable and it was never seen)"
            )
        return cert.url

    def _signed(self, receiver: str, method: str, target: str) -> dict[str, str]:
        split = urlsplit(target)
        path = unquote(split.path) + (f"?{split.query}" if split.query else "")
        try:
            return self.registry.headers(receiver=receiver, method=method, path=path)
        except RegistryError as exc:
            raise PeerError(f"cannot authenticate to {receiver}: {exc}") from None

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
        source: BinaryIO,
        size: int,
        xxh3: str,
    ) -> None:
        """PUT one file into ``peer``'s replicas of ``src_node``.

        Args:
            url, peer: The holder agent's URL and node name.
            src_node, job_id, step, name: Whose file it is and where it goes.
            source: The file, open for reading at its start; ``size`` bytes of it are sent,
                and it is closed when the request ends.
            size: Its size in bytes (sent as ``Content-Length``; the holder reserves it).
            xxh3: Its xxh3-64 hex digest.

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
            **self._signed(peer, "PUT", target),
        }
        try:
            resp = self._client.put(target, content=_chunks(source, size), headers=headers)
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
        max_bytes: int,
    ) -> int:
        """GET one file from ``holder``'s memory tier (tier ``memory``) or from a replica it
        holds for ``src`` (tier ``peer``), writing it to ``out``.

        The request asks for ``Accept-Encoding: identity`` and the raw body is written as it
        arrives (``iter_raw``: httpx decodes nothing); an answer with another
        ``Content-Encoding`` is refused unread. At most ``max_bytes`` are written: a
        ``Content-Length`` above it is refused before the body is read, and a body that goes
        past it stops the download at once.

        Args:
            max_bytes: The file's size in its manifest (bytes).

        Returns:
            Bytes written.

        Raises:
            PeerError: unreachable, refused, encoded, or more than ``max_bytes`` bytes.
        """
        params = {"tier": tier}
        if src:
            params["src"] = src
        target = (
            f"{url.rstrip('/')}/v1/peer/files/{quote(job_id)}/{step}/{quote(name)}?"
            + urlencode(params)
        )
        headers = {"Accept-Encoding": "identity", **self._signed(holder, "GET", target)}
        n = 0
        try:
            with self._client.stream("GET", target, headers=headers) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise PeerError(
                        f"{name}: {holder} answered HTTP {resp.status_code}: {error_detail(resp)}"
                    )
                encoding = resp.headers.get("content-encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise PeerError(
                        f"{name}: {holder} sent it with Content-Encoding {encoding}; the agent "
                        "asks for identity and reads files only as they are (not decoded); "
                        "nothing was read"
                    )
                declared = resp.headers.get("content-length", "")
                if declared.isdigit() and int(declared) > max_bytes:
                    raise PeerError(
                        f"{name}: {holder} announced {declared} bytes, more than the "
                        f"manifest's {max_bytes}; nothing was read"
                    )
                for chunk in resp.iter_raw(CHUNK):
                    n += len(chunk)
                    if n > max_bytes:
                        raise PeerError(
                            f"{name}: {holder} sent more than the manifest's {max_bytes} "
                            f"bytes; the download was stopped after {n}"
                        )
                    out.write(chunk)
        except (httpx.HTTPError, OSError) as exc:
            raise PeerError(f"{name}: cannot fetch from {holder} at {url}: {exc!r}") from None
        return n


def _chunks(source: BinaryIO, size: int) -> Iterator[bytes]:
    """``size`` bytes of ``source`` in chunks of :data:`CHUNK`; closes it at the end."""
    yield from iter_file(source, size, CHUNK)

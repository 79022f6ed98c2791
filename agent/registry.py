"""What an agent asks the server about its peers: its own certificate, theirs, a job's nodes.

Peer addresses come from here, never from files the ranks write or from request bodies
(docs/security.md, "Peers"):

- :meth:`PeerRegistry.certificate` — this node's certificate (``POST
  /api/v1/agent/peer-certificate`` with the node key's public half and the advertised URL),
  renewed once half its life has passed.
- :meth:`PeerRegistry.peer` — another node's certificate (``GET /api/v1/agent/peers``),
  checked with the server's keys: its URL is where this agent pushes to and fetches from.
- :meth:`PeerRegistry.job` — a job's registered nodes and pinned layout (``GET
  /api/v1/agent/jobs/{job_id}``): whom a holder accepts replicas from and serves them to.

Answers are cached for :data:`CACHE_S` seconds, and what was last learnt is kept in
``<state_dir>/registry.json``, so a server outage (or an agent restarted during one) does not
stop replication between nodes already known. A miss asks the server at most every
:data:`MISS_RETRY_S` seconds per name.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tierwatch.agent.credential_keys import ServerKeys
from tierwatch.agent.credentials import CredentialError, NodeCertificate, b64url, b64url_decode
from tierwatch.agent.peer_identity import (
    CERT_HEADER,
    SCHEME,
    load_node_key,
    public_key_text,
    sign_request,
)
from tierwatch.agent.urlsafe import redact_url

log = logging.getLogger(__name__)

CERT_PATH = "/api/v1/agent/peer-certificate"
PEERS_PATH = "/api/v1/agent/peers"
JOBS_PATH = "/api/v1/agent/jobs/"
CACHE_FILE = "registry.json"
CACHE_S = 30.0
MISS_RETRY_S = 5.0
TIMEOUT_S = 5.0
PEERS_PER_CALL = 256  # ~5 KB of query per GET: under proxies' 8 KB default


def _key(text: object) -> bytes | None:
    """A manifest key from its base64url text (None: absent or not 32 bytes)."""
    if not isinstance(text, str):
        return None
    try:
        key = b64url_decode(text)
    except CredentialError:
        return None
    return key if len(key) == 32 else None


class RegistryError(Exception):
    """The server could not say (unreachable, refused); the message says why."""


@dataclass(frozen=True)
class JobNodes:
    """A job's registered nodes, pinned layout (node per rank, or None) and manifest key
    (32 bytes; None: the server did not send one)."""

    job_id: str
    nodes: frozenset[str]
    layout: tuple[str, ...] | None
    manifest_key: bytes | None = None

    def node_of(self, rank: int) -> str | None:
        """The node the layout names for ``rank`` (None: no layout, or out of range)."""
        if self.layout is None or not 0 <= rank < len(self.layout):
            return None
        return self.layout[rank]


class PeerRegistry:
    """This agent's view of the server's node registry.

    Args:
        node: This node's name.
        server: The server's base URL.
        token: The agent token.
        state_dir: The agent's own folder (node key, cache).
        keys: The server's public keys (certificates are checked with them).
    """

    def __init__(
        self, *, node: str, server: str, token: str, state_dir: Path, keys: ServerKeys
    ) -> None:
        self.node = node
        self.server = server.rstrip("/")
        self.keys = keys
        self.state_dir = state_dir
        self.key = load_node_key(state_dir)
        self.public_key = public_key_text(self.key)
        self._http = httpx.Client(
            base_url=self.server,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(TIMEOUT_S, connect=min(TIMEOUT_S, 2.0)),
        )
        self._lock = threading.Lock()
        self._own: NodeCertificate | None = None
        self._own_issued = 0.0
        self._url = ""
        self._peers: dict[str, tuple[NodeCertificate, float]] = {}  # node -> (cert, fetched)
        self._jobs: dict[str, tuple[JobNodes, float]] = {}
        self._misses: dict[str, float] = {}
        self.error: str | None = None
        self._load_cache()

    # -- own certificate -------------------------------------------------------------------
    def register(self, url: str) -> None:
        """Ask for this node's certificate for ``url`` (logged, never raised, when the server
        cannot answer: :meth:`certificate` asks again)."""
        self._url = url
        try:
            self._fetch_own()
        except RegistryError as exc:
            log.warning("%s; peers cannot authenticate this node until it has one", exc)

    def certificate(self) -> NodeCertificate:
        """This node's certificate, renewed at half its life.

        Raises:
            RegistryError: none yet and the server cannot issue one now.
        """
        own = self._own
        now = time.time()
        if own is None or now > own.expires_at - (own.expires_at - self._own_issued) / 2:
            try:
                return self._fetch_own()
            except RegistryError:
                if own is not None and now < own.expires_at:
                    return own  # the server is away: the old one is still good
                raise
        return own

    def _fetch_own(self) -> NodeCertificate:
        if not self._url:
            raise RegistryError("this agent's peer URL is not known yet")
        body = {"public_key": self.public_key, "url": self._url}
        data = self._call("POST", CERT_PATH, json=body)
        try:
            cert = self.keys.verifier.verify_node_certificate(str(data.get("certificate")))
        except CredentialError as exc:
            raise RegistryError(
                f"the server's certificate for {self.node} is unusable: {exc}"
            ) from None
        if cert.node != self.node:
            raise RegistryError(f"the server certified {cert.node!r}, not {self.node!r}")
        with self._lock:
            self._own, self._own_issued = cert, time.time()
        self._save_cache()
        return cert

    def headers(self, *, receiver: str, method: str, path: str) -> dict[str, str]:
        """The authentication headers of one request to node ``receiver``.

        Raises:
            RegistryError: this node has no certificate (see :meth:`certificate`).
        """
        cert = self.certificate()
        proof = sign_request(
            self.key, sender=self.node, receiver=receiver, method=method, path=path
        )
        return {"Authorization": f"{SCHEME} {proof}", CERT_HEADER: cert.token}

    # -- peers -------------------------------------------------------------------------------
    def peer(self, node: str) -> NodeCertificate | None:
        """``node``'s certificate (its URL is where to reach it), or None when the server does
        not know it (and did not, :data:`MISS_RETRY_S` ago)."""
        return self.peers([node]).get(node)

    def peers(self, nodes: list[str]) -> dict[str, NodeCertificate]:
        """Certificates of ``nodes`` (those the server knows), fetched as needed."""
        now = time.time()
        with self._lock:
            have = {n: c for n, (c, at) in self._peers.items() if n in nodes}
        want = [
            n
            for n in dict.fromkeys(nodes)
            if (n not in have or now - self._peers[n][1] > CACHE_S or have[n].expires_at < now)
            and now - self._misses.get(n, 0.0) > MISS_RETRY_S
        ]
        for i in range(0, len(want), PEERS_PER_CALL):
            chunk = want[i : i + PEERS_PER_CALL]
            try:
                data = self._call("GET", PEERS_PATH, params=[("node", n) for n in chunk])
            except RegistryError as exc:
                log.warning("%s; using the peers known before", exc)
                for n in chunk:
                    self._misses[n] = now
                continue
            got = set()
            for p in data.get("peers", []):
                try:
                    cert = self.keys.verifier.verify_node_certificate(str(p.get("certificate")))
                except CredentialError as exc:
                    log.warning("certificate of %s from the server refused: %s", p.get("node"), exc)
                    continue
                with self._lock:
                    self._peers[cert.node] = (cert, now)
                got.add(cert.node)
            for n in chunk:
                if n not in got:
                    self._misses[n] = now
            if got:
                self._save_cache()
        with self._lock:
            return {n: c for n, (c, _) in self._peers.items() if n in nodes and c.expires_at >= now}

    # -- jobs --------------------------------------------------------------------------------
    def job(self, job_id: str, *, fresh: bool = False) -> JobNodes | None:
        """The job's registered nodes and layout, or None when the server does not know the
        job (or this node is not one of its nodes) and nothing is cached.

        Args:
            fresh: Ask the server even if a cached answer is younger than :data:`CACHE_S`
                (still at most every :data:`MISS_RETRY_S` seconds).
        """
        now = time.time()
        with self._lock:
            cached = self._jobs.get(job_id)
        if cached is not None and not fresh and now - cached[1] <= CACHE_S:
            return cached[0]
        if now - self._misses.get("job:" + job_id, 0.0) <= MISS_RETRY_S:
            return cached[0] if cached else None
        try:
            data = self._call("GET", JOBS_PATH + job_id, missing_ok=True)
        except RegistryError as exc:
            log.warning("%s; using what was known of job %s", exc, job_id)
            self._misses["job:" + job_id] = now
            return cached[0] if cached else None
        if data is None:
            self._misses["job:" + job_id] = now
            with self._lock:
                self._jobs.pop(job_id, None)
            return None
        layout = data.get("layout")
        nodes = JobNodes(
            job_id=job_id,
            nodes=frozenset(str(n) for n in data.get("nodes") or []),
            layout=tuple(str(n) for n in layout) if isinstance(layout, list) else None,
            manifest_key=_key(data.get("manifest_key")),
        )
        with self._lock:
            self._jobs[job_id] = (nodes, now)
        self._save_cache()
        return nodes

    # -- plumbing ----------------------------------------------------------------------------
    def _call(self, method: str, path: str, *, missing_ok: bool = False, **kw: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise RegistryError(
                f"cannot reach the server at {redact_url(self.server)} for {path}: "
                f"{type(exc).__name__}"
            ) from None
        if missing_ok and resp.status_code in (403, 404):
            return None
        if resp.status_code != 200:
            raise RegistryError(
                f"the server answered {method} {path} with HTTP {resp.status_code}: "
                f"{resp.text[:300]}"
            )
        try:
            return resp.json()
        except ValueError:
            raise RegistryError(f"the server's answer to {path} is not JSON") from None

    def _load_cache(self) -> None:
        path = self.state_dir / CACHE_FILE
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        verifier = self.keys.verifier
        for token in data.get("peers", []):
            try:
                cert = verifier.verify_node_certificate(token)
            except CredentialError:
                continue
            self._peers[cert.node] = (cert, 0.0)  # stale: asked again, used meanwhile
        for job_id, j in dict(data.get("jobs") or {}).items():
            layout = j.get("layout")
            self._jobs[job_id] = (
                JobNodes(
                    job_id=job_id,
                    nodes=frozenset(j.get("nodes") or []),
                    layout=tuple(layout) if isinstance(layout, list) else None,
                    manifest_key=_key(j.get("manifest_key")),
                ),
                0.0,
            )

    def _save_cache(self) -> None:
        with self._lock:
            data = {
                "peers": [c.token for c, _ in self._peers.values()],
                "jobs": {
                    j: {
                        "nodes": sorted(v.nodes),
                        "layout": list(v.layout) if v.layout else None,
                        "manifest_key": b64url(v.manifest_key) if v.manifest_key else None,
                    }
                    for j, (v, _) in self._jobs.items()
                },
            }
        path = self.state_dir / CACHE_FILE
        try:  # it holds the jobs' manifest keys: readable by the agent's user only
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(data))
            os.chmod(tmp, 0o600)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot keep the registry cache in %s: %s", path, exc)

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

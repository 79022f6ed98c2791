"""The peer registry: node certificates, the peers an agent asks about, and a job's layout
as its agents may see it.

Peers authenticate as nodes (docs/security.md, "Peers: node certificates and the
registry"; the agent side is ``tierwatch.agent.peer_identity``). Each agent holds its own
Ed25519 key and asks the server, with its agent token, to certify it
(:func:`certify_node`): the server signs a node certificate (a JWT,
``tierwatch.agent.credentials.issue_node_certificate``) that names the token's node, never
one the request names, with the key and the URL the agent gave, and keeps it in
``peer_registry``, one row per node. Asking again (a renewal, a new key, a new URL)
replaces the row; a new node or a changed key or URL is audited (``peer_register``), a
plain renewal is not.

Other agents look peers up by node name (:func:`registered_peers`) and get the stored
certificate while it is valid: an expired one is never re-signed from the stored key and
URL (the server would vouch for a key the node may no longer hold), so a node that stops
renewing drops out of the registry when its certificate expires.

A job's registered nodes and pinned layout (``checkpoints.scoping``) are shown only to the
agents of those nodes (:func:`agent_job`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from tierwatch.agent import credentials as wire
from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import audit
from tierwatch.server.checkpoints import scoping
from tierwatch.server.checkpoints.models import Job
from tierwatch.server.credentials import service
from tierwatch.server.credentials.models import PeerRegistration
from tierwatch.server.credentials.peer_schemas import PeerCertificateIn

PEERS = PeerRegistration.__table__


class UnknownJobError(LookupError):
    """The job has no row, or has not registered (the message says what to do)."""


class NotInJobError(PermissionError):
    """The asking node is not one of the job's registered nodes."""


def certify_node(
    session: Session,
    *,
    node: str,
    url: str,
    public_key: str,
    ttl_s: float,
    actor: str,
    role: str = "agent",
    now: datetime | None = None,
) -> dict[str, Any]:
    """Issue a node certificate for ``node`` and store it in the registry (the caller
    commits).

    Args:
        session: open session.
        node: the node, from the agent token (never from the request body).
        url: the agent's advertised peer URL (``peer_schemas.check_peer_url``).
        public_key: the node's Ed25519 public key, base64url of the raw 32 bytes.
        ttl_s: the certificate's lifetime (seconds, > 0).
        actor, role: who asks (audit log).
        now: issue time (default: now).

    Returns:
        ``{node, url, certificate, expires_at}`` (``PeerOut``).

    Raises:
        pydantic.ValidationError: a malformed key or URL (each with what to fix).
        tierwatch.agent.credentials.CredentialError: ``ttl_s`` is not positive.
    """
    request = PeerCertificateIn.model_validate({"public_key": public_key, "url": url})
    now = now or utcnow()
    key = service.signing_key(session, now=now)
    certificate, expires = wire.issue_node_certificate(
        service._private_key(key),
        kid=key.kid,
        node=node,
        url=request.url,
        node_public_key=request.public_key,
        ttl_s=ttl_s,
        now=now.timestamp(),
    )
    expires_at = datetime.fromtimestamp(expires, UTC)
    query = select(PEERS.c.url, PEERS.c.public_key).where(PEERS.c.node_name == node)
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        query = query.with_for_update()  # one renewal of a node at a time; audit sees the last
    previous = session.execute(query).first()
    values = {
        "node_name": node,
        "url": request.url,
        "public_key": request.public_key,
        "certificate": certificate,
        "kid": key.kid,
        "certificate_expires_at": expires_at,
        "registered_at": now,
        "updated_at": now,
        "updated_by": actor[:128],
    }
    insert_fn = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = insert_fn(PEERS).values(**values)
    stmt = stmt.on_conflict_do_update(
        index_elements=[PEERS.c.node_name],
        set_={k: stmt.excluded[k] for k in values if k not in ("node_name", "registered_at")},
    )
    session.execute(stmt)
    changed = previous is None or (previous.url, previous.public_key) != (
        request.url,
        request.public_key,
    )
    if changed:
        audit.record(
            session,
            actor=actor,
            role=role,
            action="peer_register",
            target_kind="node",
            target=node,
            outcome="ok",
            now=now,
            detail={
                "url": request.url,
                "public_key": request.public_key,
                "expires_at": expires_at.isoformat(),
                "kid": key.kid,
                "previous": None
                if previous is None
                else {"url": previous.url, "public_key": previous.public_key},
            },
        )
    return {"node": node, "url": request.url, "certificate": certificate, "expires_at": expires_at}


def registered_peers(
    session: Session, *, nodes: Sequence[str], now: datetime | None = None
) -> list[dict[str, Any]]:
    """The registry entries of ``nodes`` whose certificate is still valid, in the order
    asked (duplicates once); a node that never registered, or whose certificate expired,
    is absent.

    Returns:
        ``[{node, url, certificate, expires_at}, ...]`` (``PeerOut``).
    """
    wanted = list(dict.fromkeys(nodes))
    if not wanted:
        return []
    now = now or utcnow()
    rows = session.execute(
        select(
            PEERS.c.node_name, PEERS.c.url, PEERS.c.certificate, PEERS.c.certificate_expires_at
        ).where(PEERS.c.node_name.in_(wanted), PEERS.c.certificate_expires_at > now)
    )
    found = {r.node_name: r for r in rows}
    return [
        {
            "node": n,
            "url": found[n].url,
            "certificate": found[n].certificate,
            "expires_at": found[n].certificate_expires_at,
        }
        for n in wanted
        if n in found
    ]


def agent_job(session: Session, *, job_id: str, node: str) -> dict[str, Any]:
    """A registered job's nodes, pinned world size, pinned layout and manifest key, for one
    of its nodes' agents (``checkpoints.scoping.pinned_world_size`` / ``pinned_layout``).

    Raises:
        UnknownJobError: no such job, or it has not registered.
        NotInJobError: ``node`` is not one of the job's registered nodes (an agent sees
            only the jobs that run on its node).
    """
    job = session.scalar(select(Job).where(Job.job_id == job_id))
    row = (
        None
        if job is None
        else {
            "registered_at": job.registered_at,
            "registered_nodes": job.registered_nodes,
            "registered_world_size": job.registered_world_size,
            "layout": job.layout,
        }
    )
    if not scoping.is_registered(row):
        raise UnknownJobError(
            f"job {job_id!r} is not registered: its launcher registers it before its ranks "
            f"start (POST /api/v1/jobs/{job_id}/credential)"
        )
    nodes = list(row["registered_nodes"]) if row else []
    if node not in nodes:
        raise NotInJobError(
            f"node {node!r} is not one of job {job_id!r}'s registered nodes: an agent may "
            "see only the jobs that run on its node"
        )
    key = service.signing_key(session)
    manifest_key = wire.job_manifest_key(wire.b64url_decode(key.job_secret), job_id)
    return {
        "job_id": job_id,
        "nodes": nodes,
        "world_size": scoping.pinned_world_size(row),
        "layout": scoping.pinned_layout(row),
        "manifest_key": wire.b64url(manifest_key),
    }

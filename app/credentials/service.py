"""The server's signing key, job registration and the public key set.

The credential format and its checks are ``tierwatch.agent.credentials`` (shared with the
agents); this module keeps the key and the job secret in the database and registers jobs.

The signing key is made on first use (:func:`signing_key`): row id 1 of ``signing_keys``,
inserted with ``ON CONFLICT DO NOTHING`` and read back, so two server processes that start
at once agree on one key and one job secret (the second insert conflicts on the primary key
and reads the first's row). Its ``kid`` is the RFC 7638 thumbprint of the public key.

Registering a job (:func:`register_job`) pins the nodes whose agents may report for it, and
its world size and layout when given (``checkpoints.scoping``), and issues a job credential.
Registering again (the job's own restart) replaces nodes, world size and layout and issues a
new credential with the same secret (it is derived from the job id).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from datetime import UTC, datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_pem_private_key,
    load_pem_public_key,
)
from sqlalchemy import select
from sqlalchemy.orm import Session

from tierwatch.agent import credentials as wire
from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import audit
from tierwatch.server.checkpoints.models import Job
from tierwatch.server.checkpoints.service import JOB_ID_RE
from tierwatch.server.credentials.models import SigningKey
from tierwatch.server.credentials.schemas import JobCredentialIn
from tierwatch.server.db import insert_ignore

#: ``signing_keys.id`` of the key that signs job credentials.
SIGNING_KEY_ID = 1
AUDIT_NODES_SHOWN = 64


class RegistrationError(ValueError):
    """A registration that cannot be made (the message says what to fix)."""


def thumbprint(public_key: Ed25519PublicKey) -> str:
    """RFC 7638 JWK thumbprint (SHA-256, base64url) of an Ed25519 public key."""
    x = wire.b64url(public_key.public_bytes(Encoding.Raw, PublicFormat.Raw))
    canonical = json.dumps({"crv": "Ed25519", "kty": "OKP", "x": x}, separators=(",", ":"))
    return wire.b64url(hashlib.sha256(canonical.encode()).digest())


def _new_key_row(now: datetime) -> dict[str, Any]:
    private = Ed25519PrivateKey.generate()
    public = private.public_key()
    return {
        "id": SIGNING_KEY_ID,
        "kid": thumbprint(public),
        "algorithm": wire.ALGORITHM,
        "private_key": private.private_bytes(
            Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()
        ).decode(),
        "public_key": public.public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo).decode(),
        "job_secret": wire.b64url(secrets.token_bytes(wire.SECRET_BYTES)),
        "created_at": now,
    }


def signing_key(session: Session, *, now: datetime | None = None) -> SigningKey:
    """The key that signs job credentials, made on first use (the caller commits).

    Safe when two server processes make it at once: the row has a fixed id, so the second
    insert conflicts and reads the first's row.
    """
    query = select(SigningKey).where(SigningKey.id == SIGNING_KEY_ID)
    row = session.scalar(query)
    if row is None:
        insert_ignore(session, SigningKey.__table__, _new_key_row(now or utcnow()))
        row = session.scalar(query.execution_options(populate_existing=True))
        assert row is not None  # inserted by us, or by the process whose insert won
    return row


def _private_key(row: SigningKey) -> Ed25519PrivateKey:
    key = load_pem_private_key(row.private_key.encode(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise RuntimeError(f"signing key {row.kid} is not an Ed25519 key")
    return key


def _public_key(row: SigningKey) -> Ed25519PublicKey:
    key = load_pem_public_key(row.public_key.encode())
    if not isinstance(key, Ed25519PublicKey):
        raise RuntimeError(f"signing key {row.kid} is not an Ed25519 key")
    return key


def public_key_set(session: Session) -> dict[str, list[dict[str, str]]]:
    """The JWK set of the server's signing keys (``{"keys": [jwk, ...]}``; RFC 7517), made
    on first use. Agents check job credentials with it
    (``tierwatch.agent.credentials.CredentialVerifier.from_jwks``)."""
    signing_key(session)
    rows = session.scalars(select(SigningKey).order_by(SigningKey.id))
    return wire.jwks((r.kid, _public_key(r)) for r in rows)


def _lock_job(session: Session, job_id: str, now: datetime) -> Job:
    """The job's row, made if missing; locked until commit on PostgreSQL (a report being
    stored for the job waits, and then sees the new registration)."""
    insert_ignore(session, Job.__table__, {"job_id": job_id, "first_seen": now, "last_seen": now})
    query = select(Job).where(Job.job_id == job_id).execution_options(populate_existing=True)
    if session.get_bind().dialect.name == "postgresql":
        query = query.with_for_update()
    job = session.scalar(query)
    assert job is not None
    return job


def register_job(
    session: Session,
    *,
    job_id: str,
    nodes: list[str],
    world_size: int | None,
    layout: list[str] | None,
    ttl_s: float,
    actor: str,
    role: str = "operator",
    now: datetime | None = None,
) -> dict[str, Any]:
    """Register a job (or register it again) and issue its credential (the caller commits).

    Pins the job's nodes (only their agents may report for it), its world size (given, or
    the layout's length; kept as it was when neither is given, until rank 0's first layout
    pins it) and its layout (given, else none until rank 0's first layout report), and
    audits the registration (never the credential).

    Args:
        session: open session.
        job_id: the job (1-128 letters, digits, '.', '_' or '-', starting with a letter or
            digit).
        nodes: node names the job runs on (1 to 16,384; duplicates dropped).
        world_size: number of ranks, or None.
        layout: node per rank, or None; every entry one of ``nodes``.
        ttl_s: credential lifetime (seconds, 60 s to 366 days).
        actor, role: who registers (audit log).
        now: registration time (default: now).

    Returns:
        ``{job_id, credential, expires_at, nodes, world_size, layout}`` (``JobCredentialOut``).

    Raises:
        RegistrationError: a malformed job id.
        pydantic.ValidationError: invalid nodes, world size, layout or lifetime (each
            wrong field with what to fix).
    """
    if not JOB_ID_RE.match(job_id):
        raise RegistrationError(
            f"job id {job_id!r} is not valid: 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    request = JobCredentialIn.model_validate(
        {"nodes": nodes, "world_size": world_size, "layout": layout, "ttl_s": ttl_s}
    )
    assert request.ttl_s is not None
    now = now or utcnow()
    key = signing_key(session, now=now)
    job = _lock_job(session, job_id, now)
    previous = {
        "nodes": (job.registered_nodes or [])[:AUDIT_NODES_SHOWN],
        "world_size": job.registered_world_size,
        "registered_at": job.registered_at.isoformat() if job.registered_at else None,
    }
    pinned_size = request.effective_world_size
    job.registered_nodes = list(request.nodes)
    job.registered_world_size = pinned_size
    job.layout = list(request.layout) if request.layout is not None else None
    if pinned_size is not None:
        job.world_size = pinned_size
    job.registered_at = now
    job.registered_by = actor[:128]
    credential, expires = wire.issue_job_credential(
        _private_key(key),
        kid=key.kid,
        job_secret_key=wire.b64url_decode(key.job_secret),
        job_id=job_id,
        ttl_s=request.ttl_s,
        now=now.timestamp(),
    )
    expires_at = datetime.fromtimestamp(expires, UTC)
    job.credential_expires_at = expires_at
    audit.record(
        session,
        actor=actor,
        role=role,
        action="job_register",
        target_kind="job",
        target=job_id,
        outcome="ok",
        now=now,
        detail={
            "nodes": request.nodes[:AUDIT_NODES_SHOWN],
            "node_count": len(request.nodes),
            "world_size": pinned_size,
            "layout_given": request.layout is not None,
            "expires_at": expires_at.isoformat(),
            "kid": key.kid,
            "previous": previous if previous["registered_at"] else None,
        },
    )
    session.flush()
    return {
        "job_id": job_id,
        "credential": credential,
        "expires_at": expires_at,
        "nodes": list(request.nodes),
        "world_size": pinned_size,
        "layout": job.layout,
    }

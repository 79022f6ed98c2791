"""The server's signing keys (table ``signing_keys``, migration 0005) and the peer registry
(table ``peer_registry``, migration 0007).

Signing keys: one row per key. The row with ``id`` 1 is created on first use
(``service.signing_key``) and signs every job credential; ``job_secret`` derives each job's
secret (``tierwatch.agent.credentials.derive_job_secret``), so it must never change while
jobs use the secrets derived from it (their manifests are signed with keys derived from them).
The same key signs node certificates.

Peer registry: one row per node whose agent asked for a node certificate
(``POST /api/v1/agent/peer-certificate``).
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from tierwatch.server.db import Base, UTCDateTime


class SigningKey(Base):
    """An Ed25519 signing key and the job secret issued with it.

    Attributes:
        kid: key id (JWT header ``kid``, JWK ``kid``): the RFC 7638 thumbprint of the
            public key, unique.
        algorithm: ``EdDSA``.
        private_key: PKCS#8 PEM of the private key (unencrypted: whoever reads the database
            can issue credentials; protect it and its backups as you do the tokens' table).
        public_key: SubjectPublicKeyInfo PEM of the public key.
        job_secret: base64url (no padding) of 32 random bytes.
        created_at: when the key was made (UTC).
    """

    __tablename__ = "signing_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kid: Mapped[str] = mapped_column(String(64), unique=True)
    algorithm: Mapped[str] = mapped_column(String(16))
    private_key: Mapped[str] = mapped_column(Text)
    public_key: Mapped[str] = mapped_column(Text)
    job_secret: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)


class PeerRegistration(Base):
    """A node's entry in the peer registry (table ``peer_registry``, migration 0007): the
    key its agent signs peer requests with, the URL other agents reach it at, and the node
    certificate the server issued for them (``credentials.peers.certify_node``).

    One row per node, written only with that node's agent token (the node is the token's,
    never the request's). Peers are handed the stored certificate while it is valid
    (``certificate_expires_at``); an agent renews it by asking again.

    Attributes:
        node_name: the node (the agent token's ``node``; names as in ``app/fleet``).
        url: the agent's advertised peer URL (``http(s)://host:port``), as certified.
        public_key: the node's Ed25519 public key, raw 32 bytes in base64url (no padding).
        certificate: the node certificate issued for ``url`` and ``public_key`` (a JWT
            signed by the server, ``tierwatch.agent.credentials.issue_node_certificate``).
        kid: the id of the signing key that signed it.
        certificate_expires_at: its expiry (UTC).
        registered_at: when the node first registered (UTC).
        updated_at: when the certificate was last issued (UTC).
        updated_by: the actor (``token:<id>@<node>``) that asked for it.
    """

    __tablename__ = "peer_registry"

    node_name: Mapped[str] = mapped_column(String(253), primary_key=True)
    url: Mapped[str] = mapped_column(Text)
    public_key: Mapped[str] = mapped_column(String(64))
    certificate: Mapped[str] = mapped_column(Text)
    kid: Mapped[str] = mapped_column(String(64))
    certificate_expires_at: Mapped[datetime] = mapped_column(UTCDateTime)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime)
    updated_by: Mapped[str] = mapped_column(String(128))

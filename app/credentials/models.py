"""The server's signing keys (table ``signing_keys``, migration 0005).

One row per key. The row with ``id`` 1 is created on first use (``service.signing_key``)
and signs every job credential; ``job_secret`` derives each job's secret
(``tierwatch.agent.credentials.derive_job_secret``), so it must never change while jobs
use the secrets derived from it (their manifests are signed with keys derived from them).
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

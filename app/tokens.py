"""API tokens: random, shown once, stored only as a SHA-256 hash.

Roles: ``viewer`` (read), ``operator`` (+ actions), ``admin`` (+ tokens, settings), and
``agent`` (report for its own node only; bound to a node name).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import datetime
from typing import Literal

from sqlalchemy import ForeignKey, Index, Integer, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from tierwatch.agent.protocol import NODE_NAME_PATTERN, utcnow
from tierwatch.server.db import Base, UTCDateTime

Role = Literal["viewer", "operator", "admin", "agent"]
ROLES: tuple[Role, ...] = ("viewer", "operator", "admin", "agent")
TOKEN_PREFIX = "tw_"
# session.info key: hashes of the tokens this session revoked (the token cache of every
# resolver in this process drops them when the session commits; see security.TokenResolver).
REVOKED_HASHES_KEY = "tierwatch_revoked_token_hashes"


class ApiToken(Base):
    """A bearer token. ``node_name`` binds an agent token to one node."""

    __tablename__ = "api_tokens"
    __table_args__ = (Index("ix_api_tokens_hash", "token_hash", unique=True),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16))
    node_name: Mapped[str | None] = mapped_column(String(128))
    label: Mapped[str] = mapped_column(String(200), default="")
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_by: Mapped[int | None] = mapped_column(ForeignKey("api_tokens.id"))


class TokenError(ValueError):
    """A token request that cannot be honoured; the message says what to fix."""


def hash_token(token: str) -> str:
    """SHA-256 hex digest of a token (tokens carry 256 bits of randomness; no salt needed)."""
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(
    session: Session, *, role: str, node: str | None = None, label: str = ""
) -> tuple[str, ApiToken]:
    """Create a token and return ``(plaintext, row)``; only the hash is stored.

    Raises:
        TokenError: unknown role, an agent token without a node, a node name that is not a
            valid node name, or a node given for a non-agent role.
    """
    if role not in ROLES:
        raise TokenError(f"unknown role {role!r}: choose one of {', '.join(ROLES)}")
    if role == "agent":
        if not node:
            raise TokenError("an agent token must be bound to a node: pass --node NAME")
        if not re.fullmatch(NODE_NAME_PATTERN, node):
            raise TokenError(
                f"invalid node name {node!r}: use letters, digits, '.', '_' or '-' (max 128)"
            )
    elif node:
        raise TokenError(f"--node only applies to agent tokens, not to role {role!r}")
    plaintext = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(
        token_hash=hash_token(plaintext),
        role=role,
        node_name=node,
        label=label,
        created_at=utcnow(),
    )
    session.add(row)
    session.flush()
    return plaintext, row


def lookup_token(session: Session, plaintext: str) -> ApiToken | None:
    """The live (not revoked) token row for a plaintext token, or None."""
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(plaintext)))
    if row is None or row.revoked_at is not None:
        return None
    return row


def list_tokens(session: Session) -> list[ApiToken]:
    """All tokens, newest first (hashes only; plaintext is never stored)."""
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id.desc())))


def revoke_token(session: Session, token_id: int) -> ApiToken:
    """Revoke a token by id. Once the session commits, the token stops working at once in
    this process (cached lookups are dropped); other server processes refuse it for
    state-changing requests at once and for reads within ``token_cache_s``.

    Raises:
        TokenError: no token has that id.
    """
    row = session.get(ApiToken, token_id)
    if row is None:
        raise TokenError(f"no token with id {token_id}: see `tierwatch-server token list`")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    session.info.setdefault(REVOKED_HASHES_KEY, set()).add(row.token_hash)
    return row

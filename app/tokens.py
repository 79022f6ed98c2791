"""API tokens: random, shown once, stored only as a SHA-256 hash.

Roles: ``viewer`` (read), ``operator`` (+ actions), ``admin`` (+ tokens, settings), and
``agent`` (report for its own node only, and nothing else: bound to a node name, it reads
nothing). A token may expire (``expires_at``); an expired token is refused like a revoked
one, with a message that says it expired.
"""

from __future__ import annotations

import hashlib
import math
import re
import secrets
from datetime import datetime, timedelta
from typing import Literal

from sqlalchemy import ForeignKey, Index, Integer, String, delete, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from tierwatch.agent.protocol import NODE_NAME_PATTERN, utcnow
from tierwatch.server.db import Base, UTCDateTime
from tierwatch.server.web.sessions import end_token_sessions

Role = Literal["viewer", "operator", "admin", "agent"]
ROLES: tuple[Role, ...] = ("viewer", "operator", "admin", "agent")
TOKEN_PREFIX = "tw_"
#: The longest expiry a token may be given (seconds; 100 years: beyond that, give none).
MAX_EXPIRES_IN_S = 100 * 365 * 86400
# session.info key: hashes of the tokens this session revoked (the token cache of every
# resolver in this process drops them when the session commits; see security.TokenResolver).
REVOKED_HASHES_KEY = "tierwatch_revoked_token_hashes"


class ApiToken(Base):
    """A bearer token. ``node_name`` binds an agent token to one node; ``expires_at`` (UTC,
    optional) is when it stops working."""

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
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    def expired(self, now: datetime) -> bool:
        """Whether the token has expired by ``now``."""
        return is_expired(self.expires_at, now)

    def status(self, now: datetime) -> str:
        """``active``, ``revoked`` or ``expired``."""
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if self.expired(now) else "active"


class TokenError(ValueError):
    """A token request that cannot be honoured; the message says what to fix."""


def is_expired(expires_at: datetime | None, now: datetime) -> bool:
    """Whether a token with this expiry (None: never) has expired by ``now``."""
    return expires_at is not None and expires_at <= now


_DURATION_RE = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[smhdw]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``3600``, ``90s``, ``15m``, ``12h``, ``30d`` or ``2w``.

    Raises:
        TokenError: not a positive number with an optional unit s, m, h, d or w.
    """
    match = _DURATION_RE.fullmatch(text.strip().lower())
    seconds = float(match["n"]) * _UNIT_S[match["unit"]] if match else 0.0
    if not match or seconds <= 0 or not math.isfinite(seconds):
        raise TokenError(
            f"invalid duration {text!r}: give a positive number of seconds or a number with "
            "a unit, e.g. 90m, 12h, 30d, 2w"
        )
    return seconds


def hash_token(token: str) -> str:
    """SHA-256 hex digest of a token (tokens carry 256 bits of randomness; no salt needed)."""
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(
    session: Session,
    *,
    role: str,
    node: str | None = None,
    label: str = "",
    expires_in_s: float | None = None,
) -> tuple[str, ApiToken]:
    """Create a token and return ``(plaintext, row)``; only the hash is stored.

    Args:
        expires_in_s: the token stops working this many seconds from now (None: never).

    Raises:
        TokenError: unknown role, an agent token without a node, a node name that is not a
            valid node name, a node given for a non-agent role, or an expiry that is not a
            positive number of seconds.
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
    if expires_in_s is not None and not 0 < expires_in_s <= MAX_EXPIRES_IN_S:
        raise TokenError(
            f"invalid expiry {expires_in_s!r} s: give a positive number of seconds up to "
            f"{MAX_EXPIRES_IN_S} (100 years), or no expiry"
        )
    plaintext = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = utcnow()
    row = ApiToken(
        token_hash=hash_token(plaintext),
        role=role,
        node_name=node,
        label=label,
        created_at=now,
        expires_at=None if expires_in_s is None else now + timedelta(seconds=expires_in_s),
    )
    session.add(row)
    session.flush()
    return plaintext, row


def find_token(session: Session, plaintext: str) -> ApiToken | None:
    """The token row for a plaintext token, live or not (see :meth:`ApiToken.status`), or
    None for an unknown token."""
    return session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_token(plaintext)))


def lookup_token(session: Session, plaintext: str) -> ApiToken | None:
    """The live (neither revoked nor expired) token row for a plaintext token, or None."""
    row = find_token(session, plaintext)
    if row is None or row.status(utcnow()) != "active":
        return None
    return row


def list_tokens(session: Session) -> list[ApiToken]:
    """All tokens, newest first (hashes only; plaintext is never stored)."""
    return list(session.scalars(select(ApiToken).order_by(ApiToken.id.desc())))


def token_actor(token_id: int, node: str | None) -> str:
    """How a token's caller appears in logs, the audit trail and ``updated_by`` columns:
    ``token:<id>`` or, for a node-bound token, ``token:<id>@<node>``."""
    return f"token:{token_id}" + (f"@{node}" if node else "")


def revoke_token(session: Session, token_id: int) -> ApiToken:
    """Revoke a token by id, end its dashboard sessions and, for an agent token, remove the
    peer registry entry it certified. Once the session commits, the
    token stops working at once in this process (cached lookups are dropped) and its
    dashboard sessions end at once everywhere; other server processes refuse the token for
    state-changing requests at once and for reads within ``token_cache_s``.

    Raises:
        TokenError: no token has that id.
    """
    row = session.get(ApiToken, token_id)
    if row is None:
        raise TokenError(f"no token with id {token_id}: see `tierwatch-server token list`")
    if row.revoked_at is None:
        row.revoked_at = utcnow()
    end_token_sessions(session, row.id)
    if row.role == "agent" and row.node_name:
        # the node's peer registry entry, when this token certified it: peers are no longer
        # handed its URL and certificate (the certificate itself stays valid until it
        # expires: docs/security.md "Known gaps")
        from tierwatch.server.credentials.models import PeerRegistration

        session.execute(
            delete(PeerRegistration).where(
                PeerRegistration.node_name == row.node_name,
                PeerRegistration.updated_by == token_actor(row.id, row.node_name),
            )
        )
    session.info.setdefault(REVOKED_HASHES_KEY, set()).add(row.token_hash)
    return row

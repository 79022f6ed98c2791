"""Dashboard sessions kept on the server: the cookie carries an opaque id, never a token.

Signing in creates a :class:`WebSession` row for the API token that signed in and puts a
random session id (256 bits, ``secrets.token_urlsafe(32)``) into the signed session cookie;
the database keeps only its SHA-256 hash, as it does for API tokens. Every request made with
the cookie looks the row up (no cache), so a session ends at once, in every server process,
when

- its user signs out (the row is deleted: a copy of the cookie is worth nothing),
- its API token is revoked (``revoke_token`` deletes the token's rows, and the lookup
  refuses a revoked token's sessions anyway, whichever process revoked it),
- its API token expires, or
- it is ``TIERWATCH_SESSION_TTL_S`` old (default 12 h). The lifetime is absolute, counted
  from the sign-in, not from the last request: an open dashboard polls every few seconds,
  so an idle timeout would never end a session left open on a screen.

Expired rows are deleted at the next sign-in (they can no longer authenticate anything).
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta

from sqlalchemy import ForeignKey, Index, Integer, String, delete
from sqlalchemy.orm import Mapped, Session, mapped_column

from tierwatch.server.db import Base, UTCDateTime


class WebSession(Base):
    """One signed-in dashboard session of the API token ``token_id``.

    Attributes:
        id_hash: SHA-256 hex digest of the session id the cookie holds.
        token_id: the API token that signed in (its role is the session's role).
        created_at: the sign-in (UTC).
        expires_at: when the session ends: ``created_at`` + the session lifetime, or the
            token's own expiry when that comes first (UTC).
    """

    __tablename__ = "web_sessions"
    __table_args__ = (
        Index("ix_web_sessions_id_hash", "id_hash", unique=True),
        Index("ix_web_sessions_token_id", "token_id"),
        Index("ix_web_sessions_expires_at", "expires_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    id_hash: Mapped[str] = mapped_column(String(64))
    token_id: Mapped[int] = mapped_column(ForeignKey("api_tokens.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


def hash_session_id(session_id: str) -> str:
    """SHA-256 hex digest of a session id (256 random bits: no salt needed)."""
    return hashlib.sha256(session_id.encode()).hexdigest()


def start_session(
    session: Session,
    *,
    token_id: int,
    ttl_s: float,
    now: datetime,
    token_expires_at: datetime | None = None,
) -> str:
    """Create a session for ``token_id`` and return its id (for the cookie; only its hash
    is stored). It lasts ``ttl_s`` seconds, or until ``token_expires_at`` if that is sooner.

    Expired sessions of every token are deleted on the way.
    """
    prune_expired(session, now=now)
    session_id = secrets.token_urlsafe(32)
    expires_at = now + timedelta(seconds=ttl_s)
    if token_expires_at is not None:
        expires_at = min(expires_at, token_expires_at)
    session.add(
        WebSession(
            id_hash=hash_session_id(session_id),
            token_id=token_id,
            created_at=now,
            expires_at=expires_at,
        )
    )
    session.flush()
    return session_id


def end_session(session: Session, session_id: str) -> None:
    """Delete the session with this id (signing out); an unknown id is a no-op."""
    session.execute(delete(WebSession).where(WebSession.id_hash == hash_session_id(session_id)))


def end_token_sessions(session: Session, token_id: int) -> None:
    """Delete every session of the API token ``token_id`` (it was revoked)."""
    session.execute(delete(WebSession).where(WebSession.token_id == token_id))


def prune_expired(session: Session, *, now: datetime) -> None:
    """Delete the sessions that have expired by ``now``."""
    session.execute(delete(WebSession).where(WebSession.expires_at <= now))

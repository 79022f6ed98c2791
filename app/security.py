"""Who is calling: bearer tokens and dashboard sessions resolved to a :class:`Principal`.

Routes declare what they need with the ``Annotated`` aliases at the bottom
(``ReaderDep``, ``AgentDep``, ``OperatorDep``…), so a new role check is one alias.
Agent tokens may only report (``AgentDep``): every read (``ReaderDep``) needs a viewer,
operator or admin token, and refuses an agent token with 403.

The dashboard's cookie holds an opaque session id (:mod:`tierwatch.server.web.sessions`),
never a token: each request made with it looks the session up in the database.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from sqlalchemy import Engine, Index, Integer, Row, String, delete, event, func, select
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker
from starlette.concurrency import run_in_threadpool

from tierwatch.agent.protocol import utcnow
from tierwatch.server.db import Base, UTCDateTime
from tierwatch.server.tokens import (
    REVOKED_HASHES_KEY,
    ApiToken,
    hash_token,
    is_expired,
    token_actor,
)
from tierwatch.server.web.csrf import CsrfError, verify_csrf
from tierwatch.server.web.sessions import WebSession, hash_session_id

ROLE_RANK = {"viewer": 1, "operator": 2, "admin": 3}
#: The signed cookie's key for the dashboard session id (see web/sessions.py).
SESSION_ID_KEY = "sid"
#: Where cookies from before server-side sessions kept the plaintext token: dropped on sight.
LEGACY_SESSION_TOKEN_KEY = "token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: What an agent token is for: the refusal of everything else names it.
AGENT_ONLY = "agent tokens may only report for their own node (POST /api/v1/ingest/report)"


@dataclass(frozen=True)
class Principal:
    """The authenticated caller.

    Attributes:
        token_id: id of the token that authenticated the request.
        role: viewer | operator | admin | agent.
        node: for agent tokens, the only node the caller may report for.
        via: "bearer" or "session".
    """

    token_id: int
    role: str
    node: str | None
    via: str

    @property
    def actor(self) -> str:
        """How this caller appears in logs and the audit trail."""
        return token_actor(self.token_id, self.node)

    def has_role(self, minimum: str) -> bool:
        """True when the caller's role is at least ``minimum`` (agents rank below viewers)."""
        return ROLE_RANK.get(self.role, 0) >= ROLE_RANK[minimum]


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(
        status_code=status.HTTP_401_UNAUTHORIZED,
        detail=detail,
        headers={"WWW-Authenticate": "Bearer"},
    )


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization")
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise _unauthorized("malformed Authorization header: use 'Authorization: Bearer <token>'")
    return value.strip()


class TokenResolver:
    """Resolves tokens to (id, role, node, expires_at), remembering live tokens for ``ttl_s``
    seconds, and dashboard session ids to the same (never cached).

    Each lookup is one indexed Core query on a connection held only for that query, so a
    request never keeps a pooled connection while it waits (e.g. for the ingest writer):
    that is what kept a burst of reports from deadlocking the pool. Unknown tokens are
    never cached.

    Revocation: a token revoked with :func:`~tierwatch.server.tokens.revoke_token` in this
    process is dropped from every resolver's cache when that session commits, so it stops
    working at once. A revocation by another process (``tierwatch-server token revoke``)
    cannot reach this cache: state-changing requests by people are therefore always checked
    against the database (see :func:`_cached_row`), and reads with a revoked token
    stop within ``ttl_s`` (0 disables the cache).

    Expiry: a cached row carries the token's ``expires_at``, which :func:`_principal` checks
    on every request, so the cache never accepts a token past its expiry.

    Sessions: :meth:`lookup_session` always asks the database, so signing out, a
    revocation or an expiry ends a session at once in every process.
    """

    MAX_ENTRIES = 100_000

    def __init__(self, engine: Engine, ttl_s: float) -> None:
        self._engine = engine
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[float, Row[Any]]] = {}
        # Bumped by every forget(): a lookup that raced a revocation does not cache its row.
        self._generation = 0
        self._lock = threading.Lock()
        _RESOLVERS.add(self)

    def cached(self, token: str) -> Row[Any] | None:
        """The remembered ``(id, role, node_name, expires_at)`` of ``token``, or None (not
        cached)."""
        hit = self._cache.get(hash_token(token))
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def lookup(self, token: str, *, fresh: bool = False) -> Row[Any] | None:
        """``(id, role, node_name, expires_at)`` of the unrevoked token ``token``, or None
        (unknown/revoked). An expired token is returned (its caller refuses it, saying so).

        Blocking (may query the database); the cache answers when it can, unless ``fresh``
        (then the database always does, and the cache is refreshed from its answer).
        """
        key = hash_token(token)
        now = time.monotonic()
        if not fresh:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        generation = self._generation
        with self._engine.connect() as conn:
            row = conn.execute(
                select(ApiToken.id, ApiToken.role, ApiToken.node_name, ApiToken.expires_at).where(
                    ApiToken.token_hash == key, ApiToken.revoked_at.is_(None)
                )
            ).first()
        with self._lock:
            if row is None:
                self._cache.pop(key, None)
            elif self._ttl_s > 0 and generation == self._generation:
                if len(self._cache) >= self.MAX_ENTRIES:
                    self._cache.clear()
                self._cache[key] = (now + self._ttl_s, row)
        return row

    def lookup_session(self, session_id: str) -> Row[Any] | None:
        """``(id, role, node_name, expires_at)`` of the token of the live dashboard session
        ``session_id``, or None (unknown, signed out, expired, or its token revoked or
        expired). Blocking: one indexed query, never cached.
        """
        now = utcnow()
        with self._engine.connect() as conn:
            return conn.execute(
                select(ApiToken.id, ApiToken.role, ApiToken.node_name, ApiToken.expires_at)
                .join(WebSession, WebSession.token_id == ApiToken.id)
                .where(
                    WebSession.id_hash == hash_session_id(session_id),
                    WebSession.expires_at > now,
                    ApiToken.revoked_at.is_(None),
                    ApiToken.expires_at.is_(None) | (ApiToken.expires_at > now),
                )
            ).first()

    def forget(self, token_hashes: Iterable[str] | None = None) -> None:
        """Drop the cached tokens with these SHA-256 hashes (all of them for None), e.g.
        after a revocation in this process."""
        with self._lock:
            self._generation += 1
            if token_hashes is None:
                self._cache.clear()
            else:
                for key in token_hashes:
                    self._cache.pop(key, None)


_RESOLVERS: weakref.WeakSet[TokenResolver] = weakref.WeakSet()


@event.listens_for(Session, "after_commit")
def _forget_revoked_tokens(session: Session) -> None:
    """Drop tokens revoked by this session's transaction from every resolver's cache."""
    revoked = session.info.pop(REVOKED_HASHES_KEY, None)
    if revoked:
        for resolver in list(_RESOLVERS):
            resolver.forget(revoked)


@event.listens_for(Session, "after_rollback")
def _keep_unrevoked_tokens(session: Session) -> None:
    """A rolled-back revocation revoked nothing."""
    session.info.pop(REVOKED_HASHES_KEY, None)


def _credentials(request: Request) -> tuple[str, str] | None:
    """(token, "bearer") or (session id, "session") from the request, or None when it
    carries neither."""
    token = _bearer(request)
    if token is not None:
        return token, "bearer"
    if "session" not in request.scope:
        return None
    if LEGACY_SESSION_TOKEN_KEY in request.session:
        # A cookie from before server-side sessions: it held the token itself. Drop it (the
        # browser gets a cookie without it) and let that browser sign in again.
        request.session.clear()
        return None
    session_id = request.session.get(SESSION_ID_KEY)
    return (session_id, "session") if isinstance(session_id, str) and session_id else None


def _principal(request: Request, via: str, row: Row[Any] | None) -> Principal | None:
    if row is None:
        if via == "session":
            request.session.clear()
            return None
        raise _unauthorized("unknown or revoked token")
    if is_expired(row.expires_at, utcnow()):
        if via == "session":  # (lookup_session does not return expired tokens)
            request.session.clear()
            return None
        raise _unauthorized(
            f"this token expired at {row.expires_at.isoformat()}: create a new one with "
            "`tierwatch-server token create` (see --expires-in)"
        )
    return Principal(token_id=row.id, role=row.role, node=row.node_name, via=via)


def _cached_row(request: Request, resolver: TokenResolver, token: str) -> Row[Any] | None:
    """The cached row of ``token`` when the cache may answer this request, else None.

    A state-changing request by a person (viewer, operator, admin) is never answered from
    the cache, so a token revoked by another process (the CLI) cannot change anything once
    the revocation is committed. Agent reports keep the cache: they are the hot path, and
    an agent token can only report for its own node (revoked, it stops within ``ttl_s``).
    """
    row = resolver.cached(token)
    if row is not None and request.method not in SAFE_METHODS and row.role != "agent":
        return None
    return row


def principal_from_request(request: Request) -> Principal | None:
    """The caller from a bearer token or the dashboard session cookie, or None (blocking).

    Raises:
        HTTPException: 401 for a malformed header or an unknown, revoked or expired bearer
            token.
    """
    creds = _credentials(request)
    if creds is None:
        return None
    resolver: TokenResolver = request.app.state.token_resolver
    if creds[1] == "session":
        return _principal(request, "session", resolver.lookup_session(creds[0]))
    row = _cached_row(request, resolver, creds[0])
    if row is None:
        row = resolver.lookup(creds[0], fresh=True)
    return _principal(request, creds[1], row)


async def optional_principal(request: Request) -> Principal | None:
    """Dependency form of :func:`principal_from_request`: answered on the event loop when the
    token is cached (and the cache may answer, see :func:`_cached_row`), on a worker thread
    when it must be looked up (a dashboard session always is).

    Raises:
        HTTPException: 401 for a malformed header or an unknown, revoked or expired bearer
            token.
    """
    creds = _credentials(request)
    if creds is None:
        return None
    resolver: TokenResolver = request.app.state.token_resolver
    if creds[1] == "session":
        row = await run_in_threadpool(resolver.lookup_session, creds[0])
        return _principal(request, "session", row)
    row = _cached_row(request, resolver, creds[0])
    if row is None:
        row = await run_in_threadpool(resolver.lookup, creds[0], fresh=True)
    return _principal(request, creds[1], row)


async def current_principal(
    request: Request,
    principal: Annotated[Principal | None, Depends(optional_principal)],
) -> Principal:
    """Any authenticated caller.

    A state-changing API request authenticated by the dashboard's session cookie (not a
    bearer token) must carry the session's CSRF token too (``X-CSRF-Token``), as the
    dashboard's own forms do; otherwise another page could make a signed-in browser act.

    Raises:
        HTTPException: 401 without credentials; 403 for a cookie-authenticated
            state-changing request without the session's CSRF token.
    """
    if principal is None:
        raise _unauthorized("authentication required: send 'Authorization: Bearer <token>'")
    if principal.via == "session" and request.method not in SAFE_METHODS:
        try:
            await verify_csrf(request)
        except CsrfError as exc:
            raise HTTPException(
                status_code=status.HTTP_403_FORBIDDEN,
                detail="a state-changing request signed in with the dashboard cookie needs "
                "the session's CSRF token in the X-CSRF-Token header; scripts should send "
                "'Authorization: Bearer <token>' instead",
            ) from exc
    return principal


PrincipalDep = Annotated[Principal, Depends(current_principal)]


def role_refusal(role: str, minimum: str) -> str:
    """Why a caller with ``role`` may not do what needs ``minimum`` (what to use instead)."""
    roles = [r for r, rank in ROLE_RANK.items() if rank >= ROLE_RANK[minimum]]
    allowed = " or ".join([", ".join(roles[:-1]), roles[-1]] if len(roles) > 1 else roles)
    if role == "agent":
        article = "an" if allowed[0] in "aeiou" else "a"
        return f"{AGENT_ONLY}; this needs {article} {allowed} token"
    return f"this action needs the {minimum} role; your token has {role}"


def require_role(minimum: str):  # noqa: ANN201 - returns a FastAPI dependency
    """Dependency factory: the caller must hold ``minimum`` or a higher role (agent tokens
    hold none: they rank below viewers).

    Raises:
        HTTPException: 403 when the role is too low (an agent token's refusal says what
            agent tokens are for).
    """

    async def dependency(principal: PrincipalDep) -> Principal:
        if not principal.has_role(minimum):
            raise HTTPException(
                status_code=status.HTTP_403_FORBIDDEN,
                detail=role_refusal(principal.role, minimum),
            )
        return principal

    return dependency


async def require_agent(principal: PrincipalDep) -> Principal:
    """The caller must be an agent token (its node is checked against the payload later).

    Raises:
        HTTPException: 403 for a non-agent token.
    """
    if principal.role != "agent":
        raise HTTPException(
            status_code=status.HTTP_403_FORBIDDEN,
            detail=f"only agent tokens may report; your token has role {principal.role}",
        )
    return principal


ReaderDep = Annotated[Principal, Depends(require_role("viewer"))]  # people only: no agents
AgentDep = Annotated[Principal, Depends(require_agent)]
OperatorDep = Annotated[Principal, Depends(require_role("operator"))]
AdminDep = Annotated[Principal, Depends(require_role("admin"))]


# --- error answers in the OpenAPI schema -------------------------------------------------------


class ErrorOut(BaseModel):
    """An error answer: ``detail`` says what went wrong and what to do."""

    detail: str


class FieldErrorOut(BaseModel):
    """One invalid field of a request (``field`` is its path, e.g. ``body.samples.0.ts``)."""

    field: str
    message: str
    type: str | None = None


class ValidationErrorOut(BaseModel):
    """A 422 answer: a one-line summary and each invalid field (see ``main._validation_error``)."""

    detail: str
    errors: list[FieldErrorOut]


def invalid_request(loc: tuple[str | int, ...], message: str) -> RequestValidationError:
    """A 422 about one field (``loc`` like ``("query", "since")``) in the same shape as the
    app's other validation errors (:class:`ValidationErrorOut`); raise it from a route."""
    return RequestValidationError([{"loc": loc, "msg": message, "type": "value_error"}])


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for the error codes a route answers with, e.g.
    ``APIRouter(responses=error_responses(401, 422))`` or ``@router.get(...,
    responses=error_responses(404))``. 422 documents the app's own validation-error shape
    (FastAPI would otherwise list its default ``HTTPValidationError``, which this app never
    sends)."""
    descriptions = {
        400: "the body could not be read (e.g. it is not UTF-8)",
        401: "no token, or an unknown, revoked or expired one",
        403: "the token's role (or node) does not allow this (agent tokens may only report)",
        404: "the named object does not exist",
        409: "the request conflicts with the current state",
        413: "the request body is over the size limit",
        422: "invalid request (each wrong field is listed)",
        503: "the server cannot store it right now: retry (see Retry-After)",
    }
    return {
        code: {
            "model": ValidationErrorOut if code == 422 else ErrorOut,
            "description": descriptions[code],
        }
        for code in codes
    }


class LoginFailure(Base):
    """One failed dashboard sign-in, counted by :class:`LoginLimiter`.

    Attributes:
        client: the client address (the TCP peer, or ``X-Forwarded-For`` from a trusted
            proxy), at most 255 characters.
        failed_at: when it failed (UTC).
    """

    __tablename__ = "login_failures"
    __table_args__ = (
        Index("ix_login_failures_client_failed_at", "client", "failed_at"),
        Index("ix_login_failures_failed_at", "failed_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    client: Mapped[str] = mapped_column(String(255))
    failed_at: Mapped[datetime] = mapped_column(UTCDateTime)


class LoginLimiter:
    """Rate limit of failed dashboard sign-ins per client address: at most ``attempts``
    failures within any ``window_s`` (a moving window), counted in the database so every
    replica of the server shares one budget per address.

    Each failure is a :class:`LoginFailure` row; :meth:`blocked` counts the address's rows of
    the last ``window_s``. Rows older than the window are deleted as failures are counted
    (up to :data:`PRUNE_BATCH` per failure, ``SKIP LOCKED`` on PostgreSQL so concurrent
    sign-ins on several replicas never wait for or deadlock on each other), so the table
    holds about one window's failures. (The ``limits`` library, which kept these counters in
    one process's memory before, has storage for Redis, Memcached and MongoDB, none for SQL.)

    Checking and counting are separate steps, as they were in memory: requests from one
    address that are in flight at once all pass :meth:`blocked` before any of them counts,
    so an address may get that many attempts past the limit.

    Args:
        factory: session factory on the server's database.
        attempts: failed attempts allowed per ``window_s``.
        window_s: the window (seconds; rounded up to whole seconds).
        clock: the current time (timezone-aware UTC; tests move it).
    """

    PRUNE_BATCH = 1000

    def __init__(
        self,
        factory: sessionmaker[Session],
        attempts: int,
        window_s: float,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._factory = factory
        self._attempts = attempts
        self.window_s = max(1, math.ceil(window_s))
        self._clock = clock

    def blocked(self, client: str) -> bool:
        """Whether ``client`` has used up its failed attempts for now.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: the database cannot be read.
        """
        since = self._clock() - timedelta(seconds=self.window_s)
        with self._factory() as session:
            failures = session.scalar(
                select(func.count())
                .select_from(LoginFailure)
                .where(LoginFailure.client == client[:255], LoginFailure.failed_at > since)
            )
        return int(failures or 0) >= self._attempts

    def failed(self, client: str) -> None:
        """Count one failed attempt of ``client`` (committed at once), and delete failures
        older than the window.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: the database cannot be written.
        """
        now = self._clock()
        expired = (
            select(LoginFailure.id)
            .where(LoginFailure.failed_at <= now - timedelta(seconds=self.window_s))
            .order_by(LoginFailure.id)
            .limit(self.PRUNE_BATCH)
            .with_for_update(skip_locked=True)  # (SQLite: no row locks, nothing rendered)
        )
        with self._factory() as session:
            session.execute(delete(LoginFailure).where(LoginFailure.id.in_(expired)))
            session.add(LoginFailure(client=client[:255], failed_at=now))
            session.commit()

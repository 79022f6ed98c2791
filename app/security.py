"""Who is calling: bearer tokens and dashboard sessions resolved to a :class:`Principal`.

Routes declare what they need with the ``Annotated`` aliases at the bottom
(``ReaderDep``, ``AgentDep``, ``OperatorDep``…), so a new role check is one alias.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy import Engine, Row, select
from starlette.concurrency import run_in_threadpool

from tierwatch.server.tokens import ApiToken, hash_token

ROLE_RANK = {"viewer": 1, "operator": 2, "admin": 3}
SESSION_TOKEN_KEY = "token"


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
        return f"token:{self.token_id}" + (f"@{self.node}" if self.node else "")

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
    """Resolves tokens to (id, role, node), remembering live tokens for ``ttl_s`` seconds.

    Each lookup is one indexed Core query on a connection held only for that query, so a
    request never keeps a pooled connection while it waits (e.g. for the ingest writer):
    that is what kept a burst of reports from deadlocking the pool. A revoked token stops
    working within ``ttl_s`` (0 disables the cache). Unknown tokens are never cached.
    """

    MAX_ENTRIES = 100_000

    def __init__(self, engine: Engine, ttl_s: float) -> None:
        self._engine = engine
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[float, Row[Any]]] = {}

    def cached(self, token: str) -> Row[Any] | None:
        """The remembered ``(id, role, node_name)`` of ``token``, or None (not cached)."""
        hit = self._cache.get(hash_token(token))
        return hit[1] if hit is not None and hit[0] > time.monotonic() else None

    def lookup(self, token: str) -> Row[Any] | None:
        """``(id, role, node_name)`` of the live token ``token``, or None (unknown/revoked).

        Blocking (may query the database); the cache answers when it can.
        """
        key = hash_token(token)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        with self._engine.connect() as conn:
            row = conn.execute(
                select(ApiToken.id, ApiToken.role, ApiToken.node_name).where(
                    ApiToken.token_hash == key, ApiToken.revoked_at.is_(None)
                )
            ).first()
        if row is None:
            self._cache.pop(key, None)
        elif self._ttl_s > 0:
            if len(self._cache) >= self.MAX_ENTRIES:
                self._cache.clear()
            self._cache[key] = (now + self._ttl_s, row)
        return row

    def forget(self) -> None:
        """Drop every cached token (e.g. after a revocation in this process)."""
        self._cache.clear()


def _credentials(request: Request) -> tuple[str, str] | None:
    """(token, "bearer" | "session") from the request, or None when it carries none."""
    token = _bearer(request)
    if token is not None:
        return token, "bearer"
    token = request.session.get(SESSION_TOKEN_KEY) if "session" in request.scope else None
    return (token, "session") if token else None


def _principal(request: Request, via: str, row: Row[Any] | None) -> Principal | None:
    if row is None:
        if via == "session":
            request.session.clear()
            return None
        raise _unauthorized("unknown or revoked token")
    return Principal(token_id=row.id, role=row.role, node=row.node_name, via=via)


def principal_from_request(request: Request) -> Principal | None:
    """The caller from a bearer token or the dashboard session cookie, or None (blocking).

    Raises:
        HTTPException: 401 for a malformed header or an unknown/revoked bearer token.
    """
    creds = _credentials(request)
    if creds is None:
        return None
    resolver: TokenResolver = request.app.state.token_resolver
    return _principal(request, creds[1], resolver.lookup(creds[0]))


async def optional_principal(request: Request) -> Principal | None:
    """Dependency form of :func:`principal_from_request`: answered on the event loop when the
    token is cached, on a worker thread when it must be looked up.

    Raises:
        HTTPException: 401 for a malformed header or an unknown/revoked bearer token.
    """
    creds = _credentials(request)
    if creds is None:
        return None
    resolver: TokenResolver = request.app.state.token_resolver
    row = resolver.cached(creds[0])
    if row is None:
        row = await run_in_threadpool(resolver.lookup, creds[0])
    return _principal(request, creds[1], row)


async def current_principal(
    principal: Annotated[Principal | None, Depends(optional_principal)],
) -> Principal:
    """Any authenticated caller.

    Raises:
        HTTPException: 401 without credentials.
    """
    if principal is None:
        raise _unauthorized("authentication required: send 'Authorization: Bearer <token>'")
    return principal


PrincipalDep = Annotated[Principal, Depends(current_principal)]


def require_role(minimum: str):  # noqa: ANN201 - returns a FastAPI dependency
    """Dependency factory: the caller must hold ``minimum`` or a higher role.

    Raises:
        HTTPException: 403 when the role is too low.
    """

    async def dependency(principal: PrincipalDep) -> Principal:
        if not principal.has_role(minimum):
            raise HTTPException(
                status_code=status.HTTP_403_FORBIDDEN,
                detail=f"this action needs the {minimum} role; your token has {principal.role}",
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


ReaderDep = PrincipalDep  # any valid token may read
AgentDep = Annotated[Principal, Depends(require_agent)]
OperatorDep = Annotated[Principal, Depends(require_role("operator"))]
AdminDep = Annotated[Principal, Depends(require_role("admin"))]


class LoginLimiter:
    """Rate limit of failed dashboard sign-ins per client address (moving window, in this
    process's memory; the ``limits`` library keeps the counters).

    Args:
        attempts: failed attempts allowed per ``window_s``.
        window_s: the window (seconds; rounded up to whole seconds).
    """

    def __init__(self, attempts: int, window_s: float) -> None:
        from limits import RateLimitItemPerSecond
        from limits.storage import MemoryStorage
        from limits.strategies import MovingWindowRateLimiter

        self._item = RateLimitItemPerSecond(attempts, max(1, math.ceil(window_s)))
        self._limiter = MovingWindowRateLimiter(MemoryStorage())
        self.window_s = max(1, math.ceil(window_s))

    def blocked(self, client: str) -> bool:
        """Whether ``client`` has used up its failed attempts for now."""
        return not self._limiter.test(self._item, "login", client)

    def failed(self, client: str) -> None:
        """Count one failed attempt of ``client``."""
        self._limiter.hit(self._item, "login", client)

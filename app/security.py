"""Who is calling: bearer tokens and dashboard sessions resolved to a :class:`Principal`.

Routes declare what they need with the ``Annotated`` aliases at the bottom
(``ReaderDep``, ``AgentDep``, ``OperatorDep``…), so a new role check is one alias.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.server.tokens import ApiToken, hash_token, lookup_token

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
    """Resolves tokens to principals, remembering live tokens for ``ttl_s`` seconds.

    Each lookup uses its own short session, so a request never holds a pooled database
    connection while it waits (e.g. for the ingest writer): that is what kept a burst of
    reports from deadlocking the pool. A revoked token therefore stops working within
    ``ttl_s`` (0 disables the cache). Unknown tokens are never cached.
    """

    MAX_ENTRIES = 100_000

    def __init__(self, factory: sessionmaker[Session], ttl_s: float) -> None:
        self._factory = factory
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[float, ApiToken]] = {}

    def lookup(self, token: str) -> ApiToken | None:
        """The live token row for ``token``, or None when unknown or revoked."""
        key = hash_token(token)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        with self._factory() as session:
            row = lookup_token(session, token)
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


def optional_principal(request: Request) -> Principal | None:
    """The caller from a bearer token or the dashboard session cookie, or None.

    Raises:
        HTTPException: 401 for a malformed header or an unknown/revoked bearer token.
    """
    token = _bearer(request)
    via = "bearer"
    if token is None:
        token = request.session.get(SESSION_TOKEN_KEY) if "session" in request.scope else None
        via = "session"
        if not token:
            return None
    resolver: TokenResolver = request.app.state.token_resolver
    row = resolver.lookup(token)
    if row is None:
        if via == "session":
            request.session.clear()
            return None
        raise _unauthorized("unknown or revoked token")
    return Principal(token_id=row.id, role=row.role, node=row.node_name, via=via)


def current_principal(
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

    def dependency(principal: PrincipalDep) -> Principal:
        if not principal.has_role(minimum):
            raise HTTPException(
                status_code=status.HTTP_403_FORBIDDEN,
                detail=f"this action needs the {minimum} role; your token has {principal.role}",
            )
        return principal

    return dependency


def require_agent(principal: PrincipalDep) -> Principal:
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

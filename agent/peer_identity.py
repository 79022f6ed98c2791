"""Peers authenticate as nodes: a node key, the server's certificate for it, signed requests.

Every agent holds its own Ed25519 key (``<state_dir>/node-key.pem``, mode 0600, made at first
start). The server certifies it (``POST /api/v1/agent/peer-certificate`` with the agent token:
a JWT naming the node, its advertised URL and the key, :func:`~tierwatch.agent.credentials.
issue_node_certificate`). A peer request carries two headers:

- ``X-Tierwatch-Node-Certificate: <certificate>``;
- ``Authorization: TierwatchNode <request token>``, a JWT signed with the node key: ``iss``
  and ``sub`` ``node:<sender>``, ``aud`` ``node:<receiver>``, ``htm`` (method), ``htu`` (path
  and query, as sent), ``iat``, ``exp`` (at most :data:`MAX_REQUEST_LIFETIME_S` later) and a
  random ``jti``. (The shape follows OAuth DPoP, RFC 9449: a proof bound to one method, one
  URL and one audience.)

The receiver checks the certificate with the server's keys, the request token with the key
the certificate names, that it is the audience, the method and path, the lifetime and that
the ``jti`` was not seen before (:class:`ReplayCache`). A node can therefore speak only as
itself, a proof sent to one peer is refused by every other one, and a proof cannot be
replayed. Confidentiality of the bytes is TLS's job (``https://`` advertise URLs).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
    load_pem_private_key,
)

from tierwatch.agent.credentials import (
    ALGORITHM,
    CredentialError,
    CredentialVerifier,
    NodeCertificate,
    b64url,
)

CERT_HEADER = "X-Tierwatch-Node-Certificate"
SCHEME = "TierwatchNode"
KEY_FILE = "node-key.pem"
#: Longest lifetime of one request token (seconds); the receiver refuses longer ones.
MAX_REQUEST_LIFETIME_S = 120
#: Clock skew tolerated between two nodes (seconds).
SKEW_S = 60


class PeerAuthError(Exception):
    """A peer request that does not authenticate (the message says why)."""


def load_node_key(state_dir: Path) -> Ed25519PrivateKey:
    """This node's key, made (mode 0600) on first use.

    Raises:
        OSError: the state folder cannot be written, or the key file cannot be read.
        ValueError: the key file holds something else than an Ed25519 PEM key.
    """
    path = state_dir / KEY_FILE
    if path.is_file():
        key = load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} is not an Ed25519 key; remove it to make a new one")
        return key
    state_dir.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    os.replace(tmp, path)
    return key


def public_key_text(key: Ed25519PrivateKey) -> str:
    """The base64url raw public key (the certificate's ``cnf.x``)."""
    return b64url(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))


def sign_request(
    key: Ed25519PrivateKey,
    *,
    sender: str,
    receiver: str,
    method: str,
    path: str,
    lifetime_s: float = 60.0,
    now: float | None = None,
) -> str:
    """A request token for one call (see the module docstring).

    Args:
        path: The path and query as sent (e.g. ``/v1/peer/files/j/1/x?tier=peer&src=a``).
    """
    issued = int(time.time() if now is None else now)
    claims = {
        "iss": f"node:{sender}",
        "sub": f"node:{sender}",
        "aud": f"node:{receiver}",
        "htm": method.upper(),
        "htu": path,
        "iat": issued,
        "exp": issued + int(lifetime_s),
        "jti": secrets.token_urlsafe(16),
    }
    return jwt.encode(claims, key, algorithm=ALGORITHM)


class ReplayCache:
    """``jti`` values seen within their lifetime (bounded: the oldest are dropped first)."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, jti: str, expires_at: float, now: float) -> bool:
        """Remember ``jti``; False when it was seen before (a replay)."""
        with self._lock:
            if len(self._seen) >= self.max_entries:
                for k in [k for k, exp in self._seen.items() if exp < now]:
                    del self._seen[k]
                while len(self._seen) >= self.max_entries:
                    del self._seen[next(iter(self._seen))]
            if jti in self._seen:
                return False
            self._seen[jti] = expires_at
            return True


@dataclass(frozen=True)
class PeerCaller:
    """An authenticated peer: the node that signed, and its certificate."""

    node: str
    certificate: NodeCertificate


def verify_request(
    verifier: CredentialVerifier,
    replays: ReplayCache,
    *,
    me: str,
    method: str,
    path: str,
    authorization: str | None,
    certificate: str | None,
    now: float | None = None,
) -> PeerCaller:
    """Authenticate a peer request.

    Args:
        verifier: The server's public keys.
        replays: Seen ``jti`` values.
        me: This node's name (the audience).
        method, path: The request's method and path with query.
        authorization: The ``Authorization`` header.
        certificate: The ``X-Tierwatch-Node-Certificate`` header.

    Raises:
        PeerAuthError: anything does not check out (the message says what).
    """
    when = time.time() if now is None else now
    scheme, _, proof = (authorization or "").partition(" ")
    if scheme != SCHEME or not proof.strip() or not certificate:
        raise PeerAuthError(
            f"peer endpoints need 'Authorization: {SCHEME} <request token>' and "
            f"'{CERT_HEADER}: <node certificate>': agents authenticate to each other as nodes "
            "(docs/security.md)"
        )
    try:
        cert = verifier.verify_node_certificate(certificate.strip())
    except CredentialError as exc:
        raise PeerAuthError(f"node certificate refused: {exc}") from None
    try:
        claims = jwt.decode(
            proof.strip(),
            cert.public_key,
            algorithms=[ALGORITHM],
            audience=f"node:{me}",
            issuer=f"node:{cert.node}",
            leeway=SKEW_S,
            options={"require": ["exp", "iat", "jti", "aud", "iss"]},
        )
    except jwt.InvalidAudienceError:
        raise PeerAuthError(f"request token is not for node {me}") from None
    except jwt.PyJWTError as exc:
        raise PeerAuthError(f"request token refused: {exc}") from None
    if claims.get("htm") != method.upper() or claims.get("htu") != path:
        raise PeerAuthError("request token was made for another method or path")
    if float(claims["exp"]) - float(claims["iat"]) > MAX_REQUEST_LIFETIME_S:
        raise PeerAuthError(f"request token lives longer than {MAX_REQUEST_LIFETIME_S} s")
    if not replays.add(str(claims["jti"]), float(claims["exp"]) + SKEW_S, when):
        raise PeerAuthError("request token was used before (a replay)")
    return PeerCaller(cert.node, cert)

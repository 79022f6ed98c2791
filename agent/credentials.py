"""Job credentials: what a training job shows its node's agent, issued and signed by the server.

A job credential is one string, ``<statement>~<secret>`` (docs/security.md):

- ``statement`` is a JWT (RFC 7519) signed by the server with Ed25519 (``alg: EdDSA``,
  RFC 8037), header ``kid`` naming the signing key. Claims: ``iss`` = ``tierwatch``, ``typ`` =
  ``job``, ``sub`` = ``job:<job_id>``, ``job`` (the job id), ``iat`` and ``exp`` (Unix
  seconds), ``sh`` (base64url SHA-256 of the secret).
- ``secret`` is 32 bytes (base64url, no padding) that the server derives from its own job
  secret and the job id (HMAC-SHA256), so every credential issued for one job carries the same
  secret: a restarted job that registers again gets a new statement (new expiry) with the same
  secret, and therefore the same manifest key (:attr:`JobCredential.manifest_key`).

Agents check a credential offline with the server's public keys (:class:`CredentialVerifier`,
fed from ``GET /api/v1/credentials/public-keys``, a JWK set): the signature, the issuer, the
type, the expiry and that the secret hashes to ``sh``. Nothing here talks to the network.

The JWT work is PyJWT's (``jwt.encode``/``jwt.decode`` with ``EdDSA``); the keys are
``cryptography``'s Ed25519 keys.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ISSUER = "tierwatch"
ALGORITHM = "EdDSA"
SEPARATOR = "~"
#: Clock skew allowed between the server that issued a credential and the agent checking it.
LEEWAY_S = 60
#: Bytes of the per-job secret.
SECRET_BYTES = 32
MANIFEST_KEY_INFO = b"tierwatch manifest key v1"
#: Longest credential accepted (a statement is ~400 bytes; this bounds parsing work).
MAX_CREDENTIAL_CHARS = 4096


class CredentialError(ValueError):
    """A credential that cannot be used; the message says why and what to do."""


def b64url(data: bytes) -> str:
    """Base64url without padding (RFC 7515 section 2)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def b64url_decode(text: str) -> bytes:
    """Inverse of :func:`b64url`.

    Raises:
        CredentialError: not base64url.
    """
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise CredentialError("not base64url") from exc


def derive_job_secret(job_secret_key: bytes, job_id: str) -> bytes:
    """The secret of ``job_id``: HMAC-SHA256(server job secret, ``"job:" + job_id``), 32 bytes."""
    return hmac.new(job_secret_key, b"job:" + job_id.encode(), hashlib.sha256).digest()


def _manifest_key(secret: bytes) -> bytes:
    return hmac.new(secret, MANIFEST_KEY_INFO, hashlib.sha256).digest()


def job_manifest_key(job_secret_key: bytes, job_id: str) -> bytes:
    """The manifest key of ``job_id`` as the server derives it from its job secret (32 bytes):
    the same as :attr:`JobCredential.manifest_key` of every credential the job is issued."""
    return _manifest_key(derive_job_secret(job_secret_key, job_id))


def manifest_key_of(credential: str) -> bytes:
    """The manifest key of a job credential, taken from its secret alone (32 bytes).

    A rank cannot check the statement's signature (it has no server keys; its agent does),
    so this reads only the secret part of ``<statement>~<secret>`` and derives the same key
    as :attr:`JobCredential.manifest_key`.

    Raises:
        CredentialError: not ``<statement>~<secret>`` with a 32-byte base64url secret.
    """
    if len(credential) > MAX_CREDENTIAL_CHARS or credential.count(SEPARATOR) != 1:
        raise CredentialError(
            "not a job credential: expected '<statement>~<secret>' as issued by "
            "'tierwatch-server job credential' or POST /api/v1/jobs/{job_id}/credential"
        )
    secret = b64url_decode(credential.split(SEPARATOR)[1])
    if len(secret) != SECRET_BYTES:
        raise CredentialError(
            f"job credential's secret is {len(secret)} bytes, not {SECRET_BYTES}: "
            "register the job again for a new credential"
        )
    return _manifest_key(secret)


def secret_hash(secret: bytes) -> str:
    """``sh`` claim: base64url SHA-256 of the secret."""
    return b64url(hashlib.sha256(secret).digest())


def issue_job_credential(
    private_key: Ed25519PrivateKey,
    *,
    kid: str,
    job_secret_key: bytes,
    job_id: str,
    ttl_s: float,
    now: float | None = None,
) -> tuple[str, float]:
    """Sign a job credential.

    Args:
        private_key: The server's signing key.
        kid: Its key id (JWT header ``kid``).
        job_secret_key: The server's job secret (derives the job's secret).
        job_id: The job the credential is for.
        ttl_s: Lifetime in seconds (> 0).
        now: Issue time (Unix seconds; default: now).

    Returns:
        ``(credential, expires_at)``, expiry in Unix seconds.

    Raises:
        CredentialError: ``ttl_s`` is not positive.
    """
    if ttl_s <= 0:
        raise CredentialError(f"credential lifetime must be positive, got {ttl_s} s")
    issued = int(time.time() if now is None else now)
    expires = issued + int(ttl_s)
    secret = derive_job_secret(job_secret_key, job_id)
    claims = {
        "iss": ISSUER,
        "typ": "job",
        "sub": f"job:{job_id}",
        "job": job_id,
        "iat": issued,
        "exp": expires,
        "sh": secret_hash(secret),
    }
    statement = jwt.encode(claims, private_key, algorithm=ALGORITHM, headers={"kid": kid})
    return f"{statement}{SEPARATOR}{b64url(secret)}", float(expires)


@dataclass(frozen=True)
class JobCredential:
    """A checked job credential.

    Attributes:
        job_id: The job it is for.
        issued_at: ``iat`` (Unix seconds).
        expires_at: ``exp`` (Unix seconds).
        kid: The signing key's id.
        secret: The job's 32-byte secret.
        token: The whole credential string (what the ranks send as a bearer token).
    """

    job_id: str
    issued_at: float
    expires_at: float
    kid: str
    secret: bytes
    token: str

    @property
    def manifest_key(self) -> bytes:
        """The job's manifest signing key: HMAC-SHA256(secret, ``MANIFEST_KEY_INFO``), 32 bytes.

        The same for every credential of the job (the secret is), so steps saved before a
        restart verify after it.
        """
        return _manifest_key(self.secret)

    def __repr__(self) -> str:  # never print the secret
        return (
            f"JobCredential(job_id={self.job_id!r}, expires_at={self.expires_at}, kid={self.kid!r})"
        )


@dataclass(frozen=True)
class NodeCertificate:
    """A checked node certificate: the server vouches that ``node``'s agent holds the key
    ``public_key`` and is reached at ``url`` (docs/security.md, "Peers").

    Attributes:
        node: The node name (the agent token's node that asked for it).
        url: The agent's advertised peer URL.
        public_key: The node's own Ed25519 key (signs its peer requests).
        expires_at: ``exp`` (Unix seconds).
        token: The certificate as sent (a JWT).
    """

    node: str
    url: str
    public_key: Ed25519PublicKey
    expires_at: float
    token: str


def issue_node_certificate(
    private_key: Ed25519PrivateKey,
    *,
    kid: str,
    node: str,
    url: str,
    node_public_key: str,
    ttl_s: float,
    now: float | None = None,
) -> tuple[str, float]:
    """Sign a node certificate (a JWT: ``typ`` ``node``, ``sub`` ``node:<name>``, ``node``,
    ``url``, ``cnf`` ``{"x": <base64url raw Ed25519 public key>}`` as in RFC 7800, ``iat``,
    ``exp``).

    Returns:
        ``(certificate, expires_at)``.

    Raises:
        CredentialError: ``node_public_key`` is not 32 bytes of base64url, or ``ttl_s`` ≤ 0.
    """
    if ttl_s <= 0:
        raise CredentialError(f"certificate lifetime must be positive, got {ttl_s} s")
    if len(b64url_decode(node_public_key)) != 32:
        raise CredentialError("a node's public key is 32 bytes (Ed25519), base64url")
    issued = int(time.time() if now is None else now)
    claims = {
        "iss": ISSUER,
        "typ": "node",
        "sub": f"node:{node}",
        "node": node,
        "url": url,
        "cnf": {"x": node_public_key},
        "iat": issued,
        "exp": issued + int(ttl_s),
    }
    token = jwt.encode(claims, private_key, algorithm=ALGORITHM, headers={"kid": kid})
    return token, float(issued + int(ttl_s))


def public_key_jwk(public_key: Ed25519PublicKey, kid: str) -> dict[str, str]:
    """One Ed25519 public key as a JWK (RFC 8037 section 2: ``kty: OKP``, ``crv: Ed25519``)."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    raw = public_key.public_bytes(Encoding.Raw, PublicFormat.Raw)
    return {
        "kty": "OKP",
        "crv": "Ed25519",
        "x": b64url(raw),
        "kid": kid,
        "alg": ALGORITHM,
        "use": "sig",
    }


def _key_from_jwk(jwk: Mapping[str, Any]) -> tuple[str, Ed25519PublicKey]:
    if jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
        raise CredentialError(
            f"public key {jwk.get('kid')!r} is not an Ed25519 JWK (kty OKP, crv Ed25519)"
        )
    kid = jwk.get("kid")
    x = jwk.get("x")
    if not isinstance(kid, str) or not kid or not isinstance(x, str):
        raise CredentialError("a public key needs a 'kid' and an 'x' (base64url) member")
    raw = b64url_decode(x)
    if len(raw) != 32:
        raise CredentialError(f"public key {kid!r}: 'x' must be 32 bytes, got {len(raw)}")
    return kid, Ed25519PublicKey.from_public_bytes(raw)


class CredentialVerifier:
    """Checks job credentials against the server's public keys (offline).

    Args:
        keys: ``{kid: Ed25519PublicKey}``.

    A verifier with no keys refuses everything (its error says where the keys come from).
    """

    def __init__(self, keys: Mapping[str, Ed25519PublicKey] | None = None) -> None:
        self.keys: dict[str, Ed25519PublicKey] = dict(keys or {})

    @classmethod
    def from_jwks(cls, document: Mapping[str, Any]) -> CredentialVerifier:
        """Build from a JWK set ``{"keys": [jwk, ...]}``.

        Raises:
            CredentialError: not a JWK set of Ed25519 keys.
        """
        keys = document.get("keys") if isinstance(document, Mapping) else None
        if not isinstance(keys, list):
            raise CredentialError("a public key set is a JSON object with a 'keys' list")
        return cls(dict(_key_from_jwk(k) for k in keys if isinstance(k, Mapping)))

    def _decode(self, token: str, what: str) -> dict[str, Any]:
        """Check a server-signed JWT's signature, issuer and expiry; its claims.

        Raises:
            CredentialError: no keys, unknown key, bad signature, wrong issuer, expired.
        """
        if not self.keys:
            raise CredentialError(
                f"this agent has no public key of the server yet, so it cannot check {what}s: "
                "it fetches them from the server at start (GET /api/v1/credentials/public-keys),"
                " or give --credential-keys-file"
            )
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError as exc:
            raise CredentialError(f"not a {what}: {exc}") from None
        kid = header.get("kid")
        key = self.keys.get(kid) if isinstance(kid, str) else None
        if key is None:
            raise CredentialError(
                f"{what} signed with key {kid!r}, which this agent does not know "
                "(issued by another server, or the agent's key set is stale)"
            )
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=[ALGORITHM],
                issuer=ISSUER,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iat", "iss", "sub"]},
            )
        except jwt.ExpiredSignatureError:
            raise CredentialError(f"{what} has expired") from None
        except jwt.PyJWTError as exc:
            raise CredentialError(f"{what} refused: {exc}") from None
        claims["_kid"] = kid
        return claims

    def verify_node_certificate(self, token: str) -> NodeCertificate:
        """Check a node certificate.

        Raises:
            CredentialError: as :meth:`_decode`, or not a node certificate.
        """
        if len(token) > MAX_CREDENTIAL_CHARS:
            raise CredentialError("node certificate too long")
        claims = self._decode(token, "node certificate")
        node, url, cnf = claims.get("node"), claims.get("url"), claims.get("cnf")
        if (
            claims.get("typ") != "node"
            or not isinstance(node, str)
            or not isinstance(url, str)
            or not isinstance(cnf, dict)
            or not isinstance(cnf.get("x"), str)
        ):
            raise CredentialError("not a node certificate (typ, node, url or cnf missing)")
        if claims.get("sub") != f"node:{node}":
            raise CredentialError(f"node certificate's subject is not node:{node}")
        raw = b64url_decode(cnf["x"])
        if len(raw) != 32:
            raise CredentialError("node certificate's key is not 32 bytes")
        return NodeCertificate(
            node=node,
            url=url,
            public_key=Ed25519PublicKey.from_public_bytes(raw),
            expires_at=float(claims["exp"]),
            token=token,
        )

    def verify_job(self, credential: str, *, now: float | None = None) -> JobCredential:
        """Check one job credential.

        Args:
            credential: ``<statement>~<secret>``.
            now: Unix seconds (default: now).

        Returns:
            The checked credential.

        Raises:
            CredentialError: malformed, unknown key, bad signature, wrong issuer/type,
                expired, or a secret that does not match the statement.
        """
        if len(credential) > MAX_CREDENTIAL_CHARS or credential.count(SEPARATOR) != 1:
            raise CredentialError(
                "not a job credential: expected '<statement>~<secret>' as issued by "
                "'tierwatch-server job credential' or POST /api/v1/jobs/{job_id}/credential"
            )
        statement, secret_text = credential.split(SEPARATOR)
        try:
            claims = self._decode(statement, "job credential")
        except CredentialError as exc:
            if "has expired" in str(exc):
                raise CredentialError(
                    "job credential has expired: register the job again to get a new one"
                ) from None
            raise
        kid = claims["_kid"]
        if claims.get("typ") != "job" or not isinstance(claims.get("job"), str):
            raise CredentialError("not a job credential (typ is not 'job')")
        if now is not None and float(claims["exp"]) + LEEWAY_S < now:
            raise CredentialError(
                "job credential has expired: register the job again to get a new one"
            )
        secret = b64url_decode(secret_text)
        if not hmac.compare_digest(secret_hash(secret), str(claims.get("sh", ""))):
            raise CredentialError("job credential's secret does not match its statement")
        return JobCredential(
            job_id=claims["job"],
            issued_at=float(claims["iat"]),
            expires_at=float(claims["exp"]),
            kid=kid,
            secret=secret,
            token=credential,
        )


def jwks(keys: Iterable[tuple[str, Ed25519PublicKey]]) -> dict[str, list[dict[str, str]]]:
    """A JWK set of ``(kid, public key)`` pairs."""
    return {"keys": [public_key_jwk(k, kid) for kid, k in keys]}


CREDENTIAL_ENV = "TIERWATCH_JOB_CREDENTIAL"
CREDENTIAL_FILE_ENV = "TIERWATCH_JOB_CREDENTIAL_FILE"


def job_credential_from_env(
    value: str | None = None, *, environ: Mapping[str, str] | None = None
) -> str | None:
    """The job credential a rank sends its agent: ``value``, else ``$TIERWATCH_JOB_CREDENTIAL``,
    else the contents of ``$TIERWATCH_JOB_CREDENTIAL_FILE`` (one trailing newline dropped).

    Returns:
        The credential, or None when none is configured.

    Raises:
        CredentialError: the file cannot be read or is empty.
    """
    env = os.environ if environ is None else environ
    if value:
        return value.strip()
    if env.get(CREDENTIAL_ENV):
        return env[CREDENTIAL_ENV].strip()
    path = env.get(CREDENTIAL_FILE_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read().strip()
    except OSError as exc:
        raise CredentialError(
            f"{CREDENTIAL_FILE_ENV}={path}: cannot read the job credential ({exc.strerror})"
        ) from None
    if not text:
        raise CredentialError(f"{CREDENTIAL_FILE_ENV}={path}: the file is empty")
    return text


def unverified_job_id(credential: str) -> str | None:
    """The job id a credential claims, read without checking its signature (ranks have no
    key; the agent checks it). None when it is not a job credential."""
    statement = credential.split(SEPARATOR, 1)[0]
    try:
        claims = jwt.decode(statement, options={"verify_signature": False})
    except jwt.PyJWTError:
        return None
    job = claims.get("job") if claims.get("typ") == "job" else None
    return job if isinstance(job, str) else None


class LocalAuthority:
    """A signing key held in this process, for agents run without a server (benchmarks,
    single-machine checks): it writes the key set the agents are started with
    (``--credential-keys-file``) and signs job credentials exactly as the server does.

    Args:
        kid: Key id.
        seed: 32+ bytes to derive the key and the job secret from (the same authority in
            every process that knows the seed); None: random.
    """

    def __init__(self, kid: str = "local", seed: bytes | None = None) -> None:
        self.kid = kid
        if seed is None:
            self.key = Ed25519PrivateKey.generate()
            self.job_secret = os.urandom(SECRET_BYTES)
        else:
            self.key = Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest())
            self.job_secret = hashlib.sha256(b"job secret " + seed).digest()

    def jwks(self) -> dict[str, list[dict[str, str]]]:
        """The public key set (what ``GET /api/v1/credentials/public-keys`` answers)."""
        return jwks([(self.kid, self.key.public_key())])

    def write_keys(self, path: os.PathLike[str] | str) -> str:
        """Write :meth:`jwks` to ``path`` (for ``--credential-keys-file``); returns the path."""
        import json

        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.jwks(), fh)
        return str(path)

    def node_certificate(
        self, node: str, url: str, node_public_key: str, ttl_s: float = 86400.0
    ) -> str:
        """A node certificate, as ``POST /api/v1/agent/peer-certificate`` issues it."""
        return issue_node_certificate(
            self.key,
            kid=self.kid,
            node=node,
            url=url,
            node_public_key=node_public_key,
            ttl_s=ttl_s,
        )[0]

    def manifest_key(self, job_id: str) -> bytes:
        """``job_id``'s manifest key (what ``GET /api/v1/agent/jobs/{job}`` hands its agents)."""
        return job_manifest_key(self.job_secret, job_id)

    def job_credential(self, job_id: str, ttl_s: float = 7 * 86400.0) -> str:
        """A credential for ``job_id`` (default lifetime 7 days)."""
        return issue_job_credential(
            self.key, kid=self.kid, job_secret_key=self.job_secret, job_id=job_id, ttl_s=ttl_s
        )[0]

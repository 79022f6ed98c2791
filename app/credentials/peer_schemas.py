"""API shapes of the peer registry: node certificates, peers and a job's layout (pydantic v2).

Units: seconds; times are timezone-aware UTC. The checks here are the whole of what the
server accepts from an agent about itself (its key and its URL); everything else a
certificate says (the node) comes from the agent token.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from tierwatch.agent import credentials as wire

#: Bounds of a node certificate's lifetime (seconds): five minutes to 30 days.
MIN_NODE_CERTIFICATE_TTL_S = 300.0
MAX_NODE_CERTIFICATE_TTL_S = 30 * 24 * 3600.0
#: Longest advertised URL accepted (characters).
MAX_URL_CHARS = 2048
#: Most nodes one ``GET /api/v1/agent/peers`` may ask about.
MAX_PEER_NODES = 4096
#: Characters of a raw 32-byte Ed25519 key in base64url without padding.
PUBLIC_KEY_CHARS = 43
_PUBLIC_KEY_RE = re.compile(r"[A-Za-z0-9_-]{43}")
#: Printable ASCII without the space: what a URL may hold unescaped (RFC 3986).
_URL_CHARS_RE = re.compile(r"[\x21-\x7e]+")


def check_public_key(value: str) -> str:
    """A node's Ed25519 public key: 32 raw bytes in base64url without padding, in its one
    canonical spelling (so one key has one registry value).

    Raises:
        ValueError: anything else (the message says what the key must be).
    """
    if not _PUBLIC_KEY_RE.fullmatch(value):
        raise ValueError(
            "public_key must be the node's raw 32-byte Ed25519 public key in base64url "
            f"without padding ({PUBLIC_KEY_CHARS} characters of A-Z a-z 0-9 - _), got "
            f"{len(value)} character(s)"
            + (" with padding: drop the '='" if value.endswith("=") else "")
        )
    raw = wire.b64url_decode(value)
    if len(raw) != 32 or wire.b64url(raw) != value:
        raise ValueError(
            "public_key is not canonical base64url of 32 bytes: its last character carries "
            "bits past the key's end (encode the raw key again)"
        )
    return value


def check_peer_url(value: str) -> str:
    """An agent's advertised peer URL: ``http://`` or ``https://``, a host, an optional port
    and path; no user name or password, no query, no fragment, ASCII only, at most
    :data:`MAX_URL_CHARS` characters. Returned as given (it is what the certificate names).

    Raises:
        ValueError: anything else (the message says what to fix).
    """
    example = "e.g. https://gpu-017.cluster:9470"
    if not _URL_CHARS_RE.fullmatch(value):
        raise ValueError(
            "url must be printable ASCII without spaces (percent-encode other characters; "
            f"an international host name in its xn-- form), {example}"
        )
    parts = urlsplit(value)
    if parts.scheme.lower() not in ("http", "https") or not value.lower().startswith(
        f"{parts.scheme.lower()}://"
    ):
        raise ValueError(f"url must start with http:// or https://, {example}")
    if "@" in parts.netloc:
        raise ValueError(
            f"url must not hold a user name or password (nothing before '@'), {example}"
        )
    if not parts.hostname:
        raise ValueError(f"url must name a host, {example}")
    try:
        _ = parts.port  # urlsplit checks the port only when it is read
    except ValueError:
        raise ValueError(f"url's port must be a number from 0 to 65535, {example}") from None
    if "?" in value or "#" in value:
        raise ValueError(
            "url must not have a query or fragment ('?' or '#'): give the agent's base URL, "
            f"{example}"
        )
    return value


PeerUrl = Annotated[str, Field(max_length=MAX_URL_CHARS), AfterValidator(check_peer_url)]
NodePublicKey = Annotated[str, Field(max_length=256), AfterValidator(check_public_key)]


class PeerCertificateIn(BaseModel):
    """``POST /api/v1/agent/peer-certificate``: what an agent says about itself.

    Attributes:
        public_key: the node's Ed25519 public key (raw 32 bytes, base64url, no padding;
            ``tierwatch.agent.peer_identity.public_key_text``).
        url: the URL other agents reach this agent's peer API at (``http(s)://host:port``).

    There is no ``node``: the certificate names the agent token's node.
    """

    model_config = ConfigDict(extra="forbid")

    public_key: NodePublicKey
    url: PeerUrl

    @model_validator(mode="before")
    @classmethod
    def _no_node(cls, data: Any) -> Any:
        """Refuse a ``node`` field with a message saying where the node comes from."""
        if isinstance(data, dict) and "node" in data:
            raise ValueError(
                "leave 'node' out: a node certificate names the node of the agent token that "
                "asks for it, and an agent can only certify its own node"
            )
        return data


class PeerOut(BaseModel):
    """One registered node: its advertised URL and its certificate (a JWT the server
    signed: ``tierwatch.agent.credentials.CredentialVerifier.verify_node_certificate``).

    The certificate is not a secret: it proves nothing without the node's private key.
    """

    node: str
    url: str
    certificate: str
    expires_at: datetime


class PeersOut(BaseModel):
    """``GET /api/v1/agent/peers``: the asked-for nodes that hold a valid certificate, in the
    order asked (a node that never registered, or whose certificate expired, is absent)."""

    peers: list[PeerOut]


class AgentJobOut(BaseModel):
    """``GET /api/v1/agent/jobs/{job_id}``: a registered job as its agents may see it.

    Attributes:
        job_id: the job.
        nodes: the nodes its registration names.
        world_size: the pinned world size (registered, else the pinned layout's), or None.
        layout: the pinned node per rank (index = rank), or None while not pinned.
        manifest_key: the job's manifest key (32 bytes, base64url): the agent checks the
            signatures of the job's commit markers and manifests with it before it
            replicates, persists or applies retention (a local user without the job's
            credential cannot plant a step that the agent acts on).
    """

    job_id: str
    nodes: list[str]
    world_size: int | None
    layout: list[str] | None
    manifest_key: str

"""A node certificate names its node twice (``sub`` and ``node``); both must agree, and a
certificate the server's key signed with any claim changed is refused (no database)."""

from __future__ import annotations

import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tierwatch.agent.credentials import (
    ALGORITHM,
    CredentialError,
    CredentialVerifier,
    LocalAuthority,
)
from tierwatch.agent.peer_identity import public_key_text

AUTHORITY = LocalAuthority(kid="claims", seed=b"node certificate claims test")


def _claims(**change: object) -> dict[str, object]:
    now = int(time.time())
    key = public_key_text(Ed25519PrivateKey.generate())
    return {
        "iss": "tierwatch",
        "typ": "node",
        "sub": "node:gpu-1",
        "node": "gpu-1",
        "url": "http://10.0.0.1:9400",
        "cnf": {"x": key},
        "iat": now,
        "exp": now + 600,
        **change,
    }


def _sign(claims: dict[str, object]) -> str:
    return jwt.encode(claims, AUTHORITY.key, algorithm=ALGORITHM, headers={"kid": AUTHORITY.kid})


def test_a_certificate_whose_subject_is_another_node_is_refused() -> None:
    verifier = CredentialVerifier.from_jwks(AUTHORITY.jwks())
    issued = AUTHORITY.node_certificate(
        "gpu-1", "http://10.0.0.1:9400", public_key_text(Ed25519PrivateKey.generate())
    )
    assert verifier.verify_node_certificate(issued).node == "gpu-1"
    for sub in ("node:gpu-2", "gpu-1", "node:"):
        with pytest.raises(CredentialError, match="subject is not node:gpu-1"):
            verifier.verify_node_certificate(_sign(_claims(sub=sub)))
    no_subject = _claims()
    del no_subject["sub"]
    with pytest.raises(CredentialError):
        verifier.verify_node_certificate(_sign(no_subject))
    with pytest.raises(CredentialError, match="not a node certificate"):
        verifier.verify_node_certificate(_sign(_claims(typ="job")))

"""Fixtures for the security tests: a token per role, a seeded cluster (node n1 and a job
with committed steps). The process fixtures (``server``, ``browser``) come from
tests/e2e/process_fixtures.py, registered for the whole suite.
"""

from __future__ import annotations

import pytest
from security_support import ROLES, seed_cluster


@pytest.fixture
def tokens(make_token) -> dict[str, str | None]:  # type: ignore[no-untyped-def]
    """Plaintext token per role of :data:`security_support.ROLES` (``None`` for "none")."""
    made: dict[str, str | None] = {"none": None}
    for role in ROLES[1:]:
        if role == "agent_n1":
            made[role] = make_token("agent", "n1")
        elif role == "agent_other":
            made[role] = make_token("agent", "other-node")
        else:
            made[role] = make_token(role)
    made["agent_n2"] = make_token("agent", "n2")
    return made


@pytest.fixture
def seeded(client, tokens):  # type: ignore[no-untyped-def]
    """The in-process client with node n1 (and n2) reporting and job ``job-1`` holding
    committed steps on both ranks."""
    seed_cluster(client, tokens)
    return client

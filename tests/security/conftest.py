"""Fixtures for the security tests: a token per role, a seeded cluster (node n1 and a job
with committed steps), and the e2e fixtures (``server``, ``browser``) for the tests that need
a real server process or a real browser.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from security_support import ROLES, seed_cluster

# The e2e fixtures (a real server process, the shared headless Chromium) live in
# tests/e2e/conftest.py; load that module under its own name and re-export them here.
_E2E_CONFTEST = Path(__file__).resolve().parents[1] / "e2e" / "conftest.py"
_spec = importlib.util.spec_from_file_location("tierwatch_e2e_conftest", _E2E_CONFTEST)
assert _spec is not None
assert _spec.loader is not None
_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_e2e)
server = _e2e.server
browser = _e2e.browser


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

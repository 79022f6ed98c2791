"""Fixtures for dashboard tests: a client signed in through the login form."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from web_support import sign_in


@pytest.fixture
def viewer(client: TestClient, make_token) -> TestClient:  # type: ignore[no-untyped-def]
    """The test client, signed in to the dashboard with a viewer token."""
    r = sign_in(client, make_token("viewer"))
    assert r.status_code == 303, r.text
    return client


@pytest.fixture
def agent_token(make_token):  # type: ignore[no-untyped-def]
    """``agent_token("n1") -> plaintext`` of an agent token bound to that node."""
    return lambda node: make_token("agent", node)

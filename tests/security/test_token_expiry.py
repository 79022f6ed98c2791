"""Optional token expiry: an expired token is refused with 401 saying it expired, also by a
process whose token cache still remembers it; tokens without an expiry never expire."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support import auth, make_batch

from tierwatch.agent.protocol import utcnow
from tierwatch.server import security
from tierwatch.server.tokens import MAX_EXPIRES_IN_S, TokenError, create_token, parse_duration


def _token(app, role: str, node: str | None = None, expires_in_s: float | None = 3600):  # type: ignore[no-untyped-def]
    with app.state.sessionmaker() as s:
        token, row = create_token(s, role=role, node=node, expires_in_s=expires_in_s)
        s.commit()
        return token, row.expires_at


def _advance_clock(monkeypatch, seconds: float) -> None:
    later = utcnow() + timedelta(seconds=seconds)
    monkeypatch.setattr(security, "utcnow", lambda: later)


def test_expired_bearer_token_is_refused_saying_it_expired(app, client, monkeypatch):
    token, expires_at = _token(app, "operator")
    assert expires_at is not None
    h = auth(token)
    assert client.get("/api/v1/nodes", headers=h).status_code == 200
    _advance_clock(monkeypatch, 3601)
    for r in (
        client.get("/api/v1/nodes", headers=h),
        client.post("/api/v1/nodes/n1/isolate", json={"reason": "late"}, headers=h),
    ):
        assert r.status_code == 401, r.text
        detail = r.json()["detail"]
        assert f"this token expired at {expires_at.isoformat()}" in detail
        assert "tierwatch-server token create" in detail
        assert r.headers["www-authenticate"] == "Bearer"


def test_the_token_cache_does_not_accept_a_token_past_its_expiry(app, client, monkeypatch):
    """Reads and agent reports are answered from the cache (token_cache_s = 30 s): the
    cached row carries the expiry, checked on every request."""
    assert app.state.settings.token_cache_s >= 30
    resolver = app.state.token_resolver
    viewer, _ = _token(app, "viewer", expires_in_s=10)
    agent, _ = _token(app, "agent", "n1", expires_in_s=10)
    body = make_batch("n1", 5).model_dump_json()
    report_headers = {**auth(agent), "Content-Type": "application/json"}
    assert client.get("/api/v1/nodes", headers=auth(viewer)).status_code == 200
    assert client.post("/api/v1/ingest/report", content=body, headers=report_headers).is_success
    assert resolver.cached(viewer) is not None
    assert resolver.cached(agent) is not None
    _advance_clock(monkeypatch, 11)
    r = client.get("/api/v1/nodes", headers=auth(viewer))
    assert r.status_code == 401, r.text
    assert "expired" in r.json()["detail"]
    r = client.post("/api/v1/ingest/report", content=body, headers=report_headers)
    assert r.status_code == 401, r.text
    assert "expired" in r.json()["detail"]


def test_a_token_without_expiry_never_expires(app, client, monkeypatch):
    token, expires_at = _token(app, "viewer", expires_in_s=None)
    assert expires_at is None
    _advance_clock(monkeypatch, 50 * 365 * 86400)
    assert client.get("/api/v1/nodes", headers=auth(token)).status_code == 200


def test_an_expired_token_is_refused_by_the_dashboard_too(app, client, monkeypatch):
    token, _ = _token(app, "viewer", expires_in_s=60)
    assert client.get("/", headers=auth(token), follow_redirects=False).status_code == 200
    _advance_clock(monkeypatch, 61)
    r = client.get("/", headers=auth(token), follow_redirects=False)
    assert r.status_code == 401
    assert "expired" in r.json()["detail"]


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), MAX_EXPIRES_IN_S + 1])
def test_create_token_refuses_an_expiry_that_is_not_a_positive_duration(session, bad):
    with pytest.raises(TokenError, match="invalid expiry"):
        create_token(session, role="viewer", expires_in_s=bad)


def test_create_token_sets_the_expiry_from_its_creation(session):
    _, row = create_token(session, role="viewer", expires_in_s=7200)
    assert row.expires_at - row.created_at == timedelta(hours=2)
    assert row.status(row.created_at) == "active"
    assert row.status(row.created_at + timedelta(hours=2)) == "expired"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("3600", 3600),
        ("90s", 90),
        ("15m", 900),
        ("12h", 43200),
        ("1.5h", 5400),
        ("30d", 30 * 86400),
        ("2w", 14 * 86400),
        (" 2H ", 7200),
        ("10 m", 600),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "0", "0h", "-5m", "5y", "1e3", "h", "1h30m"])
def test_parse_duration_refuses_what_is_not_a_duration(text):
    with pytest.raises(TokenError, match="invalid duration"):
        parse_duration(text)

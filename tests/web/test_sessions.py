"""Dashboard sessions kept on the server: the cookie holds an opaque session id, never a token;
signing out, revoking the token (in this process or with the CLI), the token's expiry and the
session lifetime each end the session, copies of the cookie included; the cookie is Secure
outside dev mode."""

from __future__ import annotations

import base64
import json
import subprocess
from datetime import datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from itsdangerous import TimestampSigner
from procs import BIN, base_env
from sqlalchemy import func, select, update
from web_support import csrf_from, sign_in

from tierwatch.agent.protocol import utcnow
from tierwatch.server import security
from tierwatch.server.main import create_app
from tierwatch.server.tokens import ApiToken, create_token, lookup_token, revoke_token
from tierwatch.server.web.csrf import SESSION_COOKIE
from tierwatch.server.web.sessions import WebSession, hash_session_id

SECRET = "a-test-secret-key-that-is-long-enough-" + "x" * 16


def _payload(cookie: str) -> dict:
    """The session dict inside Starlette's signed cookie (``base64(json).time.signature``)."""
    return json.loads(base64.b64decode(cookie.split(".")[0]))


def _with_cookie(app, cookie: str, path: str = "/"):  # type: ignore[no-untyped-def]
    """GET ``path`` from a fresh client that presents only this session cookie (a copy)."""
    copy = TestClient(app, follow_redirects=False)
    return copy.get(path, headers={"Cookie": f"{SESSION_COOKIE}={cookie}"})


def _is_login(response) -> bool:  # type: ignore[no-untyped-def]
    return response.status_code == 303 and response.headers["location"].startswith("/login")


def _sessions(app) -> list[WebSession]:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker() as s:
        return list(s.scalars(select(WebSession)))


def _token_row(app, token: str) -> ApiToken:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker() as s:
        row = lookup_token(s, token)
        assert row is not None
        return row


def _advance_clock(monkeypatch, seconds: float, since: datetime | None = None) -> None:
    """Requests see a clock ``seconds`` ahead of ``since`` (default: now); the session and
    token checks read it."""
    later = (since or utcnow()) + timedelta(seconds=seconds)
    monkeypatch.setattr(security, "utcnow", lambda: later)


def test_cookie_holds_an_opaque_session_id_not_the_token(app, client, make_token):
    token = make_token("viewer")
    assert sign_in(client, token).status_code == 303
    cookie = client.cookies[SESSION_COOKIE]
    payload = _payload(cookie)
    assert token not in json.dumps(payload)
    assert set(payload) == {"sid", "csrf"}
    [row] = _sessions(app)
    assert row.id_hash == hash_session_id(payload["sid"])  # only the hash is stored
    assert payload["sid"] not in row.id_hash
    assert row.token_id == _token_row(app, token).id
    assert client.get("/", follow_redirects=False).status_code == 200


def test_copied_cookie_stops_working_after_sign_out(app, client, make_token):
    assert sign_in(client, make_token("operator")).status_code == 303
    cookie = client.cookies[SESSION_COOKIE]
    assert _with_cookie(app, cookie).status_code == 200
    assert _with_cookie(app, cookie, "/api/v1/nodes").status_code == 200
    page = client.get("/")
    r = client.post("/logout", data={"csrf_token": csrf_from(page.text)}, follow_redirects=False)
    assert r.status_code == 303
    assert _is_login(_with_cookie(app, cookie))
    assert _with_cookie(app, cookie, "/api/v1/nodes").status_code == 401
    assert _sessions(app) == []


def test_signing_in_again_ends_the_previous_session(app, client, make_token):
    assert sign_in(client, make_token("viewer")).status_code == 303
    first = client.cookies[SESSION_COOKIE]
    assert sign_in(client, make_token("operator")).status_code == 303
    assert _is_login(_with_cookie(app, first))
    assert len(_sessions(app)) == 1


def test_revoking_the_token_in_process_ends_and_deletes_its_sessions(app, client, make_token):
    token, other = make_token("operator"), make_token("viewer")
    cookies = []
    for t in (token, token, other):
        browser = TestClient(app, follow_redirects=False)
        assert sign_in(browser, t).status_code == 303
        cookies.append(browser.cookies[SESSION_COOKIE])
    with app.state.sessionmaker() as s:
        revoke_token(s, _token_row(app, token).id)
        s.commit()
    assert [_with_cookie(app, c).status_code for c in cookies] == [303, 303, 200]
    assert [r.token_id for r in _sessions(app)] == [_token_row(app, other).id]


def test_cli_revoke_ends_the_session_at_once(app, client, make_token, settings):
    """`tierwatch-server token revoke` runs in another process (no cache hook reaches this
    one): the session still ends with the next request, not after token_cache_s."""
    assert settings.token_cache_s >= 30
    token = make_token("viewer")
    browser = TestClient(app, follow_redirects=False)
    assert sign_in(browser, token).status_code == 303
    assert browser.get("/").status_code == 200
    assert browser.get("/api/v1/nodes").status_code == 200
    subprocess.run(
        [str(BIN / "tierwatch-server"), "token", "revoke", str(_token_row(app, token).id)],
        env=base_env(TIERWATCH_DATABASE_URL=settings.database_url),
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert browser.get("/api/v1/nodes").status_code == 401
    assert _is_login(browser.get("/"))
    assert _sessions(app) == []


def test_session_lifetime_is_absolute_from_sign_in(settings, make_token, monkeypatch):
    app = create_app(settings.model_copy(update={"session_ttl_s": 600.0}))
    with TestClient(app, follow_redirects=False) as browser:
        r = sign_in(browser, make_token("viewer"))
        assert "max-age=600" in r.headers["set-cookie"].lower()
        [row] = _sessions(app)
        assert row.expires_at - row.created_at == timedelta(seconds=600)
        cookie = browser.cookies[SESSION_COOKIE]
        _advance_clock(monkeypatch, 599, since=row.created_at)  # not now: sign-in may be slow
        assert browser.get("/").status_code == 200
        assert [r.expires_at for r in _sessions(app)] == [row.expires_at]  # not extended
        _advance_clock(monkeypatch, 601, since=row.created_at)
        assert _is_login(browser.get("/"))
        assert _with_cookie(app, cookie, "/api/v1/nodes").status_code == 401


def test_session_ends_when_its_token_expires(app, client, monkeypatch):
    with app.state.sessionmaker() as s:
        token, row = create_token(s, role="viewer", expires_in_s=3600)
        s.commit()
        token_expires = row.expires_at
    assert sign_in(client, token).status_code == 303
    [session_row] = _sessions(app)
    assert session_row.expires_at == token_expires  # the token's expiry comes first (< 12 h)
    # The token's expiry decides on its own too: with the session's own expiry moved out of
    # the way, the session still ends when the token expires.
    with app.state.engine.begin() as conn:
        conn.execute(update(WebSession).values(expires_at=utcnow() + timedelta(days=1)))
    _advance_clock(monkeypatch, 3601)
    assert _is_login(client.get("/", follow_redirects=False))


def test_expired_token_cannot_sign_in(app, client, make_token):
    token = make_token("operator")
    with app.state.engine.begin() as conn:
        conn.execute(
            update(ApiToken)
            .where(ApiToken.id == _token_row(app, token).id)
            .values(expires_at=utcnow() - timedelta(minutes=1))
        )
    r = sign_in(client, token)
    assert r.status_code == 401
    assert "That token expired at" in r.text
    assert _sessions(app) == []


def test_expired_sessions_are_deleted_at_the_next_sign_in(app, client, make_token):
    assert sign_in(client, make_token("viewer")).status_code == 303
    with app.state.engine.begin() as conn:
        conn.execute(update(WebSession).values(expires_at=utcnow() - timedelta(seconds=1)))
    browser = TestClient(app, follow_redirects=False)
    assert sign_in(browser, make_token("viewer")).status_code == 303
    with app.state.sessionmaker() as s:
        assert s.scalar(select(func.count()).select_from(WebSession)) == 1


def test_cookie_holding_a_token_from_before_sessions_signs_no_one_in(app, settings, make_token):
    """Cookies of the first version held the token itself: they sign no one in now, and the
    answer replaces the cookie with one without the token."""
    token = make_token("admin")
    signer = TimestampSigner(settings.session_secret)
    old = signer.sign(base64.b64encode(json.dumps({"token": token, "csrf": "c"}).encode()))
    r = _with_cookie(app, old.decode())
    assert _is_login(r)
    assert _with_cookie(app, old.decode(), "/api/v1/audit").status_code == 401
    value = r.headers["set-cookie"].split("=", 1)[1].split(";")[0]
    assert value == "null" or "token" not in _payload(value)  # deleted, or rewritten without


# --- the Secure flag ----------------------------------------------------------------------


def _cookie_flags(response) -> set[str]:  # type: ignore[no-untyped-def]
    header = response.headers["set-cookie"]
    assert header.startswith(f"{SESSION_COOKIE}="), header
    return {part.strip().split("=")[0].lower() for part in header.split(";")[1:]}


def test_session_cookie_is_not_secure_in_dev_mode(client, make_token):
    flags = _cookie_flags(sign_in(client, make_token("viewer")))
    assert "secure" not in flags
    assert {"httponly", "samesite", "max-age", "path"} <= flags


def test_session_cookie_is_secure_outside_dev_mode(settings, make_token):
    app = create_app(settings.model_copy(update={"dev": False, "secret_key": SECRET}))
    with TestClient(app, base_url="https://testserver", follow_redirects=False) as browser:
        assert "secure" in _cookie_flags(browser.get("/login"))
        r = sign_in(browser, make_token("viewer"))
        assert r.status_code == 303, r.text
        assert "secure" in _cookie_flags(r)
        assert browser.get("/").status_code == 200


def test_plain_http_sign_in_outside_dev_mode_says_why_it_failed(settings, make_token):
    """Over http a browser does not send a Secure cookie back: the CSRF refusal says so."""
    app = create_app(settings.model_copy(update={"dev": False, "secret_key": SECRET}))
    with TestClient(app, follow_redirects=False) as browser:
        r = sign_in(browser, make_token("viewer"))
        assert r.status_code == 403
        assert "CSRF check failed" in r.text
        assert "marks it Secure" in r.text
        assert "TIERWATCH_SESSION_COOKIE_SECURE=0" in r.text


def test_dev_mode_csrf_refusal_has_no_secure_cookie_hint(client):
    r = client.post("/login", data={"token": "x", "csrf_token": "y"})
    assert r.status_code == 403
    assert "Secure" not in r.text


@pytest.mark.parametrize(("dev", "secure"), [(True, True), (False, False)])
def test_session_cookie_secure_setting_overrides_the_mode(settings, make_token, dev, secure):
    update_ = {"dev": dev, "secret_key": SECRET, "session_cookie_secure": secure}
    app = create_app(settings.model_copy(update=update_))
    base_url = "https://testserver" if secure else "http://testserver"
    with TestClient(app, base_url=base_url, follow_redirects=False) as browser:
        r = sign_in(browser, make_token("viewer"))
        assert r.status_code == 303, r.text
        assert ("secure" in _cookie_flags(r)) is secure
        assert browser.get("/").status_code == 200

"""Dashboard sign-in: the login form, CSRF, redirects for callers without a session."""

from __future__ import annotations

from support import auth
from web_support import csrf_from, sign_in

from tierwatch.server.tokens import lookup_token, revoke_token


def test_login_page_renders_form_with_csrf_field(client):
    r = client.get("/login")
    assert r.status_code == 200
    assert 'name="token"' in r.text
    assert csrf_from(r.text)


def test_good_token_signs_in_and_returns_to_next(client, make_token):
    r = sign_in(client, make_token("viewer"), next_url="/nodes/n1?x=1")
    assert r.status_code == 303
    assert r.headers["location"] == "/nodes/n1?x=1"
    assert client.get("/", follow_redirects=False).status_code == 200


def test_bad_token_shows_form_again_with_401(client):
    r = sign_in(client, "tw_not-a-real-token")
    assert r.status_code == 401
    assert "not valid" in r.text
    assert 'name="token"' in r.text
    assert client.get("/", follow_redirects=False).status_code == 303


def test_empty_token_is_401(client):
    r = sign_in(client, "  ")
    assert r.status_code == 401
    assert "Enter an API token" in r.text


def test_agent_token_cannot_sign_in(client, make_token):
    r = sign_in(client, make_token("agent", "n1"))
    assert r.status_code == 401
    assert "Agent tokens cannot sign in" in r.text


def test_login_without_csrf_token_is_403(client, make_token):
    client.get("/login")
    r = client.post("/login", data={"token": make_token("viewer")}, follow_redirects=False)
    assert r.status_code == 403
    assert "CSRF check failed" in r.text
    assert client.get("/", follow_redirects=False).status_code == 303


def test_login_with_wrong_csrf_token_is_403(client, make_token):
    client.get("/login")
    r = client.post(
        "/login",
        data={"token": make_token("viewer"), "csrf_token": "forged"},
        follow_redirects=False,
    )
    assert r.status_code == 403


def test_next_never_leaves_the_site(client, make_token):
    for target in ("https://evil.example/", "//evil.example/x", "/\\evil.example", "nodes"):
        r = sign_in(client, make_token("viewer"), next_url=target)
        assert r.status_code == 303
        assert r.headers["location"] == "/", target


def test_signed_in_user_visiting_login_goes_on(viewer):
    r = viewer.get("/login?next=/nodes/x", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/nodes/x"


def test_logout_needs_csrf_and_ends_session(viewer):
    assert viewer.post("/logout", follow_redirects=False).status_code == 403
    page = viewer.get("/")
    r = viewer.post("/logout", data={"csrf_token": csrf_from(page.text)}, follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/login"
    assert viewer.get("/", follow_redirects=False).status_code == 303


def test_csrf_header_is_accepted_for_htmx_posts(viewer):
    page = viewer.get("/")
    r = viewer.post(
        "/logout", headers={"X-CSRF-Token": csrf_from(page.text)}, follow_redirects=False
    )
    assert r.status_code == 303


def test_csrf_token_changes_at_sign_in(client, make_token):
    before = csrf_from(client.get("/login").text)
    sign_in(client, make_token("viewer"))
    assert csrf_from(client.get("/").text) != before


def test_pages_without_session_redirect_to_login_with_next(client):
    r = client.get("/", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/login"
    r = client.get("/nodes/n1?range=1h", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/login?next=%2Fnodes%2Fn1%3Frange%3D1h"


def test_htmx_request_without_session_gets_hx_redirect(client):
    r = client.get(
        "/?state=healthy",
        headers={"HX-Request": "true", "HX-Current-URL": "http://testserver/?state=healthy"},
        follow_redirects=False,
    )
    assert r.status_code == 401
    assert r.headers["HX-Redirect"].startswith("/login")
    assert r.text == ""


def test_bearer_token_can_view_pages(client, make_token):
    r = client.get("/", headers=auth(make_token("viewer")), follow_redirects=False)
    assert r.status_code == 200


def test_agent_bearer_token_cannot_view_pages(client, make_token):
    r = client.get("/", headers=auth(make_token("agent", "n1")), follow_redirects=False)
    assert r.status_code == 403
    assert "viewer" in r.text


def test_revoked_token_ends_the_session(viewer, session, make_token):
    token = make_token("operator")
    sign_in(viewer, token)
    row = lookup_token(session, token)
    assert row is not None
    revoke_token(session, row.id)
    session.commit()
    assert viewer.get("/", follow_redirects=False).status_code == 303

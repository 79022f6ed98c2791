"""CSRF: a cookie session's state-changing requests need the session's token (form field
``csrf_token`` or header ``X-CSRF-Token``); bearer-token API calls need none. And the sign-in
rate limit: after ``login_attempts`` failures one client address gets 429 even with a valid
token, with a page that says what to do.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from security_support import JOB, anonymous_csrf, is_login_redirect, sign_in
from support import auth
from test_role_matrix import MATRIX, PATH_PARAMS, PRESENT

from tierwatch.server.main import create_app

# Request checks, not SQL: PostgreSQL when configured, else SQLite.
pytestmark = pytest.mark.one_backend

WEB_ROUTES = [key for key in PRESENT if MATRIX[key].kind in ("web", "login")]
CSRF_REFUSAL = "CSRF check failed"


def _form(key: tuple[str, str], tokens) -> dict[str, str]:  # type: ignore[no-untyped-def]
    row = MATRIX[key]
    if row.kind == "login":
        return {"token": tokens["admin"], "next": "/"}
    return dict(row.form)


def _browser(app, key: tuple[str, str], tokens) -> tuple[TestClient, str]:  # type: ignore[no-untyped-def]
    """A dashboard session fit for the route (admin, or not signed in for /login) and its
    CSRF token."""
    browser = TestClient(app, follow_redirects=False)
    if MATRIX[key].kind == "login":
        return browser, anonymous_csrf(browser)
    return browser, sign_in(browser, tokens["admin"])


# Where each dashboard form post lands once its CSRF token is right (a 303 to this path).
LANDS_ON = {
    ("POST", "/login"): "/",
    ("POST", "/logout"): "/login",
    ("POST", "/nodes/{name}/isolate"): "/nodes/n1",
    ("POST", "/nodes/{name}/release"): "/nodes/n1",
    ("POST", "/nodes/{name}/ack"): "/nodes/n1",
    ("POST", "/jobs/{job_id}/restore"): f"/jobs/{JOB}",
    ("POST", "/policy"): "/policy",
    ("POST", "/maintenance"): "/maintenance",
    ("POST", "/maintenance/{window_id}/end"): "/maintenance",
}


def _refused(response) -> bool:  # type: ignore[no-untyped-def]
    return response.status_code == 403 and CSRF_REFUSAL in response.text


@pytest.mark.parametrize("key", WEB_ROUTES, ids=[f"{m} {p}" for m, p in WEB_ROUTES])
def test_dashboard_route_needs_the_sessions_csrf_token(app, seeded, tokens, key):
    method, template = key
    path = template.format(**PATH_PARAMS)
    form = _form(key, tokens)

    browser, csrf = _browser(app, key, tokens)
    missing = browser.request(method, path, data=form)
    assert _refused(missing), (missing.status_code, missing.text[:300])
    assert "Reload the page" in missing.text  # says what to do
    wrong = browser.request(method, path, data={**form, "csrf_token": csrf[::-1]})
    assert _refused(wrong), (wrong.status_code, wrong.text[:300])
    wrong_header = browser.request(method, path, data=form, headers={"X-CSRF-Token": "x" * 43})
    assert _refused(wrong_header), wrong_header.status_code
    # Another session's token is a wrong token too.
    _, other_csrf = _browser(app, key, tokens)
    other = browser.request(method, path, data={**form, "csrf_token": other_csrf})
    assert _refused(other), other.status_code

    in_form = browser.request(method, path, data={**form, "csrf_token": csrf})
    assert in_form.status_code == 303, in_form.text[:300]
    assert in_form.headers["location"] == LANDS_ON[key]

    browser, csrf = _browser(app, key, tokens)
    in_header = browser.request(method, path, data=form, headers={"X-CSRF-Token": csrf})
    assert in_header.status_code == 303, in_header.text[:300]
    assert in_header.headers["location"] == LANDS_ON[key]


def test_a_session_without_a_csrf_token_is_refused(app, seeded, tokens):
    # A brand-new client that never loaded a page has no session token to match.
    browser = TestClient(app, follow_redirects=False)
    r = browser.post("/login", data={"token": tokens["admin"], "csrf_token": "guess"})
    assert _refused(r)
    assert is_login_redirect(browser.get("/"))  # not signed in


API_WRITES = [
    ("POST", "/api/v1/nodes/n1/isolate", {"reason": "csrf"}),
    ("POST", "/api/v1/nodes/n1/release", {"reason": "csrf"}),
    ("POST", "/api/v1/nodes/n1/ack", {}),
    ("POST", f"/api/v1/jobs/{JOB}/restore", {"reason": "csrf"}),
    ("PUT", "/api/v1/policy", {"breaker_pct": 30}),
    ("POST", "/api/v1/maintenance", {"node": "n1", "duration_s": 60, "reason": "csrf"}),
]


@pytest.mark.parametrize(
    ("method", "path", "body"), API_WRITES, ids=[f"{m} {p}" for m, p, _ in API_WRITES]
)
def test_bearer_api_calls_need_no_csrf_token(seeded, tokens, method, path, body):
    r = seeded.request(method, path, json=body, headers=auth(tokens["admin"]))
    assert 200 <= r.status_code < 300, r.text


@pytest.mark.parametrize(
    ("method", "path", "body"), API_WRITES, ids=[f"{m} {p}" for m, p, _ in API_WRITES]
)
def test_cookie_session_api_writes_need_the_csrf_header(app, seeded, tokens, method, path, body):
    """The session cookie also authenticates API calls (the dashboard's charts read with
    it); a state-changing one without the session's CSRF token must not go through, or any
    page could make a signed-in browser isolate nodes."""
    browser = TestClient(app, follow_redirects=False)
    csrf = sign_in(browser, tokens["admin"])
    refused = browser.request(method, path, json=body)
    assert refused.status_code == 403, refused.text
    assert "X-CSRF-Token" in refused.json()["detail"]
    wrong = browser.request(method, path, json=body, headers={"X-CSRF-Token": csrf[::-1]})
    assert wrong.status_code == 403, wrong.text
    ok = browser.request(method, path, json=body, headers={"X-CSRF-Token": csrf})
    assert 200 <= ok.status_code < 300, ok.text
    # Reads with the cookie need no token.
    assert browser.get("/api/v1/nodes/n1").status_code == 200


def test_cookie_session_ack_without_body_is_refused_without_csrf(app, seeded, tokens):
    """POST /api/v1/nodes/{name}/ack takes no body, so a plain cross-site form could send it."""
    browser = TestClient(app, follow_redirects=False)
    sign_in(browser, tokens["operator"])
    r = browser.post("/api/v1/nodes/n1/ack", data={"x": "1"})
    assert r.status_code == 403, r.text
    assert "X-CSRF-Token" in r.json()["detail"]
    r = browser.post("/api/v1/nodes/n1/ack")
    assert r.status_code == 403, r.text


# --- sign-in rate limit -----------------------------------------------------------------------


@pytest.fixture
def limited_app(settings):  # type: ignore[no-untyped-def]
    return create_app(settings.model_copy(update={"login_attempts": 3, "login_window_s": 60}))


def _attempt(browser: TestClient, token: str):  # type: ignore[no-untyped-def]
    return browser.post(
        "/login", data={"token": token, "next": "/", "csrf_token": anonymous_csrf(browser)}
    )


def test_sign_in_is_rate_limited_per_client_address(limited_app, make_token):
    with TestClient(limited_app, follow_redirects=False) as browser:
        good = make_token("viewer")
        agent = make_token("agent", "n1")
        for bad in ("tw_wrong-1", agent, "tw_wrong-2"):  # an agent token counts as a failure
            r = _attempt(browser, bad)
            assert r.status_code == 401, r.text
        blocked = _attempt(browser, good)
        assert blocked.status_code == 429, blocked.text
        assert "Too many failed sign-ins" in blocked.text
        assert "wait 60 s and try again" in blocked.text
        assert is_login_redirect(browser.get("/"))  # not signed in
        # Another address is not affected.
        other = TestClient(limited_app, follow_redirects=False, client=("10.0.0.9", 40000))
        assert _attempt(other, good).status_code == 303


def test_successful_sign_ins_do_not_count(limited_app, make_token):
    with TestClient(limited_app, follow_redirects=False) as browser:
        good = make_token("viewer")
        for _ in range(5):
            browser.cookies.clear()  # signed out again
            assert _attempt(browser, good).status_code == 303

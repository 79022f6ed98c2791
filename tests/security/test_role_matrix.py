"""Who may change what, and who may read what: every role against every state-changing route
and every read (API and dashboard), with valid bodies so the role check is what decides. The
matrix runs on one backend (``one_backend``: PostgreSQL when configured): the role check is
Python, and the token and session SQL it reads is tested on both backends
(tests/web/test_sessions.py, tests/security/test_token_expiry.py, tests/web/test_signin.py).

The routes come from ``app.routes`` at collection time; :data:`MATRIX` holds the expected
answer per state-changing route and role, :data:`READS` per read route, and
:func:`test_every_state_changing_route_has_a_row` / :func:`test_every_read_route_has_a_row`
fail when a route exists that the tables do not cover (a new endpoint needs its row here
first). Agent tokens may only report, and call what agents call on the server (the peer
registry, :data:`AGENT_READS`): every other read refuses them with 403.

Roles (see ``security_support.ROLES``): no token, viewer, operator, admin, an agent token
for n1 (the node the requests are about) and an agent token for another node. API rows send
a bearer token; dashboard rows sign in through the form and post the session's CSRF token
(agents cannot sign in, so they send their bearer token with a valid anonymous CSRF token;
"none" posts with the anonymous CSRF token and is sent to the sign-in form).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient
from procs import BIN, base_env, wait_for
from security_support import (
    JOB,
    ROLES,
    STATE_CHANGING,
    anonymous_csrf,
    is_login_redirect,
    seed_cluster,
    sign_in,
)
from sqlalchemy import update
from support import auth, make_batch

from tierwatch.agent.protocol import utcnow
from tierwatch.server.config import Settings
from tierwatch.server.main import create_app
from tierwatch.server.tokens import ApiToken, lookup_token, revoke_token

OK = "ok"  # 2xx, or a 303 somewhere other than the sign-in form (a dashboard action's redirect)
LOGIN = "login"  # sent to the sign-in form (303 /login…, or 401 + HX-Redirect for htmx)
# Let past the role check: anything but 401/403/a sign-in redirect/5xx (a read of a command
# that does not exist is a 404, the demo report without a demo 404).
ALLOWED = "allowed"

PEOPLE_WRITE = {
    "none": 401,
    "viewer": 403,
    "operator": OK,
    "admin": OK,
    "agent_n1": 403,
    "agent_other": 403,
}
ADMIN_WRITE = {**PEOPLE_WRITE, "operator": 403}
#: What agents call on the server besides reporting (the peer registry): agents only.
AGENT_CALL: dict[str, int | str] = {
    "none": 401,
    "viewer": 403,
    "operator": 403,
    "admin": 403,
    "agent_n1": OK,
    "agent_other": OK,
}
PAGE_OPERATOR = {
    "none": LOGIN,
    "viewer": 403,
    "operator": OK,
    "admin": OK,
    "agent_n1": 403,
    "agent_other": 403,
}
PAGE_ADMIN = {**PAGE_OPERATOR, "operator": 403}


@dataclass(frozen=True)
class Row:
    """One state-changing route: how to call it and what each role gets.

    ``kind`` "api" sends ``json``/``content`` with a bearer token; "web" posts ``form`` (plus
    the CSRF token) from a dashboard session; "login" submits the role's token to the form.
    """

    kind: str
    expect: dict[str, int | str]
    json: Callable[[], Any] | None = None
    form: dict[str, str] = field(default_factory=dict)


def _node_key() -> str:
    """A fresh node key's public half, as an agent sends it for its certificate."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from tierwatch.agent.peer_identity import public_key_text

    return public_key_text(Ed25519PrivateKey.generate())


def _report() -> dict[str, Any]:
    return make_batch("n1", 7, offset_s=0).model_dump(mode="json")


MATRIX: dict[tuple[str, str], Row] = {
    # --- API ---
    ("POST", "/api/v1/ingest/report"): Row(
        "api",
        {
            "none": 401,
            "viewer": 403,
            "operator": 403,
            "admin": 403,
            "agent_n1": OK,
            "agent_other": 403,
        },
        json=_report,
    ),
    ("POST", "/api/v1/nodes/{name}/ack"): Row("api", PEOPLE_WRITE, json=lambda: {"note": "ok"}),
    ("POST", "/api/v1/nodes/{name}/isolate"): Row(
        "api", PEOPLE_WRITE, json=lambda: {"reason": "matrix"}
    ),
    ("POST", "/api/v1/nodes/{name}/release"): Row(
        "api", PEOPLE_WRITE, json=lambda: {"reason": "matrix"}
    ),
    ("POST", "/api/v1/jobs/{job_id}/restore"): Row(
        "api", PEOPLE_WRITE, json=lambda: {"reason": "matrix"}
    ),
    ("PUT", "/api/v1/policy"): Row("api", ADMIN_WRITE, json=lambda: {"breaker_pct": 25}),
    ("POST", "/api/v1/maintenance"): Row(
        "api", PEOPLE_WRITE, json=lambda: {"node": "n1", "duration_s": 600, "reason": "matrix"}
    ),
    # The first role allowed ends the seeded window; ending it again is a valid no-op.
    ("POST", "/api/v1/maintenance/{window_id}/end"): Row(
        "api", PEOPLE_WRITE, json=lambda: {"reason": "matrix"}
    ),
    # Registering the job again (the next role) replaces its registration: each call is valid.
    ("POST", "/api/v1/jobs/{job_id}/credential"): Row(
        "api", PEOPLE_WRITE, json=lambda: {"nodes": ["n1", "n2"]}
    ),
    # Any agent certifies its own node (the body names none); people are refused.
    ("POST", "/api/v1/agent/peer-certificate"): Row(
        "api", AGENT_CALL, json=lambda: {"public_key": _node_key(), "url": "http://n1:9470"}
    ),
    # --- dashboard ---
    # The "role" of a sign-in is the token submitted ("none": an empty field).
    ("POST", "/login"): Row(
        "login",
        {
            "none": 401,
            "viewer": OK,
            "operator": OK,
            "admin": OK,
            "agent_n1": 401,
            "agent_other": 401,
        },
    ),
    # Signing out is for anyone with the session's CSRF token; it always lands on /login.
    ("POST", "/logout"): Row("web", dict.fromkeys(ROLES, LOGIN)),
    ("POST", "/nodes/{name}/isolate"): Row("web", PAGE_OPERATOR, form={"reason": "matrix"}),
    ("POST", "/nodes/{name}/release"): Row("web", PAGE_OPERATOR, form={"reason": "matrix"}),
    ("POST", "/nodes/{name}/ack"): Row("web", PAGE_OPERATOR, form={"note": "matrix"}),
    ("POST", "/jobs/{job_id}/restore"): Row(
        "web", PAGE_OPERATOR, form={"step": "", "tier": "", "reason": "matrix"}
    ),
    ("POST", "/policy"): Row("web", PAGE_ADMIN, form={"breaker_pct": "25"}),
    ("POST", "/maintenance"): Row(
        "web", PAGE_OPERATOR, form={"node": "n1", "hours": "1", "reason": "matrix"}
    ),
    ("POST", "/maintenance/{window_id}/end"): Row("web", PAGE_OPERATOR, form={"reason": "matrix"}),
}
#: The id of the maintenance window each matrix test seeds (far above what the table's own
#: sequence hands out, so a window opened in the same test never collides with it).
WINDOW_ID = 2_000_000_000
PATH_PARAMS = {
    "name": "n1",
    "job_id": JOB,
    "command_id": "1",
    "request_id": "1",
    "window_id": str(WINDOW_ID),
    "step": "10",  # seed_cluster's job committed step 10 in memory
    "tier": "memory",
}

# --- reads ---
API_READ: dict[str, int | str] = {
    "none": 401,
    "viewer": ALLOWED,
    "operator": ALLOWED,
    "admin": ALLOWED,
    "agent_n1": 403,
    "agent_other": 403,
}
PAGE_READ: dict[str, int | str] = {**API_READ, "none": LOGIN}
#: Reads that name no principal: the sign-in form, the API's own description, liveness,
#: /metrics (public unless TIERWATCH_METRICS_REQUIRE_TOKEN; see tests/server/test_metrics.py)
#: and the job-credential public keys (agents verify job credentials with them).
PUBLIC_READS = frozenset(
    {
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        "/login",
        "/favicon.ico",
        "/healthz",
        "/metrics",
        "/api/v1/credentials/public-keys",
    }
)
READS: dict[str, dict[str, int | str]] = {
    "/api/v1/nodes": API_READ,
    "/api/v1/nodes/{name}": API_READ,
    "/api/v1/nodes/{name}/samples": API_READ,
    "/api/v1/events": API_READ,
    "/api/v1/jobs": API_READ,
    "/api/v1/jobs/{job_id}": API_READ,
    "/api/v1/jobs/{job_id}/history": API_READ,
    "/api/v1/jobs/{job_id}/steps": API_READ,
    "/api/v1/jobs/{job_id}/steps/{step}/{tier}": API_READ,
    "/api/v1/jobs/{job_id}/restores": API_READ,
    "/api/v1/restores/{request_id}": API_READ,
    "/api/v1/commands": API_READ,
    "/api/v1/commands/{command_id}": API_READ,
    "/api/v1/audit": API_READ,
    "/api/v1/policy": API_READ,
    "/api/v1/maintenance": API_READ,
    "/api/v1/alerts": API_READ,
    "/api/v1/demo/report": API_READ,
    "/": PAGE_READ,
    "/nodes/{name}": PAGE_READ,
    "/jobs/{job_id}": PAGE_READ,
    "/jobs/{job_id}/steps/{step}/{tier}": PAGE_READ,
    "/alerts": PAGE_READ,
    "/audit": PAGE_READ,
    "/policy": PAGE_READ,
    "/maintenance": PAGE_READ,
    "/demo": PAGE_READ,
    # The peer registry: agents only; a job's layout only for the agents of its nodes.
    "/api/v1/agent/peers": AGENT_CALL,
    "/api/v1/agent/jobs/{job_id}": {**AGENT_CALL, "agent_other": 403},
}
#: Reads for agents (the peer registry): their refusals of people name what agents may do.
AGENT_READS = frozenset({"/api/v1/agent/peers", "/api/v1/agent/jobs/{job_id}"})
#: Query strings the reads need to be valid.
READ_QUERIES = {"/api/v1/agent/peers": "?node=n1&node=n2"}


def state_changing_routes(app) -> set[tuple[str, str]]:  # type: ignore[no-untyped-def]
    """(method, path) of every state-changing route of ``app`` (API and dashboard)."""
    found = set()
    for route in iter_route_contexts(app.routes):
        path = route.path
        for method in route.methods or ():
            if method in STATE_CHANGING and path is not None:
                found.add((method, path))
    return found


def read_routes(app) -> set[str]:  # type: ignore[no-untyped-def]
    """Paths of every GET route of ``app`` (API and dashboard)."""
    return {
        route.path
        for route in iter_route_contexts(app.routes)
        if "GET" in (route.methods or ()) and route.path is not None
    }


def _collection_app():  # type: ignore[no-untyped-def]
    # Routes only: create_app() opens no connection until its lifespan runs.
    return create_app(Settings(database_url="sqlite:///:memory:", dev=True))


_APP = _collection_app()
ROUTES = state_changing_routes(_APP)
# Rows of routes that do not exist (yet) are not collected; every route that exists has a
# row, or test_every_state_changing_route_has_a_row fails.
PRESENT = sorted(key for key in MATRIX if key in ROUTES)
READS_PRESENT = sorted(path for path in READS if path in read_routes(_APP))


def test_every_state_changing_route_has_a_row(app):
    missing = sorted(state_changing_routes(app) - MATRIX.keys())
    assert not missing, (
        "state-changing routes without a row in tests/security/test_role_matrix.py MATRIX "
        f"(add the expected status per role): {missing}"
    )
    for key, row in MATRIX.items():
        assert set(row.expect) == set(ROLES), f"{key}: expectations must name every role"


def test_every_read_route_has_a_row(app):
    missing = sorted(read_routes(app) - READS.keys() - PUBLIC_READS)
    assert not missing, (
        "read routes without a row in tests/security/test_role_matrix.py READS (add the "
        f"expected status per role, or list a route that names no principal in PUBLIC_READS): "
        f"{missing}"
    )
    assert not READS.keys() & PUBLIC_READS
    for path, expect in READS.items():
        assert set(expect) == set(ROLES), f"{path}: expectations must name every role"


def _verdict(response, expected: int | str) -> bool:  # type: ignore[no-untyped-def]
    if expected == LOGIN:
        return is_login_redirect(response)
    if expected == ALLOWED:
        return response.status_code not in (401, 403) and not is_login_redirect(response)
    if expected == OK:
        if response.status_code == 303:
            return not is_login_redirect(response)
        return 200 <= response.status_code < 300
    return response.status_code == expected


def _describe(response) -> str:  # type: ignore[no-untyped-def]
    where = response.headers.get("location") or response.headers.get("hx-redirect")
    return (
        f"{response.status_code}"
        + (f" -> {where}" if where else "")
        + (f" {response.text[:160]!r}" if response.status_code not in (303,) else "")
    )


def _call(app, client: TestClient, tokens, key: tuple[str, str], row: Row, role: str):  # type: ignore[no-untyped-def]
    method, template = key
    path = template.format(**PATH_PARAMS)
    token = tokens[role]
    if row.kind == "api":
        headers = auth(token) if token else {}
        return client.request(
            method,
            path,
            json=row.json() if row.json else None,
            headers=headers,
            follow_redirects=False,
        )
    # Dashboard: a fresh browser-like client per role, so cookies never leak between roles.
    browser = TestClient(app, follow_redirects=False)
    if row.kind == "login":
        return browser.post(
            path, data={"token": token or "", "next": "/", "csrf_token": anonymous_csrf(browser)}
        )
    headers: dict[str, str] = {}
    if role in ("viewer", "operator", "admin"):
        csrf = sign_in(browser, token)
    else:
        csrf = anonymous_csrf(browser)
        if token:
            headers = auth(token)
    return browser.request(method, path, data={**row.form, "csrf_token": csrf}, headers=headers)


@pytest.mark.one_backend
@pytest.mark.parametrize("key", PRESENT, ids=[f"{m} {p}" for m, p in PRESENT])
def test_role_matrix(app, client, tokens, key):
    seed_cluster(client, tokens)
    _seed_window(app)
    row = MATRIX[key]
    wrong = {}
    for role in ROLES:
        response = _call(app, client, tokens, key, row, role)
        if response.status_code >= 500 or not _verdict(response, row.expect[role]):
            wrong[role] = f"expected {row.expect[role]}, got {_describe(response)}"
    assert not wrong, f"{key[0]} {key[1]}: {wrong}"


def _seed_window(app) -> None:  # type: ignore[no-untyped-def]
    """An active maintenance window on n1 with id :data:`WINDOW_ID`."""
    from datetime import timedelta

    from tierwatch.server.actions.models import MaintenanceWindow

    now = utcnow()
    with app.state.sessionmaker() as s:
        s.add(
            MaintenanceWindow(
                id=WINDOW_ID,
                scope="node",
                node="n1",
                starts_at=now,
                ends_at=now + timedelta(hours=1),
                reason="seeded",
                created_by="matrix",
                created_at=now,
                ended_by="",
            )
        )
        s.commit()


def _read(app, client: TestClient, tokens, path: str, role: str):  # type: ignore[no-untyped-def]
    """GET ``path`` as ``role``: a bearer token for the API and for agents; people sign in
    to the dashboard for its pages (as a browser would)."""
    token = tokens[role]
    if path.startswith("/api/") or role not in ("viewer", "operator", "admin"):
        return client.get(path, headers=auth(token) if token else {}, follow_redirects=False)
    browser = TestClient(app, follow_redirects=False)
    sign_in(browser, token)
    return browser.get(path)


@pytest.mark.one_backend
@pytest.mark.parametrize("template", READS_PRESENT)
def test_read_matrix(app, client, tokens, template):
    """People read everything; agent tokens read nothing (403 saying what they are for) but
    the peer registry, which only agents read."""
    seed_cluster(client, tokens)
    path = template.format(**PATH_PARAMS) + READ_QUERIES.get(template, "")
    expect = READS[template]
    wrong = {}
    for role in ROLES:
        response = _read(app, client, tokens, path, role)
        if response.status_code >= 500 or not _verdict(response, expect[role]):
            wrong[role] = f"expected {expect[role]}, got {_describe(response)}"
        elif template in AGENT_READS:
            if response.status_code == 403 and not role.startswith("agent"):
                if "only agent tokens" not in response.json()["detail"]:
                    wrong[role] = f"403 without saying who may: {response.text[:160]!r}"
        elif role.startswith("agent") and path.startswith("/api/"):
            detail = response.json()["detail"]
            if "agent tokens may only report" not in detail:
                wrong[role] = f"403 without saying what agent tokens are for: {detail!r}"
        elif role.startswith("agent") and "agent tokens may only report" not in response.text:
            wrong[role] = "403 page without saying what agent tokens are for"
    assert not wrong, f"GET {template}: {wrong}"


@pytest.mark.parametrize("path", sorted(PUBLIC_READS & read_routes(_APP)))
def test_public_reads_answer_everyone(client, tokens, path):
    for role in ROLES:
        token = tokens[role]
        r = client.get(path, headers=auth(token) if token else {}, follow_redirects=False)
        assert r.status_code in (200, 204, 303), (role, r.status_code, r.text[:200])


def test_people_read_the_audit_log_and_agents_do_not(seeded, tokens):
    client = seeded
    r = client.post(
        "/api/v1/nodes/n1/isolate", json={"reason": "audit me"}, headers=auth(tokens["operator"])
    )
    assert r.status_code == 200, r.text
    for role in ("viewer", "operator", "admin"):
        r = client.get("/api/v1/audit", headers=auth(tokens[role]))
        assert r.status_code == 200, (role, r.text)
        assert [e["reason"] for e in r.json()][:1] == ["audit me"], role
    for role in ("agent_n1", "agent_other"):
        r = client.get("/api/v1/audit", headers=auth(tokens[role]))
        assert r.status_code == 403, (role, r.text)
        assert "audit me" not in r.text
        assert r.json()["detail"].startswith("agent tokens may only report"), r.text
    assert client.get("/api/v1/audit").status_code == 401


def test_agent_tokens_still_reach_what_the_agent_calls(seeded, tokens):
    """What the agent (agent/reporter.py) calls on the server keeps working for its token:
    the report, whose answer carries the node's pending commands."""
    from tierwatch.agent.reporter import INGEST_PATH

    r = seeded.post(
        INGEST_PATH,
        content=make_batch("n1", 3).model_dump_json(),
        headers={**auth(tokens["agent_n1"]), "Content-Type": "application/json"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["acked_seq"] == 3


# --- revocation ------------------------------------------------------------------------------


def _token_id(app, token: str) -> int:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker() as s:
        row = lookup_token(s, token)
        assert row is not None
        return row.id


def test_token_revoked_in_this_process_stops_working_at_once(app, seeded, tokens):
    """The default 30 s token cache must not outlive a revocation made in this process."""
    client = seeded
    assert app.state.settings.token_cache_s >= 30
    op = auth(tokens["operator"])
    assert client.get("/api/v1/nodes", headers=op).status_code == 200  # now cached
    assert (
        client.post("/api/v1/nodes/n1/isolate", json={"reason": "before"}, headers=op).status_code
        == 200
    )
    with app.state.sessionmaker() as s:
        revoke_token(s, _token_id(app, tokens["operator"]))
        s.commit()
    assert client.get("/api/v1/nodes", headers=op).status_code == 401
    r = client.post("/api/v1/nodes/n1/release", json={"reason": "after"}, headers=op)
    assert r.status_code == 401, r.text
    assert "revoked" in r.json()["detail"]


def test_rolled_back_revocation_keeps_the_token(app, seeded, tokens):
    client = seeded
    viewer = auth(tokens["viewer"])
    assert client.get("/api/v1/nodes", headers=viewer).status_code == 200
    with app.state.sessionmaker() as s:
        revoke_token(s, _token_id(app, tokens["viewer"]))
        s.rollback()
    assert client.get("/api/v1/nodes", headers=viewer).status_code == 200


def test_revoked_session_cannot_act_on_the_dashboard(app, seeded, tokens):
    browser = TestClient(app, follow_redirects=False)
    csrf = sign_in(browser, tokens["operator"])
    assert browser.get("/").status_code == 200  # cached for the session's token
    with app.state.sessionmaker() as s:
        revoke_token(s, _token_id(app, tokens["operator"]))
        s.commit()
    r = browser.post(
        "/api/v1/nodes/n1/isolate", json={"reason": "revoked"}, headers={"X-CSRF-Token": csrf}
    )
    assert r.status_code == 401, r.text
    assert is_login_redirect(browser.get("/"))
    node = seeded.get("/api/v1/nodes/n1", headers=auth(tokens["viewer"])).json()
    assert node["isolated"] is False


def _revoke_elsewhere(database_url: str, token_id: int) -> None:
    """Revoke as an operator would from another machine: ``tierwatch-server token revoke``."""
    subprocess.run(
        [str(BIN / "tierwatch-server"), "token", "revoke", str(token_id)],
        env=base_env(TIERWATCH_DATABASE_URL=database_url),
        check=True,
        capture_output=True,
        timeout=60,
    )


def test_token_revoked_by_the_cli_cannot_change_anything(settings, make_token):
    """Another process's revocation cannot clear this process's cache: writes by people are
    checked against the database every time, reads stop within token_cache_s."""
    app = create_app(settings.model_copy(update={"token_cache_s": 1.0}))
    with TestClient(app) as client:
        tokens = {
            "agent_n1": make_token("agent", "n1"),
            "agent_n2": make_token("agent", "n2"),
            "viewer": make_token("viewer"),
            "operator": make_token("operator"),
            "admin": make_token("admin"),
        }
        seed_cluster(client, tokens)
        for role in ("operator", "admin"):
            h = auth(tokens[role])
            assert client.get("/api/v1/nodes", headers=h).status_code == 200  # cached
            _revoke_elsewhere(settings.database_url, _token_id(app, tokens[role]))
            writes = [
                client.post("/api/v1/nodes/n1/isolate", json={"reason": "x"}, headers=h),
                client.post("/api/v1/nodes/n1/ack", json={}, headers=h),
                client.post(f"/api/v1/jobs/{JOB}/restore", json={"reason": "x"}, headers=h),
                client.put("/api/v1/policy", json={"enabled": False}, headers=h),
            ]
            assert [w.status_code for w in writes] == [401] * 4, [w.text for w in writes]
            wait_for(
                lambda h=h: client.get("/api/v1/nodes", headers=h).status_code == 401,
                timeout=10,
                what="revoked token refused for reads",
            )
        node = client.get("/api/v1/nodes/n1", headers=auth(tokens["viewer"])).json()
        assert node["isolated"] is False


def test_agent_token_revoked_elsewhere_stops_within_the_cache_window(settings, make_token):
    """Agent reports keep the token cache (the hot path): refused within token_cache_s."""
    app = create_app(settings.model_copy(update={"token_cache_s": 0.5}))
    with TestClient(app) as client:
        token = make_token("agent", "n1")
        body = make_batch("n1", 1).model_dump_json()
        headers = {**auth(token), "Content-Type": "application/json"}
        assert (
            client.post("/api/v1/ingest/report", content=body, headers=headers).status_code == 200
        )
        with app.state.engine.begin() as conn:  # as another process would: no hook runs
            conn.execute(
                update(ApiToken).where(ApiToken.node_name == "n1").values(revoked_at=utcnow())
            )
        wait_for(
            lambda: (
                client.post("/api/v1/ingest/report", content=body, headers=headers).status_code
                == 401
            ),
            timeout=10,
            what="revoked agent token refused",
        )

"""Dashboard actions: operators see and use the isolate / release / acknowledge / restore
forms (confirm step, required reason, CSRF, post/redirect/get with a message); viewers see
the same pages without them and are refused; the audit and policy pages."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from support import auth, make_batch, post_batch, register_job
from web_support import csrf_from, sign_in

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, ReportBatch, utcnow


@pytest.fixture
def signed_in(client: TestClient, make_token):
    def _as(role: str) -> TestClient:
        client.cookies.clear()
        r = sign_in(client, make_token(role))
        assert r.status_code == 303, r.text
        return client

    return _as


@pytest.fixture
def node(client, make_token) -> str:
    token = make_token("agent", "gpu-07")
    r = post_batch(client, token, make_batch("gpu-07", 1, gpus=4, xids=[(3, 79)]))
    assert r.status_code == 200
    return "gpu-07"


def _post(client: TestClient, path: str, page: str, **data):
    html = client.get(page).text
    return client.post(path, data={"csrf_token": csrf_from(html), **data}, follow_redirects=False)


def test_operator_isolates_and_releases_from_the_node_page(signed_in, node):
    client = signed_in("operator")
    page = client.get(f"/nodes/{node}").text
    assert 'data-action="isolate"' in page
    assert "Confirm isolate" in page
    r = _post(client, f"/nodes/{node}/isolate", f"/nodes/{node}", reason="XID 79 on GPU 3")
    assert r.status_code == 303
    assert r.headers["location"] == f"/nodes/{node}"
    page = client.get(f"/nodes/{node}").text
    assert "gpu-07 isolated (driver none: recorded only)." in page
    assert 'data-isolated="true"' in page
    assert "XID 79 on GPU 3" in page
    assert 'data-action="release"' in page
    # The message shows once.
    assert "recorded only" not in client.get(f"/nodes/{node}").text
    r = _post(client, f"/nodes/{node}/release", f"/nodes/{node}", reason="GPU reseated")
    assert r.status_code == 303
    assert 'data-isolated="true"' not in client.get(f"/nodes/{node}").text


def test_empty_reason_changes_nothing_and_says_why(signed_in, node):
    client = signed_in("operator")
    r = _post(client, f"/nodes/{node}/isolate", f"/nodes/{node}", reason="   ")
    assert r.status_code == 303
    page = client.get(f"/nodes/{node}").text
    assert "Give a reason" in page
    assert 'data-isolated="true"' not in page


def test_acknowledge_from_the_node_page_clears_the_xid(signed_in, node, client, make_token):
    client = signed_in("operator")
    assert 'data-action="ack"' in client.get(f"/nodes/{node}").text
    r = _post(client, f"/nodes/{node}/ack", f"/nodes/{node}", note="GPU reset")
    assert r.status_code == 303
    api = client.get(f"/api/v1/nodes/{node}", headers=auth(make_token("viewer"))).json()
    assert api["reasons"] == []
    audit = client.get(
        "/api/v1/audit", params={"action": "ack"}, headers=auth(make_token("viewer"))
    ).json()
    assert audit[0]["reason"] == "GPU reset"


def test_viewer_sees_no_buttons_and_is_refused(signed_in, node):
    client = signed_in("viewer")
    page = client.get(f"/nodes/{node}").text
    assert "Confirm isolate" not in page
    assert 'id="node-actions"' not in page
    r = _post(client, f"/nodes/{node}/isolate", f"/nodes/{node}", reason="try")
    assert r.status_code == 403
    assert "needs the operator role" in r.text


def test_form_without_csrf_token_is_refused(signed_in, node):
    client = signed_in("operator")
    r = client.post(f"/nodes/{node}/isolate", data={"reason": "x"}, follow_redirects=False)
    assert r.status_code == 403
    assert "CSRF" in r.text


def _job(client, make_token) -> str:
    register_job(client, "llm", ["gpu-07"])
    tok = make_token("agent", "gpu-07")
    ev = [
        CheckpointEvent(
            job_id="llm", step=s, tier="memory", kind="committed", rank=0, world_size=1, ts=utcnow()
        )
        for s in (10, 20)
    ]
    batch = ReportBatch(
        node="gpu-07",
        epoch="e2",
        seq=1,
        sent_at=utcnow(),
        checkpoint_events=ev,
        progress=[
            JobProgress(job_id="llm", rank=0, world_size=1, step=22, ts=utcnow(), layout=["gpu-07"])
        ],
    )
    assert post_batch(client, tok, batch).status_code == 200
    return "llm"


def test_operator_requests_a_restore_from_the_job_page(signed_in, node, client, make_token):
    job = _job(client, make_token)
    client = signed_in("operator")
    page = client.get(f"/jobs/{job}").text
    assert '<option value="10">10 (memory)</option>' in page
    r = _post(
        client, f"/jobs/{job}/restore", f"/jobs/{job}", step="10", tier="", reason="loss spike"
    )
    assert r.status_code == 303
    page = client.get(f"/jobs/{job}").text
    assert "to step 10 requested" in page
    assert 'data-phase="pending"' in page
    r = _post(client, f"/jobs/{job}/restore", f"/jobs/{job}", step="15", reason="x")
    page = client.get(f"/jobs/{job}").text
    assert "Restore refused: step 15 is not held completely" in page
    r = _post(client, f"/jobs/{job}/restore", f"/jobs/{job}", step="abc", reason="x")
    assert "Step must be a whole number" in client.get(f"/jobs/{job}").text


def test_audit_page_lists_and_filters(signed_in, node, client):
    client = signed_in("operator")
    _post(client, f"/nodes/{node}/isolate", f"/nodes/{node}", reason="first")
    _post(client, f"/nodes/{node}/release", f"/nodes/{node}", reason="second")
    client = signed_in("viewer")
    page = client.get("/audit").text
    assert page.count('data-action="isolate"') == 1
    assert page.count('data-action="release"') == 1
    only = client.get("/audit", params={"action": "release"}).text
    assert 'data-action="isolate"' not in only
    assert "second" in only


def test_policy_page_admin_changes_it(signed_in):
    client = signed_in("operator")
    page = client.get("/policy").text
    assert 'data-policy="off"' in page
    assert "Change the policy" not in page
    r = _post(client, "/policy", "/policy", enabled="on")
    assert r.status_code == 403
    client = signed_in("admin")
    r = _post(client, "/policy", "/policy", enabled="on", breaker_pct="20")
    assert r.status_code == 303
    page = client.get("/policy").text
    assert 'data-policy="on"' in page
    assert "auto-isolation is ON" in page
    r = _post(client, "/policy", "/policy", enabled="on", breaker_pct="500")
    assert "Policy not changed: breaker_pct" in client.get("/policy").text
    assert 'data-policy="on"' in client.get("/").text


def test_restore_form_with_a_bad_tier_changes_nothing(signed_in, node, client, make_token):
    job = _job(client, make_token)
    client = signed_in("operator")
    _post(client, f"/jobs/{job}/restore", f"/jobs/{job}", step="10", tier="disk", reason="x")
    page = client.get(f"/jobs/{job}").text
    assert "Tier must be memory, peer or persistent" in page
    assert "restore-request" not in page


def test_over_long_form_input_gets_a_page_not_json(signed_in, node):
    client = signed_in("operator")
    r = _post(client, f"/nodes/{node}/isolate", f"/nodes/{node}", reason="x" * 1001)
    assert r.status_code == 422
    assert r.headers["content-type"].startswith("text/html")
    assert "Nothing was changed" in r.text
    assert "reason" in r.text
    assert 'data-isolated="true"' not in client.get(f"/nodes/{node}").text


def test_turning_the_policy_off_lets_the_breaker_go(signed_in, client, make_token):
    from tierwatch.agent.protocol import utcnow
    from tierwatch.server.actions import policy
    from tierwatch.server.actions.models import PolicySettingsRow

    app = client.app
    # The test runs the policy pass itself: the app's own loop would race it to the reset.
    client.portal.call(app.state.background.stop)
    with app.state.sessionmaker() as s:
        s.add(
            PolicySettingsRow(
                id=1,
                enabled=False,
                updated_by="",
                breaker_message="held",
                breaker_tripped_at=utcnow(),
            )
        )
        s.commit()
        run = policy.run(s, app.state.settings, now=utcnow())
        s.commit()
    assert run.reset
    client = signed_in("viewer")
    assert 'data-breaker="ok"' in client.get("/").text

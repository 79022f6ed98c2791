"""Auth and input validation of the REST API: clear 401/403/404/413/422, never a 500."""

from __future__ import annotations

import json

import pytest
from support import auth, make_batch, post_batch

# Request checks, not SQL: PostgreSQL when configured, else SQLite.
pytestmark = pytest.mark.one_backend


def test_ingest_without_token_is_401(client):
    r = client.post("/api/v1/ingest/report", content=make_batch("n1", 1).model_dump_json())
    assert r.status_code == 401
    assert "Bearer" in r.json()["detail"]


def test_ingest_with_unknown_token_is_401(client):
    r = post_batch(client, "tw_not-a-real-token", make_batch("n1", 1))
    assert r.status_code == 401
    assert r.json()["detail"] == "unknown or revoked token"


def test_malformed_authorization_header_is_401(client):
    r = client.get("/api/v1/nodes", headers={"Authorization": "Token abc"})
    assert r.status_code == 401
    assert "Bearer" in r.json()["detail"]


def test_agent_token_for_other_node_is_403_and_stores_nothing(client, make_token):
    token_a = make_token("agent", "node-a")
    viewer = make_token("viewer")
    r = post_batch(client, token_a, make_batch("node-b", 1))
    assert r.status_code == 403
    assert "node-a" in r.json()["detail"]
    assert "node-b" in r.json()["detail"]
    assert client.get("/api/v1/nodes", headers=auth(viewer)).json()["nodes"] == []


def test_viewer_token_cannot_report(client, make_token):
    r = post_batch(client, make_token("viewer"), make_batch("n1", 1))
    assert r.status_code == 403
    assert "agent" in r.json()["detail"]


def test_read_endpoints_need_a_token(client):
    for path in ("/api/v1/nodes", "/api/v1/events", "/api/v1/nodes/x", "/api/v1/nodes/x/samples"):
        assert client.get(path).status_code == 401, path


def _revoke_all(app):
    from tierwatch.server.tokens import list_tokens, revoke_token

    with app.state.sessionmaker() as s:
        for t in list_tokens(s):
            revoke_token(s, t.id)
        s.commit()


def test_revoked_token_stops_working_at_once_without_cache(settings, make_token):
    from fastapi.testclient import TestClient

    from tierwatch.server.main import create_app

    app = create_app(settings.model_copy(update={"token_cache_s": 0}))
    with TestClient(app) as c:
        viewer = make_token("viewer")
        assert c.get("/api/v1/nodes", headers=auth(viewer)).status_code == 200
        _revoke_all(app)
        assert c.get("/api/v1/nodes", headers=auth(viewer)).status_code == 401


def test_revoked_token_stops_working_within_the_cache_ttl(settings, make_token):
    from fastapi.testclient import TestClient
    from procs import wait_for

    from tierwatch.server.main import create_app

    app = create_app(settings.model_copy(update={"token_cache_s": 0.5}))
    with TestClient(app) as c:
        viewer = make_token("viewer")
        assert c.get("/api/v1/nodes", headers=auth(viewer)).status_code == 200
        _revoke_all(app)
        # still remembered for at most 0.5 s, then refused
        wait_for(
            lambda: c.get("/api/v1/nodes", headers=auth(viewer)).status_code == 401,
            timeout=5,
            what="revoked token refused",
        )


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b.update(seq=0), "body.seq"),
        (lambda b: b.update(node="bad name!"), "body.node"),
        (lambda b: b["samples"][0].update(temperature_c="hot"), "body.samples.0.temperature_c"),
        (lambda b: b["samples"][1].update(ts="2026-01-01T00:00:00"), "body.samples.1.ts"),
        (lambda b: b.update(surprise=1), "body.surprise"),
        (lambda b: b["samples"][0].update(ecc_dbe_volatile=-1), "body.samples.0.ecc_dbe_volatile"),
        (lambda b: b.pop("epoch"), "body.epoch"),
        # values the database could not store must be refused here, not fail at INSERT
        (
            lambda b: b["samples"][0].update(ecc_sbe_volatile=2**64),
            "body.samples.0.ecc_sbe_volatile",
        ),
        (lambda b: b["gpus"][0].update(name="H100\u0000"), "body.gpus.0.name"),
        (lambda b: b.update(seq=2**63), "body.seq"),
    ],
)
def test_junk_report_is_422_with_field_path(client, make_token, mutate, field):
    token = make_token("agent", "n1")
    body = json.loads(make_batch("n1", 1).model_dump_json())
    mutate(body)
    r = client.post("/api/v1/ingest/report", json=body, headers=auth(token))
    assert r.status_code == 422
    payload = r.json()
    assert field in [e["field"] for e in payload["errors"]]
    assert field in payload["detail"]


def test_non_finite_numbers_are_422(client, make_token):
    token = make_token("agent", "n1")
    body = make_batch("n1", 1).model_dump_json().replace('"power_w":400.0', '"power_w":Infinity', 1)
    r = client.post(
        "/api/v1/ingest/report",
        content=body,
        headers={**auth(token), "Content-Type": "application/json"},
    )
    assert r.status_code == 422


def test_invalid_json_is_422(client, make_token):
    token = make_token("agent", "n1")
    r = client.post(
        "/api/v1/ingest/report",
        content=b"{not json",
        headers={**auth(token), "Content-Type": "application/json"},
    )
    assert r.status_code == 422


def test_oversized_body_is_413_by_content_length(client, make_token, settings):
    token = make_token("agent", "n1")
    big = b"x" * (settings.max_body_bytes + 1)
    r = client.post("/api/v1/ingest/report", content=big, headers=auth(token))
    assert r.status_code == 413
    assert "limit" in r.json()["detail"]


def test_oversized_chunked_body_is_413(client, make_token, settings):
    token = make_token("agent", "n1")

    def chunks():
        for _ in range(settings.max_body_bytes // 65536 + 2):
            yield b"y" * 65536

    r = client.post("/api/v1/ingest/report", content=chunks(), headers=auth(token))
    assert r.status_code == 413


def test_unknown_node_is_404(client, make_token):
    viewer = make_token("viewer")
    for path in ("/api/v1/nodes/ghost", "/api/v1/nodes/ghost/samples", "/api/v1/events?node=ghost"):
        r = client.get(path, headers=auth(viewer))
        assert r.status_code == 404, path
        assert "ghost" in r.json()["detail"]


@pytest.mark.parametrize(
    "query",
    [
        "metric=bogus",
        "since=yesterday",
        "since=2026-01-01T00:00:00",  # naive: ambiguous, refused
        "gpu=-1",
        "limit=0",
        "since=2030-01-02T00:00:00Z&until=2030-01-01T00:00:00Z",
    ],
)
def test_bad_sample_queries_are_422(client, make_token, query):
    agent = make_token("agent", "n1")
    assert post_batch(client, agent, make_batch("n1", 1)).status_code == 200
    r = client.get(f"/api/v1/nodes/n1/samples?{query}", headers=auth(make_token("viewer")))
    assert r.status_code == 422, r.text
    assert r.json()["detail"]


def test_bad_event_filters_are_422(client, make_token):
    viewer = make_token("viewer")
    assert client.get("/api/v1/events?kind=nope", headers=auth(viewer)).status_code == 422
    assert client.get("/api/v1/nodes?state=sleepy", headers=auth(viewer)).status_code == 422


def test_ack_needs_operator(client, make_token):
    agent = make_token("agent", "n1")
    post_batch(client, agent, make_batch("n1", 1))
    r = client.post("/api/v1/nodes/n1/ack", json={}, headers=auth(make_token("viewer")))
    assert r.status_code == 403
    assert "operator" in r.json()["detail"]


def test_openapi_is_served(client):
    spec = client.get("/openapi.json").json()
    assert "/api/v1/nodes" in spec["paths"]
    assert "/api/v1/ingest/report" in spec["paths"]
    assert client.get("/docs").status_code == 200


def test_healthz_and_metrics_need_no_token(client):
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/metrics").status_code == 200


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b["samples"][0].update(ts="2999-01-01T00:00:00Z"), "body.samples.0.ts"),
        (lambda b: b.update(sent_at="9999-12-31T23:59:59-14:00"), "body.sent_at"),
        (lambda b: b["samples"][1].update(ts="0001-01-01T00:00:00+14:00"), "body.samples.1.ts"),
        (lambda b: b["samples"][0].update(ts="1970-01-01T00:00:00Z"), "body.samples.0.ts"),
    ],
)
def test_impossible_times_are_422_and_store_nothing(client, make_token, mutate, field):
    """A reading from the future would pin a GPU's latest value; refuse it, naming the field."""
    token, viewer = make_token("agent", "n1"), make_token("viewer")
    body = json.loads(make_batch("n1", 1).model_dump_json())
    mutate(body)
    r = client.post("/api/v1/ingest/report", json=body, headers=auth(token))
    assert r.status_code == 422, r.text
    assert field in [e["field"] for e in r.json()["errors"]]
    assert "clock" in r.json()["detail"]
    assert "SELECT" not in r.text
    assert client.get("/api/v1/nodes", headers=auth(viewer)).json()["nodes"] == []


def test_nul_and_impossible_names_never_reach_the_database(client, make_token):
    viewer, operator = make_token("viewer"), make_token("operator")
    post_batch(client, make_token("agent", "n1"), make_batch("n1", 1))
    for path in ("/api/v1/nodes/%00", "/api/v1/nodes/a%00b/samples", "/api/v1/events?node=a%00b"):
        r = client.get(path, headers=auth(viewer))
        assert r.status_code == 404, (path, r.text)
    assert client.get("/api/v1/nodes?name=n%00", headers=auth(viewer)).status_code == 200
    r = client.post("/api/v1/nodes/n1/ack", json={"note": "a\u0000b"}, headers=auth(operator))
    assert r.status_code == 422
    assert "body.note" in [e["field"] for e in r.json()["errors"]]


def test_ack_validates_the_rule_and_needs_no_body(client, make_token):
    operator = make_token("operator")
    post_batch(client, make_token("agent", "n1"), make_batch("n1", 1, xids=[(0, 79)]))
    bad = client.post("/api/v1/nodes/n1/ack", json={"rule": "nope"}, headers=auth(operator))
    assert bad.status_code == 422
    assert "unknown rule" in bad.json()["detail"]
    ok = client.post("/api/v1/nodes/n1/ack", headers=auth(operator))
    assert ok.status_code == 200
    assert ok.json()["cleared"] == 1
    assert ok.json()["node"]["state"] == "healthy"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b["gpus"].append(dict(b["gpus"][0])), "may appear once"),
        (lambda b: b["samples"][0].update(index=7), "names GPU 7"),
        (
            lambda b: b["xids"].append({"gpu": 99, "xid": 79, "ts": b["sent_at"]}),
            "names GPU 99",
        ),
    ],
)
def test_gpus_outside_the_inventory_are_422(client, make_token, mutate, message):
    token, viewer = make_token("agent", "n1"), make_token("viewer")
    body = json.loads(make_batch("n1", 1).model_dump_json())
    mutate(body)
    r = client.post("/api/v1/ingest/report", json=body, headers=auth(token))
    assert r.status_code == 422, r.text
    assert message in r.json()["detail"]
    assert client.get("/api/v1/nodes", headers=auth(viewer)).json()["nodes"] == []

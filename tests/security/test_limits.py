"""Input limits the API and the agent protocol must enforce before the database does:
ids and codes beyond a column's range are a 4xx that names the field, never a 5xx, and never
a 503 that an agent would retry from its spool for ever; a NUL character (which
PostgreSQL text cannot hold) is refused or matches nothing. Found by fuzzing (test_fuzz.py)
and probing its neighbours; both database backends (PostgreSQL ``integer`` is 32-bit).
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from security_support import JOB, seed_cluster
from support import auth, post_batch

from tierwatch.agent.protocol import CommandResult, ReportBatch, RestoreReport, utcnow
from tierwatch.server.config import Settings
from tierwatch.server.main import create_app

INT32_MAX = 2**31 - 1


def _report(client: TestClient, token: str, seq: int, **content):  # type: ignore[no-untyped-def]
    batch = ReportBatch.model_construct(
        node="n1", epoch="epoch-1", seq=seq, sent_at=utcnow(), protocol=1, **content
    )
    body = batch.model_dump_json(round_trip=True, warnings=False)
    return client.post(
        "/api/v1/ingest/report",
        content=body,
        headers={**auth(token), "Content-Type": "application/json"},
    )


@pytest.mark.parametrize("request_id", [INT32_MAX, INT32_MAX + 1, 2**62])
def test_restore_report_with_an_out_of_range_request_id_is_refused_not_retried(
    seeded, tokens, request_id
):
    """restore_requests.id is a 32-bit integer: a larger request id can name no request.
    On PostgreSQL it used to fail the insert: 503, which the agent retries for ever."""
    report = RestoreReport.model_construct(
        job_id=JOB,
        rank=0,
        world_size=2,
        step=10,
        ts=utcnow(),
        seconds=1.0,
        request_id=request_id,
        phase="loaded",
        ok=True,
        message="",
        files_by_tier={},
        sources={},
        steps_lost=None,
    )
    r = _report(seeded, tokens["agent_n1"], 10, restores=[report])
    if request_id <= INT32_MAX:
        assert r.status_code == 200, r.text  # unknown request: ignored
    else:
        assert r.status_code == 422, r.text
        assert "body.restores.0.request_id" in r.text


@pytest.fixture
def command_client(db_url: str):  # type: ignore[no-untyped-def]
    settings = Settings(
        database_url=db_url, dev=True, prune_interval_s=0, isolation={"driver": "command"}
    )
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.mark.parametrize("exit_code", [-(2**31), 255, INT32_MAX + 1, 2**70])
def test_command_result_exit_code_fits_its_column(command_client, make_token, exit_code):
    client = command_client
    tokens = {
        "agent_n1": make_token("agent", "n1"),
        "agent_n2": make_token("agent", "n2"),
        "viewer": make_token("viewer"),
    }
    seed_cluster(client, tokens)
    op = make_token("operator")
    cmd = client.post(
        "/api/v1/nodes/n1/isolate", json={"reason": "limits"}, headers=auth(op)
    ).json()["command"]
    assert cmd is not None
    r = post_batch(
        client, tokens["agent_n1"], ReportBatch(node="n1", epoch="epoch-1", seq=3, sent_at=utcnow())
    )
    assert [c["id"] for c in r.json()["commands"]] == [cmd["id"]]
    result = CommandResult.model_construct(
        id=cmd["id"], state="failed", ts=utcnow(), exit_code=exit_code, output=""
    )
    r = _report(client, tokens["agent_n1"], 4, command_results=[result])
    if -(2**31) <= exit_code <= INT32_MAX:
        assert r.status_code == 200, r.text
        got = client.get(f"/api/v1/commands/{cmd['id']}", headers=auth(op)).json()
        assert got["exit_code"] == exit_code
    else:
        assert r.status_code == 422, r.text
        assert "body.command_results.0.exit_code" in r.text


def test_unknown_restore_request_id_in_range_is_a_404(app, client, make_token):
    viewer = TestClient(app, raise_server_exceptions=False)
    r = viewer.get(f"/api/v1/restores/{INT32_MAX}", headers=auth(make_token("viewer")))
    assert r.status_code == 404, (r.status_code, r.text[:200])
    assert r.json()["detail"] == f"no restore request has id {INT32_MAX}"


@pytest.mark.parametrize("request_id", [INT32_MAX + 1, 2**63, 2**64])
def test_restore_request_id_beyond_the_column_is_a_422_never_a_500(
    app, client, make_token, request_id
):
    """GET /api/v1/restores/{request_id} with an id beyond the column's range (INT32)."""
    viewer = TestClient(app, raise_server_exceptions=False)
    r = viewer.get(f"/api/v1/restores/{request_id}", headers=auth(make_token("viewer")))
    assert r.status_code == 422, (r.status_code, r.text[:200])
    assert r.json()["errors"][0]["field"] == "path.request_id"


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/api/v1/audit", {"before_id": 2**62}),
        ("/api/v1/events", {"limit": 10_000}),
        (f"/api/v1/jobs/{JOB}/restores", {"limit": 200}),
    ],
)
def test_boundary_query_values_answer_an_empty_list(app, seeded, tokens, path, params):
    viewer = TestClient(app, raise_server_exceptions=False)
    r = viewer.get(path, params=params, headers=auth(tokens["viewer"]))
    assert r.status_code == 200, (r.status_code, r.text[:200])
    if path == "/api/v1/audit":
        # Seeding registered the job (audited): a before_id beyond every id filters nothing.
        everything = viewer.get(path, headers=auth(tokens["viewer"])).json()
        assert [e["action"] for e in everything] == ["job_register"], everything
        assert r.json() == everything
    else:
        assert r.json() == []


def test_boundary_samples_query_answers_no_samples(app, seeded, tokens):
    viewer = TestClient(app, raise_server_exceptions=False)
    r = viewer.get(
        "/api/v1/nodes/n1/samples",
        params={"gpu": 255, "limit": 100_000},
        headers=auth(tokens["viewer"]),
    )
    assert r.status_code == 200, (r.status_code, r.text[:200])
    assert (r.json()["node"], r.json()["samples"]) == ("n1", [])


def test_longest_command_id_that_matches_nothing_is_a_404(app, seeded, tokens):
    viewer = TestClient(app, raise_server_exceptions=False)
    r = viewer.get("/api/v1/commands/" + "9" * 64, headers=auth(tokens["viewer"]))
    assert r.status_code == 404, (r.status_code, r.text[:200])
    assert r.json()["detail"] == f"no command has id {'9' * 64!r}"


# --- NUL characters (PostgreSQL text cannot hold one) ------------------------------------------

NUL = "\x00"


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("POST", "/api/v1/nodes/n1/isolate", {"json": {"reason": f"a{NUL}b"}}),
        ("POST", "/api/v1/nodes/n1/release", {"json": {"reason": f"a{NUL}b"}}),
        ("POST", "/api/v1/nodes/n1/ack", {"json": {"note": f"a{NUL}b"}}),
        ("POST", f"/api/v1/jobs/{JOB}/restore", {"json": {"reason": f"a{NUL}b"}}),
    ],
    ids=["isolate", "release", "ack", "restore"],
)
def test_nul_in_a_body_is_a_422_naming_the_field(app, seeded, tokens, method, path, kwargs):
    caller = TestClient(app, raise_server_exceptions=False)
    r = caller.request(method, path, headers=auth(tokens["admin"]), **kwargs)
    assert r.status_code == 422, (r.status_code, r.text[:200])
    field = next(iter(kwargs["json"]))
    assert f"body.{field}" in r.text


def test_nul_in_the_alert_kind_filter_matches_nothing(app, seeded, tokens):
    """No alert kind holds a NUL, so the filter matches nothing (never sent to the database)."""
    caller = TestClient(app, raise_server_exceptions=False)
    r = caller.get("/api/v1/alerts", params={"kind": NUL}, headers=auth(tokens["viewer"]))
    assert r.status_code == 200, (r.status_code, r.text[:200])
    assert r.json()["alerts"] == []


@pytest.mark.parametrize(
    ("path", "params"),
    [
        ("/api/v1/commands", {"node": NUL}),
        ("/api/v1/audit", {"outcome": NUL}),
        ("/api/v1/audit", {"actor": NUL, "action": NUL, "target": NUL}),
    ],
    ids=lambda v: v if isinstance(v, str) else ",".join(v),
)
def test_nul_in_a_filter_is_a_422_naming_each_field(app, seeded, tokens, path, params):
    caller = TestClient(app, raise_server_exceptions=False)
    r = caller.get(path, params=params, headers=auth(tokens["viewer"]))
    assert r.status_code == 422, (r.status_code, r.text[:200])
    assert [e["field"] for e in r.json()["errors"]] == [f"query.{name}" for name in params]


def test_nul_in_the_events_node_filter_is_an_unknown_node(app, seeded, tokens):
    caller = TestClient(app, raise_server_exceptions=False)
    r = caller.get("/api/v1/events", params={"node": NUL}, headers=auth(tokens["viewer"]))
    assert r.status_code == 404, (r.status_code, r.text[:200])
    assert r.json()["detail"] == "no node named '\\x00'"


def test_nul_in_the_node_name_filter_is_dropped(app, seeded, tokens):
    """The name filter drops NULs (no name holds one), so it matches like the rest of it."""
    r = seeded.get("/api/v1/nodes", params={"name": f"n{NUL}2"}, headers=auth(tokens["viewer"]))
    assert r.status_code == 200, r.text
    assert [n["name"] for n in r.json()["nodes"]] == ["n2"]


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/?name=%00", 200),  # a filter: matches nothing
        ("/alerts?kind=%00", 200),
        ("/nodes/%00", 404),  # a name: no node or job has it
        ("/jobs/%00", 404),
    ],
)
def test_nul_in_a_dashboard_url_is_no_server_error(app, seeded, tokens, path, status):
    caller = TestClient(app, raise_server_exceptions=False)
    r = caller.get(path, headers=auth(tokens["viewer"]))
    assert r.status_code == status, (r.status_code, r.text[:200])

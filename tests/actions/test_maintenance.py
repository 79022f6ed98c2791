"""Maintenance windows: the rules (pure), the API (who may open and end one, bad input,
audit), the policy honouring them, the dashboard forms and the /metrics series."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import func, select
from support import auth, make_batch, post_batch
from web_support import csrf_from, sign_in

from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import maintenance, policy
from tierwatch.server.actions.maintenance import (
    ActiveMaintenance,
    MaintenanceIn,
    MaintenanceRefused,
    plan,
)
from tierwatch.server.actions.models import MaintenanceWindow
from tierwatch.server.config import Settings
from tierwatch.server.fleet.models import Node
from tierwatch.server.main import create_app

T0 = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
WEEK = 7 * 86400.0


# --- the rules (pure) ----------------------------------------------------------------------


def test_a_window_starts_now_and_lasts_its_duration() -> None:
    body = MaintenanceIn(node="n1", reason="GPU swap", duration_s=7200)
    assert plan(body, now=T0, max_s=WEEK) == (T0, T0 + timedelta(hours=2))
    later = MaintenanceIn(
        reason="upgrade", starts_at=T0 + timedelta(hours=1), ends_at=T0 + timedelta(hours=3)
    )
    assert plan(later, now=T0, max_s=WEEK) == (T0 + timedelta(hours=1), T0 + timedelta(hours=3))
    # a start a little in the past (clock skew) is taken as now
    skewed = MaintenanceIn(reason="x", starts_at=T0 - timedelta(seconds=30), duration_s=60)
    assert plan(skewed, now=T0, max_s=WEEK) == (T0, T0 + timedelta(seconds=60))


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"starts_at": T0 - timedelta(hours=1), "duration_s": 60}, "is in the past; leave it out"),
        ({"ends_at": T0 - timedelta(minutes=1)}, "is not after starts_at"),
        (
            {"duration_s": 8 * 86400},
            "longer than the 168 h allowed (TIERWATCH_POLICY__MAINTENANCE_MAX_S)",
        ),
        ({"starts_at": datetime(9999, 12, 31, tzinfo=UTC), "duration_s": 60}, "a year ahead"),
    ],
    ids=["past-start", "end-before-start", "too-long", "far-ahead"],
)
def test_a_window_that_cannot_be_opened_says_what_to_change(body, says) -> None:
    with pytest.raises(MaintenanceRefused) as info:
        plan(MaintenanceIn(reason="x", **body), now=T0, max_s=WEEK)
    assert says in str(info.value)


@pytest.mark.parametrize(
    "body",
    [
        {"reason": "x"},
        {"reason": "x", "duration_s": 60, "ends_at": T0},
        {"reason": "x", "duration_s": 0},
        {"reason": "  ", "duration_s": 60},
        {"reason": "x", "duration_s": 60, "ends_at_typo": T0},
        {"reason": "x", "ends_at": "2026-12-03T10:00:00"},  # no offset
        {"reason": "x", "duration_s": 1e300},  # past any calendar
    ],
    ids=["no-end", "both-ends", "zero", "blank-reason", "unknown-field", "naive-time", "huge"],
)
def test_bad_bodies_are_refused_by_the_schema(body) -> None:
    with pytest.raises(ValidationError):
        MaintenanceIn(**body)


def _window(id_, scope="node", node="n1", start=T0, end=T0 + timedelta(hours=1), ended=None):
    return SimpleNamespace(
        id=id_, scope=scope, node=node if scope == "node" else None, starts_at=start,
        ends_at=end, ended_at=ended, reason=f"w{id_}",
    )  # fmt: skip


def test_which_window_covers_what() -> None:
    windows = [
        _window(1, node="n1"),
        _window(2, node="n2", start=T0 + timedelta(hours=2), end=T0 + timedelta(hours=3)),
        _window(3, node="n3", ended=T0 - timedelta(minutes=1)),
        _window(4, node="n1", end=T0 + timedelta(hours=5)),
    ]
    now = T0 + timedelta(minutes=10)
    active = ActiveMaintenance.of(windows, now)
    assert active.covering("n1").id == 4  # the one open longest
    assert active.covering("n2") is None  # scheduled, not open yet
    assert active.covering("n3") is None  # ended early
    assert active.silencing({"node": "n1", "state": "unhealthy"}).id == 4
    assert active.silencing({"scope": "cluster"}) is None
    assert active.silencing({"job": "llama"}) is None
    with_cluster = ActiveMaintenance.of([*windows, _window(5, scope="cluster")], now)
    assert with_cluster.covering("n1").id == 4  # its own window outlasts the cluster's
    assert with_cluster.covering("n9").id == 5
    assert with_cluster.silencing({"scope": "cluster"}).id == 5
    assert with_cluster.silencing({"job": "llama"}) is None  # a job's owner is not on maintenance
    assert maintenance.state(windows[1], now) == "scheduled"
    assert maintenance.state(windows[2], now) == "over"
    assert maintenance.state(windows[0], T0 + timedelta(hours=1)) == "over"  # ends_at is open


# --- the API -------------------------------------------------------------------------------


@pytest.fixture
def reported(client: TestClient, make_token) -> TestClient:
    token = make_token("agent", "n1")
    assert post_batch(client, token, make_batch("n1", 1, gpus=2)).status_code == 200
    return client


def _count(app) -> int:
    with app.state.sessionmaker() as s:
        return s.scalar(select(func.count()).select_from(MaintenanceWindow)) or 0


def test_an_operator_opens_and_ends_a_window_and_both_are_audited(reported, make_token, app):
    op = auth(make_token("operator"))
    r = reported.post(
        "/api/v1/maintenance",
        json={"node": "n1", "duration_s": 3600, "reason": "GPU swap"},
        headers=op,
    )
    assert r.status_code == 201, r.text
    window = r.json()
    assert (window["scope"], window["node"], window["state"]) == ("node", "n1", "active")
    listed = reported.get("/api/v1/maintenance", headers=auth(make_token("viewer"))).json()
    assert [w["id"] for w in listed["windows"]] == [window["id"]]
    assert reported.get("/api/v1/maintenance", params={"node": "n2"}, headers=op).json() == {
        "windows": []
    }
    r = reported.post(
        f"/api/v1/maintenance/{window['id']}/end", json={"reason": "done"}, headers=op
    )
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "over"
    assert reported.get("/api/v1/maintenance", headers=op).json() == {"windows": []}
    over = reported.get("/api/v1/maintenance", params={"include_over": True}, headers=op).json()
    assert [w["state"] for w in over["windows"]] == ["over"]
    # ending it again changes nothing and says so in the audit log
    again = reported.post(
        f"/api/v1/maintenance/{window['id']}/end", json={"reason": "x"}, headers=op
    )
    assert again.status_code == 200
    entries = reported.get("/api/v1/audit", params={"target": "n1"}, headers=op).json()
    assert [(e["action"], e["outcome"]) for e in entries] == [
        ("maintenance_end", "noop"),
        ("maintenance_end", "ok"),
        ("maintenance_start", "ok"),
    ]
    assert entries[-1]["reason"] == "GPU swap"


def test_a_cluster_window_needs_no_node(reported, make_token):
    op = auth(make_token("operator"))
    r = reported.post(
        "/api/v1/maintenance", json={"duration_s": 600, "reason": "DB upgrade"}, headers=op
    )
    assert r.status_code == 201, r.text
    assert (r.json()["scope"], r.json()["node"]) == ("cluster", None)
    entries = reported.get("/api/v1/audit", params={"target_kind": "cluster"}, headers=op).json()
    assert [e["action"] for e in entries] == ["maintenance_start"]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"node": "nope", "duration_s": 60, "reason": "x"}, 404, "no node named 'nope'"),
        ({"node": "n1", "duration_s": 30 * 86400, "reason": "x"}, 409, "MAINTENANCE_MAX_S"),
        ({"node": "n1", "reason": "x"}, 422, "exactly one of ends_at"),
        ({"node": "n1", "duration_s": 60}, 422, "reason"),
        ({"node": "n\x00", "duration_s": 60, "reason": "x"}, 422, "NUL"),
    ],
    ids=["unknown-node", "too-long", "no-end", "no-reason", "nul"],
)
def test_bad_input_is_refused_with_what_to_fix_and_stores_nothing(
    reported, make_token, app, body, status, says
):
    op = auth(make_token("operator"))
    kept = reported.post(
        "/api/v1/maintenance", json={"node": "n1", "duration_s": 60, "reason": "kept"}, headers=op
    )
    assert kept.status_code == 201
    r = reported.post("/api/v1/maintenance", json=body, headers=op)
    assert r.status_code == status, r.text
    assert says in r.text
    assert _count(app) == 1  # the earlier window is untouched, no new one
    assert reported.get("/api/v1/maintenance", headers=op).json()["windows"][0]["reason"] == "kept"


def test_ending_an_unknown_window_is_a_404(reported, make_token):
    r = reported.post(
        "/api/v1/maintenance/999/end", json={"reason": "x"}, headers=auth(make_token("operator"))
    )
    assert r.status_code == 404
    assert "no maintenance window 999" in r.text


@pytest.mark.parametrize("role", ["viewer", "agent"])
def test_viewers_and_agents_cannot_open_or_end_windows(reported, make_token, app, role):
    op = auth(make_token("operator"))
    wid = reported.post(
        "/api/v1/maintenance", json={"node": "n1", "duration_s": 60, "reason": "x"}, headers=op
    ).json()["id"]
    who = auth(make_token(role, "n1") if role == "agent" else make_token(role))
    assert (
        reported.post(
            "/api/v1/maintenance", json={"node": "n1", "duration_s": 60, "reason": "x"}, headers=who
        ).status_code
        == 403
    )
    assert (
        reported.post(
            f"/api/v1/maintenance/{wid}/end", json={"reason": "x"}, headers=who
        ).status_code
        == 403
    )
    assert (
        reported.post("/api/v1/maintenance", json={"duration_s": 60, "reason": "x"}).status_code
        == 401
    )
    assert _count(app) == 1
    with app.state.sessionmaker() as s:
        assert s.get(MaintenanceWindow, wid).ended_at is None


# --- the policy ----------------------------------------------------------------------------


@pytest.fixture
def env(db_url: str, make_token):
    settings = Settings(
        database_url=db_url,
        dev=True,
        prune_interval_s=0,
        background_tick_s=0,
        policy={"enabled": True, "breaker_pct": 100, "unreachable_s": 3600},
        alerts={"webhooks": ["http://127.0.0.1:9/hook"]},
    )
    app = create_app(settings)
    client = TestClient(app).__enter__()
    tokens: dict[str, str] = {}
    seq: dict[str, int] = {}

    def report(node: str, xid: int | None = None) -> None:
        if node not in tokens:
            tokens[node] = make_token("agent", node)
            seq[node] = 0
        seq[node] += 1
        # a 300 s interval: the fleet calls a node unreachable after 900 s, so the time these
        # tests take on a loaded machine never makes a freshly reported node silent
        batch = make_batch(
            node, seq[node], gpus=4, xids=[(2, xid)] if xid else None, interval_s=300.0
        )
        assert post_batch(client, tokens[node], batch).status_code == 200

    def run(at=None):
        with app.state.sessionmaker() as s:
            out = policy.run(s, settings, now=at or utcnow())
            s.commit()
        return out

    def open_window(node: str | None, hours: float = 1.0) -> int:
        r = client.post(
            "/api/v1/maintenance",
            json={"node": node, "duration_s": hours * 3600, "reason": "planned work"},
            headers=auth(make_token("operator")),
        )
        assert r.status_code == 201, r.text
        return r.json()["id"]

    yield SimpleNamespace(client=client, app=app, report=report, run=run, open=open_window)
    client.__exit__(None, None, None)


def _age(app, seconds: float, *nodes: str) -> None:
    with app.state.sessionmaker() as s:
        for n in s.scalars(select(Node).where(Node.name.in_(nodes))):
            n.last_seen -= timedelta(seconds=seconds)
        s.commit()


def test_the_policy_does_not_isolate_a_node_in_maintenance_and_acts_after_it(env, make_token):
    for n in ("n0", "n1", "n2"):
        env.report(n)
    wid = env.open("n0", hours=0.01)  # 36 s
    env.report("n0", xid=79)  # fell off the bus during the work
    first = env.run()
    assert first.isolated == []
    assert first.maintenance == ["n0"]
    assert env.run().maintenance == ["n0"]  # held again, audited once
    viewer = auth(make_token("viewer"))
    holds = env.client.get(
        "/api/v1/audit", params={"action": "maintenance_hold"}, headers=viewer
    ).json()
    assert len(holds) == 1
    assert f"maintenance window {wid}" in holds[0]["reason"]
    # another node's finding still acts
    env.report("n1", xid=79)
    assert env.run().isolated == ["n1"]
    # once the window is over, the finding that still stands is acted on
    after = env.run(at=utcnow() + timedelta(seconds=40))
    assert after.isolated == ["n0"]


def test_a_cluster_window_holds_every_automatic_isolation(env):
    for n in ("n0", "n1"):
        env.report(n)
    env.open(None)
    env.report("n0", xid=79)
    _age(env.app, 4000, "n1")
    out = env.run()
    assert out.isolated == []
    assert sorted(out.maintenance) == ["n0", "n1"]


def test_a_rack_in_maintenance_going_silent_is_not_a_control_plane_outage(env):
    """Five nodes of twenty taken down for planned work are left out of the "many nodes at
    once" rule: one other node that really went silent is still isolated."""
    nodes = [f"n{i:02d}" for i in range(20)]
    for n in nodes:
        env.report(n)
    rack = nodes[:5]
    for n in rack:
        env.open(n)
    _age(env.app, 4000, *rack, "n10")
    out = env.run()
    assert out.suspect is None
    assert out.isolated == ["n10"]
    assert sorted(out.maintenance) == rack


def test_without_the_windows_the_same_silence_is_suspect(env):
    """The control for the test above: the same six silent nodes, no window."""
    nodes = [f"n{i:02d}" for i in range(20)]
    for n in nodes:
        env.report(n)
    _age(env.app, 4000, *nodes[:5], "n10")
    out = env.run()
    assert out.suspect is not None
    assert out.isolated == []


def test_an_operator_still_isolates_a_node_in_maintenance(env, make_token):
    env.report("n0")
    env.open("n0")
    r = env.client.post(
        "/api/v1/nodes/n0/isolate", json={"reason": "bad fan"}, headers=auth(make_token("operator"))
    )
    assert r.status_code == 200
    assert r.json()["node"]["isolated"] is True


# --- alerts under a window (the server's own path: ingest raises them) ---------------------


def _alerts(env, make_token, kind: str = "node_state") -> list[dict]:
    alerts = env.client.get("/api/v1/alerts", headers=auth(make_token("viewer"))).json()["alerts"]
    return [a for a in alerts if a["kind"] == kind]


def test_a_nodes_alerts_in_maintenance_are_recorded_not_delivered(env, make_token):
    env.report("n0")
    env.report("n1")
    wid = env.open("n0")
    env.report("n0", xid=79)
    env.report("n1", xid=79)
    by_node = {a["labels"]["node"]: a for a in _alerts(env, make_token)}
    assert by_node["n0"]["silenced_by"] == wid
    assert by_node["n0"]["deliveries"] == []
    assert by_node["n1"]["silenced_by"] is None
    assert len(by_node["n1"]["deliveries"]) == 1


# --- the dashboard -------------------------------------------------------------------------


def _as(client: TestClient, make_token, role: str) -> TestClient:
    client.cookies.clear()
    assert sign_in(client, make_token(role)).status_code == 303
    return client


def test_an_operator_opens_and_ends_a_window_from_the_dashboard(reported, make_token, app):
    client = _as(reported, make_token, "operator")
    page = client.get("/nodes/n1").text
    assert "Silence n1 for maintenance" in page
    r = client.post(
        "/maintenance",
        data={
            "csrf_token": csrf_from(page),
            "node": "n1",
            "hours": "1.5",
            "reason": "PSU swap",
            "back": "/nodes/n1",
        },
        follow_redirects=False,
    )
    assert (r.status_code, r.headers["location"]) == (303, "/nodes/n1")
    page = client.get("/nodes/n1").text
    assert "open on node n1 until" in page
    assert 'data-maintenance="' in page
    assert "PSU swap" in page
    listing = client.get("/maintenance").text
    with app.state.sessionmaker() as s:
        wid = s.scalar(select(MaintenanceWindow.id))
    assert f'data-window="{wid}" data-state="active"' in listing
    r = client.post(
        f"/maintenance/{wid}/end",
        data={"csrf_token": csrf_from(listing), "reason": "done"},
        follow_redirects=False,
    )
    assert r.status_code == 303
    listing = client.get("/maintenance").text
    assert "ended: the policy and alerts act again" in listing
    assert f'data-window="{wid}" data-state="over"' in listing


@pytest.mark.parametrize(
    ("form", "says"),
    [
        ({"node": "n1", "hours": "two", "reason": "x"}, "Hours must be a positive number"),
        ({"node": "n1", "hours": "1", "reason": " "}, "Give a reason"),
        ({"node": "nope", "hours": "1", "reason": "x"}, "no node named"),
        ({"node": "n1", "hours": "200", "reason": "x"}, "MAINTENANCE_MAX_S"),
        ({"node": "n1", "hours": "-1", "reason": "x"}, "Hours must be a positive number"),
    ],
    ids=["not-a-number", "no-reason", "unknown-node", "too-long", "negative"],
)
def test_a_bad_form_says_why_and_opens_nothing(reported, make_token, app, form, says):
    client = _as(reported, make_token, "operator")
    page = client.get("/maintenance").text
    r = client.post(
        "/maintenance", data={"csrf_token": csrf_from(page), **form}, follow_redirects=False
    )
    assert r.status_code == 303
    assert says in client.get("/maintenance").text
    assert _count(app) == 0


def test_viewers_see_the_windows_without_the_forms(reported, make_token):
    client = _as(reported, make_token, "viewer")
    page = client.get("/maintenance")
    assert page.status_code == 200
    assert "Maintenance windows" in page.text
    assert "Confirm window" not in page.text
    assert "Silence n1 for maintenance" not in client.get("/nodes/n1").text
    r = client.post(
        "/maintenance",
        data={"csrf_token": csrf_from(client.get("/login").text), "hours": "1", "reason": "x"},
        follow_redirects=False,
    )
    assert r.status_code == 403


# --- /metrics ------------------------------------------------------------------------------


def test_metrics_say_which_nodes_are_in_maintenance(reported, make_token):
    token = make_token("agent", "n2")
    assert post_batch(reported, token, make_batch("n2", 1, gpus=2)).status_code == 200
    op = auth(make_token("operator"))
    reported.post(
        "/api/v1/maintenance", json={"node": "n1", "duration_s": 60, "reason": "x"}, headers=op
    )
    text = reported.get("/metrics", headers=auth(make_token("viewer"))).text
    assert 'tierwatch_node_maintenance{Hostname="n1"} 1.0' in text
    assert 'tierwatch_node_maintenance{Hostname="n2"} 0.0' in text
    assert "tierwatch_cluster_maintenance 0.0" in text
    reported.post("/api/v1/maintenance", json={"duration_s": 60, "reason": "x"}, headers=op)
    text = reported.get("/metrics", headers=auth(make_token("viewer"))).text
    assert 'tierwatch_node_maintenance{Hostname="n2"} 1.0' in text
    assert "tierwatch_cluster_maintenance 1.0" in text


def test_every_open_window_is_listed_before_the_ones_that_are_over(reported, app):
    """An active window never drops off the list (and so the page that ends it) behind
    200 newer windows that are over."""
    now = utcnow()
    with app.state.sessionmaker() as s:
        for i in range(maintenance.OVER_SHOWN + 5):
            start = now - timedelta(hours=2)
            s.add(
                MaintenanceWindow(
                    scope="node" if i else "cluster",
                    node="n1" if i else None,
                    starts_at=start,
                    ends_at=now + timedelta(days=5) if i == 0 else start + timedelta(seconds=1),
                    reason=f"w{i}",
                    created_by="t",
                    created_at=start,
                    ended_by="",
                )
            )
        s.commit()
        windows = maintenance.list_windows(s, now=now, include_over=True)
    assert windows[0].reason == "w0"
    assert len(windows) == 1 + maintenance.OVER_SHOWN


def test_each_window_that_holds_a_node_is_audited_once(env, make_token):
    for n in ("n0", "n1"):
        env.report(n)
    own = env.open("n0", hours=1)
    cluster = env.open(None, hours=2)  # the longer one holds n0 first
    env.report("n0", xid=79)
    env.run()
    env.run()
    op = auth(make_token("operator"))
    r = env.client.post(f"/api/v1/maintenance/{cluster}/end", json={"reason": "done"}, headers=op)
    assert r.status_code == 200
    env.run()
    env.run()
    holds = env.client.get(
        "/api/v1/audit", params={"action": "maintenance_hold", "target": "n0"}, headers=op
    ).json()
    assert sorted(h["detail"]["window"] for h in holds) == sorted([own, cluster])


def test_the_leaders_pass_delivers_an_alert_that_outlived_its_window(env, make_token):
    """A node turned unhealthy in its window, the window ends, and the node stays unhealthy:
    its alert is delivered by the next pass of the server's own background work."""
    from tierwatch.server.alerts.service import deliver_after_maintenance

    env.report("n0")
    wid = env.open("n0")
    env.report("n0", xid=79)
    op = auth(make_token("operator"))
    [alert] = _alerts(env, make_token)
    assert alert["silenced_by"] == wid
    assert (
        env.client.post(
            f"/api/v1/maintenance/{wid}/end", json={"reason": "x"}, headers=op
        ).status_code
        == 200
    )
    with env.app.state.sessionmaker() as s:
        assert deliver_after_maintenance(s, env.app.state.settings.alerts, now=utcnow()) == 1
        s.commit()
    newest = _alerts(env, make_token)[0]
    assert newest["silenced_by"] is None
    assert len(newest["deliveries"]) == 1


@pytest.mark.parametrize(
    ("hours", "reason", "says"),
    [
        ("nan", "x", "Hours must be a positive number"),
        ("inf", "x", "Hours must be a positive number"),
        ("1", "ok\x00evil", "NUL character"),
    ],
    ids=["nan", "inf", "nul-reason"],
)
def test_odd_form_values_say_what_to_fix(reported, make_token, app, hours, reason, says):
    client = _as(reported, make_token, "operator")
    page = client.get("/maintenance").text
    form = {"csrf_token": csrf_from(page), "node": "n1", "hours": hours, "reason": reason}
    assert client.post("/maintenance", data=form, follow_redirects=False).status_code == 303
    assert says in client.get("/maintenance").text
    assert _count(app) == 0

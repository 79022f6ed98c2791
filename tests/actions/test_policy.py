"""The auto-isolation policy on a real database: candidates, the circuit breaker (trip, hold,
reset), no re-isolation after a release for the same finding, optional job restores, and
admin overrides of the settings. The policy pass is called directly (in the server the
leader replica runs it every second: see tests/e2e/test_actions_e2e.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select
from support import auth, make_batch, post_batch, register_job

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, ReportBatch, utcnow
from tierwatch.server.actions import policy
from tierwatch.server.actions.control_plane import ControlPlaneFacts
from tierwatch.server.actions.drivers import SchedulerView
from tierwatch.server.actions.models import RestoreRequest
from tierwatch.server.actions.settings import PolicyUpdate
from tierwatch.server.config import Settings
from tierwatch.server.fleet.models import Node
from tierwatch.server.main import create_app


@pytest.fixture
def policy_settings(db_url: str) -> Settings:
    return Settings(
        database_url=db_url,
        dev=True,
        prune_interval_s=0,
        background_tick_s=0,
        policy={"enabled": True, "breaker_pct": 25, "restore_jobs": True, "unreachable_s": 3600},
    )


@pytest.fixture
def env(policy_settings, make_token):
    app = create_app(policy_settings)
    # background_tick_s=0: no background loop; the test drives the policy itself.
    client = TestClient(app).__enter__()
    tokens = {}
    seq = {}

    def report(node: str, xid: int | None = None, **content) -> None:
        if node not in tokens:
            tokens[node] = make_token("agent", node)
            seq[node] = 0
        seq[node] += 1
        batch = make_batch(node, seq[node], gpus=4, xids=[(2, xid)] if xid else None)
        if content:
            batch = ReportBatch(**{**batch.model_dump(), **content})
        r = post_batch(client, tokens[node], batch)
        assert r.status_code == 200, r.text

    def run(at=None, **kwargs):
        with app.state.sessionmaker() as s:
            out = policy.run(s, policy_settings, now=at or utcnow(), **kwargs)
            s.commit()
        return out

    yield client, report, run, app
    client.__exit__(None, None, None)


def test_policy_isolates_with_the_rule_and_the_breaker_holds(env, make_token):
    client, report, run, _ = env
    for i in range(8):
        report(f"n{i}")
    report("n0", xid=79)
    first = run()
    assert first.isolated == ["n0"]
    node = client.get("/api/v1/nodes/n0", headers=auth(make_token("viewer"))).json()
    assert node["isolation"]["by"] == "policy"
    assert "XID 79" in node["isolation"]["reason"] or "79" in node["isolation"]["reason"]
    # 25 % of 8 = 2 per window: the 2nd goes through, the 3rd and 4th trip the breaker.
    for n in ("n1", "n2", "n3"):
        report(n, xid=79)
    second = run()
    assert second.isolated == ["n1"]
    assert second.held == ["n2", "n3"]
    assert second.tripped
    st = client.get("/api/v1/policy", headers=auth(make_token("viewer"))).json()
    assert st["breaker"]["tripped"] is True
    assert st["breaker"]["allowed_per_window"] == 2
    assert "n2, n3" in st["breaker"]["message"]
    # A pass inside the window holds again, without a second trip.
    third = run()
    assert third.held == ["n2", "n3"]
    assert not third.tripped
    # Once the window has passed, the breaker resets and lets the next ones through.
    later = run(at=utcnow() + timedelta(seconds=601))
    assert later.reset
    assert later.isolated == ["n2", "n3"]
    actions = [
        e["action"]
        for e in client.get(
            "/api/v1/audit", params={"actor": "policy"}, headers=auth(make_token("viewer"))
        ).json()
    ]
    assert actions.count("breaker_trip") == 1
    assert actions.count("breaker_reset") == 1


def test_degraded_or_app_level_xids_are_not_candidates(env):
    _, report, run, _ = env
    report("n0")
    report("n1")
    report("n0", xid=13)  # Graphics engine exception: RESTART_APP, not a node fault
    assert run().isolated == []


def test_a_release_is_not_undone_by_the_same_finding(env, make_token):
    client, report, run, _ = env
    for i in range(4):
        report(f"n{i}")
    report("n0", xid=79)
    assert run().isolated == ["n0"]
    op = auth(make_token("operator"))
    r = client.post("/api/v1/nodes/n0/release", json={"reason": "reset the GPU"}, headers=op)
    assert r.json()["changed"] is True
    later = utcnow() + timedelta(seconds=700)
    assert run(at=later).isolated == []
    # A new occurrence of a qualifying fault after the release: isolated again.
    report("n0", xid=48)  # DBE: RESET_GPU
    assert run(at=later).isolated == ["n0"]


def age(app, seconds: float, *nodes: str) -> None:
    """Move the nodes' last report back by ``seconds`` (as if they went silent then)."""
    with app.state.sessionmaker() as s:
        for n in s.scalars(select(Node).where(Node.name.in_(nodes))):
            n.last_seen -= timedelta(seconds=seconds)
        s.commit()


def test_unreachable_node_is_isolated_after_the_limit(env):
    _, report, run, app = env
    for i in range(4):
        report(f"n{i}")
    age(app, 3000, "n0")
    assert run().isolated == []
    age(app, 700, "n0")  # silent for 3,700 s now, the limit is 3,600 s
    out = run()
    assert out.isolated == ["n0"]
    assert out.suspect is None


def test_many_nodes_silent_at_once_hold_the_policy_and_raise_one_alert(env, make_token):
    """The control plane stalled: every node aged into "unreachable" together."""
    client, report, run, app = env
    for i in range(4):
        report(f"n{i}")
    age(app, 3700, "n0", "n1", "n2", "n3")
    out = run()
    assert out.isolated == []
    assert out.held_unreachable == ["n0", "n1", "n2", "n3"]
    assert out.suspect is not None
    assert "4 of 4 nodes went unreachable" in out.suspect.summary()
    again = run()  # the next pass holds again, and the alert is not raised twice
    assert again.isolated == []
    viewer = auth(make_token("viewer"))
    alerts = client.get("/api/v1/alerts", headers=viewer).json()["alerts"]
    suspect = [a for a in alerts if a["kind"] == "control_plane"]
    assert len(suspect) == 1, suspect
    assert suspect[0]["status"] == "firing"
    assert "control plane suspect" in suspect[0]["summary"]
    entries = client.get("/api/v1/audit", params={"actor": "policy"}, headers=viewer).json()
    assert [e["action"] for e in entries].count("control_plane_suspect") == 1
    # The nodes report again: the alert resolves.
    for i in range(4):
        report(f"n{i}")
    assert run().suspect is None
    alerts = client.get("/api/v1/alerts", headers=viewer).json()["alerts"]
    statuses = [a["status"] for a in alerts if a["kind"] == "control_plane"]
    assert sorted(statuses) == ["firing", "resolved"]


def test_hardware_findings_still_act_while_the_control_plane_is_suspect(env):
    _, report, run, app = env
    for i in range(8):
        report(f"n{i}")
    age(app, 3700, "n1", "n2", "n3")
    report("n0", xid=79)
    out = run()
    assert out.suspect is not None
    assert out.isolated == ["n0"]
    assert out.held_unreachable == ["n1", "n2", "n3"]


@pytest.mark.parametrize(
    ("facts", "says"),
    [
        ({"listening_for_s": 20, "cause": "started"}, "listening for only 20 s (started"),
        ({"listening_for_s": 4000, "lag_s": 42.0}, "ingest lag 42.0 s"),
    ],
    ids=["just-restarted", "ingest-lag"],
)
def test_the_leaders_own_state_holds_a_single_unreachable_node(env, facts, says):
    _, report, run, app = env
    for i in range(4):
        report(f"n{i}")
    age(app, 3700, "n0")
    now = utcnow()
    held = run(
        at=now,
        facts=ControlPlaneFacts(
            now=now,
            listening_since=now - timedelta(seconds=facts["listening_for_s"]),
            ingest_lag_s=facts.get("lag_s", 0.0),
            ingest_waiting=3 if "lag_s" in facts else 0,
            cause=facts.get("cause", "started"),
        ),
    )
    assert held.isolated == []
    assert held.held_unreachable == ["n0"]
    assert says in held.suspect.summary()
    # Listening long enough, no lag: the same node is isolated.
    calm = ControlPlaneFacts(now=now, listening_since=now - timedelta(seconds=4000))
    assert run(at=now, facts=calm).isolated == ["n0"]


def test_an_unreachable_node_the_scheduler_still_hears_is_not_isolated(env, make_token):
    client, report, run, app = env
    for i in range(4):
        report(f"n{i}")
    age(app, 3700, "n0")
    asked = []

    def up(node: str) -> SchedulerView:
        asked.append(node)
        return SchedulerView(ok=True, text="slurm: IDLE", responding=True, detail={"state": "IDLE"})

    out = run(observe=up)
    assert asked == ["n0"]
    assert out.isolated == []
    assert out.agent_silent == ["n0"]
    alerts = client.get("/api/v1/alerts", headers=auth(make_token("viewer"))).json()["alerts"]
    [silent] = [a for a in alerts if a["kind"] == "agent_silent"]
    assert "slurm: IDLE" in silent["summary"]
    assert "check the node's tierwatch agent" in silent["summary"]

    def down(node: str) -> SchedulerView:
        return SchedulerView(ok=True, text="slurm: DOWN+NOT_RESPONDING", responding=False)

    out = run(observe=down)
    assert out.isolated == ["n0"]
    node = client.get("/api/v1/nodes/n0", headers=auth(make_token("viewer"))).json()
    assert node["isolation"]["reason"].endswith("; slurm: DOWN+NOT_RESPONDING")


def test_a_hardware_finding_is_isolated_whatever_the_scheduler_says(env, make_token):
    client, report, run, _ = env
    for i in range(4):
        report(f"n{i}")
    report("n0", xid=79)

    def unreachable_scheduler(node: str) -> SchedulerView:
        return SchedulerView(ok=False, text="$ scontrol -o show node n0\nexit 1")

    out = run(observe=unreachable_scheduler)
    assert out.isolated == ["n0"]
    node = client.get("/api/v1/nodes/n0", headers=auth(make_token("viewer"))).json()
    assert "scheduler not asked: $ scontrol -o show node n0 exit 1" in node["isolation"]["reason"]


def test_policy_restores_the_jobs_of_an_isolated_node(env):
    client, report, run, app = env
    register_job(client, "gpt", ["n1", "n2"])
    report("n1")
    report("n2")
    ev = [
        CheckpointEvent(
            job_id="gpt",
            step=20,
            tier="memory",
            kind="committed",
            rank=r,
            world_size=2,
            ts=utcnow(),
        )
        for r in (0, 1)
    ]
    report(
        "n1",
        checkpoint_events=ev[:1],
        progress=[
            JobProgress(
                job_id="gpt", rank=0, world_size=2, step=25, ts=utcnow(), layout=["n1", "n2"]
            )
        ],
    )
    report("n2", checkpoint_events=ev[1:])
    report("n1", xid=79)
    out = run()
    assert out.isolated == ["n1"]
    assert len(out.restores) == 1
    with app.state.sessionmaker() as s:
        req = s.get(RestoreRequest, out.restores[0])
        assert (req.job_id, req.step, req.actor) == ("gpt", 20, "policy")
        assert "n1 auto-isolated" in req.reason


def test_disabled_policy_does_nothing_and_admin_overrides_env(env, make_token):
    client, report, run, app = env
    report("n0")
    report("n1")
    r = client.put("/api/v1/policy", json={"enabled": False}, headers=auth(make_token("admin")))
    assert r.status_code == 200
    assert r.json()["source"]["enabled"] == "admin"
    report("n0", xid=79)
    assert run().isolated == []
    r = client.put("/api/v1/policy", json={"enabled": None}, headers=auth(make_token("admin")))
    assert r.json()["source"]["enabled"] == "env"
    assert run().isolated == ["n0"]
    bad = client.put("/api/v1/policy", json={"breaker_pct": 0}, headers=auth(make_token("admin")))
    assert bad.status_code == 422
    assert "breaker_pct" in bad.text
    assert (
        client.put(
            "/api/v1/policy", json={"enabled": True}, headers=auth(make_token("operator"))
        ).status_code
        == 403
    )


def test_allowed_isolations_is_at_least_one():
    assert policy.allowed_isolations(10, 3) == 1
    assert policy.allowed_isolations(10, 2048) == 204
    assert policy.allowed_isolations(100, 5) == 5
    assert PolicyUpdate(enabled=None).model_fields_set == {"enabled"}

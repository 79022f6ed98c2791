"""Isolate / release / restore through the REST API and the agents' report path: the
overlay, the command queue (delivery, re-delivery, results, idempotence, expiry), restore
requests with per-rank progress, and the audit log. Both database backends."""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from support import auth, post_batch, register_job

from tierwatch.agent.protocol import (
    CheckpointEvent,
    CommandResult,
    JobProgress,
    ReportBatch,
    RestoreReport,
    utcnow,
)
from tierwatch.server.actions import queue, restores
from tierwatch.server.actions.models import CommandRow
from tierwatch.server.config import Settings
from tierwatch.server.main import create_app

JOB = "gpt-small"
LAYOUT = ["n1", "n2"]


class Agents:
    """Reports for n1/n2 with their own tokens; returns the commands in each answer."""

    def __init__(self, client: TestClient, make_token) -> None:
        self.client = client
        self.tokens = {n: make_token("agent", n) for n in ("n1", "n2", "n3")}
        self.seq = dict.fromkeys(self.tokens, 0)

    def post(self, node: str, **content) -> list[dict]:
        self.seq[node] += 1
        batch = ReportBatch(node=node, epoch="e1", seq=self.seq[node], sent_at=utcnow(), **content)
        r = post_batch(self.client, self.tokens[node], batch)
        assert r.status_code == 200, r.text
        return r.json()["commands"]


def committed(step: int, tier: str, rank: int | None) -> CheckpointEvent:
    return CheckpointEvent(
        job_id=JOB,
        step=step,
        tier=tier,
        kind="committed",
        rank=rank,
        world_size=None if rank is None else 2,
        ts=utcnow(),
        bytes=100,
        seconds=0.5,
    )


def run_job(agents: Agents) -> None:
    """A 2-rank job on n1/n2: steps 10 and 20 in memory, 10 in persistent, at step 25."""
    register_job(agents.client, JOB, LAYOUT)  # the layout comes from rank 0's report
    agents.post(
        "n1",
        progress=[
            JobProgress(job_id=JOB, rank=0, world_size=2, step=25, ts=utcnow(), layout=LAYOUT)
        ],
        checkpoint_events=[
            committed(10, "memory", 0),
            committed(20, "memory", 0),
            committed(10, "persistent", None),
        ],
    )
    agents.post(
        "n2",
        progress=[JobProgress(job_id=JOB, rank=1, world_size=2, step=25, ts=utcnow())],
        checkpoint_events=[committed(10, "memory", 1), committed(20, "memory", 1)],
    )


@pytest.fixture
def tokens(make_token) -> dict[str, str]:
    return {r: make_token(r) for r in ("viewer", "operator", "admin")}


def _audit(client, tokens, **params) -> list[dict]:
    r = client.get("/api/v1/audit", params=params, headers=auth(tokens["viewer"]))
    assert r.status_code == 200, r.text
    return r.json()


def test_isolate_takes_effect_at_once_and_holds_until_release(client, make_token, tokens):
    agents = Agents(client, make_token)
    agents.post("n1")
    op = auth(tokens["operator"])
    r = client.post("/api/v1/nodes/n1/isolate", json={"reason": "XID 79 twice"}, headers=op)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["changed"] is True
    assert body["node"]["isolated"] is True
    assert body["node"]["isolation"]["reason"] == "XID 79 twice"
    assert body["node"]["isolation"]["by"].startswith("token:")
    assert body["command"] is None  # driver "none": record only
    # A healthy report does not lift the overlay.
    agents.post("n1")
    node = client.get("/api/v1/nodes/n1", headers=op).json()
    assert node["isolated"] is True
    assert node["state"] == "healthy"
    # Isolating again changes nothing and says so.
    again = client.post("/api/v1/nodes/n1/isolate", json={"reason": "again"}, headers=op)
    assert again.json()["changed"] is False
    r = client.post("/api/v1/nodes/n1/release", json={"reason": "GPU swapped"}, headers=op)
    assert r.json()["changed"] is True
    assert r.json()["node"]["isolated"] is False
    assert r.json()["node"]["released_at"] is not None
    entries = _audit(client, tokens, target="n1")
    assert [(e["action"], e["outcome"]) for e in entries] == [
        ("release", "ok"),
        ("isolate", "noop"),
        ("isolate", "ok"),
    ]
    assert entries[2]["reason"] == "XID 79 twice"
    assert entries[2]["role"] == "operator"


@pytest.mark.parametrize(
    "body",
    [{}, {"reason": ""}, {"reason": "   "}, {"reason": "x" * 1001}, {"reason": "ok", "extra": 1}],
)
def test_isolate_needs_a_reason(client, make_token, tokens, body):
    Agents(client, make_token).post("n1")
    r = client.post("/api/v1/nodes/n1/isolate", json=body, headers=auth(tokens["operator"]))
    assert r.status_code == 422
    assert "reason" in r.text or "extra" in r.text
    node = client.get("/api/v1/nodes/n1", headers=auth(tokens["viewer"])).json()
    assert node["isolated"] is False


def test_unknown_node_is_404_with_the_name(client, tokens):
    r = client.post(
        "/api/v1/nodes/nope-1/isolate", json={"reason": "x"}, headers=auth(tokens["operator"])
    )
    assert r.status_code == 404
    assert "nope-1" in r.json()["detail"]


def test_sql_looking_reason_is_stored_literally(client, make_token, tokens):
    Agents(client, make_token).post("n1")
    reason = "'); DROP TABLE nodes; -- <script>alert(1)</script>"
    r = client.post(
        "/api/v1/nodes/n1/isolate", json={"reason": reason}, headers=auth(tokens["operator"])
    )
    assert r.json()["node"]["isolation"]["reason"] == reason
    assert _audit(client, tokens, target="n1")[0]["reason"] == reason


def age_deliveries(client: TestClient, seconds: float) -> None:
    """Move every command's delivery time back (instead of waiting out redeliver_s)."""
    with client.app.state.sessionmaker() as s:
        for row in s.query(CommandRow).filter(CommandRow.delivered_at.is_not(None)):
            row.delivered_at -= timedelta(seconds=seconds)
        s.commit()


@pytest.fixture
def command_settings(db_url: str) -> Settings:
    return Settings(
        database_url=db_url,
        dev=True,
        prune_interval_s=0,
        isolation={"driver": "command"},
        commands={"redeliver_s": 0.5},
    )


@pytest.fixture
def command_client(command_settings) -> TestClient:
    with TestClient(create_app(command_settings)) as c:
        yield c


def test_node_local_driver_command_is_delivered_once_and_results_recorded(
    command_client, make_token, tokens
):
    client = command_client
    agents = Agents(client, make_token)
    agents.post("n1")
    r = client.post(
        "/api/v1/nodes/n1/isolate", json={"reason": "fan failure"}, headers=auth(tokens["operator"])
    )
    cmd = r.json()["command"]
    assert cmd["executor"] == "agent"
    assert cmd["driver"] == "command"
    assert cmd["state"] == "pending"
    delivered = agents.post("n1")
    assert [(c["id"], c["kind"]) for c in delivered] == [(cmd["id"], "isolate")]
    assert delivered[0]["args"]["reason"] == "fan failure"
    # Another node's report does not get it; n1's next report within redeliver_s does not
    # either (it is on its way).
    assert agents.post("n2") == []
    # The answer was lost: after redeliver_s the same command comes again, same id.
    age_deliveries(client, 1.0)
    again = agents.post("n1")
    assert [c["id"] for c in again] == [cmd["id"]]
    agents.post("n1", command_results=[CommandResult(id=cmd["id"], state="running", ts=utcnow())])
    agents.post(
        "n1",
        command_results=[
            CommandResult(
                id=cmd["id"], state="succeeded", ts=utcnow(), exit_code=0, output="cordoned n1"
            )
        ],
    )
    # A late duplicate "running" and a "failed" for a finished command change nothing.
    agents.post(
        "n1",
        command_results=[
            CommandResult(id=cmd["id"], state="running", ts=utcnow()),
            CommandResult(id=cmd["id"], state="failed", ts=utcnow(), exit_code=3),
        ],
    )
    # n2 cannot report on n1's command.
    agents.post("n2", command_results=[CommandResult(id=cmd["id"], state="failed", ts=utcnow())])
    age_deliveries(client, 1.0)
    assert agents.post("n1") == []  # finished: never delivered again
    got = client.get(f"/api/v1/commands/{cmd['id']}", headers=auth(tokens["viewer"])).json()
    assert got["state"] == "succeeded"
    assert got["exit_code"] == 0
    assert got["output"] == "cordoned n1"
    assert got["attempts"] == 2
    outcomes = [e["outcome"] for e in _audit(client, tokens, action="command")]
    assert outcomes == ["succeeded"]


def test_commands_expire_when_the_agent_never_reports(
    command_client, make_token, tokens, command_settings
):
    client = command_client
    agents = Agents(client, make_token)
    agents.post("n1")
    cmd = client.post(
        "/api/v1/nodes/n1/isolate", json={"reason": "dead agent"}, headers=auth(tokens["operator"])
    ).json()["command"]
    factory = client.app.state.sessionmaker
    with factory() as s:
        later = utcnow() + timedelta(seconds=command_settings.commands.ttl_s + 1)
        expired = queue.expire(s, now=later, run_limit_s=3600)
        s.commit()
    assert [r.id for r in expired] == [cmd["id"]]
    assert agents.post("n1") == []
    got = client.get(f"/api/v1/commands/{cmd['id']}", headers=auth(tokens["viewer"])).json()
    assert got["state"] == "expired"
    assert "not started" in got["output"]


def test_restore_refused_lists_restorable_steps(client, make_token, tokens):
    agents = Agents(client, make_token)
    run_job(agents)
    op = auth(tokens["operator"])
    r = client.post(f"/api/v1/jobs/{JOB}/restore", json={"step": 15, "reason": "SDC"}, headers=op)
    assert r.status_code == 409
    assert "20 (memory)" in r.json()["detail"]
    assert "10 (memory/persistent)" in r.json()["detail"]
    r = client.post(
        f"/api/v1/jobs/{JOB}/restore",
        json={"step": 20, "tier": "persistent", "reason": "SDC"},
        headers=op,
    )
    assert r.status_code == 409
    assert "persistent" in r.json()["detail"]
    r = client.post("/api/v1/jobs/nope/restore", json={"reason": "x"}, headers=op)
    assert r.status_code == 404
    assert [e["outcome"] for e in _audit(client, tokens, action="restore")] == ["refused"] * 2


def test_restore_request_follows_rank_progress(client, make_token, tokens):
    agents = Agents(client, make_token)
    run_job(agents)
    r = client.post(
        f"/api/v1/jobs/{JOB}/restore",
        json={"reason": "loss spike"},
        headers=auth(tokens["operator"]),
    )
    assert r.status_code == 202, r.text
    req = r.json()
    assert req["step"] == 20
    assert req["state"] == "running"
    assert [(p["rank"], p["node"], p["phase"]) for p in req["ranks"]] == [
        (0, "n1", "pending"),
        (1, "n2", "pending"),
    ]
    c1, c2 = agents.post("n1"), agents.post("n2")
    assert c1[0]["kind"] == "restore"
    assert c1[0]["args"]["request_id"] == req["id"]
    assert c1[0]["args"]["step"] == 20
    assert c2[0]["args"]["step"] == 20

    def rep(rank, phase, **kw):
        base = {
            "job_id": JOB,
            "rank": rank,
            "world_size": 2,
            "ts": utcnow(),
            "seconds": 0.0,
            "request_id": req["id"],
            "phase": phase,
            "step": 20,
        }
        return RestoreReport(**{**base, **kw})

    agents.post(
        "n1",
        command_results=[CommandResult(id=c1[0]["id"], state="running", ts=utcnow())],
        restores=[rep(0, "staging")],
    )
    now = client.get(f"/api/v1/restores/{req['id']}", headers=auth(tokens["viewer"])).json()
    assert [p["phase"] for p in now["ranks"]] == ["staging", "pending"]
    agents.post(
        "n1", restores=[rep(0, "loaded", seconds=1.5, steps_lost=5, files_by_tier={"memory": 3})]
    )
    agents.post(
        "n2",
        restores=[
            rep(1, "loaded", seconds=2.5, steps_lost=5, files_by_tier={"peer": 2, "memory": 1})
        ],
    )
    done = client.get(f"/api/v1/restores/{req['id']}", headers=auth(tokens["viewer"])).json()
    assert done["state"] == "succeeded"
    assert done["seconds"] == 2.5
    assert done["steps_lost"] == 5
    assert [(p["phase"], p["tier"]) for p in done["ranks"]] == [
        ("loaded", "memory"),
        ("loaded", "peer"),
    ]
    cmds = client.get(
        "/api/v1/commands", params={"kind": "restore"}, headers=auth(tokens["viewer"])
    ).json()
    assert sorted(c["state"] for c in cmds) == ["succeeded", "succeeded"]
    # The staging notice is not a restore outcome in the job's restore history.
    job = client.get(f"/api/v1/jobs/{JOB}", headers=auth(tokens["viewer"])).json()
    assert len(job["restores"]) == 2


def test_restore_failed_rank_fails_the_request(client, make_token, tokens, session):
    agents = Agents(client, make_token)
    run_job(agents)
    req = client.post(
        f"/api/v1/jobs/{JOB}/restore",
        json={"step": 10, "tier": "persistent", "reason": "rack lost"},
        headers=auth(tokens["operator"]),
    ).json()
    agents.post(
        "n1",
        restores=[
            RestoreReport(
                job_id=JOB,
                rank=0,
                world_size=2,
                ts=utcnow(),
                seconds=0.4,
                request_id=req["id"],
                phase="failed",
                ok=False,
                message="__0_0.distcp: checksum mismatch in persistent",
            )
        ],
    )
    done = client.get(f"/api/v1/restores/{req['id']}", headers=auth(tokens["viewer"])).json()
    assert done["state"] == "failed"
    assert "checksum mismatch" in done["message"]
    states = {c.node_id: c.state for c in session.query(CommandRow)}
    # The request is over: the other node's command is ended too.
    assert sorted(states.values()) == ["failed", "failed"]


def test_restore_resolve_step_is_pure():
    steps = {20: ["memory"], 10: ["memory", "persistent"]}
    assert restores.resolve_step(steps, None, None) == 20
    assert restores.resolve_step(steps, None, "persistent") == 10
    assert restores.resolve_step(steps, 10, "memory") == 10
    with pytest.raises(restores.RestoreRefused, match="nothing to restore"):
        restores.resolve_step({}, None, None)


def test_metrics_show_the_queue_and_the_isolation(command_client, make_token, tokens):
    client = command_client
    Agents(client, make_token).post("n1")
    client.post("/api/v1/nodes/n1/isolate", json={"reason": "x"}, headers=auth(tokens["operator"]))
    text = client.get("/metrics").text
    assert 'tierwatch_commands{kind="isolate",state="pending"} 1.0' in text
    assert 'tierwatch_commands{kind="release",state="pending"} 0.0' in text
    assert 'tierwatch_node_isolated{Hostname="n1"} 1.0' in text
    assert "tierwatch_policy_breaker_tripped 0.0" in text


def test_a_step_evicted_by_a_rollback_and_saved_again_is_restorable_again(
    client, make_token, tokens
):
    agents = Agents(client, make_token)
    run_job(agents)
    op = auth(tokens["operator"])

    def evicted(rank):
        return CheckpointEvent(
            job_id=JOB, step=20, tier="memory", kind="evicted", rank=rank, world_size=2, ts=utcnow()
        )

    agents.post("n1", checkpoint_events=[evicted(0)])
    r = client.post(f"/api/v1/jobs/{JOB}/restore", json={"step": 20, "reason": "x"}, headers=op)
    assert r.status_code == 409
    # Saved again after the eviction: one rank is not enough, both make it whole again.
    agents.post("n1", checkpoint_events=[committed(20, "memory", 0)])
    r = client.post(f"/api/v1/jobs/{JOB}/restore", json={"step": 20, "reason": "x"}, headers=op)
    assert r.status_code == 409
    agents.post("n2", checkpoint_events=[committed(20, "memory", 1)])
    r = client.post(f"/api/v1/jobs/{JOB}/restore", json={"step": 20, "reason": "x"}, headers=op)
    assert r.status_code == 202, r.text
    job = client.get(f"/api/v1/jobs/{JOB}", headers=op).json()
    assert job["tiers"]["memory"]["newest_step"] == 20


def test_a_driver_run_the_agent_never_finished_is_sent_again_then_given_up(
    command_client, make_token, tokens
):
    client = command_client
    agents = Agents(client, make_token)
    agents.post("n1")
    cmd = client.post(
        "/api/v1/nodes/n1/isolate", json={"reason": "x"}, headers=auth(tokens["operator"])
    ).json()["command"]
    assert [c["id"] for c in agents.post("n1")] == [cmd["id"]]
    agents.post("n1", command_results=[CommandResult(id=cmd["id"], state="running", ts=utcnow())])
    age_deliveries(client, 1.0)  # past redeliver_s: the agent may have crashed mid-run
    assert [c["id"] for c in agents.post("n1")] == [cmd["id"]]
    got = client.get(f"/api/v1/commands/{cmd['id']}", headers=auth(tokens["viewer"])).json()
    assert got["state"] == "running"
    with client.app.state.sessionmaker() as s:
        ended = queue.expire(s, now=utcnow() + timedelta(seconds=61), run_limit_s=60)
        s.commit()
    assert [r.id for r in ended] == [cmd["id"]]
    got = client.get(f"/api/v1/commands/{cmd['id']}", headers=auth(tokens["viewer"])).json()
    assert got["state"] == "failed"
    assert "not run again" in got["output"]

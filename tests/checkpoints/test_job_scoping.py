"""Agent tokens are scoped to their node's ranks: checkpoint events, progress, restore reports
and latency samples of a job are accepted only from the nodes the job registered, and for a
rank only from the node its pinned layout names (app/checkpoints/scoping.py), on both
database backends.

The victim job ``victim`` runs 2 ranks on n2 only; n1 is another node of the cluster whose
agent token is the attacker's. Every refused item is dropped, nothing stored changes, and
the batch is still acked; the refusal shows on /metrics, in the log and as an agent event
on the reporting node.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from support import auth, make_batch, post_batch, register_job

from tierwatch.agent.protocol import (
    CheckpointEvent,
    JobProgress,
    LatencySample,
    ReportBatch,
    RestoreReport,
    utcnow,
)
from tierwatch.server.actions import policy
from tierwatch.server.actions.models import RestoreRankProgress, RestoreRequest
from tierwatch.server.checkpoints.models import (
    CheckpointEventRow,
    Job,
    LedgerRow,
    ProgressRow,
    RestoreRow,
)
from tierwatch.server.config import Settings
from tierwatch.server.fleet.models import Event, LatencySampleRow, Node
from tierwatch.server.ingest.refusals import EVENT_AGENT_KIND, RefusalLog
from tierwatch.server.main import create_app

VICTIM = "victim"


class Agents:
    """Agent tokens and sequence numbers per node; posts ReportBatch JSON like an agent."""

    def __init__(self, client: TestClient, make_token) -> None:
        self.client = client
        self.make_token = make_token
        self.tokens: dict[str, str] = {}
        self.seq: dict[str, int] = {}

    def post(self, node: str, **content) -> dict:
        if node not in self.tokens:
            self.tokens[node] = self.make_token("agent", node)
            self.seq[node] = 0
        self.seq[node] += 1
        batch = ReportBatch(node=node, epoch="e1", seq=self.seq[node], sent_at=utcnow(), **content)
        r = post_batch(self.client, self.tokens[node], batch)
        assert r.status_code == 200, r.text  # acked, whatever was refused
        assert r.json()["stored"] is True
        return r.json()


def committed(step: int, tier: str, rank: int | None, job: str = VICTIM, ws: int | None = 2):
    return CheckpointEvent(
        job_id=job,
        step=step,
        tier=tier,
        kind="committed",
        rank=rank,
        world_size=None if rank is None else ws,
        ts=utcnow(),
        bytes=100,
        seconds=0.5,
    )


def progress(rank: int, step: int, layout=None, job: str = VICTIM, ws: int = 2, **kw):
    return JobProgress(
        job_id=job, rank=rank, world_size=ws, step=step, ts=utcnow(), layout=layout, **kw
    )


@pytest.fixture
def agents(client, make_token) -> Agents:
    return Agents(client, make_token)


def run_victim(client, agents: Agents) -> None:
    """The victim job registers on n2, reports step 100 and commits step 90 in memory."""
    register_job(client, VICTIM, ["n2"], world_size=2)
    agents.post("n1")  # n1 is a node of the cluster (it exists), not of the job
    agents.post(
        "n2",
        progress=[progress(0, 100, layout=["n2", "n2"]), progress(1, 100)],
        checkpoint_events=[committed(90, "memory", 0), committed(90, "memory", 1)],
    )


def job_row(session, job_id: str = VICTIM) -> Job:
    session.expire_all()
    job = session.scalar(select(Job).where(Job.job_id == job_id))
    assert job is not None
    return job


def count(session, model, *where) -> int:
    return session.scalar(select(func.count()).select_from(model).where(*where)) or 0


def node_id(session, name: str) -> int:
    return session.scalar(select(Node.id).where(Node.name == name))


def refused_metric(client, reason: str, item: str) -> float:
    text = client.get("/metrics").text
    line = f'tierwatch_ingest_refused_total{{item="{item}",reason="{reason}"}}'
    values = [float(x.split()[-1]) for x in text.splitlines() if x.startswith(line)]
    assert values, f"{line} not on /metrics"
    return values[0]


def test_another_nodes_agent_cannot_report_for_the_job(client, agents, session, make_token):
    """The confirmed attack: n1's token posts layout, step 9999, a persistent step 7777 and a
    restore for a job that runs on n2 only. Nothing is taken, and a default restore still
    targets step 90 on n2."""
    run_victim(client, agents)
    agents.post(
        "n1",
        progress=[progress(0, 9999, layout=["n1", "n1"]), progress(1, 9999)],
        checkpoint_events=[
            committed(7777, "memory", 0),
            committed(7777, "memory", 1),
            committed(7777, "persistent", None),
        ],
        restores=[RestoreReport(job_id=VICTIM, rank=0, world_size=2, ts=utcnow(), seconds=1)],
        latency=[LatencySample(job_id=VICTIM, rank=0, ts=utcnow(), latency_ms=500.0)],
    )
    job = job_row(session)
    assert job.layout == ["n2", "n2"]
    assert job.step == 100
    assert job.world_size == 2
    assert count(session, LedgerRow, LedgerRow.step == 7777) == 0
    n1 = node_id(session, "n1")
    for model in (CheckpointEventRow, ProgressRow, RestoreRow, LatencySampleRow):
        assert count(session, model, model.node_id == n1) == 0, model.__name__
    viewer = auth(make_token("viewer"))
    tiers = client.get(f"/api/v1/jobs/{VICTIM}", headers=viewer).json()["tiers"]
    assert tiers["persistent"]["newest_step"] is None
    assert tiers["memory"]["newest_step"] == 90

    r = client.post(
        f"/api/v1/jobs/{VICTIM}/restore",
        json={"reason": "default restore"},
        headers=auth(make_token("operator")),
    )
    assert r.status_code == 202, r.text
    assert r.json()["step"] == 90
    assert {p["node"] for p in r.json()["ranks"]} == {"n2"}

    assert refused_metric(client, "node_not_in_job", "progress") == 2
    assert refused_metric(client, "node_not_in_job", "checkpoint_event") == 3
    assert refused_metric(client, "node_not_in_job", "restore") == 1
    assert refused_metric(client, "node_not_in_job", "latency") == 1
    [event] = session.scalars(select(Event).where(Event.node_id == n1, Event.kind == "agent"))
    assert event.data["agent_kind"] == EVENT_AGENT_KIND
    assert event.data["reason"] == "node_not_in_job"
    assert event.data["jobs"] == [VICTIM]
    assert event.severity == "warning"
    assert "not one of the nodes job 'victim' registered (n2)" in event.message


def test_a_rank_is_reported_only_by_the_node_the_layout_names(client, agents, session):
    register_job(client, "shared", ["n1", "n2"], layout=["n1", "n2"])
    agents.post(
        "n1",
        progress=[progress(1, 50, job="shared")],
        checkpoint_events=[
            committed(40, "memory", 1, job="shared"),
            committed(40, "memory", 0, job="shared"),
        ],
        restores=[RestoreReport(job_id="shared", rank=1, world_size=2, ts=utcnow(), seconds=1)],
        latency=[LatencySample(job_id="shared", rank=1, ts=utcnow(), latency_ms=9.0)],
    )
    job = job_row(session, "shared")
    assert job.step == 40  # rank 0's event (n1's own rank) counted, rank 1's progress not
    [row] = session.scalars(select(LedgerRow).where(LedgerRow.job_pk == job.id))
    assert row.ranks_committed == 1
    assert not row.complete
    assert count(session, ProgressRow, ProgressRow.job_pk == job.id) == 0
    assert count(session, RestoreRow, RestoreRow.job_pk == job.id) == 0
    assert count(session, LatencySampleRow, LatencySampleRow.job_id == "shared") == 0
    assert refused_metric(client, "rank_on_other_node", "checkpoint_event") == 1
    # n2 reports its own rank: the step completes.
    agents.post("n2", checkpoint_events=[committed(40, "memory", 1, job="shared")])
    session.expire_all()
    assert session.get(LedgerRow, row.id).complete


def test_whole_step_commits_and_peer_evictions_come_from_any_node_of_the_job(
    client, agents, session
):
    register_job(client, "shared", ["n1", "n2"], layout=["n1", "n2"])
    evicted = CheckpointEvent(
        job_id="shared", step=40, tier="peer", kind="evicted", rank=1, ts=utcnow()
    )
    agents.post(
        "n1",
        checkpoint_events=[committed(40, "persistent", None, job="shared"), evicted],
    )
    job = job_row(session, "shared")
    rows = {r.tier: r for r in session.scalars(select(LedgerRow).where(LedgerRow.job_pk == job.id))}
    assert rows["persistent"].complete  # the whole step, from the node that wrote .metadata
    assert rows["peer"].evicted  # n1 held rank 1's replica


def test_an_unregistered_jobs_reports_are_refused_and_make_no_job(
    client, agents, session, make_token
):
    agents.post(
        "n1",
        progress=[progress(0, 5, layout=["n1"], job="ghost", ws=1)],
        checkpoint_events=[committed(5, "memory", 0, job="ghost", ws=1)],
        restores=[RestoreReport(job_id="ghost", rank=0, world_size=1, ts=utcnow(), seconds=1)],
    )
    assert session.scalar(select(Job).where(Job.job_id == "ghost")) is None
    assert count(session, CheckpointEventRow) == 0
    r = client.get("/api/v1/jobs/ghost", headers=auth(make_token("viewer")))
    assert r.status_code == 404
    assert refused_metric(client, "unregistered_job", "progress") == 1
    [event] = session.scalars(select(Event).where(Event.kind == "agent"))
    assert "tierwatch-server job credential ghost --node n1" in event.message


def test_the_first_layout_pins_it_until_the_job_registers_again(client, agents, session):
    register_job(client, "elastic", ["n1", "n2"])
    # rank 1 reports before rank 0's layout: accepted (n2 is a node of the job)
    agents.post("n2", progress=[progress(1, 3, job="elastic")])
    # a layout naming an unregistered node, or another node for the reporting rank: refused
    agents.post("n1", progress=[progress(0, 4, layout=["n1", "n3"], job="elastic")])
    agents.post("n1", progress=[progress(0, 4, layout=["n2", "n1"], job="elastic")])
    assert job_row(session, "elastic").layout is None
    agents.post("n1", progress=[progress(0, 5, layout=["n1", "n2"], job="elastic")])
    assert job_row(session, "elastic").layout == ["n1", "n2"]
    # pinned: another layout, another world size, or rank 0 from n2 are refused
    agents.post(
        "n1",
        progress=[
            progress(0, 6, layout=["n1", "n1"], job="elastic"),
            progress(0, 6, layout=["n1", "n1", "n2", "n2"], job="elastic", ws=4),
        ],
    )
    agents.post("n2", progress=[progress(0, 7, job="elastic")])
    job = job_row(session, "elastic")
    assert (job.layout, job.world_size, job.step) == (["n1", "n2"], 2, 5)
    assert refused_metric(client, "layout_refused", "progress") == 2
    assert refused_metric(client, "layout_mismatch", "progress") == 1
    assert refused_metric(client, "world_size_mismatch", "progress") == 1
    assert refused_metric(client, "rank_on_other_node", "progress") == 1
    # the restart registers again, on 4 ranks and a new node: the new layout is taken
    register_job(client, "elastic", ["n1", "n2", "n3"], world_size=4)
    assert job_row(session, "elastic").layout is None
    agents.post(
        "n3",
        progress=[progress(0, 8, layout=["n3", "n3", "n1", "n2"], job="elastic", ws=4)],
    )
    job = job_row(session, "elastic")
    assert (job.layout, job.world_size, job.step) == (["n3", "n3", "n1", "n2"], 4, 8)


def test_two_layouts_in_one_group_pin_the_first_applied(client, agents, session):
    """Within one batch, the first layout pins it and binds the reports after it."""
    register_job(client, "race", ["n1"])
    t = utcnow()
    agents.post(
        "n1",
        progress=[
            JobProgress(job_id="race", rank=0, world_size=1, step=1, ts=t, layout=["n1"]),
            JobProgress(
                job_id="race",
                rank=0,
                world_size=2,
                step=2,
                ts=t + timedelta(seconds=1),
                layout=["n1", "n1"],
            ),
        ],
    )
    job = job_row(session, "race")
    assert (job.layout, job.world_size, job.step) == (["n1"], 1, 1)


def test_latency_for_another_nodes_ranks_does_not_reach_the_straggler_rule(
    client, agents, session, make_token
):
    register_job(client, VICTIM, ["n2"], layout=["n2", "n2"])
    now = utcnow()
    for i in range(6):
        ts = now + timedelta(seconds=i)
        # n2's own ranks: rank 1 is slow (a real straggler)
        agents.post(
            "n2",
            latency=[
                LatencySample(job_id=VICTIM, rank=0, world_size=2, ts=ts, latency_ms=2.0),
                LatencySample(job_id=VICTIM, rank=1, world_size=2, ts=ts, latency_ms=40.0),
            ],
        )
        # n1 posts slow samples for rank 0, to raise the baseline and hide the straggler
        agents.post(
            "n1",
            latency=[LatencySample(job_id=VICTIM, rank=0, world_size=2, ts=ts, latency_ms=1e3)],
        )
    n1 = node_id(session, "n1")
    assert count(session, LatencySampleRow, LatencySampleRow.node_id == n1) == 0
    assert count(session, LatencySampleRow, LatencySampleRow.job_id == VICTIM) == 12
    assert refused_metric(client, "node_not_in_job", "latency") == 6
    node = client.get("/api/v1/nodes/n2", headers=auth(make_token("viewer"))).json()
    assert any(r["rule"] == "straggler" for r in node["reasons"]), node["reasons"]


def test_restore_rank_reports_are_checked_against_the_reporting_node(
    client, agents, session, make_token
):
    register_job(client, "shared", ["n1", "n2"], layout=["n1", "n2"])
    agents.post("n1", checkpoint_events=[committed(10, "memory", 0, job="shared")])
    agents.post("n2", checkpoint_events=[committed(10, "memory", 1, job="shared")])
    r = client.post(
        "/api/v1/jobs/shared/restore", json={"reason": "test"}, headers=auth(make_token("operator"))
    )
    assert r.status_code == 202, r.text
    request_id = r.json()["id"]

    def loaded(rank: int) -> RestoreReport:
        return RestoreReport(
            job_id="shared",
            rank=rank,
            world_size=2,
            step=10,
            ts=utcnow(),
            seconds=1.0,
            request_id=request_id,
            phase="loaded",
        )

    def phases() -> dict[int, str]:
        session.expire_all()
        rows = session.scalars(
            select(RestoreRankProgress).where(RestoreRankProgress.request_id == request_id)
        )
        return {p.rank: p.phase for p in rows}

    agents.post("n1", restores=[loaded(1)])  # n1 claims n2's rank: refused by the layout
    assert phases() == {0: "pending", 1: "pending"}
    # The job moves (registers again, rank 1 now on n1): the request still names n2 for rank
    # 1, so n1's report for it does not settle the request's rank.
    register_job(client, "shared", ["n1", "n2"], layout=["n1", "n1"])
    agents.post("n1", restores=[loaded(1)])
    assert phases() == {0: "pending", 1: "pending"}
    agents.post("n1", restores=[loaded(0)])
    assert phases() == {0: "loaded", 1: "pending"}
    req = session.get(RestoreRequest, request_id)
    assert req is not None
    assert req.state == "running"


@pytest.fixture
def policy_client(db_url: str):
    settings = Settings(
        database_url=db_url,
        dev=True,
        prune_interval_s=0,
        background_tick_s=0,
        policy={"enabled": True, "breaker_pct": 50, "restore_jobs": True, "unreachable_s": 3600},
    )
    app = create_app(settings)
    with TestClient(app) as c:
        yield c, settings


def test_the_chained_attack_does_not_roll_the_victim_back(policy_client, make_token):
    """n1 tries to put itself into the victim's layout, then reports a fatal XID: the policy
    isolates n1 (its own node) but requests no restore of the victim job."""
    client, settings = policy_client
    app = client.app
    agents = Agents(client, make_token)
    for n in ("n0", "n3", "n4"):
        agents.post(n)
    run_victim(client, agents)
    agents.post(
        "n1",
        progress=[progress(0, 101, layout=["n1", "n2"]), progress(0, 102, layout=["n1", "n1"])],
    )
    batch = make_batch("n1", agents.seq["n1"] + 1, gpus=4, xids=[(2, 79)])
    r = post_batch(client, agents.tokens["n1"], batch)
    assert r.status_code == 200, r.text
    with app.state.sessionmaker() as s:
        run = policy.run(s, settings, now=utcnow())
        s.commit()
        assert run.isolated == ["n1"]
        assert run.restores == []
        assert s.scalar(select(func.count()).select_from(RestoreRequest)) == 0
        assert s.scalar(select(Job.layout).where(Job.job_id == VICTIM)) == ["n2", "n2"]


def test_refusal_events_are_rate_limited_per_node_and_reason(client, agents, session):
    register_job(client, VICTIM, ["n2"])
    for step in (1, 2, 3):
        agents.post("n1", progress=[progress(0, step)])
    n1 = node_id(session, "n1")
    assert count(session, Event, Event.node_id == n1, Event.kind == "agent") == 1
    agents.post("n1", progress=[progress(0, 4, job="ghost")])  # another reason: its own event
    assert count(session, Event, Event.node_id == n1, Event.kind == "agent") == 2
    assert refused_metric(client, "node_not_in_job", "progress") == 3


def test_refusal_log_warns_once_per_node_job_and_reason_per_interval(caplog):
    from tierwatch.server.checkpoints.scoping import Refusal

    clock = [0.0]
    log = RefusalLog(log_every_s=60, clock=lambda: clock[0])
    refusal = Refusal(
        node="n1", job_id=VICTIM, item="progress", reason="node_not_in_job", message="m", rank=3
    )
    with caplog.at_level(logging.WARNING, logger="tierwatch.server.ingest"):
        log.record([refusal, refusal])
        log.record([refusal])
        clock[0] = 61.0
        log.record([refusal])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    for part in ("node n1", "job victim", "ranks 3", "node_not_in_job"):
        assert part in lines[0]
    assert "[1 more refused since the last line]" in lines[1]
    assert log.count("node_not_in_job", "progress") == 4

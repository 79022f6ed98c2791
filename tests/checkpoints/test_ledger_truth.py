"""The ledger tells the truth about the tiers: the exact event sequences of a fast job.

A 2-rank job (rank 0 on n1, rank 1 on n2) saving every step with ``keep_memory`` 2: each
agent's report carries its rank's ``committed`` and ``evicted`` of the same steps, the two
nodes' reports cover different steps, and the trainers' memory events reach the server later
than the agents' peer events. The rules are docs/checkpointing.md "Ledger" and
``app/checkpoints/ledger.py``; each test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import select
from support import auth, post_batch, register_job

from tierwatch.agent.protocol import (
    CheckpointEvent,
    JobProgress,
    ReportBatch,
    RestoreReport,
    utcnow,
)
from tierwatch.server.checkpoints.models import LedgerRow
from tierwatch.server.fleet import service as fleet_service

JOB = "fast"
NODE_OF = {0: "n1", 1: "n2"}
T0 = (utcnow() - timedelta(minutes=5)).replace(microsecond=0)
STEP_S = 0.1  # seconds per step
SHARD = 1000  # bytes per rank and step


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


class Agents:
    """n1 and n2 posting report batches with their own tokens and sequence numbers, for
    :data:`JOB`, registered on both (its layout comes from rank 0's reports)."""

    def __init__(self, client, make_token):
        register_job(client, JOB, ["n1", "n2"])
        self.client = client
        self.tokens = {n: make_token("agent", n) for n in ("n1", "n2")}
        self.seq = dict.fromkeys(self.tokens, 0)

    def post(self, node, **content):
        self.seq[node] += 1
        batch = ReportBatch(node=node, epoch="e1", seq=self.seq[node], sent_at=utcnow(), **content)
        r = post_batch(self.client, self.tokens[node], batch)
        assert r.status_code == 200, r.text


def ev(kind, step, tier, rank, t=None, **kw) -> CheckpointEvent:
    return CheckpointEvent(
        job_id=JOB,
        step=step,
        tier=tier,
        kind=kind,
        rank=rank,
        world_size=None if rank is None else 2,
        ts=at(step * STEP_S if t is None else t),
        **kw,
    )


def saves(rank, steps, tier="memory", keep=2) -> list[CheckpointEvent]:
    """A rank's events for saves of ``steps`` (every step): each commit, then retention's
    eviction of the step ``keep`` saves older, as the rank sends them."""
    out = []
    for s in steps:
        out.append(ev("committed", s, tier, rank, bytes=SHARD, seconds=0.05))
        if s - keep >= 0:
            out.append(ev("evicted", s - keep, tier, rank, s * STEP_S + 0.01))
    return out


def progress(rank, step, **kw) -> JobProgress:
    return JobProgress(
        job_id=JOB,
        rank=rank,
        world_size=2,
        step=step,
        step_time_s=STEP_S,
        ts=at(step * STEP_S),
        **kw,
    )


def tiers(client, viewer) -> dict:
    r = client.get(f"/api/v1/jobs/{JOB}", headers=auth(viewer))
    assert r.status_code == 200, r.text
    return r.json()["tiers"]


def newest(client, viewer) -> dict[str, int | None]:
    return {t: v["newest_step"] for t, v in tiers(client, viewer).items()}


def test_a_batch_with_a_ranks_commit_and_eviction_of_one_step_keeps_a_committed_step(
    client, make_token
):
    """n1's report covers rank 0's steps 0-5 (evicting 0-3), n2's rank 1's steps 0-9
    (evicting 0-7): no step is both complete and not evicted, yet step 5 was complete in
    memory (rank 0 evicts it only once a newer step is committed)."""
    agents, viewer = Agents(client, make_token), make_token("viewer")
    agents.post("n1", progress=[progress(0, 5)], checkpoint_events=saves(0, range(6)))
    agents.post("n2", progress=[progress(1, 9)], checkpoint_events=saves(1, range(10)))
    t = tiers(client, viewer)
    assert t["memory"]["newest_step"] == 5
    assert (t["memory"]["lag_steps"], t["memory"]["bytes"]) == (4, 2 * SHARD)
    # the next report of n1 catches up: the newest step both ranks committed
    agents.post("n1", progress=[progress(0, 9)], checkpoint_events=saves(0, range(6, 10)))
    t = tiers(client, viewer)
    assert (t["memory"]["newest_step"], t["memory"]["lag_steps"]) == (9, 0)


def test_one_batch_with_every_ranks_commit_and_eviction_of_every_step(client, make_token):
    """One agent hosting both ranks reports steps 0-9 at once, each step's eviction two
    saves later: the newest step (9) is never evicted, and steps evicted in the same report
    they were committed in still count until it."""
    agents, viewer = Agents(client, make_token), make_token("viewer")
    events = [e for s in range(10) for r in (0, 1) for e in saves(r, [s])]
    agents.post("n1", progress=[progress(0, 9)], checkpoint_events=events)
    assert newest(client, viewer)["memory"] == 9
    # the ranks' newest step evicted too (its own eviction arrives first): still counted
    agents.post("n1", checkpoint_events=[ev("evicted", 9, "memory", r, 1.2) for r in (0, 1)])
    assert newest(client, viewer)["memory"] == 9


def test_late_memory_events_never_put_memory_below_peer_or_persistent(client, make_token):
    """The agents' peer commits of step 6 and the persistent commit of step 5 arrive before
    the trainers' memory events of those steps: memory committed them first."""
    agents, viewer = Agents(client, make_token), make_token("viewer")
    agents.post("n1", progress=[progress(0, 7)], checkpoint_events=saves(0, range(4)))
    agents.post("n2", progress=[progress(1, 7)], checkpoint_events=saves(1, range(4)))
    peer = [ev("committed", 6, "peer", r, 0.75, bytes=SHARD, seconds=0.2) for r in (0, 1)]
    persistent = [ev("committed", 5, "persistent", None, 0.7, bytes=2 * SHARD, seconds=0.3)]
    agents.post("n1", checkpoint_events=[peer[1], *persistent])
    agents.post("n2", checkpoint_events=[peer[0]])
    t = tiers(client, viewer)
    assert {k: v["newest_step"] for k, v in t.items()} == {
        "memory": 6,
        "peer": 6,
        "persistent": 5,
    }
    # memory's own row of step 6 is not here yet: the peer copy's time and size, no commit_s
    assert (t["memory"]["lag_steps"], t["memory"]["bytes"], t["memory"]["commit_s"]) == (
        1,
        2 * SHARD,
        None,
    )
    assert t["memory"]["committed_at"] == t["peer"]["committed_at"]
    # the trainers' events arrive: memory's own figures
    agents.post("n1", checkpoint_events=saves(0, range(4, 8)))
    agents.post("n2", checkpoint_events=saves(1, range(4, 8)))
    t = tiers(client, viewer)
    assert (t["memory"]["newest_step"], t["memory"]["commit_s"]) == (7, 0.05)


def test_a_rollback_abandons_the_steps_above_its_target_until_they_are_saved_again(
    client, make_token
):
    """Steps 0-10 committed (0-8 evicted by retention), then a rollback to step 7 (restored
    from persistent) evicts 9 and 10; saving step 8 again counts again."""
    agents, viewer = Agents(client, make_token), make_token("viewer")
    agents.post("n1", progress=[progress(0, 10)], checkpoint_events=saves(0, range(11)))
    agents.post("n2", progress=[progress(1, 10)], checkpoint_events=saves(1, range(11)))
    agents.post(
        "n1", checkpoint_events=[ev("committed", 7, "persistent", None, 0.8, bytes=2 * SHARD)]
    )
    assert newest(client, viewer) == {"memory": 10, "peer": None, "persistent": 7}
    rollback = [
        RestoreReport(
            job_id=JOB,
            rank=r,
            world_size=2,
            step=7,
            ts=at(2.0),
            seconds=0.5,
            steps_lost=3,
            files_by_tier={"persistent": 2},
            request_id=1,
            phase="loaded",
        )
        for r in (0, 1)
    ]
    gone = [ev("evicted", s, "memory", r, 2.0) for s in (9, 10) for r in (0, 1)]
    agents.post("n1", restores=rollback, checkpoint_events=gone)
    assert newest(client, viewer) == {"memory": 7, "peer": None, "persistent": 7}
    again = [ev("committed", 8, "memory", r, 2.1, bytes=SHARD) for r in (0, 1)]
    agents.post("n1", checkpoint_events=again)
    assert newest(client, viewer)["memory"] == 8


def test_prune_keeps_the_newest_committed_step_after_its_eviction(client, make_token, session):
    agents, viewer = Agents(client, make_token), make_token("viewer")
    agents.post("n1", progress=[progress(0, 5)], checkpoint_events=saves(0, range(6)))
    agents.post("n2", progress=[progress(1, 9)], checkpoint_events=saves(1, range(10)))
    fleet_service.prune(
        session, now=utcnow() + timedelta(days=1), sample_retention_s=60, event_retention_s=60
    )
    session.commit()
    assert session.scalars(select(LedgerRow.step)).all() == [5]
    assert newest(client, viewer)["memory"] == 5


def test_a_refused_start_does_not_rewrite_the_jobs_world_size_or_layout(client, make_token):
    """Rank 0 of a 1-rank start announces itself (``starting``) before its restore refuses
    the 2-rank job's steps. Unregistered, the start is refused for its world size (pinned at
    2 by the layout); registered again (as a restart is), the announcement changes neither
    world size nor layout, and the first save of the accepted start sets both."""
    agents, viewer = Agents(client, make_token), make_token("viewer")
    agents.post("n1", progress=[progress(0, 3, layout=["n1", "n2"])])
    start = JobProgress(
        job_id=JOB, rank=0, world_size=1, step=0, ts=at(5.0), layout=["n1"], starting=True
    )
    refused = RestoreReport(
        job_id=JOB,
        rank=0,
        world_size=1,
        ts=at(5.1),
        seconds=0.2,
        ok=False,
        message="job_id 'fast' holds steps saved at world_size 2 (newest step 3)",
    )

    def job(job_id=JOB) -> tuple:
        out = client.get(f"/api/v1/jobs/{job_id}", headers=auth(viewer)).json()
        return out["world_size"], out["layout"], len(out["restores"])

    agents.post("n1", progress=[start], restores=[refused])
    assert job() == (2, ["n1", "n2"], 0)  # refused: the layout pins world size 2
    register_job(client, JOB, ["n1"])  # the 1-rank restart registers again
    agents.post("n1", progress=[start], restores=[refused])
    assert job() == (2, None, 1)  # its world size stays; the layout waits for the first save
    # a new job takes its world size and layout from the announcement
    register_job(client, "fresh", ["n1"])
    agents.post("n1", progress=[start.model_copy(update={"job_id": "fresh"})])
    assert job("fresh") == (1, ["n1"], 0)
    # an accepted start's first save reports the new world size and layout
    first = JobProgress(job_id=JOB, rank=0, world_size=1, step=0, ts=at(6.0), layout=["n1"])
    agents.post("n1", progress=[first])
    assert job() == (1, ["n1"], 1)


def test_the_layout_of_a_start_survives_another_nodes_newer_report_arriving_first(
    client, make_token
):
    """n2's report (rank 1, step 2, no layout) reaches the server before n1's, which holds
    rank 0's start report and its first save's report with the layout."""
    agents, viewer = Agents(client, make_token), make_token("viewer")
    agents.post("n2", progress=[progress(1, 2)])
    start = JobProgress(
        job_id=JOB, rank=0, world_size=2, step=0, ts=at(0.0), layout=["n1", "n2"], starting=True
    )
    agents.post("n1", progress=[start, progress(0, 0, layout=["n1", "n2"]), progress(0, 1)])
    job = client.get(f"/api/v1/jobs/{JOB}", headers=auth(viewer)).json()
    assert (job["world_size"], job["layout"], job["step"]) == (2, ["n1", "n2"], 2)

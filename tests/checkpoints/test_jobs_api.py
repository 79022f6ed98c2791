"""Server: tier status, lag and interval advice from a scripted event sequence.

Two agents (n1: ranks 0-1, n2: ranks 2-3) of one 4-rank job post real ReportBatch JSON
through the ingest API; the tests then read /api/v1/jobs and /metrics and check the values
exactly against the ledger rules and app/checkpoints/advice.py.

The script (times are seconds after T0, step time 2 s):

=====  ==========================================================================
step   what the agents report
=====  ==========================================================================
10     trained at +20; memory: all 4 ranks commit; peer: all 4 ranks commit;
       persistent: one whole-step commit (rank None)
20     trained at +40; memory: all 4 ranks commit; peer: ranks 0, 1, 2 (rank 3 never)
30     trained at +60; memory: ranks 0, 1, 2 commit, rank 3 fails
35     trained at +70 (current step)
=====  ==========================================================================

Then retention evicts memory step 10.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
from datetime import timedelta

import pytest
from support import auth, post_batch, register_job

from tierwatch.agent.protocol import (
    CheckpointEvent,
    JobProgress,
    ReportBatch,
    RestoreReport,
    utcnow,
)
from tierwatch.server.checkpoints.advice import advise

JOB = "llm-7b"
WORLD = 4
LAYOUT = ["n1", "n1", "n2", "n2"]
NODE_OF = dict(enumerate(LAYOUT))
T0 = (utcnow() - timedelta(minutes=10)).replace(microsecond=0)
TRAINED = {10: 20.0, 20: 40.0, 30: 60.0, 35: 70.0}
STEP_TIMES = {0: 2.0, 1: 2.0, 2: 2.2, 3: 1.8}  # per rank; the median is 2.0 s


def at(seconds: float):
    return T0 + timedelta(seconds=seconds)


class Agents:
    """Posts batches for n1 and n2 with their own agent tokens and sequence numbers."""

    def __init__(self, client, make_token):
        self.client = client
        self.tokens = {n: make_token("agent", n) for n in ("n1", "n2")}
        self.seq = dict.fromkeys(self.tokens, 0)

    def batch(self, node, **content) -> ReportBatch:
        self.seq[node] += 1
        return ReportBatch(node=node, epoch="e1", seq=self.seq[node], sent_at=utcnow(), **content)

    def post(self, node, **content):
        r = post_batch(self.client, self.tokens[node], self.batch(node, **content))
        assert r.status_code == 200, r.text
        return r

    def post_raw(self, node, body: dict):
        return self.client.post(
            "/api/v1/ingest/report",
            json=body,
            headers={**auth(self.tokens[node]), "Content-Type": "application/json"},
        )


def ev(kind, step, tier, rank, t, **kw) -> CheckpointEvent:
    return CheckpointEvent(
        job_id=JOB,
        step=step,
        tier=tier,
        kind=kind,
        rank=rank,
        world_size=None if rank is None else WORLD,
        ts=at(t),
        **kw,
    )


def progress(step, rank) -> JobProgress:
    return JobProgress(
        job_id=JOB,
        rank=rank,
        world_size=WORLD,
        step=step,
        step_time_s=STEP_TIMES[rank],
        ts=at(TRAINED[step] + 0.1 * rank),
        layout=LAYOUT if rank == 0 else None,
    )


# staged blocking_s per (step, rank) in the memory tier; committed seconds per tier
BLOCKING = {
    (10, 0): 0.5,
    (10, 1): 0.7,
    (10, 2): 0.6,
    (10, 3): 0.4,
    (20, 0): 0.5,
    (20, 1): 0.9,
    (20, 2): 0.3,
    (20, 3): 0.5,
    (30, 0): 0.6,
    (30, 1): 0.6,
    (30, 2): 0.8,
    (30, 3): 1.2,
}
MEMORY_COMMIT_S = {
    (10, 0): 1.0,
    (10, 1): 1.5,
    (10, 2): 2.0,
    (10, 3): 0.5,
    (20, 0): 1.0,
    (20, 1): 1.2,
    (20, 2): 1.1,
    (20, 3): 1.3,
    (30, 0): 1.0,
    (30, 1): 1.0,
    (30, 2): 1.4,
}
PEER_COMMIT_S = {
    (10, 0): 3.0,
    (10, 1): 3.5,
    (10, 2): 2.5,
    (10, 3): 4.0,
    (20, 0): 3.0,
    (20, 1): 3.0,
    (20, 2): 3.2,
}
SHARD_BYTES = 1000


def node_events(node, step):
    """One node's events of one step, as its agent would batch them."""
    ranks = [r for r, n in NODE_OF.items() if n == node]
    t = TRAINED[step]
    out = []
    for r in ranks:
        out.append(ev("staged", step, "memory", r, t + 0.5, blocking_s=BLOCKING[(step, r)]))
        if (step, r) in MEMORY_COMMIT_S:
            out.append(
                ev(
                    "committed",
                    step,
                    "memory",
                    r,
                    t + 2,
                    bytes=SHARD_BYTES,
                    seconds=MEMORY_COMMIT_S[(step, r)],
                )
            )
        elif step == 30:
            out.append(
                ev(
                    "failed",
                    step,
                    "memory",
                    r,
                    t + 2,
                    message="write __3_0.distcp: No space left on device",
                )
            )
        if (step, r) in PEER_COMMIT_S:
            out.append(
                ev(
                    "committed",
                    step,
                    "peer",
                    r,
                    t + 5,
                    bytes=SHARD_BYTES,
                    seconds=PEER_COMMIT_S[(step, r)],
                )
            )
    if step == 10 and node == "n1":
        out.append(
            ev("committed", 10, "persistent", None, t + 9, bytes=4 * SHARD_BYTES, seconds=8.0)
        )
    return out


def run_script(agents: Agents) -> None:
    for step in (10, 20, 30):
        for node in ("n1", "n2"):
            agents.post(
                node,
                progress=[progress(step, r) for r, n in NODE_OF.items() if n == node],
                checkpoint_events=node_events(node, step),
            )
    for node in ("n1", "n2"):
        agents.post(node, progress=[progress(35, r) for r, n in NODE_OF.items() if n == node])
    agents.post("n1", checkpoint_events=[ev("evicted", 10, "memory", None, 65.0)])


@pytest.fixture
def scripted(client, make_token):
    register_job(client, JOB, ["n1", "n2"])  # its layout comes from rank 0's reports
    agents = Agents(client, make_token)
    run_script(agents)
    return agents, make_token("viewer")


def job_json(client, viewer, job=JOB):
    r = client.get(f"/api/v1/jobs/{job}", headers=auth(viewer))
    assert r.status_code == 200, r.text
    return r.json()


def test_tier_status_and_lag(client, scripted):
    _, viewer = scripted
    job = job_json(client, viewer)
    assert job["job_id"] == JOB
    assert (job["world_size"], job["layout"], job["step"]) == (WORLD, LAYOUT, 35)
    assert job["step_time_s"] == 2.0
    memory, peer, persistent = (job["tiers"][t] for t in ("memory", "peer", "persistent"))
    # memory: step 10 evicted, 20 complete, 30 missing rank 3 -> newest 20, lag 15 steps;
    # steps 20 and 35 were both seen in progress: 70 s - 40 s of training at risk
    assert (memory["newest_step"], memory["lag_steps"], memory["lag_s"]) == (20, 15, 30.0)
    assert memory["bytes"] == WORLD * SHARD_BYTES
    assert memory["commit_s"] == 1.3  # slowest rank of step 20
    assert memory["throughput_bytes_per_s"] == WORLD * SHARD_BYTES / 1.3
    assert memory["last_blocking_s"] == BLOCKING[(30, 3)]  # newest staged event
    assert memory["pending"] == {
        "step": 30,
        "world_size": WORLD,
        "ranks_committed": 3,
        "missing_ranks": [3],
        "missing_count": 1,
        "failures": 1,
    }
    assert memory["committed_at"] is not None
    # peer: step 20 lacks rank 3, so step 10 is the newest
    assert (peer["newest_step"], peer["lag_steps"], peer["lag_s"]) == (10, 25, 50.0)
    assert peer["pending"]["missing_ranks"] == [3]
    assert (peer["bytes"], peer["commit_s"]) == (WORLD * SHARD_BYTES, 4.0)
    # persistent: one whole-step commit of step 10
    assert (persistent["newest_step"], persistent["lag_steps"]) == (10, 25)
    assert (persistent["bytes"], persistent["commit_s"]) == (4 * SHARD_BYTES, 8.0)
    assert persistent["throughput_bytes_per_s"] == 500.0
    assert persistent["pending"] is None
    assert job["worst_lag"] == {"tier": "persistent", "steps": 25, "seconds": 50.0}


def test_work_at_risk_per_failure_class(client, scripted):
    _, viewer = scripted
    risk = job_json(client, viewer)["at_risk"]
    assert risk == {
        "process": {"tier": "memory", "step": 20, "steps": 15, "seconds": 30.0},
        "node": {"tier": "peer", "step": 10, "steps": 25, "seconds": 50.0},
        "rack": {"tier": "persistent", "step": 10, "steps": 25, "seconds": 50.0},
        "rollback": {"tier": "persistent", "step": 10, "steps": 25, "seconds": 50.0},
    }


def test_interval_advice_matches_advice_module(client, scripted):
    _, viewer = scripted
    tiers = job_json(client, viewer)["tiers"]
    blocking = statistics.median(BLOCKING.values())  # every staged event is memory-tier
    for tier, commits in (
        ("memory", MEMORY_COMMIT_S.values()),
        ("peer", PEER_COMMIT_S.values()),
        ("persistent", [8.0]),
    ):
        commit_s = statistics.median(commits)
        expected = advise(tier, cost_s=blocking, commit_s=commit_s, gpus=WORLD)
        got = tiers[tier]["advice"]
        assert got == {
            "cost_s": blocking,
            "commit_s": commit_s,
            "mtbf_s": expected.mtbf_s,
            "mtbf_source": "llama3_table",
            "young_s": expected.young_s,
            "daly_s": expected.daly_s,
            "recommended_s": expected.recommended_s,
            "recommended_steps": expected.recommended_s / 2.0,
            "bounded_by_commit": expected.bounded_by_commit,
        }, tier


def test_events_newest_first_with_failures(client, scripted):
    _, viewer = scripted
    events = job_json(client, viewer)["events"]
    assert (events[0]["kind"], events[0]["step"]) == ("evicted", 10)
    times = [e["ts"] for e in events]
    assert times == sorted(times, reverse=True)
    [failed] = [e for e in events if e["kind"] == "failed"]
    assert failed == {
        "ts": failed["ts"],
        "kind": "failed",
        "tier": "memory",
        "step": 30,
        "rank": 3,
        "world_size": WORLD,
        "node": "n2",
        "bytes": None,
        "seconds": None,
        "blocking_s": None,
        "message": "write __3_0.distcp: No space left on device",
    }


def test_an_evicted_newest_step_counts_until_a_restore_abandons_it(client, scripted):
    """Retention evicts a tier's newest committed step only after a newer one committed
    (docs/checkpointing.md "Ledger"), so the eviction alone leaves step 20 the newest; a
    restore of step 10 abandons it (and step 10, evicted from memory, was reached there)."""
    agents, viewer = scripted
    agents.post("n1", checkpoint_events=[ev("evicted", 20, "memory", 0, 72.0)])
    job = job_json(client, viewer)
    assert (job["tiers"]["memory"]["newest_step"], job["tiers"]["memory"]["lag_steps"]) == (20, 15)
    assert job["at_risk"]["process"]["step"] == 20
    restored = [
        RestoreReport(
            job_id=JOB, rank=r, world_size=WORLD, step=10, ts=at(80.0), seconds=1.0, steps_lost=25
        )
        for r in range(WORLD)
    ]
    agents.post("n1", restores=restored[:2])
    agents.post("n2", restores=restored[2:])
    job = job_json(client, viewer)
    memory = job["tiers"]["memory"]
    assert (memory["newest_step"], memory["lag_steps"], memory["lag_s"]) == (10, 25, 50.0)
    assert memory["pending"] is None  # step 30, committed before the restore, is not waited for
    assert job["at_risk"]["process"] == {"tier": "memory", "step": 10, "steps": 25, "seconds": 50.0}


def test_late_rank_completes_a_step_and_replays_count_once(client, scripted):
    agents, viewer = scripted
    late = ev("committed", 20, "peer", 3, 47.0, bytes=SHARD_BYTES, seconds=9.0)
    batch = agents.batch("n2", checkpoint_events=[late])
    assert post_batch(client, agents.tokens["n2"], batch).json()["stored"] is True
    assert post_batch(client, agents.tokens["n2"], batch).json()["stored"] is False
    # the same rank reported again in a new batch is no new commit either
    agents.post("n2", checkpoint_events=[late])
    peer = job_json(client, viewer)["tiers"]["peer"]
    assert (peer["newest_step"], peer["lag_steps"], peer["lag_s"]) == (20, 15, 30.0)
    assert (peer["bytes"], peer["commit_s"]) == (WORLD * SHARD_BYTES, 9.0)
    assert peer["pending"] is None


def test_job_list_shows_worst_lag(client, scripted):
    _, viewer = scripted
    r = client.get("/api/v1/jobs", headers=auth(viewer))
    assert r.status_code == 200
    [job] = r.json()
    assert (job["job_id"], job["step"], job["world_size"]) == (JOB, 35, WORLD)
    assert job["tiers"]["memory"]["newest_step"] == 20
    assert job["tiers"]["memory"]["lag_steps"] == 15
    assert job["worst_lag"] == {"tier": "persistent", "steps": 25, "seconds": 50.0}


def test_job_with_no_committed_step_has_everything_at_risk(client, make_token):
    register_job(client, "fresh", ["n1"])
    agents = Agents(client, make_token)
    agents.post(
        "n1",
        progress=[
            JobProgress(job_id="fresh", rank=0, world_size=2, step=7, step_time_s=1.5, ts=at(1))
        ],
    )
    job = job_json(client, make_token("viewer"), "fresh")
    for tier in ("memory", "peer", "persistent"):
        t = job["tiers"][tier]
        assert (t["newest_step"], t["lag_steps"], t["lag_s"]) == (None, 8, 12.0)
        assert t["advice"] is None  # nothing measured yet
    assert job["at_risk"]["process"] == {"tier": None, "step": None, "steps": 8, "seconds": 12.0}


def test_world_size_learned_later_completes_the_step(client, make_token):
    """Commits that name no world size complete once progress tells the world size."""
    register_job(client, "late-ws", ["n1"])
    agents = Agents(client, make_token)
    viewer = make_token("viewer")
    bare = [
        CheckpointEvent(
            job_id="late-ws",
            step=4,
            tier="memory",
            kind="committed",
            rank=r,
            ts=at(5),
            bytes=10,
            seconds=0.1,
        )
        for r in (0, 1)
    ]
    agents.post("n1", checkpoint_events=bare)
    memory = job_json(client, viewer, "late-ws")["tiers"]["memory"]
    assert memory["newest_step"] is None
    assert memory["pending"]["missing_ranks"] is None  # world size unknown
    agents.post(
        "n1", progress=[JobProgress(job_id="late-ws", rank=0, world_size=2, step=5, ts=at(6))]
    )
    memory = job_json(client, viewer, "late-ws")["tiers"]["memory"]
    assert (memory["newest_step"], memory["lag_steps"], memory["bytes"]) == (4, 1, 20)


def test_restores_are_listed(client, scripted):
    agents, viewer = scripted
    agents.post(
        "n2",
        restores=[
            RestoreReport(
                job_id=JOB,
                rank=2,
                world_size=WORLD,
                step=20,
                ts=at(80),
                seconds=4.5,
                steps_lost=15,
                files_by_tier={"memory": 1, "peer": 2},
                sources={"__2_0.distcp": "peer:n1"},
            ),
            RestoreReport(
                job_id=JOB,
                rank=3,
                world_size=WORLD,
                ts=at(81),
                seconds=1.0,
                ok=False,
                message="no step every rank can get",
            ),
        ],
    )
    restores = job_json(client, viewer)["restores"]
    assert [r["rank"] for r in restores] == [3, 2]
    assert restores[1] == {
        "ts": restores[1]["ts"],
        "rank": 2,
        "world_size": WORLD,
        "node": "n2",
        "step": 20,
        "seconds": 4.5,
        "steps_lost": 15,
        "files_by_tier": {"memory": 1, "peer": 2},
        "ok": True,
        "message": "",
    }
    assert (restores[0]["ok"], restores[0]["step"]) == (False, None)


def test_history_for_the_chart(client, scripted):
    _, viewer = scripted
    since = at(0).isoformat()
    r = client.get(f"/api/v1/jobs/{JOB}/history", params={"since": since}, headers=auth(viewer))
    assert r.status_code == 200, r.text
    body = r.json()
    assert [p["step"] for p in body["progress"]] == [10, 20, 30, 35]
    # newest committed step over time (a step function; evictions do not rewrite history)
    assert [p["step"] for p in body["committed"]["memory"]] == [10, 20]
    assert [p["step"] for p in body["committed"]["peer"]] == [10]
    assert [p["step"] for p in body["committed"]["persistent"]] == [10]
    later = client.get(
        f"/api/v1/jobs/{JOB}/history", params={"since": at(50).isoformat()}, headers=auth(viewer)
    ).json()
    assert [p["step"] for p in later["progress"]] == [30, 35]
    assert [p["step"] for p in later["committed"]["memory"]] == [20]  # carried in from before


def test_metrics_values(client, scripted):
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}

    def values(name):
        return {tuple(sorted(s.labels.items())): s.value for s in families[name].samples}

    def key(tier):
        return (("job", JOB), ("tier", tier))

    assert values("tierwatch_job_step") == {(("job", JOB),): 35.0}
    assert values("tierwatch_checkpoint_newest_step") == {
        key("memory"): 20.0,
        key("peer"): 10.0,
        key("persistent"): 10.0,
    }
    assert values("tierwatch_checkpoint_lag_steps") == {
        key("memory"): 15.0,
        key("peer"): 25.0,
        key("persistent"): 25.0,
    }
    assert values("tierwatch_checkpoint_lag_seconds") == {
        key("memory"): 30.0,
        key("peer"): 50.0,
        key("persistent"): 50.0,
    }


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool absent (.ci/run installs the Debian prometheus package)",
)
def test_checkpoint_metrics_pass_promtool(client, scripted):
    text = client.get("/metrics").text
    assert "tierwatch_checkpoint_lag_steps{" in text
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_observed_failures_replace_the_table_mtbf(client, scripted, session):
    """Three restore incidents served from memory give the memory tier an observed MTBF;
    the peer tier, with one node incident, keeps the Llama 3 table's."""
    from sqlalchemy import update

    from tierwatch.server.checkpoints.models import Job

    agents, viewer = scripted
    for t, tier in ((100, "memory"), (300, "memory"), (500, "memory"), (700, "peer")):
        for node in ("n1", "n2"):
            agents.post(
                node,
                restores=[
                    RestoreReport(
                        job_id=JOB,
                        rank=r,
                        world_size=WORLD,
                        step=20,
                        ts=at(t + r),
                        seconds=1.0,
                        files_by_tier={"memory": 1, tier: 1},
                    )
                    for r, n in NODE_OF.items()
                    if n == node
                ],
            )
    session.execute(
        update(Job).where(Job.job_id == JOB).values(first_seen=utcnow() - timedelta(hours=1))
    )
    session.commit()
    tiers = job_json(client, viewer)["tiers"]
    memory, peer = tiers["memory"]["advice"], tiers["peer"]["advice"]
    assert memory["mtbf_source"] == "observed"
    assert 3500 / 3 < memory["mtbf_s"] <= 3600 / 3  # last report, minus first_seen
    blocking = statistics.median(BLOCKING.values())
    expected = advise(
        "memory", cost_s=blocking, commit_s=memory["commit_s"], gpus=WORLD, mtbf_s=memory["mtbf_s"]
    )
    assert memory["recommended_s"] == expected.recommended_s
    assert peer["mtbf_source"] == "llama3_table"
    assert peer["mtbf_s"] == advise("peer", cost_s=0, commit_s=0, gpus=WORLD).mtbf_s

"""What the server makes of an agent's sending order after an outage (agent.sendorder):
the newest state first, then the backlog (urgent batches first, each oldest first).

The agent relies on these: a backfilled batch is stored once and acked with the epoch's
highest seq; its samples are stored but not evaluated (no stale findings, the newest reading
stays the latest); its XIDs become events and reasons; a batch of an earlier agent run does
not take the node back to that run's epoch.
"""

from __future__ import annotations

from sqlalchemy import func, select
from support import auth, make_batch, post_batch

from tierwatch.agent.protocol import ReportBatch
from tierwatch.server.fleet.models import GpuSampleRow


def heartbeat(batch: ReportBatch) -> ReportBatch:
    """The same report without samples (``agent.sampling``)."""
    return batch.model_copy(update={"samples": []})


def node_json(client, viewer, name):
    r = client.get(f"/api/v1/nodes/{name}", headers=auth(viewer))
    assert r.status_code == 200, r.text
    return r.json()


def reasons(node) -> set[tuple[str, int | None, str]]:
    return {(r["rule"], r["gpu"], r["key"]) for r in node["reasons"]}


def test_newest_first_then_backfill_gives_the_current_state_and_keeps_the_history(
    client, make_token, session
):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    # delivered before the outage (interval 5 s: stale telemetry after 15 s)
    assert post_batch(client, agent, make_batch("n1", 1, offset_s=-100)).status_code == 200
    # spooled during the 90 s outage
    hot = make_batch("n1", 2, offset_s=-80, temperature_c=95.0)  # over the slowdown threshold
    xid_79 = heartbeat(make_batch("n1", 3, offset_s=-60, xids=[(1, 79)]))
    newest_samples = make_batch("n1", 4, offset_s=-20, temperature_c=60.0)
    newest = heartbeat(make_batch("n1", 5, offset_s=-10, xids=[(0, 48)]))

    # the agent's order: the newest samples, the newest batch, the urgent backlog, the rest
    assert post_batch(client, agent, newest_samples).json()["acked_seq"] == 4
    node = node_json(client, viewer, "n1")
    assert (node["state"], node["reasons"]) == ("healthy", [])  # no stale telemetry
    assert {g["temperature_c"] for g in node["gpus"]} == {60.0}

    assert post_batch(client, agent, newest).json()["acked_seq"] == 5
    node = node_json(client, viewer, "n1")
    assert node["state"] == "unhealthy"
    assert reasons(node) == {("xid", 0, "48")}  # current before any backfill

    # the backfill: every ack names the epoch's highest seq
    assert post_batch(client, agent, xid_79).json() == {
        "epoch": "epoch-1",
        "acked_seq": 5,
        "stored": True,
        "commands": [],
    }
    node = node_json(client, viewer, "n1")
    assert reasons(node) == {("xid", 0, "48"), ("xid", 1, "79")}  # a backfilled fatal XID

    assert post_batch(client, agent, hot).json()["acked_seq"] == 5
    node = node_json(client, viewer, "n1")
    # the old hot reading is history: stored, not evaluated, not the latest value
    assert reasons(node) == {("xid", 0, "48"), ("xid", 1, "79")}
    assert {g["temperature_c"] for g in node["gpus"]} == {60.0}
    assert session.scalar(select(func.count()).select_from(GpuSampleRow)) == 3 * 2
    assert node["reports"] | {"epoch": None} == {
        "epoch": None,
        "first_seq": 1,
        "last_seq": 5,
        "batches": 5,
        "missing": 0,
        "dropped_by_agent": 0,
    }
    assert post_batch(client, agent, hot).json()["stored"] is False  # a resend: nothing new

    events = client.get("/api/v1/events?node=n1", headers=auth(viewer)).json()
    arrived = sorted((e for e in events if e["kind"] == "xid"), key=lambda e: e["id"])
    assert [e["code"] for e in arrived] == [48, 79]
    [state] = [e for e in events if e["kind"] == "state"]  # one change, made by the newest
    assert state["data"] == {"from": "healthy", "to": "unhealthy"}
    assert "XID 48" in state["message"]
    assert "XID 79" not in state["message"]


def test_an_earlier_runs_batch_backfilled_after_this_runs_keeps_the_new_epoch(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1, epoch="run-1", offset_s=-60))
    # the agent restarted with run-1's seq 2 (an XID) still spooled: run-2 goes first
    post_batch(client, agent, make_batch("n1", 1, epoch="run-2", offset_s=-5))
    ack = post_batch(
        client, agent, heartbeat(make_batch("n1", 2, epoch="run-1", offset_s=-50, xids=[(1, 79)]))
    ).json()
    assert (ack["epoch"], ack["acked_seq"], ack["stored"]) == ("run-1", 2, True)
    node = node_json(client, viewer, "n1")
    assert (node["reports"]["epoch"], node["reports"]["last_seq"]) == ("run-2", 1)
    assert reasons(node) == {("xid", 1, "79")}
    assert node["state"] == "unhealthy"


def test_a_backfilled_batch_does_not_roll_the_agents_settings_back(client, make_token, session):
    from tierwatch.server.fleet.models import Node

    agent = make_token("agent", "n1")
    post_batch(client, agent, make_batch("n1", 1, epoch="run-1", offset_s=-60))
    # run-2 starts with another interval; its newest batch arrives before its backlog
    newest = make_batch("n1", 3, epoch="run-2", offset_s=-1, interval_s=10.0)
    post_batch(client, agent, newest.model_copy(update={"dropped_batches": 4}))
    old = make_batch("n1", 2, epoch="run-2", offset_s=-20, interval_s=10.0)
    post_batch(client, agent, old.model_copy(update={"dropped_batches": 3}))
    # and run-1's leftover batch, with run-1's interval, comes last
    post_batch(client, agent, make_batch("n1", 2, epoch="run-1", offset_s=-55, interval_s=5.0))
    node = session.scalar(select(Node).where(Node.name == "n1"))
    assert (node.epoch, node.last_seq) == ("run-2", 3)
    assert node.interval_s == 10.0
    assert node.dropped_batches == 4

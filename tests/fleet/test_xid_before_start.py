"""XID values found already set when an agent starts (dcgm-exporter's last-XID gauge),
through the real API: a fatal one is an unhealthy reason until acknowledged, and the value
acknowledged is not raised again by the next agent start."""

from __future__ import annotations

from sqlalchemy import func, select
from support import auth, make_batch, post_batch

from tierwatch.agent.protocol import ReportBatch, XidEvent
from tierwatch.server.fleet.models import XidCount


def started(
    node: str, epoch: str, values: list[tuple[int, int]], *, offset_s: float = 0.0
) -> ReportBatch:
    """The first batch of an agent start whose collector found ``values`` (gpu, xid) set."""
    batch = make_batch(node, 1, epoch=epoch, gpus=4, offset_s=offset_s)
    xids = [
        XidEvent(
            gpu=g,
            xid=x,
            ts=batch.sent_at,
            message="dcgm-exporter DCGM_FI_DEV_XID_ERRORS was set when the agent started",
            before_start=True,
        )
        for g, x in values
    ]
    return batch.model_copy(update={"xids": xids})


def node_json(client, viewer, name):
    r = client.get(f"/api/v1/nodes/{name}", headers=auth(viewer))
    assert r.status_code == 200, r.text
    return r.json()


def ack(client, operator, name):
    r = client.post(
        f"/api/v1/nodes/{name}/ack", json={"note": "GPU checked"}, headers=auth(operator)
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_pre_start_fatal_xid_is_a_reason_until_acked_and_not_raised_again(
    client, make_token, session
):
    agent, viewer, op = make_token("agent", "n1"), make_token("viewer"), make_token("operator")
    # the agent starts on a node whose GPU 3 already fell off the bus (two hours ago)
    assert post_batch(client, agent, started("n1", "boot-1", [(3, 79)], offset_s=-7200)).is_success
    node = node_json(client, viewer, "n1")
    assert node["state"] == "unhealthy"
    [reason] = node["reasons"]
    assert (reason["rule"], reason["gpu"], reason["key"]) == ("xid_before_start", 3, "79")
    assert reason["severity"] == "unhealthy"
    assert reason["action"] == "RESTART_BM"
    assert "seen before the agent started" in reason["message"]
    assert "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS on GPU 3" in reason["message"]
    [event] = client.get("/api/v1/events?node=n1&kind=xid", headers=auth(viewer)).json()
    assert (event["code"], event["gpu"], event["severity"]) == (79, 3, "unhealthy")
    assert event["data"]["before_start"] is True
    # a value read at start is no occurrence: not counted
    assert session.scalar(select(func.count()).select_from(XidCount)) == 0
    assert node["gpus"][3]["xid_count"] == 0

    # no quiet period: two hours of healthy reports later it is still there
    assert post_batch(client, agent, make_batch("n1", 2, epoch="boot-1", gpus=4)).is_success
    assert [r["rule"] for r in node_json(client, viewer, "n1")["reasons"]] == ["xid_before_start"]

    answer = ack(client, op, "n1")
    assert answer["cleared"] == 1
    assert answer["node"]["state"] == "healthy"

    # the agent restarts: the gauge still shows 79, the value acknowledged -> nothing raised
    assert post_batch(client, agent, started("n1", "boot-2", [(3, 79)], offset_s=1)).is_success
    node = node_json(client, viewer, "n1")
    assert node["state"] == "healthy"
    assert node["reasons"] == []
    events = client.get("/api/v1/events?node=n1&kind=xid", headers=auth(viewer)).json()
    assert [(e["code"], e["severity"]) for e in events] == [(79, "info"), (79, "unhealthy")]

    # another start finds a DIFFERENT fatal code on that GPU: a new occurrence, raised
    assert post_batch(client, agent, started("n1", "boot-3", [(3, 48)], offset_s=2)).is_success
    node = node_json(client, viewer, "n1")
    assert node["state"] == "unhealthy"
    [reason] = node["reasons"]
    assert (reason["rule"], reason["gpu"], reason["key"]) == ("xid_before_start", 3, "48")
    assert reason["action"] == "WORKFLOW_XID_48"


def test_pre_start_non_fatal_and_zero_values_raise_nothing(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    assert post_batch(client, agent, started("n1", "boot-1", [(1, 13), (2, 0)])).is_success
    node = node_json(client, viewer, "n1")
    assert (node["state"], node["reasons"]) == ("healthy", [])
    # nor does it count toward the repeat rule: one live XID 13 after it is only an event
    live = make_batch("n1", 2, epoch="boot-1", gpus=4, offset_s=1, xids=[(1, 13)])
    assert post_batch(client, agent, live).is_success
    assert node_json(client, viewer, "n1")["state"] == "healthy"


def test_live_xid_between_starts_is_a_new_occurrence(client, make_token):
    """The acknowledged value is forgotten at the GPU's next live XID: the same code at the
    next start is then raised again; acknowledging the live reason covers the next start."""
    agent, viewer, op = make_token("agent", "n1"), make_token("viewer"), make_token("operator")
    post_batch(client, agent, started("n1", "boot-1", [(3, 79)]))
    ack(client, op, "n1")
    # XID 79 again, live, while the agent runs (its reason expires by quiet period or ack)
    post_batch(
        client, agent, make_batch("n1", 2, epoch="boot-1", gpus=4, offset_s=1, xids=[(3, 79)])
    )
    assert [r["rule"] for r in node_json(client, viewer, "n1")["reasons"]] == ["xid"]
    post_batch(client, agent, started("n1", "boot-2", [(3, 79)], offset_s=2))
    rules_now = sorted(r["rule"] for r in node_json(client, viewer, "n1")["reasons"])
    assert rules_now == ["xid", "xid_before_start"]
    # acknowledging (the live reason too) covers the value for the next start
    assert ack(client, op, "n1")["cleared"] == 2
    post_batch(client, agent, started("n1", "boot-3", [(3, 79)], offset_s=3))
    assert node_json(client, viewer, "n1")["state"] == "healthy"


def test_acked_live_xid_is_not_raised_by_the_next_start(client, make_token):
    agent, viewer, op = make_token("agent", "n1"), make_token("viewer"), make_token("operator")
    post_batch(client, agent, make_batch("n1", 1, epoch="boot-1", gpus=4, xids=[(0, 95)]))
    assert node_json(client, viewer, "n1")["state"] == "unhealthy"
    ack(client, op, "n1")
    post_batch(client, agent, started("n1", "boot-2", [(0, 95)], offset_s=1))
    assert node_json(client, viewer, "n1")["state"] == "healthy"


def test_old_agent_batches_without_the_field_are_accepted(client, make_token):
    agent = make_token("agent", "n1")
    body = make_batch("n1", 1, xids=[(0, 79)]).model_dump(mode="json")
    for x in body["xids"]:
        del x["before_start"]  # what an agent from before the field sends
    r = client.post("/api/v1/ingest/report", json=body, headers=auth(agent))
    assert r.status_code == 200, r.text
    viewer = make_token("viewer")
    assert [r["rule"] for r in node_json(client, viewer, "n1")["reasons"]] == ["xid"]

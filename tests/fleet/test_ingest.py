"""Ingest through the real API: idempotency, latest values, health reasons, acks, pruning."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select
from support import auth, make_batch, post_batch, register_job

from tierwatch.agent.protocol import LatencySample, utcnow
from tierwatch.server.fleet import service
from tierwatch.server.fleet.models import Event, GpuSampleRow, ReportRange


def node_json(client, viewer, name):
    r = client.get(f"/api/v1/nodes/{name}", headers=auth(viewer))
    assert r.status_code == 200, r.text
    return r.json()


def test_first_report_creates_healthy_node_with_gpus(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    r = post_batch(client, agent, make_batch("n1", 1, gpus=8))
    assert r.status_code == 200
    assert r.json() == {"epoch": "epoch-1", "acked_seq": 1, "stored": True, "commands": []}
    node = node_json(client, viewer, "n1")
    assert node["state"] == "healthy"
    assert node["simulated"] is True
    assert [g["index"] for g in node["gpus"]] == list(range(8))
    assert node["gpus"][3]["temperature_c"] == 55.0
    assert node["gpus"][3]["uuid"] == "GPU-n1-3"
    listing = client.get("/api/v1/nodes", headers=auth(viewer)).json()
    assert listing["counts"] == {"healthy": 1, "degraded": 0, "unhealthy": 0, "unreachable": 0}


def test_agent_token_may_be_created_before_node_reports(client, make_token):
    token = make_token("agent", "future-node")
    assert post_batch(client, token, make_batch("future-node", 1)).status_code == 200


def test_replayed_batch_is_stored_once(client, make_token, session):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    batch = make_batch("n1", 1, gpus=4, xids=[(0, 13)])
    assert post_batch(client, agent, batch).json()["stored"] is True
    again = post_batch(client, agent, batch).json()
    assert again["stored"] is False
    assert again["acked_seq"] == 1
    assert session.scalar(select(func.count()).select_from(GpuSampleRow)) == 4
    assert session.scalar(select(func.count()).where(Event.kind == "xid")) == 1
    assert node_json(client, viewer, "n1")["reports"]["batches"] == 1


def test_new_epoch_restarts_sequence(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    for seq in (1, 2, 3):
        post_batch(client, agent, make_batch("n1", seq, offset_s=seq))
    r = post_batch(client, agent, make_batch("n1", 1, epoch="epoch-2", offset_s=10)).json()
    assert r == {"epoch": "epoch-2", "acked_seq": 1, "stored": True, "commands": []}
    reports = node_json(client, viewer, "n1")["reports"]
    assert reports["epoch"] == "epoch-2"
    assert (reports["first_seq"], reports["last_seq"], reports["missing"]) == (1, 1, 0)


def test_gap_in_sequence_is_visible(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    for seq in (1, 2, 4):
        post_batch(client, agent, make_batch("n1", seq, offset_s=seq))
    reports = node_json(client, viewer, "n1")["reports"]
    assert reports["missing"] == 1


def test_xid_79_makes_node_unhealthy_with_catalog_action(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1, gpus=8))
    post_batch(client, agent, make_batch("n1", 2, gpus=8, offset_s=1, xids=[(3, 79)]))
    node = node_json(client, viewer, "n1")
    assert node["state"] == "unhealthy"
    [reason] = [r for r in node["reasons"] if r["rule"] == "xid"]
    assert reason["gpu"] == 3
    assert reason["action"] == "RESTART_BM"
    assert "XID 79" in reason["message"]
    events = client.get("/api/v1/events?node=n1&kind=xid", headers=auth(viewer)).json()
    assert events[0]["code"] == 79
    assert events[0]["data"]["mnemonic"] == "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS"
    assert events[0]["data"]["action"] == "RESTART_BM"
    states = client.get("/api/v1/events?node=n1&kind=state", headers=auth(viewer)).json()
    assert states[0]["data"] == {"from": "healthy", "to": "unhealthy"}


def test_every_xid_occurrence_is_counted(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1, xids=[(0, 13), (0, 13)]))
    post_batch(client, agent, make_batch("n1", 2, offset_s=1, xids=[(0, 13)]))
    node = node_json(client, viewer, "n1")
    assert node["gpus"][0]["xid_count"] == 3
    assert len(client.get("/api/v1/events?kind=xid", headers=auth(viewer)).json()) == 3
    # app-level XID 13 repeated on one GPU -> degraded, with the catalog action
    assert node["state"] == "degraded"
    [reason] = node["reasons"]
    assert (reason["rule"], reason["action"]) == ("xid_repeat", "RESTART_APP")
    metrics = client.get("/metrics").text
    assert 'tierwatch_xid_events_total{Hostname="n1",gpu="0",xid="13"} 3.0' in metrics


def test_single_app_level_xid_is_only_an_event(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1, xids=[(1, 31)]))
    node = node_json(client, viewer, "n1")
    assert node["state"] == "healthy"
    assert node["gpus"][1]["xid_count"] == 1


def test_ack_clears_xid_reason_and_old_occurrences_stop_counting(client, make_token):
    agent, viewer, op = make_token("agent", "n1"), make_token("viewer"), make_token("operator")
    post_batch(client, agent, make_batch("n1", 1, xids=[(0, 13), (0, 13)]))
    assert node_json(client, viewer, "n1")["state"] == "degraded"
    r = client.post("/api/v1/nodes/n1/ack", json={"note": "app restarted"}, headers=auth(op))
    assert r.status_code == 200
    assert r.json()["cleared"] == 1
    assert r.json()["node"]["state"] == "healthy"
    # one more occurrence after the ack: the two before it no longer count as a repeat
    post_batch(client, agent, make_batch("n1", 2, offset_s=1, xids=[(0, 13)]))
    assert node_json(client, viewer, "n1")["state"] == "healthy"
    acks = client.get("/api/v1/events?node=n1&kind=ack", headers=auth(viewer)).json()
    assert "app restarted" in acks[0]["message"]


def test_temperature_level_reason_comes_and_goes(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1, temperature_c=91.0))
    node = node_json(client, viewer, "n1")
    assert node["state"] == "unhealthy"
    assert {r["rule"] for r in node["reasons"]} == {"temperature"}
    # cooled down; still held during the rule's quiet period (30 s by default) ...
    post_batch(client, agent, make_batch("n1", 2, offset_s=5, temperature_c=60.0))
    assert node_json(client, viewer, "n1")["state"] == "unhealthy"
    # ... and cleared once the quiet period has passed
    post_batch(client, agent, make_batch("n1", 3, offset_s=40, temperature_c=60.0))
    assert node_json(client, viewer, "n1")["state"] == "healthy"


def test_uncorrectable_ecc_increase_is_unhealthy_reset_gpu(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1, ecc_dbe_volatile=0))
    post_batch(client, agent, make_batch("n1", 2, offset_s=5, ecc_dbe_volatile=1))
    node = node_json(client, viewer, "n1")
    assert node["state"] == "unhealthy"
    assert {(r["rule"], r["action"]) for r in node["reasons"]} == {
        ("ecc_uncorrectable", "RESET_GPU")
    }


def test_stale_telemetry_is_degraded(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    first = make_batch("n1", 1)
    post_batch(client, agent, first)
    later = make_batch("n1", 2, offset_s=30)
    later.samples[1] = first.samples[1]  # GPU 1 keeps sending its old reading
    post_batch(client, agent, later)
    node = node_json(client, viewer, "n1")
    assert node["state"] == "degraded"
    [reason] = node["reasons"]
    assert (reason["rule"], reason["gpu"]) == ("stale_telemetry", 1)


def test_straggler_rank_is_degraded(client, make_token):
    tokens = {f"n{i}": make_token("agent", f"n{i}") for i in range(4)}
    register_job(client, "llm", list(tokens), layout=list(tokens))  # rank i on node n<i>
    viewer = make_token("viewer")
    for step in range(3):
        for i, (name, token) in enumerate(tokens.items()):
            batch = make_batch(name, step + 1, offset_s=step)
            latency = 30.0 if name == "n2" else 2.0 + 0.1 * i
            batch.latency = [
                LatencySample(
                    job_id="llm", rank=i, world_size=4, ts=batch.sent_at, latency_ms=latency
                )
            ]
            assert post_batch(client, token, batch).status_code == 200
    states = {
        n["name"]: n["state"]
        for n in client.get("/api/v1/nodes", headers=auth(viewer)).json()["nodes"]
    }
    assert states == {"n0": "healthy", "n1": "healthy", "n2": "degraded", "n3": "healthy"}
    [reason] = node_json(client, viewer, "n2")["reasons"]
    assert reason["rule"] == "straggler"


def test_a_group_of_many_nodes_evaluates_each_job_once(client, make_token, app, settings):
    """8 nodes' reports of one job in one group per step: the job's samples are read once per
    group, and the straggler reason lands on the node of the slow rank only."""
    from sqlalchemy import event

    from tierwatch.server.fleet.ingest import ingest_reports

    names = [f"g{i}" for i in range(8)]
    register_job(client, "big", names, layout=names)  # rank i on node g<i>
    reads = []

    def count(conn, cursor, statement, *args):  # noqa: ANN001 - SQLAlchemy's event signature
        if "FROM latency_samples" in statement and statement.lstrip().startswith("SELECT"):
            reads.append(statement)

    event.listen(app.state.engine, "before_cursor_execute", count)
    try:
        for step in range(3):
            group = []
            for i, name in enumerate(names):
                batch = make_batch(name, step + 1, offset_s=step)
                latency = 40.0 if name == "g5" else 2.0 + 0.1 * i
                batch.latency = [
                    LatencySample(
                        job_id="big", rank=i, world_size=8, ts=batch.sent_at, latency_ms=latency
                    )
                ]
                group.append(batch)
            with app.state.sessionmaker() as s:
                ingest_reports(s, batches=group, settings=settings, now=utcnow())
    finally:
        event.remove(app.state.engine, "before_cursor_execute", count)
    assert len(reads) == 3  # one per group, not one per report (24)
    viewer = make_token("viewer")
    states = {
        n["name"]: n["state"]
        for n in client.get("/api/v1/nodes", headers=auth(viewer)).json()["nodes"]
    }
    assert {n for n, st in states.items() if st != "healthy"} == {"g5"}
    [reason] = node_json(client, viewer, "g5")["reasons"]
    assert reason["rule"] == "straggler"
    assert reason["evidence"]["rank"] == 5


def test_unreachable_after_three_missed_intervals(client, make_token, session):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1, interval_s=5))
    node = service.get_node(session, "n1")
    node.last_seen = utcnow() - timedelta(seconds=16)
    session.commit()
    listing = client.get("/api/v1/nodes?state=unreachable", headers=auth(viewer)).json()
    assert [n["name"] for n in listing["nodes"]] == ["n1"]
    assert listing["counts"]["unreachable"] == 1


def test_samples_api_filters_by_gpu_metric_and_time(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    for seq in range(1, 4):
        post_batch(
            client, agent, make_batch("n1", seq, gpus=2, offset_s=seq * 5 - 30, power_w=100.0 * seq)
        )
    r = client.get("/api/v1/nodes/n1/samples?gpu=1&metric=power_w", headers=auth(viewer))
    assert r.status_code == 200
    rows = r.json()["samples"]
    assert [row["power_w"] for row in rows] == [100.0, 200.0, 300.0]
    assert all(set(row) == {"gpu", "ts", "power_w"} for row in rows)
    since = rows[1]["ts"]
    later = client.get(
        "/api/v1/nodes/n1/samples", params={"gpu": 1, "since": since}, headers=auth(viewer)
    ).json()["samples"]
    assert len(later) == 2


def test_prune_removes_old_raw_history_only(client, make_token, session):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    post_batch(client, agent, make_batch("n1", 1, offset_s=-7200))
    post_batch(client, agent, make_batch("n1", 2))
    deleted = service.prune(session, now=utcnow(), sample_retention_s=3600, event_retention_s=86400)
    assert deleted["gpu_samples"] == 2
    assert session.scalar(select(func.count()).select_from(GpuSampleRow)) == 2
    # one seq range (1..2): it grew now, so it is kept
    assert session.scalar(select(func.count()).select_from(ReportRange)) == 1
    assert node_json(client, viewer, "n1")["gpus"][0]["temperature_c"] == 55.0


def test_samples_api_downsamples_with_step(client, make_token):
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    base = utcnow().replace(microsecond=0) - timedelta(seconds=600)
    base = base - timedelta(seconds=base.timestamp() % 60)  # align to a minute
    for i in range(6):  # readings every 20 s: buckets of 60 s hold 3 each
        b = make_batch("n1", i + 1, gpus=2, power_w=100.0 + 10 * i, row_remap_pending=(i == 4))
        for s in b.samples:
            s.ts = base + timedelta(seconds=20 * i)
        b.sent_at = base + timedelta(seconds=20 * i)
        assert post_batch(client, agent, b).status_code == 200
    r = client.get(
        "/api/v1/nodes/n1/samples",
        params={"gpu": 1, "step": 60, "since": (base - timedelta(seconds=1)).isoformat()},
        headers=auth(viewer),
    )
    assert r.status_code == 200, r.text
    rows = r.json()["samples"]
    assert [row["power_w"] for row in rows] == [110.0, 140.0]
    assert [row["row_remap_pending"] for row in rows] == [False, True]
    assert rows[0]["ts"].startswith(base.strftime("%Y-%m-%dT%H:%M:%S"))
    bad = client.get("/api/v1/nodes/n1/samples?step=0.5", headers=auth(viewer))
    assert bad.status_code == 422


def test_node_list_fast_path_matches_the_schema(client, make_token, session, settings):
    """GET /api/v1/nodes is serialised from rows; it must equal the pydantic NodeList."""
    from tierwatch.server.fleet.schemas import NodeList, node_out

    agent_a, agent_b = make_token("agent", "a-1"), make_token("agent", "b-1")
    viewer = make_token("viewer")
    post_batch(client, agent_a, make_batch("a-1", 1, gpus=3, throttle_reasons=0x48))
    post_batch(client, agent_b, make_batch("b-1", 1, gpus=2, xids=[(1, 79), (1, 79)]))
    fast = client.get("/api/v1/nodes", headers=auth(viewer)).json()
    now = utcnow()
    views = service.list_node_views(session, now=now, th=settings.health)
    slow = NodeList(counts=service.state_counts(views), nodes=[node_out(v) for v in views])
    assert fast == slow.model_dump(mode="json")
    assert fast["nodes"][0]["gpus"][0]["throttle_reason_names"] == [
        "hw_slowdown",
        "hw_thermal_slowdown",
    ]
    assert fast["nodes"][1]["gpus"][1]["xid_count"] == 2
    only = client.get("/api/v1/nodes?state=unhealthy&name=B-", headers=auth(viewer)).json()
    assert [n["name"] for n in only["nodes"]] == ["b-1"]
    assert only["counts"]["unhealthy"] == 1
    assert only["counts"]["healthy"] == 0
    wild = client.get("/api/v1/nodes?name=%25", headers=auth(viewer)).json()
    assert wild["nodes"] == []  # a LIKE wildcard in the filter is matched literally


def test_node_list_pages_with_a_cursor_and_keeps_its_filters(client, make_token):
    viewer = make_token("viewer")
    names = [f"r{i:02d}" for i in range(7)] + ["s00"]
    for i, name in enumerate(names):
        temp = 95.0 if i % 2 else 50.0  # odd ones unhealthy (over the temperature limit)
        post_batch(client, make_token("agent", name), make_batch(name, 1, temperature_c=temp))

    def pages(query: str) -> list[list[str]]:
        out, cursor = [], None
        while True:
            url = f"/api/v1/nodes?{query}" + (f"&cursor={cursor}" if cursor else "")
            body = client.get(url, headers=auth(viewer)).json()
            out.append([n["name"] for n in body["nodes"]])
            assert body["counts"]["healthy"] + body["counts"]["unhealthy"] == (
                7 if "name=r" in query else 8
            )  # counts ignore the paging and the state filter
            cursor = body["next_cursor"]
            if cursor is None:
                return out

    assert pages("limit=3") == [names[0:3], names[3:6], names[6:8]]
    assert pages("limit=2&name=r&state=unhealthy") == [["r01", "r03"], ["r05"]]
    assert pages("limit=4") == [names[0:4], names[4:8]]  # the last page says it is last
    everything = client.get("/api/v1/nodes", headers=auth(viewer)).json()
    assert [n["name"] for n in everything["nodes"]] == names  # under the default page size
    assert everything["next_cursor"] is None


@pytest.mark.parametrize("cursor", ["%%%", "bm9kZSBuYW1lIHdpdGggc3BhY2Vz", "_w", "x" * 257])
def test_a_cursor_the_api_did_not_give_out_is_refused(client, make_token, cursor):
    viewer = make_token("viewer")
    resp = client.get(f"/api/v1/nodes?cursor={cursor}", headers=auth(viewer))
    assert resp.status_code == 422
    if len(cursor) <= 256:
        assert "start again without it" in resp.text


def test_node_page_limit_is_bounded(client, make_token):
    viewer = make_token("viewer")
    assert client.get("/api/v1/nodes?limit=0", headers=auth(viewer)).status_code == 422
    assert client.get("/api/v1/nodes?limit=5001", headers=auth(viewer)).status_code == 422


@pytest.mark.parametrize(("sample_every", "stale"), [(1, True), (6, False)])
def test_the_stale_limit_scales_with_the_agents_sample_period(
    client, make_token, sample_every, stale
):
    """A heartbeat 20 s after the last samples (interval 5 s): stale when samples were due
    every report (limit 3 × 5 s), not when they come every 6 reports (3 × 30 s)."""
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    first = make_batch("n1", 1, offset_s=-20, temperature_c=71.0)
    post_batch(client, agent, first.model_copy(update={"sample_every": sample_every}))
    beat = make_batch("n1", 2)
    beat = beat.model_copy(update={"samples": [], "sample_every": sample_every})
    assert post_batch(client, agent, beat).status_code == 200
    node = node_json(client, viewer, "n1")
    rules_found = {r["rule"] for r in node["reasons"]}
    assert ("stale_telemetry" in rules_found) is stale
    assert node["state"] == ("degraded" if stale else "healthy")
    # the heartbeat left the latest values as the last samples had them
    assert [g["temperature_c"] for g in node["gpus"]] == [71.0, 71.0]

"""The node page: reasons with recommended actions, GPU table, XID and state events, 404."""

from __future__ import annotations

from support import make_batch, post_batch

from tierwatch.agent.protocol import THROTTLE_HW_SLOWDOWN, AgentEvent, utcnow


def test_node_page_shows_xid_79_reason_with_action(viewer, agent_token):
    token = agent_token("n1")
    assert post_batch(viewer, token, make_batch("n1", 1)).status_code == 200
    assert post_batch(viewer, token, make_batch("n1", 2, xids=[(1, 79)])).status_code == 200
    r = viewer.get("/nodes/n1")
    assert r.status_code == 200
    html = r.text
    assert 'class="node-head" data-state="unhealthy"' in html
    assert 'data-rule="xid" data-severity="unhealthy"' in html
    assert "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS on GPU 1" in html
    assert '<code class="action">RESTART_BM</code>' in html
    assert "Reboot the bare-metal node; a GPU reset is not enough." in html
    # the XID event list, with the catalog's mnemonic and action
    xid_row = html[html.index('<tr data-xid="79">') :]
    xid_row = xid_row[: xid_row.index("</tr>")]
    assert "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in xid_row
    assert "RESTART_BM" in xid_row
    assert "<td>1</td>" in xid_row  # GPU
    # the state change it caused
    assert "healthy → unhealthy" in html


def test_node_page_shows_header_and_gpu_table(viewer, agent_token):
    batch = make_batch(
        "n2",
        1,
        gpus=4,
        temperature_c=91.0,
        throttle_reasons=THROTTLE_HW_SLOWDOWN,
        ecc_dbe_aggregate=2,
        row_remap_pending=True,
        pcie_replay_count=7,
        nvlink_crc_errors=3,
    )
    assert post_batch(viewer, agent_token("n2"), batch).status_code == 200
    html = viewer.get("/nodes/n2").text
    assert ">simulated<" in html
    assert "Last seen" in html
    for i in range(4):
        assert f'<tr data-gpu="{i}">' in html
    gpu0 = html[html.index('<tr data-gpu="0">') :]
    gpu0 = gpu0[: gpu0.index("</tr>")]
    assert '<td class="bad">91 / 90</td>' in gpu0  # at the slowdown threshold
    assert "400 / 700" in gpu0  # power / limit
    assert "39.1 / 79.6" in gpu0  # memory GiB
    assert "hw_slowdown" in gpu0
    assert "pending" in gpu0
    assert "<td>7</td>" in gpu0
    assert "3 / 0 / 0" in gpu0


def test_node_page_charts_point_at_the_samples_api(viewer, agent_token):
    post_batch(viewer, agent_token("n3"), make_batch("n3", 1))
    html = viewer.get("/nodes/n3").text
    assert 'data-samples-url="/api/v1/nodes/n3/samples"' in html
    for metric in ("temperature_c", "power_w", "utilization_pct"):
        assert f'data-metric="{metric}"' in html
    for label in ("15 min", "1 h", "24 h"):
        assert f">{label}</button>" in html
    assert "/static/vendor/uPlot.iife.min.js" in html
    assert "/static/js/node-charts.js" in html


def test_samples_api_accepts_the_session_cookie(viewer, agent_token):
    post_batch(viewer, agent_token("n4"), make_batch("n4", 1, gpus=2))
    r = viewer.get("/api/v1/nodes/n4/samples", params={"metric": "temperature_c"})
    assert r.status_code == 200
    assert sorted(s["gpu"] for s in r.json()["samples"]) == [0, 1]


def test_node_fragment_has_live_block_and_oob_events(viewer, agent_token):
    post_batch(viewer, agent_token("n5"), make_batch("n5", 1, xids=[(0, 79)]))
    r = viewer.get("/nodes/n5", headers={"HX-Request": "true"})
    assert r.status_code == 200
    assert "HX-Request" in r.headers["vary"]
    assert "<html" not in r.text
    assert r.text.lstrip().startswith('<div id="node-live"')
    assert '<div id="node-events" class="events" hx-swap-oob="true">' in r.text
    assert "data-samples-url" not in r.text  # the charts are not re-rendered


def test_hostile_agent_event_message_is_escaped(viewer, agent_token):
    batch = make_batch("n6", 1)
    batch.events = [AgentEvent(kind="collector_error", ts=utcnow(), message="<script>x()</script>")]
    assert post_batch(viewer, agent_token("n6"), batch).status_code == 200
    html = viewer.get("/nodes/n6").text
    assert "<script>x()" not in html
    assert "collector_error: &lt;script&gt;x()&lt;/script&gt;" in html


def test_unknown_node_is_a_404_page(viewer):
    r = viewer.get("/nodes/nope")
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("text/html")
    assert "no node named" in r.text
    assert "Back to the cluster" in r.text


def test_unknown_node_needs_sign_in_first(client):
    r = client.get("/nodes/nope", follow_redirects=False)
    assert r.status_code == 303


def test_node_page_shows_the_fields_the_api_shows(viewer, agent_token):
    """The page and GET /api/v1/nodes/{name} take a node's fields from one builder."""
    batch = make_batch("n3", 1, gpus=2, throttle_reasons=0x48, xids=[(1, 13), (1, 13)])
    assert post_batch(viewer, agent_token("n3"), batch).status_code == 200
    api = viewer.get("/api/v1/nodes/n3").json()
    html = viewer.get("/nodes/n3").text
    assert [g["xid_count"] for g in api["gpus"]] == [0, 2]
    for g in api["gpus"]:
        row = html[html.index(f'<tr data-gpu="{g["index"]}">') :]
        row = row[: row.index("</tr>")]
        assert f"<td>{', '.join(g['throttle_reason_names'])}</td>" in row
        assert f">{g['xid_count']}</td>" in row
    assert f'data-state="{api["state"]}"' in html
    assert api["reasons"]  # XID 13 twice: a repeat reason on GPU 1
    for reason in api["reasons"]:
        gpu = "node" if reason["gpu"] is None else reason["gpu"]
        assert f'<tr data-rule="{reason["rule"]}" data-severity="{reason["severity"]}">' in html
        assert f"<td>{gpu}</td>" in html

"""/metrics: dcgm-exporter names and labels, XID counter, node state; promtool-valid."""

from __future__ import annotations

import shutil
import subprocess
from datetime import timedelta

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import update
from support import make_batch, post_batch

from tierwatch.agent.protocol import utcnow
from tierwatch.server.fleet.models import Node


@pytest.fixture
def gpu_client(settings):
    """A client of an app that re-exports GPU series (``TIERWATCH_METRICS_GPU_SERIES=1``)."""
    from fastapi.testclient import TestClient

    from tierwatch.server.main import create_app

    with TestClient(create_app(settings.model_copy(update={"metrics_gpu_series": True}))) as c:
        yield c


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_by_default_the_server_exports_state_not_gpu_series(client, make_token):
    """GPU series are the agents' /metrics; the server keeps the tierwatch_* state series."""
    post_batch(client, make_token("agent", "n1"), make_batch("n1", 1, xids=[(1, 79)]))
    families = _families(client.get("/metrics").text)
    assert not [name for name in families if name.startswith("DCGM_FI")]
    assert "tierwatch_node_state" in families
    [count] = families["tierwatch_xid_events"].samples
    assert count.labels == {"Hostname": "n1", "gpu": "1", "xid": "79"}


def test_re_exported_gpu_series_leave_out_dead_nodes_and_stale_gpus(
    gpu_client, make_token, session
):
    """An unreachable node's and a stale GPU's last values are not exported as live."""
    client = gpu_client
    # n-dead's report was fresh, but it last reported a minute ago (interval 5 s:
    # unreachable after 15 s)
    post_batch(client, make_token("agent", "n-dead"), make_batch("n-dead", 1))
    session.execute(
        update(Node).where(Node.name == "n-dead").values(last_seen=utcnow() - timedelta(minutes=1))
    )
    session.commit()
    # n-live reports now, but GPU 1's newest reading is a minute old (stale after 15 s)
    agent = make_token("agent", "n-live")
    post_batch(client, agent, make_batch("n-live", 1, offset_s=-60))
    fresh = make_batch("n-live", 2)
    post_batch(client, agent, fresh.model_copy(update={"samples": fresh.samples[:1]}))
    families = _families(client.get("/metrics").text)
    temps = {
        (s.labels["Hostname"], s.labels["gpu"]) for s in families["DCGM_FI_DEV_GPU_TEMP"].samples
    }
    assert temps == {("n-live", "0")}
    xid = {
        (s.labels["Hostname"], s.labels["gpu"]) for s in families["DCGM_FI_DEV_XID_ERRORS"].samples
    }
    assert xid == {("n-live", "0")}
    state = {
        s.labels["Hostname"]: s.labels["state"]
        for s in families["tierwatch_node_state"].samples
        if s.value == 1.0
    }
    assert state["n-dead"] == "unreachable"  # the state series still tells the story


def test_metrics_use_dcgm_exporter_names_and_labels(gpu_client, make_token):
    client = gpu_client
    agent = make_token("agent", "n1")
    post_batch(client, agent, make_batch("n1", 1, gpus=2, temperature_c=61.0, power_w=350.5))
    post_batch(
        client,
        agent,
        make_batch("n1", 2, gpus=2, offset_s=1, temperature_c=61.0, xids=[(1, 79), (1, 79)]),
    )
    text = client.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    temp = families["DCGM_FI_DEV_GPU_TEMP"]
    assert temp.type == "gauge"
    [s0] = [s for s in temp.samples if s.labels["gpu"] == "0"]
    assert s0.value == 61.0
    assert s0.labels == {"gpu": "0", "UUID": "GPU-n1-0", "Hostname": "n1"}
    assert "DCGM_FI_DEV_POWER_USAGE" in families
    assert "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" in families  # not renamed with a _total suffix
    assert "DCGM_FI_DEV_ROW_REMAP_FAILURE" in families
    xid = {s.labels["gpu"]: s.value for s in families["DCGM_FI_DEV_XID_ERRORS"].samples}
    assert xid == {"0": 0.0, "1": 79.0}
    [count] = families["tierwatch_xid_events"].samples
    assert count.name == "tierwatch_xid_events_total"
    assert count.labels == {"Hostname": "n1", "gpu": "1", "xid": "79"}
    assert count.value == 2.0
    state = {s.labels["state"]: s.value for s in families["tierwatch_node_state"].samples}
    assert state == {"healthy": 0.0, "degraded": 0.0, "unhealthy": 1.0, "unreachable": 0.0}


def test_metrics_can_require_a_token(settings, make_token):
    from fastapi.testclient import TestClient

    from tierwatch.server.main import create_app

    app = create_app(settings.model_copy(update={"metrics_require_token": True}))
    with TestClient(app) as c:
        assert c.get("/metrics").status_code == 401
        from tierwatch.server.tokens import create_token

        with app.state.sessionmaker() as s:
            token, _ = create_token(s, role="viewer")
            s.commit()
        assert c.get("/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def test_required_metrics_token_is_not_an_agent_token(settings, make_token):
    """With a token required, /metrics is a read like any other: agent tokens only report."""
    from fastapi.testclient import TestClient

    from tierwatch.server.main import create_app

    app = create_app(settings.model_copy(update={"metrics_require_token": True}))
    with TestClient(app) as c:
        agent = make_token("agent", "n1")
        r = c.get("/metrics", headers={"Authorization": f"Bearer {agent}"})
        assert r.status_code == 403, r.text
        assert r.text.startswith("agent tokens may only report for their own node")
        assert "DCGM_FI" not in r.text


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool absent (.ci/run installs the Debian prometheus package)",
)
@pytest.mark.parametrize("gpu_series", [False, True])
def test_metrics_pass_promtool(settings, make_token, gpu_series):
    from fastapi.testclient import TestClient

    from tierwatch.server.main import create_app

    app = create_app(settings.model_copy(update={"metrics_gpu_series": gpu_series}))
    client = TestClient(app)
    agent = make_token("agent", "n1")
    post_batch(client, agent, make_batch("n1", 1, gpus=8, xids=[(3, 79)]))
    text = client.get("/metrics").text
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_one_rendering_is_served_for_its_ttl():
    """Scrapes within the TTL get the same rendering; after it, a new one."""
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import CollectorRegistry

    from tierwatch.server.metrics import ScrapeCache

    value = [1.0]

    class One:
        def collect(self):
            yield GaugeMetricFamily("tierwatch_test_value", "A test value.", value=value[0])

    registry = CollectorRegistry(auto_describe=False)
    registry.register(One())
    clock = [100.0]
    cache = ScrapeCache(registry, ttl_s=5.0, clock=lambda: clock[0])
    assert b"tierwatch_test_value 1.0" in cache.get()
    value[0] = 2.0
    clock[0] += 4.9
    assert b"tierwatch_test_value 1.0" in cache.get()  # still the first rendering
    clock[0] += 0.1
    assert b"tierwatch_test_value 2.0" in cache.get()
    assert cache.renders == 2
    off = ScrapeCache(registry, ttl_s=0, clock=lambda: clock[0])
    off.get()
    off.get()
    assert off.renders == 2


def test_the_app_serves_its_cached_rendering(settings, make_token):
    """With the default TTL, a change shows at the next rendering, not at the next scrape."""
    from fastapi.testclient import TestClient

    from tierwatch.server.main import create_app

    app = create_app(settings.model_copy(update={"metrics_cache_s": 300}))
    with TestClient(app) as c:
        first = c.get("/metrics").text
        assert 'tierwatch_node_isolated{Hostname="n1"}' not in first
        post_batch(c, make_token("agent", "n1"), make_batch("n1", 1))
        assert c.get("/metrics").text == first
        assert app.state.metrics_cache.renders == 1

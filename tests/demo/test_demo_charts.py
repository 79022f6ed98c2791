"""The demo's node charts are live with and without a Prometheus: the demo's own server and
agent processes (``demo.cluster``, one simulated node) started as ``DEMO_PROMETHEUS=1`` starts
them (``demo.prometheus``: Debian's Prometheus scraping the agent), the charts read from it;
then, with that Prometheus stopped, from the server's database as without
``DEMO_PROMETHEUS`` (one set of processes for both: the database path is the same; the
choice of source by the setting is tests/fleet/test_prom_history.py's). The training job and
the failures are tests/e2e/test_demo.py's; the charts' drawing is tests/e2e/test_browser.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from executables import require_executable
from procs import free_port, port_block, wait_for
from web_support import sign_in

from demo.cluster import Cluster
from demo.prometheus import DemoPrometheus, scrape_config

NODE = "gpu-node-01"
GPUS = 2


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.fixture
def demo_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, DemoPrometheus]]:
    """The demo's server and one agent, started as ``DEMO_PROMETHEUS=1`` starts them (the
    demo's Prometheus first); stopped after the test."""
    cluster = Cluster(
        var=tmp_path / "demo",
        port=free_port(),
        agent_port=port_block(1),
        gpus=GPUS,
        interval_s=1.0,
        report=tmp_path / "demo-report.json",
    )
    exe = require_executable("prometheus", "prometheus")
    prometheus = DemoPrometheus(tmp_path / "prometheus", cluster.agent_targets(1), executable=exe)
    try:
        prometheus.start()
        cluster.prometheus_url = prometheus.url
        cluster.start_server()
        cluster.add_node(NODE, 0).wait_ready()
        yield cluster, prometheus
    finally:
        cluster.stop()
        prometheus.stop()


def live_chart(cluster: Cluster, source: str, since_ts: float) -> dict:
    """The node's 15-minute temperature chart as node-charts.js asks for it, once it is live:
    from ``source``, with every GPU, and two buckets of readings taken after ``since_ts``."""

    def chart() -> dict | None:
        since = datetime.now(UTC) - timedelta(minutes=15)
        r = cluster.api(
            "GET",
            f"/nodes/{NODE}/samples",
            params={
                "metric": "temperature_c",
                "since": since.isoformat(),
                "limit": 100000,
                "step": 2,
            },
        )
        r.raise_for_status()
        body = r.json()
        if body["source"] != source:
            return None
        buckets = {_ts(s["ts"]) for s in body["samples"] if s["temperature_c"] is not None}
        gpus = {s["gpu"] for s in body["samples"]}
        fresh = [b for b in buckets if b >= since_ts]
        return body if len(fresh) >= 2 and gpus == set(range(GPUS)) else None

    body = wait_for(chart, timeout=30, interval=0.5, what=f"live charts from the {source}")
    assert all(20 < s["temperature_c"] < 110 for s in body["samples"])
    return body


@pytest.mark.e2e
@pytest.mark.slow
def test_node_charts_are_live_with_and_without_the_demos_prometheus(demo_cluster):
    cluster, prometheus = demo_cluster
    body = live_chart(cluster, "prometheus", datetime.now(UTC).timestamp() - 2)
    assert "source_error" not in body
    # the node page says where they come from
    with httpx.Client(base_url=cluster.url, timeout=10) as browser:
        assert sign_in(browser, cluster.token).status_code == 303  # type: ignore[arg-type]
        html = browser.get(f"/nodes/{NODE}").text
    assert 'id="chart-source" class="chart-source muted" data-source="prometheus"' in html

    # without it, the same charts read the server's database, still live
    prometheus.stop()
    stopped = datetime.now(UTC).timestamp()
    body = live_chart(cluster, "database", stopped - 15)
    assert body["source_error"].startswith("cannot reach Prometheus"), body
    assert max(_ts(s["ts"]) for s in body["samples"]) >= stopped - 8  # the agents' samples


def test_prometheus_scrapes_every_demo_agent():
    config = scrape_config(["127.0.0.1:9470", "127.0.0.1:9471"])
    assert config["global"]["scrape_interval"] == "1s"
    [job] = config["scrape_configs"]
    assert job["static_configs"] == [{"targets": ["127.0.0.1:9470", "127.0.0.1:9471"]}]
    assert "metrics_path" not in job  # /metrics, served on the agents' local API

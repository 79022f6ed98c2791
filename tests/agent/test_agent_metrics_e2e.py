"""The agent's /metrics with real processes: ``tierwatch-agent run`` (simulated collector) on
loopback, its separate metrics listener scraped over HTTP, promtool on that scrape, and a real
Prometheus that scrapes several agents, answers the stock Grafana dashboard's queries, and
serves the server's node charts (``TIERWATCH_PROMETHEUS_URL``, ``fleet.prom_history``)."""

from __future__ import annotations

import math
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import yaml
from agent_helpers import Receiver, parse_series, wait_until
from executables import require_executable
from fastapi.testclient import TestClient
from procs import BIN, Proc, base_env, free_port

from tierwatch.agent.exporter import DCGM_FIELDS, XID_ERRORS, dcgm_relabel_configs
from tierwatch.server.config import Settings
from tierwatch.server.fleet.models import METRIC_FIELDS, Node
from tierwatch.server.fleet.prom_history import PromHistory, promql_string
from tierwatch.server.main import create_app
from tierwatch.server.tokens import create_token

pytestmark = pytest.mark.e2e

GPUS = 2
#: dcgm-exporter's label set of a GPU line (no MIG), as Prometheus stores an agent's lines
#: with the documented relabel rules (beside ``instance`` and ``job``).
GPU_LABELS = {
    "gpu",
    "UUID",
    "pci_bus_id",
    "device",
    "modelName",
    "Hostname",
    "DCGM_FI_DRIVER_VERSION",
}


@dataclass
class MetricsAgent:
    """A ``tierwatch-agent run`` process with ``--metrics-listen`` on its own port."""

    node: str
    proc: Proc
    api_port: int
    metrics_port: int

    @property
    def target(self) -> str:
        """The scrape target (Prometheus' ``instance`` label)."""
        return f"127.0.0.1:{self.metrics_port}"

    def scrape(self) -> str:
        resp = httpx.get(f"http://{self.target}/metrics", timeout=5)
        assert resp.status_code == 200, resp.text
        return resp.text

    def gpus_live(self) -> bool:
        if not self.proc.running:
            raise AssertionError(f"agent {self.node} exited:\n{self.proc.log_tail()}")
        temps = [n for n, _, _ in parse_series(self.scrape()) if n == "DCGM_FI_DEV_GPU_TEMP"]
        return len(temps) == GPUS


def launch_agents(receiver: Receiver, root: Path, count: int, *extra: str) -> list[MetricsAgent]:
    """``count`` agents (``node-a``, ``node-b`` …, folders under ``root``), started at once,
    each answering /metrics with all its GPUs; the caller stops them."""
    started = []
    try:
        for i in range(count):
            node = f"node-{chr(ord('a') + i)}"
            d = root / node
            d.mkdir()
            api_port, metrics_port = free_port(), free_port()
            args = [
                str(BIN / "tierwatch-agent"),
                "run",
                "--node",
                node,
                "--server",
                receiver.url,
                "--token",
                receiver.token_for(node),
                "--collector",
                "simulated",
                "--sim-gpus",
                str(GPUS),
                "--sim-seed",
                str(i),
                "--interval",
                "0.5",
                "--listen",
                f"127.0.0.1:{api_port}",
                "--metrics-listen",
                f"127.0.0.1:{metrics_port}",
                "--spool-dir",
                str(d / "spool"),
                "--state-dir",
                str(d / "state"),
                "--memory-dir",
                str(d / "memory"),
                *extra,
            ]
            proc = Proc(node, args, base_env(), d / "agent.log").start()
            started.append(MetricsAgent(node, proc, api_port, metrics_port))
        for agent in started:
            wait_until(agent.gpus_live, timeout=30, what=f"{agent.node}'s /metrics")
    except BaseException:
        for agent in started:
            agent.proc.stop()
        raise
    return started


@pytest.fixture
def start_agents(receiver: Receiver, tmp_path: Path) -> Iterator[Callable[..., list]]:
    """``start_agents(n, *extra_args) -> [MetricsAgent]``: :func:`launch_agents` under
    ``tmp_path``; stopped after the test."""
    agents: list[MetricsAgent] = []

    def start(count: int, *extra: str) -> list[MetricsAgent]:
        started = launch_agents(receiver, tmp_path, count, *extra)
        agents.extend(started)
        return started

    yield start
    for agent in agents:
        agent.proc.stop()


def test_metrics_listener_of_a_real_agent(start_agents):
    # dcgm-exporter's exact names: the options reach the agent's /metrics
    [agent] = start_agents(
        1,
        "--metrics-host-label",
        "hostname",
        "--metrics-model-label",
        "modelName",
        "--metrics-dcgm-names",
    )
    series = parse_series(agent.scrape())
    temps = {lb["gpu"]: lb for n, lb, _ in series if n == "DCGM_FI_DEV_GPU_TEMP"}
    assert sorted(temps) == ["0", "1"]
    assert temps["1"] == {
        "gpu": "1",
        "UUID": temps["1"]["UUID"],
        "pci_bus_id": "00000000:2A:00.0",
        "device": "nvidia1",
        "modelName": "NVIDIA H100 80GB HBM3 (simulated)",
        "hostname": "node-a",
        "DCGM_FI_DRIVER_VERSION": "550.90.07",
    }
    assert temps["1"]["UUID"].startswith("GPU-")
    assert {n for n, _, _ in series} >= {"DCGM_FI_DEV_PCIE_REPLAY_COUNTER"}
    assert "tierwatch_gpu_pcie_replays" not in {n for n, _, _ in series}
    # the listener serves /metrics only: the control API stays on the loopback --listen
    base = f"http://{agent.target}"
    assert httpx.post(f"{base}/v1/inject", json={"fault": "xid"}, timeout=5).status_code == 404
    assert httpx.get(f"{base}/v1/status", timeout=5).status_code == 404
    # the local API serves it as well, without a credential
    local = httpx.get(f"http://127.0.0.1:{agent.api_port}/metrics", timeout=5)
    assert local.status_code == 200
    assert "DCGM_FI_DEV_GPU_TEMP{" in local.text
    status = httpx.get(f"http://127.0.0.1:{agent.api_port}/v1/status", timeout=5).json()
    assert status["metrics_listen"] == agent.target

    # every XID counted; a frozen GPU's telemetry is not exported as live
    for _ in range(2):
        inject(agent, "xid", "79", "--gpu", "1")
    inject(agent, "freeze", "--gpu", "0")

    def frozen_and_counted() -> list:
        s = parse_series(agent.scrape())
        gpus = {lb["gpu"] for n, lb, _ in s if n == "DCGM_FI_DEV_GPU_TEMP"}
        stale = {lb["gpu"]: v for n, lb, v in s if n == "tierwatch_gpu_telemetry_stale"}
        xids = [(lb["gpu"], lb["xid"], v) for n, lb, v in s if n == "tierwatch_xid_events_total"]
        return s if gpus == {"1"} and stale == {"0": 1.0, "1": 0.0} and xids else []

    s = wait_until(frozen_and_counted, timeout=15, what="GPU 0 stale and XIDs counted")
    assert [(lb["gpu"], lb["xid"], v) for n, lb, v in s if n == "tierwatch_xid_events_total"] == [
        ("1", "79", 2.0)
    ]
    assert [v for n, lb, v in s if n == "DCGM_FI_DEV_XID_ERRORS"] == [79.0]  # GPU 1 only
    assert agent.proc.stop(signal.SIGTERM) == 0


def inject(agent: MetricsAgent, *fault: str) -> None:
    """``tierwatch-agent inject`` into the agent's local API with its agent token."""
    token = agent.proc.args[agent.proc.args.index("--token") + 1]
    subprocess.run(
        [str(BIN / "tierwatch-agent"), "inject", "--agent", f"http://127.0.0.1:{agent.api_port}"]
        + list(fault),
        env=base_env(TIERWATCH_TOKEN=token),
        check=True,
        capture_output=True,
        timeout=30,
    )


def test_a_real_agents_scrape_passes_promtool(start_agents):
    promtool = require_executable("promtool", "prometheus")
    [agent] = start_agents(1)
    inject(agent, "xid", "48", "--gpu", "0")  # a tierwatch_xid_events_total line as well

    def with_xid_counter() -> str:
        text = agent.scrape()
        return text if "tierwatch_xid_events_total{" in text else ""

    text = wait_until(with_xid_counter, timeout=10, what="the XID counter")
    families = {name for name, _, _ in parse_series(text) if name.startswith("DCGM_FI")}
    # the simulator reads every field: every DCGM_FI_* family is in the scrape
    assert families == {f.name for f in (*DCGM_FIELDS, XID_ERRORS) if f.lint_name is None}
    assert "tierwatch_gpu_pcie_replays{" in text
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (out.stdout + out.stderr).strip()


# -- a real Prometheus ----------------------------------------------------------------------
def _gpu_filter(query: str, instances: list[str], gpus: list[str]) -> str:
    """A dashboard query with Grafana's ``$instance`` / ``$gpu`` set to "All" of the
    variables' values (Grafana writes a multi-value regex ``(a|b)``; the targets' dots are
    left unescaped, as they match themselves)."""
    alt = "(" + "|".join(instances) + ")"
    return query.replace("$instance", alt).replace("$gpu", "(" + "|".join(gpus) + ")")


#: The stock dcgm-exporter dashboard's panel queries (grafana/dcgm-exporter-dashboard.json).
DASHBOARD_PANELS = {
    'DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}': "per_gpu",
    'avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})': "one",
    'DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}': "per_gpu",
    'sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})': "one",
    'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000': "per_gpu",
    'DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}': "per_gpu",
    'DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}': "per_gpu",
    'DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}': "per_gpu",
}


@dataclass
class Prometheus:
    url: str
    proc: Proc

    def query(self, expr: str) -> list[dict]:
        resp = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        body = resp.json()
        assert resp.status_code == 200, body
        assert body["status"] == "success", body
        return body["data"]["result"]

    def query_at(self, expr: str, at: float) -> list[dict]:
        """An instant query evaluated at Unix time ``at``."""
        resp = httpx.get(
            f"{self.url}/api/v1/query", params={"query": expr, "time": f"{at:.3f}"}, timeout=10
        )
        body = resp.json()
        assert resp.status_code == 200, body
        assert body["status"] == "success", body
        return body["data"]["result"]

    def label_values(self, label: str, match: str) -> set[str]:
        resp = httpx.get(
            f"{self.url}/api/v1/label/{label}/values", params={"match[]": match}, timeout=10
        )
        assert resp.status_code == 200, resp.text
        return set(resp.json()["data"])


def launch_prometheus(root: Path, targets: list[str]) -> Prometheus:
    """Debian's Prometheus on 127.0.0.1 (ephemeral port, TSDB under ``root``) scraping
    ``targets`` every second, once it is ready; the caller stops ``.proc``."""
    exe = require_executable("prometheus", "prometheus")
    d = root / "prometheus"
    d.mkdir()
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "gpu",
                "static_configs": [{"targets": targets}],
                # the documented rules that store dcgm-exporter's modelName
                "metric_relabel_configs": dcgm_relabel_configs(),
            },
        ],
    }
    (d / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = Proc(
        "prometheus",
        [
            exe,
            f"--config.file={d / 'prometheus.yml'}",
            f"--storage.tsdb.path={d / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        base_env(),
        d / "prometheus.log",
    ).start()
    prom = Prometheus(f"http://127.0.0.1:{port}", proc)

    def ready() -> bool:
        if not proc.running:
            raise AssertionError(f"prometheus exited:\n{proc.log_tail()}")
        return httpx.get(f"{prom.url}/-/ready", timeout=1).status_code == 200

    try:
        wait_until(ready, timeout=30, what=f"Prometheus ready\n{proc.log_tail()}")
    except BaseException:
        proc.stop()
        raise
    return prom


@dataclass
class ScrapedFleet:
    """Three agents (``node-a`` … ``node-c``, GPUS GPUs each) and a Prometheus that has
    scraped each of them."""

    receiver: Receiver
    agents: list[MetricsAgent]
    prometheus: Prometheus


@pytest.fixture(scope="module")
def scraped_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScrapedFleet]:
    """One :class:`ScrapedFleet` for the tests of this module that only read it (the stock
    dashboard's queries, the node charts), started once."""
    root = tmp_path_factory.mktemp("scraped-fleet")
    receiver = Receiver()
    agents: list[MetricsAgent] = []
    prom = None
    try:
        agents = launch_agents(receiver, root, 3)
        prom = launch_prometheus(root, sorted(a.target for a in agents))

        def scraped() -> bool:
            up = prom.query('up{job="gpu"}')
            return (
                len(prom.query('DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{job="gpu"}')) == 3 * GPUS
                and len(up) == 3
                and all(r["value"][1] == "1" for r in up)
            )

        wait_until(scraped, timeout=30, what="Prometheus scraping the 3 agents")
        yield ScrapedFleet(receiver, agents, prom)
    finally:
        if prom is not None:
            prom.proc.stop()
        for agent in agents:
            agent.proc.stop()
        receiver.stop()


@pytest.mark.slow
def test_prometheus_scrapes_each_agent_and_the_stock_dashboard_works(scraped_fleet):
    agents, prom = scraped_fleet.agents, scraped_fleet.prometheus
    targets = sorted(a.target for a in agents)
    # the dashboard's variables
    assert sorted(prom.label_values("instance", "DCGM_FI_DEV_GPU_TEMP")) == targets
    gpus = sorted(prom.label_values("gpu", "DCGM_FI_DEV_GPU_TEMP"))
    assert gpus == [str(i) for i in range(GPUS)]
    # its panels: one series per node and GPU
    pairs = {(a.target, str(g)) for a in agents for g in range(GPUS)}
    for panel, shape in DASHBOARD_PANELS.items():
        result = prom.query(_gpu_filter(panel, targets, gpus))
        if shape == "one":
            assert len(result) == 1, (panel, result)
            continue
        got = [(r["metric"]["instance"], r["metric"]["gpu"]) for r in result]
        assert len(got) == len(pairs), (panel, got)
        assert set(got) == pairs, (panel, got)
        hosts = {r["metric"]["instance"]: r["metric"]["Hostname"] for r in result}
        assert hosts == {a.target: a.node for a in agents}, panel
        # dcgm-exporter's full label set, modelName from the relabel rules
        for r in result:
            labels = set(r["metric"]) - {"__name__", "instance", "job"}
            assert labels == GPU_LABELS, (panel, r["metric"])
            assert r["metric"]["modelName"] == "NVIDIA H100 80GB HBM3 (simulated)"
    sm_clock = 'DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000'
    sm_hz = prom.query(_gpu_filter(sm_clock, targets, gpus))
    assert all(float(r["value"][1]) >= 1e9 for r in sm_hz)  # MHz × 10⁶ = Hz


# -- the node charts read from it ------------------------------------------------------------
def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _agent_post(agent: MetricsAgent, path: str, body: dict) -> None:
    token = agent.proc.args[agent.proc.args.index("--token") + 1]
    r = httpx.post(
        f"http://127.0.0.1:{agent.api_port}{path}",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=5,
    )
    assert r.status_code == 200, r.text


#: Node names that would leave a selector built by plain string formatting.
HOSTILE_NAMES = (
    'node-a"} or DCGM_FI_DEV_GPU_TEMP{Hostname=~".+',
    "node-a\\",
    'node-a\\"',
    ".+",
)


@pytest.mark.slow
@pytest.mark.one_backend
def test_node_charts_come_from_prometheus_one_series_per_gpu(scraped_fleet, db_url):
    agents, prom = scraped_fleet.agents, scraped_fleet.prometheus
    settings = Settings(
        database_url=db_url,
        dev=True,
        prune_interval_s=0,
        background_tick_s=0,
        prometheus_url=prom.url,
        prometheus_retry_s=0,
    )
    app = create_app(settings)
    with app.state.sessionmaker() as s:
        s.add_all([Node(name=a.node) for a in agents])
        viewer, _ = create_token(s, role="viewer")
        s.commit()
    headers = {"Authorization": f"Bearer {viewer}"}
    # a temperature of its own on each GPU of each node (pinned: no noise)
    pinned = {(a.node, g): 50.0 + 10 * i + g for i, a in enumerate(agents) for g in range(GPUS)}
    for agent in agents:
        for g in range(GPUS):
            _agent_post(
                agent, "/v1/inject", {"fault": "temp", "gpu": g, "value": pinned[agent.node, g]}
            )
    try:
        with TestClient(app) as client:

            def get(node: str, **params: object) -> dict:
                r = client.get(
                    f"/api/v1/nodes/{quote(node, safe='')}/samples", params=params, headers=headers
                )
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["source"] == "prometheus", body
                return body

            def newest_temperatures() -> dict[tuple[str, int], float]:
                since = (datetime.now(UTC) - timedelta(seconds=4)).isoformat()
                newest: dict[tuple[str, int], float] = {}
                for agent in agents:
                    for row in get(agent.node, metric="temperature_c", since=since, step=1)[
                        "samples"
                    ]:
                        newest[agent.node, row["gpu"]] = row["temperature_c"]
                return newest

            wait_until(
                lambda: newest_temperatures() == pinned, timeout=20, what="the pinned temperatures"
            )
            # what the agents export, bucket by bucket
            for agent in agents:
                exported = {
                    (agent.node, int(lb["gpu"])): v
                    for n, lb, v in parse_series(agent.scrape())
                    if n == "DCGM_FI_DEV_GPU_TEMP"
                }
                assert exported == {k: v for k, v in pinned.items() if k[0] == agent.node}

            # every metric at once: one row per GPU and bucket, every field read
            since = (datetime.now(UTC) - timedelta(seconds=3)).isoformat()
            for agent in agents:
                rows = get(agent.node, since=since, step=1)["samples"]
                assert {r["gpu"] for r in rows} == set(range(GPUS))
                keys = [(r["gpu"], r["ts"]) for r in rows]
                assert len(keys) == len(set(keys))
                last = {r["gpu"]: r for r in rows}
                for g, row in last.items():
                    assert row["temperature_c"] == pinned[agent.node, g]
                    assert [f for f in METRIC_FIELDS if row[f] is None] == []
                    assert row["row_remap_pending"] is False
                    assert 0 < row["power_w"] <= row["power_limit_w"]

            # a bucket's value is the mean of the readings Prometheus holds in it
            node, step = agents[1].node, 2
            held_s = f'count_over_time(DCGM_FI_DEV_POWER_USAGE{{Hostname="{node}"}}[10s])'

            def seven_seconds_held() -> bool:
                held = prom.query(held_s)
                return len(held) == GPUS and all(float(r["value"][1]) >= 7 for r in held)

            wait_until(
                seven_seconds_held,
                timeout=15,
                what="7 s of readings in Prometheus",
            )
            until = datetime.now(UTC) - timedelta(seconds=1)
            body = get(
                node,
                metric="power_w",
                since=(until - timedelta(seconds=10)).isoformat(),
                until=until.isoformat(),
                step=step,
            )
            assert body["step"] == step
            end = math.floor(until.timestamp() / step) * step + step
            raw = prom.query_at(f'DCGM_FI_DEV_POWER_USAGE{{Hostname="{node}"}}[14s]', end)
            readings = {
                int(r["metric"]["gpu"]): [(float(t), float(v)) for t, v in r["values"]] for r in raw
            }
            checked = dict.fromkeys(range(GPUS), 0)
            for row in body["samples"]:
                b = _ts(row["ts"])
                inside = [v for t, v in readings[row["gpu"]] if b <= t <= b + step]
                if any(t in (b, b + step) for t, _ in readings[row["gpu"]]):
                    continue  # on a bucket edge: Prometheus 3 counts it in one bucket only
                assert inside, row
                assert row["power_w"] == pytest.approx(sum(inside) / len(inside)), row
                checked[row["gpu"]] += 1
            assert min(checked.values()) >= 2, checked
            # and every bucket of the range that holds a reading has its row
            first = math.floor((until.timestamp() - 10) / step) * step
            held = {
                (g, math.floor(t / step) * step)
                for g, points in readings.items()
                for t, _ in points
                if first <= t < end - step and t % step
            }
            assert held <= {(r["gpu"], _ts(r["ts"])) for r in body["samples"]}

            # a name that would end the selector: the API knows no such node (node names
            # are [A-Za-z0-9._-]), and the PromQL matches no series and breaks nothing
            history = PromHistory(prom.url, retry_s=0)
            for name in HOSTILE_NAMES:
                r = client.get(f"/api/v1/nodes/{quote(name, safe='')}/samples", headers=headers)
                assert r.status_code == 404, r.text
                answer = history.samples(
                    node=name,
                    gpu=None,
                    metric=None,
                    since=datetime.now(UTC) - timedelta(seconds=30),
                    until=datetime.now(UTC),
                    limit=1000,
                    step_s=1,
                )
                assert answer.samples == [], name
            history.close()
            for value in ('a"} or up{x="', "back\\slash\\", "tab\tnew\nline\x7f"):
                literal = promql_string(value)
                [echo] = prom.query(f'label_replace(vector(1), "echo", {literal}, "", "")')
                assert echo["metric"]["echo"] == value
    finally:
        for agent in agents:
            _agent_post(agent, "/v1/inject", {"fault": "clear"})

"""The agent's local API and runtime, with a report receiver standing in for the server."""

from __future__ import annotations

import threading

import httpx
import pytest
from agent_helpers import (
    AUTHORITY,
    NODE_AUTH,
    TOKEN,
    FakeGpu,
    make_fake_pynvml,
    parse_series,
    wait_until,
)
from fastapi.testclient import TestClient

from tierwatch.agent.collectors.nvml import NvmlCollector
from tierwatch.agent.collectors.simulated import SimulatedCollector
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.runtime import AgentRuntime
from tierwatch.agent.server import create_app


def _settings(receiver, tmp_path, **kw) -> AgentSettings:
    return AgentSettings(
        node="node-a",
        server=receiver.url,
        token=TOKEN,
        spool_dir=tmp_path / "spool",
        listen="127.0.0.1:0",
        memory_dir=tmp_path / "memory",
        state_dir=tmp_path / "state",
        **kw,
    )


@pytest.fixture
def sim_runtime(receiver, tmp_path):
    settings = _settings(receiver, tmp_path, interval=0.1)
    runtime = AgentRuntime(
        settings, collector=SimulatedCollector("node-a", gpus=4, seed=1), flush_timeout_s=2.0
    )
    runtime.start(serve_api=False)
    yield runtime
    runtime.shutdown()


@pytest.fixture
def nvml_runtime(receiver, tmp_path):
    collector = NvmlCollector(nvml=make_fake_pynvml([FakeGpu(index=0)]), event_wait_ms=50)
    runtime = AgentRuntime(_settings(receiver, tmp_path), collector=collector, flush_timeout_s=1.0)
    runtime.start(serve_api=False)
    yield runtime
    runtime.shutdown()


def test_status(sim_runtime):
    sim_runtime.tick()
    with TestClient(create_app(sim_runtime), client=("127.0.0.1", 5000)) as client:
        wait_until(lambda: client.get("/v1/status").json()["last_seq_acked"] == 1, what="ack")
        body = client.get("/v1/status").json()
    assert body["node"] == "node-a"
    assert body["collector"] == "simulated"
    assert body["simulated"] is True
    assert body["epoch"] == sim_runtime.reporter.epoch
    assert (body["last_seq_sent"], body["spool_depth"], body["dropped_batches"]) == (1, 0, 0)


def test_inject_xid_is_pushed_at_once(sim_runtime, receiver):
    with TestClient(
        create_app(sim_runtime), client=("127.0.0.1", 5000), headers=NODE_AUTH
    ) as client:
        resp = client.post("/v1/inject", json={"fault": "xid", "gpu": 3, "value": 79})
    assert resp.status_code == 200, resp.text
    assert "XID 79 on GPU 3" in resp.json()["message"]
    batch = wait_until(lambda: [b for b in receiver.stored() if b.xids], what="XID batch")[0]
    assert [(x.gpu, x.xid) for x in batch.xids] == [(3, 79)]
    assert batch.simulated is True
    assert len(batch.gpus) == 4


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"fault": "meltdown"}, "fault"),
        ({"fault": "thermal", "gpu": 9}, "out of range"),
        ({"fault": "temp", "gpu": 0}, "needs a value"),
        ({"fault": "clear", "extra": 1}, "extra"),
    ],
)
def test_inject_bad_input_is_422(sim_runtime, body, needle):
    with TestClient(
        create_app(sim_runtime), client=("127.0.0.1", 5000), headers=NODE_AUTH
    ) as client:
        resp = client.post("/v1/inject", json=body)
    assert resp.status_code == 422
    assert needle in resp.text


def test_inject_on_real_collector_is_409(nvml_runtime):
    with TestClient(
        create_app(nvml_runtime), client=("127.0.0.1", 5000), headers=NODE_AUTH
    ) as client:
        resp = client.post("/v1/inject", json={"fault": "thermal"})
    assert resp.status_code == 409
    assert "--collector simulated" in resp.json()["detail"]


@pytest.mark.parametrize("client_host", ["127.0.0.1", "::1", "10.1.2.3"])
def test_loopback_grants_nothing_and_inject_needs_the_agent_token(sim_runtime, client_host):
    app = create_app(sim_runtime)
    with TestClient(app, client=(client_host, 5000)) as caller:
        assert caller.get("/v1/status").status_code == 200  # read-only, no secrets
        resp = caller.post("/v1/inject", json={"fault": "throttle"})
        assert resp.status_code == 401
        assert "Authorization: Bearer" in resp.json()["detail"]
        assert "loopback alone grants nothing" in resp.json()["detail"]
        wrong = caller.post(
            "/v1/inject", json={"fault": "throttle"}, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        assert caller.post("/v1/trainer/latency", json=[]).status_code == 401
        # a job's credential is valid, but faults are the node's business
        job = caller.post(
            "/v1/inject", json={"fault": "throttle"}, headers=AUTHORITY.job_auth("job-7")
        )
        assert job.status_code == 403
        assert "agent token" in job.json()["detail"]
        ok = caller.post("/v1/inject", json={"fault": "clear"}, headers=NODE_AUTH)
        assert ok.status_code == 200


def test_a_credential_of_another_authority_or_expired_is_refused(sim_runtime):
    from agent_helpers import TestAuthority

    from tierwatch.agent.credentials import issue_job_credential

    forged = TestAuthority(kid=AUTHORITY.kid)  # same key id, another key
    sample = [{"job_id": "job-7", "rank": 0, "ts": "2025-01-01T00:00:00Z", "latency_ms": 1.0}]
    expired, _ = issue_job_credential(
        AUTHORITY.key,
        kid=AUTHORITY.kid,
        job_secret_key=AUTHORITY.job_secret,
        job_id="job-7",
        ttl_s=1,
        now=1_000_000_000,
    )
    with TestClient(create_app(sim_runtime), client=("127.0.0.1", 5000)) as client:
        r = client.post("/v1/trainer/latency", json=sample, headers=forged.job_auth("job-7"))
        assert r.status_code == 401
        assert "Signature verification failed" in r.json()["detail"]
        r = client.post(
            "/v1/trainer/latency", json=sample, headers={"Authorization": f"Bearer {expired}"}
        )
        assert r.status_code == 401
        assert "expired" in r.json()["detail"]
        tampered = AUTHORITY.job_credential("job-7").rsplit("~", 1)[0] + "~" + "A" * 43
        r = client.post(
            "/v1/trainer/latency", json=sample, headers={"Authorization": f"Bearer {tampered}"}
        )
        assert r.status_code == 401
        assert "secret does not match" in r.json()["detail"]


def test_trainer_latency_goes_into_next_batch(sim_runtime, receiver):
    samples = [
        {
            "job_id": "job-7",
            "rank": r,
            "world_size": 2,
            "ts": "2025-01-01T00:00:00Z",
            "latency_ms": 2.5 + r,
        }
        for r in range(2)
    ]
    with TestClient(
        create_app(sim_runtime), client=("127.0.0.1", 5000), headers=AUTHORITY.job_auth("job-7")
    ) as client:
        resp = client.post("/v1/trainer/latency", json=samples)
        assert resp.json() == {"queued": 2}
        other = [{**samples[0], "job_id": "job-8"}]
        refused = client.post("/v1/trainer/latency", json=other)
        assert refused.status_code == 403
        assert "job-8" in refused.json()["detail"]
        assert client.post("/v1/trainer/latency", json=[{"job_id": "j"}]).status_code == 422
    sim_runtime.tick()
    batch = wait_until(lambda: [b for b in receiver.stored() if b.latency], what="latency")[0]
    assert [(s.job_id, s.rank, s.latency_ms) for s in batch.latency] == [
        ("job-7", 0, 2.5),
        ("job-7", 1, 3.5),
    ]


def test_run_loop_reports_each_interval_and_flushes_on_stop(receiver, tmp_path):
    settings = _settings(receiver, tmp_path, interval=0.05, sim_job="job-1", sim_rank=0)
    runtime = AgentRuntime(
        settings,
        collector=SimulatedCollector("node-a", gpus=2, seed=3, job="job-1", rank=0),
        flush_timeout_s=2.0,
    )
    runtime.start(serve_api=True)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(runtime.run()))
    thread.start()
    try:
        wait_until(lambda: len(receiver.stored()) >= 3, what="3 interval batches")
    finally:
        runtime.stop()
        thread.join(10)
    assert result == [0]
    assert not thread.is_alive()
    batches = sorted(receiver.stored(), key=lambda b: b.seq)  # (a backlog goes newest first)
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    # every GPU's sample, or none (a heartbeat): full samples every 6 reports by default
    assert batches[0].samples
    assert all(len(b.samples) in (0, 2) for b in batches)
    assert {b.sample_every for b in batches} == {6}
    assert all(b.latency[0].job_id == "job-1" for b in batches)
    assert runtime.reporter.status().spool_depth == 0


@pytest.mark.parametrize("client_host", ["127.0.0.1", "10.1.2.3"])
def test_metrics_need_no_credential_and_never_call_the_collector(
    sim_runtime, monkeypatch, client_host
):
    sim_runtime.tick()
    sim_runtime.collector.inject("xid", gpu=2, value=79)  # counted by the runtime's on_xid
    calls = []
    collect = sim_runtime.collector.collect
    monkeypatch.setattr(sim_runtime.collector, "collect", lambda: calls.append(1) or collect())
    with TestClient(create_app(sim_runtime), client=(client_host, 5000)) as client:
        first = client.get("/metrics")
        second = client.get("/metrics")
    assert first.status_code == 200, first.text
    assert first.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert first.text == second.text  # the same snapshot, until the next tick
    assert calls == []
    series = parse_series(first.text)
    temps = [labels for name, labels, _ in series if name == "DCGM_FI_DEV_GPU_TEMP"]
    assert [labels["gpu"] for labels in temps] == ["0", "1", "2", "3"]
    assert {labels["Hostname"] for labels in temps} == {"node-a"}
    xids = [(lb["gpu"], lb["xid"], v) for n, lb, v in series if n == "tierwatch_xid_events_total"]
    assert xids == [("2", "79", 1.0)]


def test_metrics_listener_serves_metrics_and_nothing_else(receiver, tmp_path):
    settings = _settings(receiver, tmp_path, interval=0.1, metrics_listen="127.0.0.1:0")
    runtime = AgentRuntime(
        settings, collector=SimulatedCollector("node-a", gpus=2, seed=1), flush_timeout_s=1.0
    )
    runtime.start(serve_api=False)
    try:
        runtime.tick()
        url = f"http://127.0.0.1:{runtime.metrics_port}"
        assert runtime.status()["metrics_listen"] == f"127.0.0.1:{runtime.metrics_port}"
        resp = httpx.get(f"{url}/metrics", timeout=5)
        assert resp.status_code == 200
        assert "DCGM_FI_DEV_GPU_TEMP{" in resp.text
        assert httpx.get(f"{url}/v1/status", timeout=5).status_code == 404
        assert httpx.post(f"{url}/v1/inject", json={"fault": "xid"}, timeout=5).status_code == 404
        assert httpx.get(f"{url}/openapi.json", timeout=5).status_code == 404
    finally:
        runtime.shutdown()
    assert runtime.metrics_port is None

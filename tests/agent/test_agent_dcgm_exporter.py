"""dcgm-exporter parser on a realistic /metrics page, and the collector over real HTTP."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from agent_helpers import TOKEN, parse_series, wait_until

from tierwatch.agent.collectors.dcgm_exporter import DcgmExporterCollector, parse_exposition
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.protocol import (
    THROTTLE_HW_SLOWDOWN,
    THROTTLE_HW_THERMAL_SLOWDOWN,
    XidEvent,
    utcnow,
)
from tierwatch.agent.runtime import AgentRuntime

FIXTURE = (Path(__file__).parent / "fixtures" / "dcgm_exporter_metrics.txt").read_text()


def test_parse_fixture_maps_fields_and_units():
    gpus = parse_exposition(FIXTURE)
    assert sorted(gpus) == [0, 1]
    g0, g1 = gpus[0], gpus[1]
    assert g0.uuid == "GPU-9d5e3c1a-7b2f-4e0a-8c61-2f3b4a5c6d70"
    assert g0.model == "NVIDIA H100 80GB HBM3"
    assert g0.xid == 0
    assert g1.xid == 79
    assert g0.fields == {
        "temperature_c": 47.0,
        "power_w": 412.518,
        "utilization_pct": 98.0,
        "memory_used_mib": 40712.0,
        "memory_total_mib": 40712.0 + 40247.0 + 600.0,  # used + free + reserved
        "ecc_sbe_volatile": 0,
        "ecc_dbe_volatile": 0,
        "ecc_sbe_aggregate": 3,
        "ecc_dbe_aggregate": 0,
        "remapped_rows_correctable": 1,
        "remapped_rows_uncorrectable": 0,
        "row_remap_failure": False,
        "pcie_replay_count": 0,
        "throttle_reasons": 0,
        "nvlink_crc_errors": 0,
        "nvlink_replay_errors": 0,
        "nvlink_recovery_errors": 0,
    }
    # counters declared with a _TOTAL suffix survive prometheus_client's _total handling
    assert g1.fields["ecc_dbe_volatile"] == 1
    assert g1.fields["nvlink_crc_errors"] == 12 + 3  # flit + data
    assert g1.fields["nvlink_replay_errors"] == 6
    assert g1.fields["nvlink_recovery_errors"] == 1
    assert g1.fields["row_remap_failure"] is True
    assert g1.fields["remapped_rows_uncorrectable"] == 2
    assert g1.fields["pcie_replay_count"] == 17
    assert g1.fields["throttle_reasons"] == THROTTLE_HW_SLOWDOWN | THROTTLE_HW_THERMAL_SLOWDOWN


def test_lowercase_total_suffix_and_clock_event_reasons():
    text = (
        "# TYPE DCGM_FI_DEV_ECC_DBE_VOL counter\n"
        'DCGM_FI_DEV_ECC_DBE_VOL_total{gpu="0",UUID="GPU-x"} 5\n'
        "# TYPE DCGM_FI_DEV_CLOCKS_EVENT_REASONS gauge\n"
        'DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="0",UUID="GPU-x"} 8\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-x"} NaN\n'
    )
    fields = parse_exposition(text)[0].fields
    assert fields == {"ecc_dbe_volatile": 5, "throttle_reasons": 8}


def _set_value(text: str, series_prefix: str, value: str) -> str:
    """Change the value of the series lines starting with ``series_prefix``."""
    return (
        "\n".join(
            line.rsplit(" ", 1)[0] + " " + value if line.startswith(series_prefix) else line
            for line in text.splitlines()
        )
        + "\n"
    )


class _Exporter:
    """A stand-in dcgm-exporter serving mutable text on 127.0.0.1."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.status = 200
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802
                body = exporter.text.encode()
                self.send_response(exporter.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def exporter() -> Iterator[_Exporter]:
    e = _Exporter(FIXTURE)
    yield e
    e.stop()


def test_collector_scrapes_and_reports_xid_changes(exporter):
    xids: list[XidEvent] = []
    collector = DcgmExporterCollector(exporter.url)
    try:
        assert collector.is_available()
        collector.start(xids.append)
        inv = collector.inventory()
        assert [(g.index, g.name) for g in inv] == [
            (0, "NVIDIA H100 80GB HBM3"),
            (1, "NVIDIA H100 80GB HBM3"),
        ]
        # GPU 1 already showed XID 79 at start: reported once, marked as a pre-start value
        assert [(e.gpu, e.xid, e.before_start) for e in xids] == [(1, 79, True)]
        assert collector.drain_events() == []
        xids.clear()
        samples = collector.collect()
        assert [s.temperature_c for s in samples] == [47.0, 86.0]
        assert xids == []  # the baseline: the same value is no new occurrence

        exporter.text = _set_value(FIXTURE, 'DCGM_FI_DEV_XID_ERRORS{gpu="0"', "48")
        collector.collect()
        assert [(e.gpu, e.xid, e.before_start) for e in xids] == [(0, 48, False)]
        collector.collect()  # unchanged value: no new event
        assert len(xids) == 1
    finally:
        collector.shutdown()


@pytest.mark.parametrize(
    ("value", "reported"),
    [
        pytest.param("79", [(1, 79)], id="fatal-79"),
        pytest.param("0", [], id="zero"),
        # non-fatal by the catalog: still reported, the server decides it raises nothing
        pytest.param("13", [(1, 13)], id="non-fatal-13"),
    ],
)
def test_first_scrape_reports_the_xid_gauge_as_a_pre_start_value(exporter, value, reported):
    """The first scrape's nonzero DCGM_FI_DEV_XID_ERRORS is an XidEvent with before_start;
    zero reports nothing, and the unchanged value is no occurrence at the next scrape."""
    exporter.text = _set_value(FIXTURE, 'DCGM_FI_DEV_XID_ERRORS{gpu="1"', value)
    xids: list[XidEvent] = []
    collector = DcgmExporterCollector(exporter.url)
    try:
        before = utcnow()
        collector.start(xids.append)
        assert [(e.gpu, e.xid) for e in xids] == reported
        assert all(e.before_start for e in xids)
        assert all(before <= e.ts <= utcnow() for e in xids)
        assert all("before the agent started" in e.message for e in xids)
        assert collector.drain_events() == []
        collector.collect()
        collector.collect()
        assert len(xids) == len(reported)
    finally:
        collector.shutdown()


def test_exporter_down_repeats_old_samples(exporter):
    collector = DcgmExporterCollector(exporter.url, timeout_s=1.0)
    try:
        collector.start(lambda e: None)
        first = collector.collect()
        collector.drain_events()
        exporter.status = 503
        again = collector.collect()
        assert again == first  # same samples, old ts: stale telemetry
        assert [e.kind for e in collector.drain_events()] == ["exporter_unreachable"]
        exporter.status = 200
        fresh = collector.collect()
        assert fresh[0].ts > first[0].ts
        assert [e.kind for e in collector.drain_events()] == ["exporter_recovered"]
    finally:
        collector.shutdown()


def test_agent_metrics_do_not_reexport_the_exporters_fields(exporter, receiver, tmp_path):
    """The node's Prometheus scrapes this exporter itself: the agent adds tierwatch_* only."""
    settings = AgentSettings(
        node="node-a",
        server=receiver.url,
        token=TOKEN,
        spool_dir=tmp_path / "spool",
        state_dir=tmp_path / "state",
        memory_dir=tmp_path / "memory",
        collector="dcgm-exporter",
        dcgm_exporter_url=exporter.url,
    )
    runtime = AgentRuntime(settings, flush_timeout_s=1.0)
    runtime.start(serve_api=False)
    try:
        runtime.tick()
        exporter.text = _set_value(FIXTURE, 'DCGM_FI_DEV_XID_ERRORS{gpu="0"', "48")
        runtime.tick()  # the collector sees XID 48 appear
        text = runtime.render_metrics().decode()
        # GPU 1's XID 79 from before the start reached the server, marked as such
        wait_until(
            lambda: (
                [
                    (x.gpu, x.xid, x.before_start)
                    for b in list(receiver.batches)
                    for x in b.xids
                    if x.gpu == 1
                ]
                == [(1, 79, True)]
            ),
            what="the pre-start XID 79 to be reported",
        )
    finally:
        runtime.shutdown()
    series = parse_series(text)
    names = {name for name, _, _ in series}
    assert not [name for name in names if name.startswith("DCGM_")]
    assert {"tierwatch_agent_info", "tierwatch_gpu_telemetry_stale"} <= names
    stale = {lb["gpu"]: v for n, lb, v in series if n == "tierwatch_gpu_telemetry_stale"}
    assert stale == {"0": 0.0, "1": 0.0}
    xids = [(lb["gpu"], lb["xid"], v) for n, lb, v in series if n == "tierwatch_xid_events_total"]
    assert xids == [("0", "48", 1.0)]  # the pre-start XID 79 of GPU 1 is not counted

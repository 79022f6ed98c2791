"""Node charts from Prometheus (``fleet.prom_history``): the PromQL, the step, the answer
mapping, and the samples API's choice of source, against stand-in Prometheus endpoints on
loopback (a closed port, one that answers errors, a slow one, one that answers a matrix).
The real Prometheus scraping real agents is in tests/agent/test_agent_metrics_e2e.py."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from support import auth, make_batch, post_batch
from web_support import sign_in

from tierwatch.agent.netutil import free_port
from tierwatch.server.config import Settings
from tierwatch.server.fleet import prom_history as ph
from tierwatch.server.fleet.models import METRIC_FIELDS
from tierwatch.server.main import create_app
from tierwatch.server.metrics import DCGM_GAUGES
from tierwatch.server.tokens import create_token

# the API tests check the choice of source, not the SQL (tested on both backends elsewhere)
pytestmark = pytest.mark.one_backend

T0 = datetime(2026, 11, 30, 10, 0, 0, tzinfo=UTC)


# -- PromQL ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "literal"),
    [
        ("gpu-node-01", '"gpu-node-01"'),
        ('a"b', r'"a\"b"'),
        ("a\\b", r'"a\\b"'),
        ('x"} or up{job="', r'"x\"} or up{job=\""'),
        ("a\\", r'"a\\"'),  # a trailing backslash cannot escape the closing quote
        ("line\nbreak\ttab\x7f", r'"line\x0abreak\x09tab\x7f"'),
        ("nœud-é", '"nœud-é"'),
    ],
)
def test_label_values_are_promql_string_literals(value, literal):
    assert ph.promql_string(value) == literal


def test_every_metric_reads_the_dcgm_family_the_agents_fill_from_it():
    series = {m: spec.name for m, spec in ph.DCGM_SERIES.items()}
    assert series["temperature_c"] == "DCGM_FI_DEV_GPU_TEMP"
    assert series["power_w"] == "DCGM_FI_DEV_POWER_USAGE"
    assert series["utilization_pct"] == "DCGM_FI_DEV_GPU_UTIL"
    assert series["memory_used_mib"] == "DCGM_FI_DEV_FB_USED"
    assert series["memory_total_mib"] == "DCGM_FI_DEV_FB_TOTAL"
    assert series["ecc_dbe_volatile"] == "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
    # today every metric of the samples API has one; a new metric without one is answered
    # from the database (test_a_metric_without_a_dcgm_series_comes_from_the_database)
    assert set(series) == set(METRIC_FIELDS)
    # the server's own re-export (TIERWATCH_METRICS_GPU_SERIES) names them the same way
    server = {metric: name for name, metric, _ in DCGM_GAUGES if name.startswith("DCGM_FI_")}
    assert server
    assert server.items() <= series.items()


@pytest.mark.parametrize(
    ("span_s", "step", "expected"),
    [
        (900, 2.0, 2.0),  # the chart's own bucket width is kept
        (900, None, 2.0),  # 15 min / 720 points
        (86_400, None, 120.0),  # 24 h / 720
        (10, None, 1.0),  # never below 1 s
        (0, None, 1.0),
        (86_400, 1.0, 8.0),  # 86,400 points would be refused: ceil(86,400 / 11,000)
        (7 * 86_400, 3600.0, 3600.0),
    ],
)
def test_step_bounds_the_points_of_a_series(span_s, step, expected):
    assert ph.choose_step(span_s, step) == expected


def test_query_selects_the_node_and_gpu_and_aligns_buckets():
    q = ph.build_query(
        node="gpu-node-01",
        gpu=3,
        metric="temperature_c",
        since=T0 + timedelta(seconds=1),
        until=T0 + timedelta(seconds=61),
        step_s=5,
        host_label="hostname",
    )
    assert q.expr == (
        "label_replace(max by (gpu) (avg_over_time(DCGM_FI_DEV_GPU_TEMP"
        '{hostname="gpu-node-01", gpu="3"}[5000ms])), "tierwatch_metric", "temperature_c", '
        '"", "")'
    )
    # buckets [T0, T0+5) … [T0+60, T0+65): each evaluated at its end
    assert q.start == T0.timestamp() + 5
    assert q.end == T0.timestamp() + 65
    assert q.step == 5
    assert q.fields == ("temperature_c",)
    assert q.params(2.5) == {
        "query": q.expr,
        "start": f"{T0.timestamp() + 5:.3f}",
        "end": f"{T0.timestamp() + 65:.3f}",
        "step": "5",
        "timeout": "2500ms",
    }


def test_query_of_every_metric_is_one_union_with_flags_and_mig_sums():
    q = ph.build_query(
        node="n1",
        gpu=None,
        metric=None,
        since=T0,
        until=T0 + timedelta(minutes=15),
        step_s=None,
        host_label="Hostname",
    )
    parts = q.expr.split(" or ")
    assert len(parts) == len(METRIC_FIELDS)
    assert q.fields == METRIC_FIELDS
    assert q.step == 2  # derived: 900 s / 720 points
    assert all('{Hostname="n1"}[2000ms]' in p for p in parts)
    assert not [p for p in parts if "gpu=" in p]
    flag = next(p for p in parts if '"row_remap_pending"' in p)
    assert "max_over_time(DCGM_FI_DEV_ROW_REMAP_PENDING" in flag
    fb = next(p for p in parts if '"memory_used_mib"' in p)
    assert "sum by (gpu) (max by (gpu, GPU_I_ID) (avg_over_time(DCGM_FI_DEV_FB_USED" in fb


def test_a_metric_without_a_series_is_left_out_of_the_union():
    series = {"power_w": ph.DCGM_SERIES["power_w"]}
    q = ph.build_query(
        node="n1",
        gpu=None,
        metric=None,
        since=T0,
        until=T0,
        step_s=None,
        host_label="Hostname",
        series=series,
    )
    assert q.expr.count("label_replace") == 1
    assert q.fields == METRIC_FIELDS  # the rows still carry every field (None here)
    with pytest.raises(ValueError, match="no DCGM series for temperature_c"):
        ph.build_query(
            node="n1",
            gpu=None,
            metric="temperature_c",
            since=T0,
            until=T0,
            step_s=None,
            host_label="Hostname",
            series=series,
        )
    assert ph.covers(None, series)
    assert not ph.covers("temperature_c", series)
    assert not ph.covers(None, {})


# -- mapping the answer ------------------------------------------------------------------
def matrix(*series: tuple[dict[str, str], list[tuple[float, str]]]) -> dict[str, Any]:
    return {
        "status": "success",
        "data": {
            "resultType": "matrix",
            "result": [
                {"metric": labels, "values": [[t, v] for t, v in values]}
                for labels, values in series
            ],
        },
    }


def _query(fields: tuple[str, ...], step: float = 2.0) -> ph.RangeQuery:
    return ph.RangeQuery(expr="x", start=0, end=0, step=step, fields=fields)


def test_answer_becomes_rows_per_gpu_and_bucket_start():
    t = T0.timestamp()
    body = matrix(
        ({"gpu": "1", "tierwatch_metric": "temperature_c"}, [(t + 2, "61.5"), (t + 4, "62")]),
        ({"gpu": "0", "tierwatch_metric": "temperature_c"}, [(t + 4, "58.25")]),
        ({"gpu": "0", "tierwatch_metric": "row_remap_pending"}, [(t + 4, "1")]),
        ({"gpu": "1", "tierwatch_metric": "row_remap_pending"}, [(t + 4, "0")]),
        ({"gpu": "0", "tierwatch_metric": "power_w"}, [(t + 4, "NaN")]),
    )
    fields = ("temperature_c", "power_w", "row_remap_pending")
    rows = ph.map_matrix(body, _query(fields), limit=100)
    assert rows == [
        {
            "gpu": 1,
            "ts": T0,
            "temperature_c": 61.5,
            "power_w": None,
            "row_remap_pending": None,
        },
        {
            "gpu": 0,
            "ts": T0 + timedelta(seconds=2),
            "temperature_c": 58.25,
            "power_w": None,  # NaN is no reading
            "row_remap_pending": True,
        },
        {
            "gpu": 1,
            "ts": T0 + timedelta(seconds=2),
            "temperature_c": 62.0,
            "power_w": None,
            "row_remap_pending": False,
        },
    ]
    # the newest rows are kept
    assert [r["ts"] for r in ph.map_matrix(body, _query(fields), limit=2)] == [
        T0 + timedelta(seconds=2)
    ] * 2


def test_series_without_a_gpu_index_or_of_another_field_are_left_out():
    body = matrix(
        ({"tierwatch_metric": "power_w"}, [(1.0, "1")]),
        ({"gpu": "GPU-x", "tierwatch_metric": "power_w"}, [(1.0, "1")]),
        ({"gpu": "0", "tierwatch_metric": "temperature_c"}, [(1.0, "1")]),
    )
    assert ph.map_matrix(body, _query(("power_w",)), limit=10) == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"},
            "Prometheus refused the query (bad_data): parse error at char 3",
        ),
        (["not", "an", "object"], "Prometheus refused the query (error)"),
        (
            {"status": "success", "data": {"resultType": "vector", "result": []}},
            "something other than a range (matrix)",
        ),
        (
            {"status": "success", "data": {"resultType": "matrix", "result": ["x"]}},
            "a range of an unexpected shape",
        ),
        (
            {
                "status": "success",
                "data": {
                    "resultType": "matrix",
                    "result": [
                        {
                            "metric": {"gpu": "0", "tierwatch_metric": "power_w"},
                            "values": [[1.0, "1", "extra"]],
                        }
                    ],
                },
            },
            "a range of an unexpected shape",
        ),
    ],
)
def test_an_answer_that_is_no_range_is_an_error(body, message):
    with pytest.raises(ph.PrometheusError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ph.map_matrix(body, _query(("power_w",)), limit=10)


def test_credentials_never_show_in_messages():
    assert ph.redact("http://alice:s3cret@prom.example:9090/prom") == (
        "http://prom.example:9090/prom"
    )
    assert ph.redact("https://[::1]:9090") == "https://[::1]:9090"


# -- settings ----------------------------------------------------------------------------
def test_prometheus_settings_default_to_off():
    s = Settings(dev=True)
    assert s.prometheus_url == ""
    assert s.prometheus_host_label == "Hostname"
    assert ph.from_settings(s) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prometheus_url": "prometheus:9090"}, "is not an http(s) URL"),
        ({"prometheus_url": "ftp://bob:pw@prom/"}, "'ftp://prom/' is not an http(s) URL"),
        ({"prometheus_url": "http://prom:9090/?x=1"}, "give the base URL only"),
        ({"prometheus_host_label": "host-name"}, "is not a Prometheus label name"),
        ({"prometheus_host_label": "gpu"}, "a label /metrics sets itself"),
        ({"prometheus_timeout_s": 0}, "greater than 0"),
        (
            {"prometheus_url": "http://al:S3CRET@prom:notaport"},
            "'http://prom:notaport' has no valid",
        ),
        ({"prometheus_url": "http://prom:99999"}, "has no valid port"),
    ],
)
def test_bad_prometheus_settings_say_what_to_fix(change, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings(dev=True, **change)


@pytest.mark.parametrize(
    "url",
    [
        "alice:S3CRET@prom:9090",
        "http:alice:S3CRET@prom:9090",
        "http:/alice:S3CRET@prom",
        "http://alice:S3CRET@prom:notaport",
        "http://alice:S3CRET@prom:99999",
    ],
)
def test_a_refused_url_never_shows_its_password(url):
    assert "S3CRET" not in ph.redact(url)
    with pytest.raises(ValidationError) as info:
        Settings(dev=True, prometheus_url=url)
    assert "S3CRET" not in str(info.value)


def test_url_is_kept_without_its_trailing_slash():
    s = Settings(dev=True, prometheus_url=" http://prom:9090/sub/ ")
    assert s.prometheus_url == "http://prom:9090/sub"


# -- stand-in Prometheus endpoints -------------------------------------------------------
class StandIn:
    """An HTTP endpoint on 127.0.0.1 that answers ``POST /…/api/v1/query_range`` with
    ``status``/``body`` after ``delay_s``, and records each request's form."""

    def __init__(self) -> None:
        self.status = 200
        self.body: Any = matrix()
        self.delay_s = 0.0
        self.trickle_s = 0.0  # > 0: send the body one byte at a time, this far apart
        self.requests: list[tuple[str, dict[str, str]]] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0))).decode()
                form = {k: v[0] for k, v in parse_qs(raw).items()}
                stand_in.requests.append((self.path, form))
                time.sleep(stand_in.delay_s)
                body = stand_in.body
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                try:
                    self.send_response(stand_in.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if stand_in.trickle_s <= 0:
                        self.wfile.write(data)
                    for i in range(len(data) if stand_in.trickle_s > 0 else 0):
                        self.wfile.write(data[i : i + 1])
                        self.wfile.flush()
                        time.sleep(stand_in.trickle_s)
                except OSError:  # the client gave up waiting
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,))
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    s = StandIn()
    yield s
    s.stop()


@contextmanager
def api(db_url: str, **prometheus: Any) -> Iterator[tuple[TestClient, dict[str, str]]]:
    """The app on the test database with these ``prometheus_*`` settings, node ``n1`` (two
    GPUs, one report at 55 °C in the database), and a viewer's Authorization header (the
    client is signed in to the dashboard with it too)."""
    settings = Settings(
        database_url=db_url,
        dev=True,
        prune_interval_s=0,
        metrics_cache_s=0,
        background_tick_s=0,
        **{f"prometheus_{k}": v for k, v in prometheus.items()},
    )
    app = create_app(settings)
    with TestClient(app) as client:
        with app.state.sessionmaker() as s:
            viewer, _ = create_token(s, role="viewer")
            agent, _ = create_token(s, role="agent", node="n1")
            s.commit()
        assert post_batch(client, agent, make_batch("n1", 1, gpus=2)).status_code == 200
        assert sign_in(client, viewer).status_code == 303
        yield client, auth(viewer)


def samples(client: TestClient, headers: dict[str, str], **params: Any) -> dict[str, Any]:
    r = client.get("/api/v1/nodes/n1/samples", params=params, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def parse_ts(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def closed_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # bound and released: nothing listens


def test_without_a_prometheus_the_database_answers(db_url):
    with api(db_url) as (client, viewer):
        body = samples(client, viewer, metric="temperature_c")
    assert body["source"] == "database"
    assert "source_error" not in body
    assert sorted((s["gpu"], s["temperature_c"]) for s in body["samples"]) == [
        (0, 55.0),
        (1, 55.0),
    ]


def test_prometheus_answers_the_charts_when_it_is_set(db_url, stand_in):
    now = datetime.now(UTC).replace(microsecond=0)
    t = now.timestamp()
    stand_in.body = matrix(
        ({"gpu": "0", "tierwatch_metric": "temperature_c"}, [(t - 4, "70.5"), (t - 2, "71")]),
        ({"gpu": "1", "tierwatch_metric": "temperature_c"}, [(t - 2, "64")]),
    )
    since = now - timedelta(seconds=60)
    with api(db_url, url=stand_in.url + "/prom/", host_label="hostname") as (client, viewer):
        body = samples(
            client, viewer, metric="temperature_c", since=since.isoformat(), step=2, gpu=0
        )
    assert body["source"] == "prometheus"
    assert body["step"] == 2
    rows = [(s["gpu"], parse_ts(s["ts"]), s["temperature_c"]) for s in body["samples"]]
    assert rows == [
        (0, now - timedelta(seconds=6), 70.5),
        (0, now - timedelta(seconds=4), 71.0),
        (1, now - timedelta(seconds=4), 64.0),
    ]
    [(path, form)] = stand_in.requests
    assert path == "/prom/api/v1/query_range"
    assert 'DCGM_FI_DEV_GPU_TEMP{hostname="n1", gpu="0"}[2000ms]' in form["query"]
    assert float(form["start"]) == since.timestamp() // 2 * 2 + 2  # the first bucket's end
    assert form["step"] == "2"
    assert form["timeout"] == "5000ms"


def test_no_series_in_prometheus_is_an_empty_answer_that_says_why(db_url, stand_in):
    with api(db_url, url=stand_in.url) as (client, viewer):
        body = samples(client, viewer, metric="power_w")
    assert body["source"] == "prometheus"
    assert body["samples"] == []
    assert body["source_note"] == 'Prometheus has no series with Hostname="n1" in this range'


def test_unreachable_prometheus_falls_back_and_is_not_retried_at_once(db_url, caplog):
    caplog.set_level(logging.WARNING, logger="tierwatch.server.prometheus")
    with api(db_url, url=closed_port_url()) as (client, viewer):
        first = samples(client, viewer, metric="temperature_c")
        second = samples(client, viewer, metric="temperature_c")
    assert first["source"] == "database"
    assert first["source_error"].startswith("cannot reach Prometheus: ")
    assert {s["temperature_c"] for s in first["samples"]} == {55.0}
    # within TIERWATCH_PROMETHEUS_RETRY_S the charts read the database without trying
    assert second["source"] == "database"
    assert second["source_error"].startswith(first["source_error"] + " (next try in ")
    warnings = [r for r in caplog.records if r.name == "tierwatch.server.prometheus"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "node charts read from tierwatch's database" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("status", "body", "message", "backs_off"),
    [
        (
            400,
            {"status": "error", "errorType": "bad_data", "error": "1:1: parse error"},
            "Prometheus refused the query (bad_data): 1:1: parse error",
            False,
        ),
        (
            503,
            {"status": "error", "errorType": "timeout", "error": "query timed out"},
            "Prometheus answered HTTP 503: query timed out",
            True,
        ),
        (502, "<html>Bad Gateway</html>", "Prometheus answered HTTP 502: <html>", True),
        (401, "Unauthorized", "Prometheus answered HTTP 401: Unauthorized", False),
        (200, "{not json", "Prometheus answered with no JSON: {not json", False),
    ],
    ids=["query-error", "overloaded", "proxy-5xx", "auth", "garbage"],
)
def test_prometheus_answering_an_error_falls_back(
    db_url, stand_in, status, body, message, backs_off
):
    stand_in.status, stand_in.body = status, body
    with api(db_url, url=stand_in.url, retry_s=60) as (client, viewer):
        first = samples(client, viewer, metric="utilization_pct")
        samples(client, viewer, metric="utilization_pct")
    assert first["source"] == "database"
    assert first["source_error"].startswith(message), first["source_error"]
    assert [s["utilization_pct"] for s in first["samples"]] == [90.0, 90.0]
    # 5xx backs off (one request for two charts loads); a refused query does not
    assert len(stand_in.requests) == (1 if backs_off else 2)


def test_slow_prometheus_times_out_and_falls_back(db_url, stand_in):
    stand_in.delay_s = 1.0
    with api(db_url, url=stand_in.url, timeout_s=0.2) as (client, viewer):
        body = samples(client, viewer, metric="power_w")
    # the reason says the chart gave up at the timeout instead of waiting 1 s for the answer
    assert body["source"] == "database"
    assert body["source_error"] == "Prometheus did not answer within 0.2 s"
    assert [s["power_w"] for s in body["samples"]] == [400.0, 400.0]


def test_a_prometheus_that_trickles_its_answer_is_cut_off_at_the_deadline(db_url, stand_in):
    stand_in.trickle_s = 0.05  # the matrix's ~1 KiB would take about a minute
    with api(db_url, url=stand_in.url, timeout_s=0.3) as (client, viewer):
        body = samples(client, viewer, metric="power_w")
    # each byte comes well within httpx's 0.3 s read timeout, so only the deadline on the
    # whole answer can end it with this reason
    assert body["source"] == "database"
    assert body["source_error"] == "Prometheus did not answer within 0.3 s"


def test_prometheus_is_tried_again_after_the_retry_time(db_url, stand_in):
    stand_in.status, stand_in.body = 500, "boom"
    with api(db_url, url=stand_in.url, retry_s=0) as (client, viewer):
        assert samples(client, viewer, metric="power_w")["source"] == "database"
        stand_in.status, stand_in.body = 200, matrix()
        assert samples(client, viewer, metric="power_w")["source"] == "prometheus"
    assert len(stand_in.requests) == 2


def test_a_metric_without_a_dcgm_series_comes_from_the_database(db_url, stand_in, monkeypatch):
    monkeypatch.setattr(
        ph, "DCGM_SERIES", {k: v for k, v in ph.DCGM_SERIES.items() if k != "temperature_c"}
    )
    with api(db_url, url=stand_in.url) as (client, viewer):
        body = samples(client, viewer, metric="temperature_c")
        every = samples(client, viewer)
    assert body["source"] == "database"
    assert body["source_error"] == "Prometheus has no DCGM series of temperature_c"
    assert [s["temperature_c"] for s in body["samples"]] == [55.0, 55.0]
    # all metrics at once: from Prometheus, the one without a series left out of the query
    assert every["source"] == "prometheus"
    [(_, form)] = stand_in.requests
    assert "DCGM_FI_DEV_GPU_TEMP" not in form["query"]
    assert "DCGM_FI_DEV_POWER_USAGE" in form["query"]


def test_unknown_metric_is_refused_before_any_source(db_url, stand_in):
    with api(db_url, url=stand_in.url) as (client, viewer):
        r = client.get("/api/v1/nodes/n1/samples", params={"metric": "fan_rpm"}, headers=viewer)
    assert r.status_code == 422
    assert "unknown metric 'fan_rpm'; valid: temperature_c" in r.text
    assert stand_in.requests == []


@pytest.mark.parametrize(
    ("url", "source", "caption"),
    [
        (None, "database", "Charts from tierwatch&#39;s database"),
        ("http://prometheus.example:9090", "prometheus", "Charts from Prometheus"),
    ],
    ids=["database", "prometheus"],
)
def test_node_page_says_where_its_charts_come_from(db_url, url, source, caption):
    with api(db_url, **({"url": url} if url else {})) as (client, _):
        html = client.get("/nodes/n1").text
    line = html[html.index('<p id="chart-source"') :]
    line = line[: line.index("</p>")]
    assert f'data-source="{source}"' in line
    assert line.endswith(caption)

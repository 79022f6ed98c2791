"""The demo report page (/demo) and API (/api/v1/demo/report): every state of the report
file (setting unset, file absent, not JSON, wrong shape, running, finished), the htmx
fragment and polling, the nav link, sign-in and roles, escaping, and the schema module."""

from __future__ import annotations

import copy
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from support import auth

from tierwatch.server.config import Settings
from tierwatch.server.demo import report as demo_report
from tierwatch.server.demo.report import DemoReport, ReportAbsent, ReportInvalid, read_report

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'
POLL = re.compile(r'id="demo-live"[^>]*hx-trigger="every 5s')
NAV_LINK = '<a href="/demo">Demo report</a>'

REPORT: dict[str, Any] = {
    "version": 1,
    "status": "finished",
    "seed": 7,
    "mtbf_s": 30.0,
    "seconds": 120.0,
    "started_at": "2024-05-01T12:00:00+00:00",
    "updated_at": "2024-05-01T12:02:03+00:00",
    "duration_s": 123.4,
    "effective_training_time": 0.9312,
    "baseline_persistent_only": 0.6123,
    "baseline": {
        "interval_s": 60.0,
        "checkpoint_s": 4.0,
        "restart_s": 8.0,
        "restore_s": 6.0,
        "mtbf_s": 30.0,
        "formula": "1 - δ/τ - (τ/2 + R)/M",
    },
    "loss_start": 10.8123,
    "loss_end": 3.2071,
    "steps": {"final": 812, "useful": 790, "lost": 22},
    "tiers_used": ["memory", "peer"],
    "costs": {"restart_s": 2.5, "save_stall_s": 0.012, "persistent_write_s": 3.25},
    "loss_curve": [[0, 10.8123], [100, 6.5], [200, 4.25], [812, 3.2071]],
    "nodes": {"in_use": ["sim-1", "sim-3"], "spare": [], "isolated": ["sim-2"]},
    "failures": [
        {
            "at_s": 31.5,
            "component": "gpu",
            "category": "xid",
            "failure_class": "node",
            "node": "sim-2",
            "rank": 1,
            "injected": "XID 79 on GPU 0",
            "detected_after_s": 1.75,
            "isolated": True,
            "replaced_by": "sim-3",
            "restored_step": 290,
            "restore_tier": "peer",
            "rank_tiers": {"0": "memory", "1": "peer"},
            "steps_lost": 12,
            "downtime_s": 9.5,
            "recovered": True,
            "note": None,
        },
        {
            "at_s": 77.0,
            "component": "trainer",
            "category": "crash",
            "failure_class": "process",
            "node": "sim-1",
            "rank": 0,
            "injected": "SIGKILL rank 0",
            "detected_after_s": None,
            "isolated": False,
            "replaced_by": None,
            "restored_step": None,
            "restore_tier": None,
            "rank_tiers": {},
            "steps_lost": None,
            "downtime_s": None,
            "recovered": False,
            "note": "still down",
        },
    ],
    "future_field": {"added": "by a newer demo"},
}


def running_report(**change: Any) -> dict[str, Any]:
    body = copy.deepcopy(REPORT)
    body["status"] = "running"
    body["updated_at"] = datetime.now(UTC).isoformat()
    body.update(change)
    return body


@pytest.fixture
def report_file(tmp_path: Path) -> Path | None:
    """Where the app reads the report (parametrize ``report_file`` with None: unset)."""
    return tmp_path / "var" / "demo-report.json"


@pytest.fixture
def settings(db_url: str, report_file: Path | None) -> Settings:
    return Settings(database_url=db_url, dev=True, prune_interval_s=0, demo_report=report_file)


def write(path: Path, body: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body if isinstance(body, str) else json.dumps(body))


def live_block(html: str) -> str:
    start = html.index('id="demo-live"')
    return html[start:]


# --- the setting -----------------------------------------------------------------------------


@pytest.mark.parametrize("report_file", [None])
def test_unset_setting_is_a_404_page_saying_to_start_make_demo(viewer, report_file):
    r = viewer.get("/demo")
    assert r.status_code == 404
    assert "text/html" in r.headers["content-type"]
    assert "make demo" in r.text
    assert "TIERWATCH_DEMO_REPORT" in r.text
    assert NAV_LINK not in viewer.get("/").text
    api = viewer.get("/api/v1/demo/report")
    assert api.status_code == 404
    assert "TIERWATCH_DEMO_REPORT" in api.json()["detail"]


def test_setting_reads_the_environment(monkeypatch):
    monkeypatch.setenv("TIERWATCH_DEMO_REPORT", "var/demo-report.json")
    assert Settings().demo_report == Path("var/demo-report.json")
    monkeypatch.setenv("TIERWATCH_DEMO_REPORT", "")
    assert Settings().demo_report is None
    monkeypatch.delenv("TIERWATCH_DEMO_REPORT")
    assert Settings().demo_report is None


def test_nav_links_the_page_when_set(viewer):
    assert NAV_LINK in viewer.get("/").text


# --- states of the file ----------------------------------------------------------------------


def test_absent_file_is_a_waiting_page_that_polls(viewer, report_file):
    r = viewer.get("/demo")
    assert r.status_code == 200
    assert "has not written its report yet" in r.text
    assert str(report_file) in r.text
    assert POLL.search(r.text), "the waiting page must poll every 5 s"
    assert 'data-state="absent"' in r.text
    api = viewer.get("/api/v1/demo/report")
    assert api.status_code == 404
    assert "has not written its report yet" in api.json()["detail"]
    assert str(report_file) in api.json()["detail"]


def test_file_appearing_later_is_shown_by_the_next_poll(viewer, report_file):
    assert 'data-state="absent"' in viewer.get("/demo").text
    write(report_file, running_report())
    r = viewer.get("/demo", headers={"HX-Request": "true"})
    assert r.status_code == 200
    assert 'data-state="ok"' in r.text
    assert 'data-status="running"' in r.text


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        ('{"version": 1, "status": "runn', "it is not valid JSON"),
        ("", "it is empty"),
        ("[1, 2]", "the whole file: Input should be an object"),
    ],
    ids=["truncated", "empty", "array"],
)
def test_malformed_json_is_an_error_page_naming_the_file(viewer, report_file, body, problem):
    write(report_file, body)
    r = viewer.get("/demo")
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "5"
    assert "cannot be shown" in r.text
    assert str(report_file) in r.text
    assert problem in r.text
    assert POLL.search(r.text), "an unreadable report is checked again (the demo rewrites it)"
    api = viewer.get("/api/v1/demo/report")
    assert api.status_code == 503
    assert str(report_file) in api.json()["detail"]
    assert problem in api.json()["detail"]


def test_wrong_shape_lists_each_wrong_field(viewer, report_file):
    body = copy.deepcopy(REPORT)
    body["status"] = "paused"
    del body["steps"]
    body["failures"][0]["rank"] = "first"
    body["loss_curve"] = [[1, "high"]]
    write(report_file, body)
    r = viewer.get("/demo")
    assert r.status_code == 503
    assert str(report_file) in r.text
    assert "does not match the demo report schema" in r.text
    items = re.findall(r"<li><code>(.*?)</code></li>", r.text)
    fields = {i.split(":", 1)[0] for i in items}
    assert fields == {"status", "steps", "failures.0.rank", "loss_curve.0.1"}, items
    detail = viewer.get("/api/v1/demo/report").json()["detail"]
    assert "status: Input should be 'running' or 'finished' (got 'paused')" in detail


def test_unsupported_version_is_refused(viewer, report_file):
    write(report_file, {**REPORT, "version": 2})
    r = viewer.get("/demo")
    assert r.status_code == 503
    assert "version: Input should be 1" in r.text


def test_directory_instead_of_a_file_is_an_error_page(viewer, report_file):
    report_file.mkdir(parents=True)
    r = viewer.get("/demo")
    assert r.status_code == 503
    assert "it is not a regular file" in r.text


def test_running_report_shows_the_numbers_and_polls(viewer, report_file):
    write(report_file, running_report())
    r = viewer.get("/demo")
    assert r.status_code == 200
    html = r.text
    assert 'data-status="running"' in html
    assert POLL.search(html), "a running report must refresh every 5 s"
    assert "data-stale" not in html
    facts = dict(
        re.findall(r'<div class="demo-big[^"]*" data-fact="(\w+)">.*?<b>([^<]*)</b>', html, re.S)
    )
    assert facts == {"effective_training_time": "93.1 %", "baseline_persistent_only": "61.2 %"}
    assert re.search(r'data-fact="duration_s">2\.1 min<', html)
    assert re.search(r'data-fact="loss">10\.812 → 3\.207<', html)
    assert re.search(r'data-fact="steps">812 · 790 · 22<', html)
    assert re.findall(r'<span class="badge" data-tier="(\w+)"', html) == ["memory", "peer"]
    costs = dict(re.findall(r'<tr data-cost="(\w+)"><td>\w+</td><td>([^<]*)</td>', html))
    assert costs == {
        "persistent_write_s": "3.25 s",
        "restart_s": "2.50 s",
        "save_stall_s": "0.01 s",
    }
    assert "1 - δ/τ - (τ/2 + R)/M" in html


def test_failure_table_has_a_row_per_failure(viewer, report_file):
    write(report_file, running_report())
    html = viewer.get("/demo").text
    rows = re.findall(r'<tr data-failure="(\d+)" data-class="(\w+)" data-recovered="(\w+)"', html)
    assert rows == [("0", "node", "true"), ("1", "process", "false")]
    first = html[html.index('<tr data-failure="0"') : html.index('<tr data-failure="1"')]
    cells = [
        re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", first, re.S)
    ]
    assert cells == [
        "31.5 s",
        "gpu xid",
        "node",
        "sim-2",
        "1",
        "XID 79 on GPU 0",
        "1.75 s",
        "isolated → sim-3",
        "290",
        "peer (mixed)",
        "12",
        "9.50 s",
        "yes",
        "",
    ]
    second = html[html.index('<tr data-failure="1"') :]
    second = second[: second.index("</tr>")]
    assert "not detected" in second
    assert "still down" in second
    assert 'data-fact="failures">2 <span class="bad">(1 not recovered)' in html


def test_htmx_poll_gets_only_the_live_block(viewer, report_file):
    write(report_file, running_report())
    r = viewer.get("/demo", headers={"HX-Request": "true"})
    assert r.status_code == 200
    assert r.text.lstrip().startswith('<div id="demo-live"')
    assert "<html" not in r.text
    assert "loss-chart" not in r.text
    assert "HX-Request" in r.headers["vary"]
    assert r.headers["cache-control"] == "no-store"
    # An unreadable report is swapped in too (htmx would keep the old body on a 503).
    write(report_file, "{")
    r = viewer.get("/demo", headers={"HX-Request": "true"})
    assert r.status_code == 503
    assert r.text.lstrip().startswith('<div id="demo-live"')
    assert "event.detail.shouldSwap = true" in r.text


def test_finished_report_stops_polling(viewer, report_file):
    write(report_file, REPORT)
    r = viewer.get("/demo")
    assert r.status_code == 200
    assert 'data-status="finished"' in r.text
    assert "hx-trigger" not in live_block(r.text)
    assert "data-stale" not in r.text


def test_running_report_not_rewritten_for_a_while_is_flagged(viewer, report_file):
    write(report_file, running_report(updated_at="2024-05-01T12:02:03Z"))
    html = viewer.get("/demo").text
    assert "data-stale" in html
    assert "may have stopped" in html
    assert POLL.search(html)


def test_loss_curve_is_embedded_for_the_chart(viewer, report_file):
    write(report_file, REPORT)
    html = viewer.get("/demo").text
    data = re.search(
        r'<script type="application/json" id="demo-loss-data">(.*?)</script>', html, re.S
    )
    assert data, "the live block must carry the chart's points"
    assert json.loads(data.group(1)) == REPORT["loss_curve"]
    assert 'id="loss-chart"' in html
    assert "/static/vendor/uPlot.iife.min.js" in html


def test_report_text_is_escaped(viewer, report_file):
    body = copy.deepcopy(REPORT)
    body["failures"][0]["injected"] = HOSTILE
    body["failures"][0]["note"] = HOSTILE
    body["tiers_used"] = [HOSTILE]
    body["loss_curve"] = [[1, 2.0]]
    body["costs"] = {HOSTILE: 1.0}
    write(report_file, body)
    html = viewer.get("/demo").text
    assert HOSTILE not in html
    assert "&lt;script&gt;alert(" in html
    assert "<img src=x" not in html


def test_wrong_field_values_are_escaped_on_the_error_page(viewer, report_file):
    write(report_file, {**REPORT, "status": HOSTILE})
    html = viewer.get("/demo").text
    assert "<img src=x" not in html
    assert "&lt;script&gt;" in html


# --- sign-in and roles -----------------------------------------------------------------------


def test_page_needs_sign_in(client, report_file):
    write(report_file, REPORT)
    r = client.get("/demo", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/login?next=%2Fdemo"


def test_api_returns_the_validated_report(client, make_token, report_file):
    body = copy.deepcopy(REPORT)
    body["started_at"] = "2024-05-01T12:00:00"  # no offset: read as UTC
    body["steps"]["final"] = 812.0
    write(report_file, body)
    r = client.get("/api/v1/demo/report", headers=auth(make_token("viewer")))
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["started_at"] == "2024-05-01T12:00:00Z"
    assert got["steps"] == {"final": 812, "useful": 790, "lost": 22}
    assert got["future_field"] == {"added": "by a newer demo"}
    assert got["failures"][0]["rank_tiers"] == {"0": "memory", "1": "peer"}
    assert got["loss_curve"] == REPORT["loss_curve"]
    assert DemoReport.model_validate(got).status == "finished"


def test_api_needs_a_viewer(client, make_token, report_file):
    write(report_file, REPORT)
    assert client.get("/api/v1/demo/report").status_code == 401
    r = client.get("/api/v1/demo/report", headers=auth(make_token("agent", "n1")))
    assert r.status_code == 403
    for role in ("operator", "admin"):
        assert client.get("/api/v1/demo/report", headers=auth(make_token(role))).status_code == 200


def test_api_is_in_the_openapi_schema(client):
    paths = client.get("/openapi.json").json()["paths"]
    op = paths["/api/v1/demo/report"]["get"]
    assert {"200", "401", "403", "404", "503"} <= op["responses"].keys()
    assert "/demo" not in paths


# --- the schema module -----------------------------------------------------------------------


def test_read_report_errors(tmp_path):
    with pytest.raises(ReportAbsent):
        read_report(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{")
    with pytest.raises(ReportInvalid, match="not valid JSON") as info:
        read_report(bad)
    assert str(bad) in str(info.value)


def test_optional_fields_may_be_left_out(tmp_path):
    minimal = {
        k: REPORT[k]
        for k in (
            "version",
            "status",
            "seed",
            "mtbf_s",
            "seconds",
            "started_at",
            "updated_at",
            "duration_s",
            "steps",
        )
    }
    path = tmp_path / "r.json"
    write(path, minimal)
    report = read_report(path)
    assert report.failures == []
    assert report.loss_curve == []
    assert report.baseline is None
    assert report.effective_training_time is None


def test_chart_points_keep_ends_and_limit():
    curve = [(i, float(i)) for i in range(10_001)]
    points = demo_report.chart_points(curve, limit=100)
    assert len(points) == 100
    assert points[0] == [0, 0.0]
    assert points[-1] == [10_000, 10_000.0]
    assert [p[0] for p in points] == sorted(p[0] for p in points)
    assert demo_report.chart_points([(2, 1.0), (1, 2.0)]) == [[1, 2.0], [2, 1.0]]
    # Steps trained again after a restore keep the newest loss.
    rolled_back = [(0, 9.0), (10, 5.0), (20, 4.0), (10, 5.5), (20, 3.5), (30, 3.0)]
    assert demo_report.chart_points(rolled_back) == [[0, 9.0], [10, 5.5], [20, 3.5], [30, 3.0]]

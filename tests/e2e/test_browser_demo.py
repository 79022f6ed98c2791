"""The demo report page in a real browser: a server process started with
``TIERWATCH_DEMO_REPORT``, the report file written as ``scripts/demo.py`` would (absent, then
running, then finished), and headless Chromium from the system (``/usr/bin/chromium``).

Without Chromium the test is skipped, unless ``TIERWATCH_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from procs import make_server

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

POLL_WAIT_MS = 15_000  # the page polls every 5 s


def failure(at_s: float, node: str, **change: Any) -> dict[str, Any]:
    return {
        "at_s": at_s,
        "component": "gpu",
        "category": "xid",
        "failure_class": "node",
        "node": node,
        "rank": 1,
        "injected": f"XID 79 on {node}",
        "detected_after_s": 1.5,
        "isolated": True,
        "replaced_by": "sim-9",
        "restored_step": 40,
        "restore_tier": "peer",
        "rank_tiers": {"0": "memory", "1": "peer"},
        "steps_lost": 6,
        "downtime_s": 8.0,
        "recovered": True,
        "note": None,
        **change,
    }


def report(status: str, failures: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    now = datetime.now(UTC).isoformat()
    return {
        "version": 1,
        "status": status,
        "seed": 3,
        "mtbf_s": 20.0,
        "seconds": 60.0,
        "started_at": now,
        "updated_at": now,
        "duration_s": 42.0,
        "effective_training_time": 0.91,
        "baseline_persistent_only": 0.58,
        "baseline": None,
        "loss_start": 10.5,
        "loss_end": 4.0,
        "steps": {"final": steps, "useful": steps - 6, "lost": 6},
        "tiers_used": ["memory", "peer"],
        "costs": {"restart_s": 2.0, "save_stall_s": 0.02},
        "loss_curve": [[s, 10.5 - s * 0.1] for s in range(0, steps + 1, 5)],
        "nodes": {"in_use": ["sim-1", "sim-9"], "spare": [], "isolated": ["sim-2"]},
        "failures": failures,
    }


def write(path: Path, body: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(path)


def test_demo_page_follows_the_report_from_waiting_to_finished(browser, tmp_path, db_url):
    from playwright.sync_api import expect

    report_file = tmp_path / "var" / "demo-report.json"
    report_file.parent.mkdir(parents=True)
    server = make_server(tmp_path / "server", db_url, TIERWATCH_DEMO_REPORT=str(report_file))
    server.start()
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(15_000)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{server.url}/")
        page.fill("#token", server.token("viewer"))
        page.click("main form button[type=submit]")
        expect(page).to_have_url(f"{server.url}/")

        # The nav link opens the page; the demo has not written its report yet.
        page.click("header nav a:has-text('Demo report')")
        expect(page).to_have_url(f"{server.url}/demo")
        live = page.locator("#demo-live")
        expect(live).to_have_attribute("data-state", "absent")
        expect(live).to_contain_text("has not written its report yet")

        # The demo starts: the next poll shows the running report and its failure table.
        write(report_file, report("running", [failure(12.0, "sim-2")], steps=60))
        expect(live).to_have_attribute("data-status", "running", timeout=POLL_WAIT_MS)
        rows = page.locator("table.demo-failures tbody tr")
        expect(rows).to_have_count(1)
        expect(rows.first.locator("td").nth(3)).to_have_text("sim-2")
        expect(rows.first.locator("td").nth(7)).to_have_text("isolated → sim-9")
        expect(page.locator('[data-fact="effective_training_time"] b')).to_have_text("91.0 %")
        chart = page.locator("#loss-chart")
        expect(chart).to_have_attribute("data-points", "13")
        expect(chart.locator("canvas")).to_have_count(1)

        # A broken file replaces the page with the error (htmx swaps the 503 in too).
        report_file.write_text('{"version": 1, "status": ')
        expect(live).to_have_attribute("data-state", "invalid", timeout=POLL_WAIT_MS)
        expect(live).to_contain_text(str(report_file))
        expect(live).to_contain_text("not valid JSON")

        # It finishes with a second failure: shown, and the page stops polling.
        write(
            report_file,
            report(
                "finished",
                [failure(12.0, "sim-2"), failure(30.0, "sim-1", recovered=False)],
                steps=90,
            ),
        )
        expect(live).to_have_attribute("data-status", "finished", timeout=POLL_WAIT_MS)
        expect(live).to_have_attribute("data-state", "ok")
        expect(rows).to_have_count(2)
        expect(rows.nth(1)).to_have_attribute("data-recovered", "false")
        expect(chart).to_have_attribute("data-points", "19")
        assert live.get_attribute("hx-trigger") is None

        shot = Path(os.environ.get("TIERWATCH_SCREENSHOT_DIR", tmp_path)) / "demo.png"
        page.screenshot(path=str(shot), full_page=True)
        print(f"screenshot: {shot}")
        assert errors == [], f"JavaScript errors on the page: {errors}"
    finally:
        server.stop()

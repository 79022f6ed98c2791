"""The job page in a real browser: a server process, reports posted as an agent would, and
headless Chromium from the system (``/usr/bin/chromium``; Playwright never downloads one).

Without Chromium the test is skipped, unless ``TIERWATCH_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from support import register_job

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, ReportBatch, utcnow

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

JOB = "browser-job"


def post_reports(server) -> None:
    register_job(server.url, JOB, ["gpu-a"], token=server.token("operator"))
    token = server.token("agent", "gpu-a")
    t0 = utcnow() - timedelta(minutes=2)
    for seq, step in enumerate((10, 20, 30), start=1):
        ts = t0 + timedelta(seconds=10 * seq)
        batch = ReportBatch(
            node="gpu-a",
            epoch="e1",
            seq=seq,
            sent_at=utcnow(),
            progress=[
                JobProgress(
                    job_id=JOB,
                    rank=0,
                    world_size=1,
                    step=step,
                    step_time_s=1.0,
                    ts=ts,
                    layout=["gpu-a"],
                )
            ],
            checkpoint_events=[
                CheckpointEvent(
                    job_id=JOB,
                    step=step - 5,
                    tier=tier,
                    kind="committed",
                    rank=0,
                    world_size=1,
                    ts=ts,
                    bytes=2048,
                    seconds=0.5,
                )
                for tier in ("memory", "peer")
            ],
        )
        r = httpx.post(
            f"{server.url}/api/v1/ingest/report",
            content=batch.model_dump_json(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            timeout=10,
        )
        assert r.status_code == 200, r.text


def test_job_page_shows_tier_table_and_chart(browser, server, tmp_path):
    from playwright.sync_api import expect

    post_reports(server)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server.url}/")
    page.fill("#token", server.token("viewer"))
    page.click("main form button[type=submit]")
    expect(page).to_have_url(f"{server.url}/")

    # The cluster page lists the job; its link opens the job page.
    page.click(f'tr[data-job="{JOB}"] a')
    expect(page).to_have_url(f"{server.url}/jobs/{JOB}")
    expect(page.locator(".node-head h1")).to_have_text(JOB)
    expect(page.locator("table.tiers thead th[data-tier]")).to_have_count(3)
    newest = page.locator('tr[data-row="newest_step"]')
    expect(newest.locator('td[data-tier="memory"]')).to_have_text("25")
    expect(newest.locator('td[data-tier="persistent"]')).to_have_text("none")
    expect(page.locator('tr[data-row="lag_steps"] td[data-tier="memory"]')).to_have_text("5")

    chart = page.locator("#step-chart")
    expect(chart).to_have_attribute("data-series", "4")
    expect(chart).to_have_attribute("data-points", re.compile(r"^[2-9]|\d{2,}$"))
    expect(chart.locator("canvas")).to_have_count(1)
    page.click('button[data-range="3600"]')
    expect(page.locator('button[data-range="3600"]')).to_have_attribute("aria-pressed", "true")
    expect(chart.locator("canvas")).to_have_count(1)

    shot = Path(os.environ.get("TIERWATCH_SCREENSHOT_DIR", tmp_path)) / "job.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    assert errors == [], f"JavaScript errors on the page: {errors}"

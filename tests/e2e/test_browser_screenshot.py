r"""The README's screenshot: the cluster overview of a real server in headless Chromium.

Four simulated agents report (one with an injected XID 79, so unhealthy; one running hot),
and a fifth node, registered as the node of a 4-rank job, reports the job's progress and
committed checkpoint steps through the ingest API, so the page shows every part of the
overview. The screenshot is 1280x800 and
must be a PNG under 200 KB; with ``TIERWATCH_SCREENSHOT_OUT=path.png`` it is written there
(that is how ``docs/dashboard.png`` is made)::

    TIERWATCH_SCREENSHOT_OUT=docs/dashboard.png make screenshot

It runs under ``make screenshot``, not ``make test``: the live states it shows (an unhealthy
and a degraded tile) are checked by test_browser.py, the jobs table by test_browser_jobs.py.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from procs import wait_for
from support import auth, make_batch, register_job

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, utcnow

pytestmark = [pytest.mark.e2e, pytest.mark.browser, pytest.mark.screenshot]

NODES = ("gpu-node-01", "gpu-node-02", "gpu-node-03", "gpu-node-04")
SPARE = "gpu-node-05"
JOB = "gpt-small"
VIEWPORT = {"width": 1280, "height": 800}
MAX_BYTES = 200_000
LIVE_TIMEOUT_MS = 30_000


def _report_job(server_url: str, token: str, operator: str) -> None:
    """One report from the spare node, which runs the job's 4 ranks, with their progress and
    the committed steps in every tier (whole-step events, ``rank`` None), as an agent
    forwards them. The job registers on the spare node first, as its launcher would."""
    register_job(server_url, JOB, [SPARE], layout=[SPARE] * 4, token=operator)
    now = utcnow()
    events = [
        CheckpointEvent(
            job_id=JOB,
            step=step,
            tier=tier,
            kind="committed",
            rank=None,
            world_size=4,
            ts=now - timedelta(seconds=(300 - step) * 0.5),
            bytes=420_000_000,
            seconds=seconds,
            blocking_s=0.03,
        )
        for tier, steps, seconds in (
            ("memory", (298, 299), 0.4),
            ("peer", (298,), 1.1),
            ("persistent", (280, 290), 3.6),
        )
        for step in steps
    ]
    progress = [
        JobProgress(
            job_id=JOB,
            rank=r,
            world_size=4,
            step=300,
            step_time_s=0.5,
            ts=now,
            layout=[SPARE] * 4 if r == 0 else None,
        )
        for r in range(4)
    ]
    # interval_s: this node reports once, and must not turn unreachable while the page loads
    batch = make_batch(SPARE, 1, gpus=8, interval_s=600).model_copy(
        update={"progress": progress, "checkpoint_events": events}
    )
    r = httpx.post(
        f"{server_url}/api/v1/ingest/report",
        content=batch.model_dump_json(),
        headers={**auth(token), "Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 200, r.text


def test_cluster_overview_screenshot(browser, server, start_agent, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    agents = {node: start_agent(node, interval=1.0) for node in NODES}
    viewer = server.token("viewer")
    reader = auth(viewer)

    def reported() -> bool:
        r = httpx.get(f"{server.url}/api/v1/nodes", headers=reader, timeout=5)
        return len(r.json()["nodes"]) >= len(NODES)

    wait_for(reported, timeout=30, what="every agent's first report")
    agents["gpu-node-03"].inject("xid", "79", "--gpu", "3")
    agents["gpu-node-02"].inject("temp", "87", "--gpu", "5")
    _report_job(server.url, server.token("agent", SPARE), server.token("operator"))

    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(15_000)
    page.goto(f"{server.url}/login")
    page.fill("#token", viewer)
    page.click("main form button[type=submit]")
    expect(page).to_have_url(f"{server.url}/")
    expect(page.locator('.tile[data-node="gpu-node-03"]')).to_have_attribute(
        "data-state", "unhealthy", timeout=LIVE_TIMEOUT_MS
    )
    expect(page.locator('.tile[data-node="gpu-node-02"]')).to_have_attribute(
        "data-state", "degraded", timeout=LIVE_TIMEOUT_MS
    )
    for node in ("gpu-node-01", "gpu-node-04", SPARE):
        expect(page.locator(f'.tile[data-node="{node}"]')).to_have_attribute(
            "data-state", "healthy", timeout=LIVE_TIMEOUT_MS
        )
    expect(page.locator("table.jobs")).to_contain_text(JOB, timeout=LIVE_TIMEOUT_MS)
    expect(page.locator('[data-count="all"]')).to_have_text("5")
    expect(page.locator('.tile[data-node="gpu-node-03"]')).to_contain_text(
        re.compile(r"XID 79|unhealthy")
    )

    png = page.screenshot(type="png", full_page=False)
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (VIEWPORT["width"], VIEWPORT["height"])
    assert len(png) < MAX_BYTES, f"screenshot is {len(png)} bytes (limit {MAX_BYTES})"
    (tmp_path / "cluster.png").write_bytes(png)
    out = os.environ.get("TIERWATCH_SCREENSHOT_OUT")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_bytes(png)

"""The dashboard in a real browser: a server, two simulated agents and headless Chromium.

Uses the system's Chromium (``/usr/bin/chromium``); Playwright never downloads a browser
here. Without Chromium the test is skipped, unless ``TIERWATCH_REQUIRE_BROWSER=1`` (set by
CI), where a missing browser is a failure.
"""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

LIVE_TIMEOUT_MS = 30_000  # agents start, report, and the page polls them in
NODES = ("node-a", "node-b")


def test_dashboard_shows_live_nodes_and_charts(browser, server, start_agent, tmp_path):
    from playwright.sync_api import expect

    viewer_token = server.token("viewer")
    agents = {node: start_agent(node, interval=1.0) for node in NODES}

    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    # Not signed in: the cluster page sends us to the login form.
    page.goto(f"{server.url}/")
    expect(page).to_have_url(re.compile(r"/login$"))
    page.fill("#token", viewer_token)
    page.click("main form button[type=submit]")
    expect(page).to_have_url(f"{server.url}/")

    # Both nodes arrive through htmx polling, without a reload (their GPU data is on the
    # node page: a tile shows only what changes slowly, so a quiet poll sends nothing).
    page.evaluate("window.__no_reload = true")
    for node in NODES:
        tile = page.locator(f'.tile[data-node="{node}"]')
        expect(tile).to_have_attribute("data-state", "healthy", timeout=LIVE_TIMEOUT_MS)
        expect(tile).to_have_attribute("title", f"{node}: healthy")
        expect(tile).to_contain_text("sim")
    expect(page.locator('[data-count="all"]')).to_have_text("2")
    expect(page.locator('[data-count="healthy"]')).to_have_text("2")
    for state in ("degraded", "unhealthy", "unreachable"):
        expect(page.locator(f'[data-count="{state}"]')).to_have_text("0")
    updated = page.locator("#live time").inner_text()
    expect(page.locator("#live time")).not_to_have_text(updated, timeout=10_000)
    assert page.evaluate("window.__no_reload") is True

    # The name filter narrows the grid and keeps the filter in the URL.
    page.fill("#name-filter", "node-b")
    expect(page.locator(".tile")).to_have_count(1)
    expect(page.locator('.tile[data-node="node-b"]')).to_be_visible()
    expect(page).to_have_url(re.compile(r"name=node-b"))
    # A state link swaps in the page for that state (hx-boost), keeping the name filter.
    page.click(".counts .chip-unhealthy")
    expect(page).to_have_url(re.compile(r"state=unhealthy&name=node-b"))
    expect(page.locator(".tile")).to_have_count(0)
    page.click(".counts .chip-healthy")
    expect(page).to_have_url(re.compile(r"state=healthy&name=node-b"))
    expect(page.locator(".tile")).to_have_count(1)
    assert page.evaluate("window.__no_reload") is True
    cluster_shot = tmp_path / "cluster.png"
    page.screenshot(path=str(cluster_shot), full_page=True)

    # The node page: state, GPU table, and a uPlot chart drawn with data.
    page.click('.tile[data-node="node-b"]')
    expect(page).to_have_url(f"{server.url}/nodes/node-b")
    expect(page.locator(".node-head h1")).to_have_text("node-b")
    expect(page.locator(".node-head")).to_have_attribute("data-state", "healthy")
    expect(page.locator("table.gpus tbody tr")).to_have_count(8)
    chart = page.locator('figure[data-metric="temperature_c"]')
    expect(chart).to_have_attribute("data-gpus", "8", timeout=LIVE_TIMEOUT_MS)
    expect(chart).to_have_attribute(
        "data-points", re.compile(r"^([2-9]|\d{2,})$"), timeout=LIVE_TIMEOUT_MS
    )
    expect(chart.locator("canvas")).to_have_count(1)
    for metric in ("power_w", "utilization_pct"):
        expect(page.locator(f'figure[data-metric="{metric}"] canvas')).to_have_count(1)

    # Another range reloads the charts.
    page.click('button[data-range="3600"]')
    expect(page.locator('button[data-range="3600"]')).to_have_attribute("aria-pressed", "true")
    expect(chart).to_have_attribute("data-points", re.compile(r"^[1-9]\d*$"))

    node_shot = tmp_path / "node-b.png"
    page.screenshot(path=str(node_shot), full_page=True)

    # Faults reach the overview live: an XID 79 makes node-a unhealthy, a GPU at 87 °C
    # (within 5 °C of the 90 °C slowdown) makes node-b degraded, without a reload.
    page.goto(f"{server.url}/")
    page.evaluate("window.__no_reload = true")
    agents["node-a"].inject("xid", "79", "--gpu", "3")
    agents["node-b"].inject("temp", "87", "--gpu", "5")
    expect(page.locator('.tile[data-node="node-a"]')).to_have_attribute(
        "data-state", "unhealthy", timeout=LIVE_TIMEOUT_MS
    )
    expect(page.locator('.tile[data-node="node-a"]')).to_contain_text("XID 79")
    expect(page.locator('.tile[data-node="node-b"]')).to_have_attribute(
        "data-state", "degraded", timeout=LIVE_TIMEOUT_MS
    )
    expect(page.locator('[data-count="unhealthy"]')).to_have_text("1")
    expect(page.locator('[data-count="degraded"]')).to_have_text("1")
    assert page.evaluate("window.__no_reload") is True
    print(f"screenshots: {cluster_shot} {node_shot}")  # noqa: T201
    assert errors == [], f"JavaScript errors on the page: {errors}"

"""The compact cluster grid in a real browser: a server process, 120 nodes, headless Chromium.

119 quiet nodes are rows written straight into the server's database (their reports would
change nothing the page shows); one more reports through the ingest API as its agent would,
and its XID 79 must turn its tile unhealthy in place: the poll patches that tile, the
counts and the attention list out of band, and leaves the grid and every other tile as they
are. Uses the system's Chromium (``/usr/bin/chromium``); without it the test is skipped,
unless ``TIERWATCH_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from support import auth, make_batch

from tierwatch.agent.protocol import utcnow
from tierwatch.server.db import make_engine, make_sessionmaker
from tierwatch.server.fleet.models import Node
from tierwatch.server.tokens import create_token

pytestmark = [pytest.mark.e2e, pytest.mark.browser]

QUIET = [f"rack-{i // 40}-node-{i % 40:02d}" for i in range(119)]
REPORTING = "rack-9-node-00"
ISOLATED = "rack-1-node-07"  # drained by an operator: listed as needing attention
UPDATE_TIMEOUT_MS = 15_000  # the page polls every 1.5 s


def _seed(database_url: str) -> tuple[str, str]:
    """The quiet nodes, and ``(viewer token, agent token of REPORTING)``."""
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as s:
            now = utcnow()
            s.execute(
                Node.__table__.insert(),
                [
                    {
                        "name": name,
                        "state": "healthy",
                        "isolated": name == ISOLATED,
                        "simulated": True,
                        "interval_s": 3600.0,  # stays reachable without reporting
                        "first_seen": now,
                        "last_seen": now,
                        "state_since": now,
                    }
                    for name in QUIET
                ],
            )
            viewer, _ = create_token(s, role="viewer")
            agent, _ = create_token(s, role="agent", node=REPORTING)
            s.commit()
    finally:
        engine.dispose()
    return viewer, agent


def _report(server_url: str, token: str, seq: int, **extra: object) -> None:
    r = httpx.post(
        f"{server_url}/api/v1/ingest/report",
        content=make_batch(REPORTING, seq, interval_s=3600, **extra).model_dump_json(),
        headers={**auth(token), "Content-Type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 200, r.text


def test_compact_grid_patches_a_tile_in_place(browser, server, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    viewer, agent = _seed(server.database_url)
    _report(server.url, agent, 1)

    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    polls: list[tuple[int, str]] = []

    def on_response(response) -> None:  # type: ignore[no-untyped-def]
        if "since=" in response.url:
            polls.append((response.status, response.text() if response.status == 200 else ""))

    page.on("response", on_response)
    page.goto(f"{server.url}/login")
    page.fill("#token", viewer)
    page.click("main form button[type=submit]")
    expect(page).to_have_url(f"{server.url}/")

    grid = page.locator("#cluster-grid")
    expect(grid).to_have_class(re.compile(r"\bcompact\b"))
    expect(page.locator(".tile")).to_have_count(120)
    expect(page.locator('[data-count="healthy"]')).to_have_text("120")
    expect(page.locator("#cluster-attention li")).to_have_count(1)
    expect(page.locator(f'[data-attention="{ISOLATED}"]')).to_contain_text("isolated")
    tile = page.locator(f'.tile[data-node="{REPORTING}"]')
    expect(tile).to_have_attribute("title", f"{REPORTING}: healthy")
    box = tile.bounding_box()
    assert box is not None
    assert box["width"] < 24, box
    assert box["height"] < 24, box
    # the name is there for screen readers, not only the colour
    expect(tile).to_contain_text(REPORTING)

    # Mark the grid and two tiles: a patch must keep the grid and the other tile as they are.
    page.evaluate(
        """() => {
            document.getElementById("cluster-grid").__kept = true;
            document.getElementById("n-rack-0-node-00").__kept = true;
            document.getElementById("n-rack-9-node-00").__kept = true;
            window.__no_reload = true;
        }"""
    )
    updated = page.locator("#cluster-updated").inner_text()
    expect(page.locator("#cluster-updated")).not_to_have_text(updated, timeout=UPDATE_TIMEOUT_MS)
    assert polls, "the page did not poll"
    assert {status for status, _ in polls} == {204}, polls  # nothing changed

    _report(server.url, agent, 2, xids=[(1, 79)])
    expect(tile).to_have_attribute("data-state", "unhealthy", timeout=UPDATE_TIMEOUT_MS)
    expect(tile).to_have_attribute("title", re.compile(r"^rack-9-node-00: unhealthy · XID 79 "))
    expect(page.locator('[data-count="unhealthy"]')).to_have_text("1")
    expect(page.locator('[data-count="healthy"]')).to_have_text("119")
    attention = page.locator("#cluster-attention li")
    expect(attention).to_have_count(2)
    expect(attention.first).to_have_attribute("data-attention", REPORTING)  # worst first
    expect(attention.first).to_contain_text("XID 79")
    kept = page.evaluate(
        """() => [
            document.getElementById("cluster-grid").__kept === true,
            document.getElementById("n-rack-0-node-00").__kept === true,
            document.getElementById("n-rack-9-node-00").__kept === true,
            window.__no_reload === true,
        ]"""
    )
    assert kept == [True, True, False, True], "only the changed tile may be replaced"
    patches = [body for status, body in polls if status == 200]
    assert len(patches) == 1, [status for status, _ in polls]
    assert re.findall(r'data-node="([^"]+)"', patches[0]) == [REPORTING]
    assert 'id="live"' not in patches[0]

    page.screenshot(path=str(tmp_path / "cluster-compact.png"), full_page=True)
    assert errors == [], f"JavaScript errors on the page: {errors}"

"""Fixtures that start real processes on loopback (see procs.py): a tierwatch-server, simulated
agents and the system's headless Chromium. Registered for the whole suite by tests/conftest.py
(``pytest_plugins``), so the e2e, security and browser tests share one definition.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import Agent, Server, make_agent, make_server


@pytest.fixture
def server(tmp_path: Path, db_url: str) -> Iterator[Server]:
    """A tierwatch-server process on the (emptied) test database."""
    srv = make_server(tmp_path / "server", db_url)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def start_agent(tmp_path: Path, server: Server) -> Iterator:
    """``start_agent("node-a", interval=1.0) -> Agent``: a simulated agent process."""
    agents: list[Agent] = []

    def _start(node: str, *, interval: float = 1.0, extra_args: list[str] | None = None) -> Agent:
        token = server.token("agent", node)
        agent = make_agent(
            tmp_path / "agents",
            node=node,
            server_url=server.url,
            token=token,
            interval=interval,
            extra_args=extra_args,
        )
        agent.proc.start()
        agents.append(agent)
        return agent

    yield _start
    for a in agents:
        a.stop()


CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture
def browser() -> Iterator:
    """Headless Chromium from the system, driven by Playwright (never a downloaded one).

    Skipped when /usr/bin/chromium is missing, except with TIERWATCH_REQUIRE_BROWSER=1 (CI),
    where that fails the test.
    """
    if not CHROMIUM.exists():
        reason = f"{CHROMIUM} is not installed (apt-get install chromium)"
        if os.environ.get("TIERWATCH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"TIERWATCH_REQUIRE_BROWSER=1 but {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()

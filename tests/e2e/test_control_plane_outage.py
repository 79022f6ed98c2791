"""A control-plane outage must not drain the cluster: real agents report to a real server on a
PostgreSQL of the test's own, with the auto-isolation policy on (unreachable after 3 s, the
breaker opened to 100 % so that only the control-plane guard stands in the way). Then:

1. the server is stopped and restarted on the same port;
2. its PostgreSQL is paused (SIGSTOP to every process of the cluster) and resumed.

Both times every node ages into "unreachable" while nothing listens. No node may be
auto-isolated, and the policy raises a "control plane suspect" alert instead.

``quick`` runs in ``make test``; ``full`` (20 agents, 60 s outages: the issue's case) runs in
``make soak``.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from own_postgres import start_postgres
from procs import make_agent, make_server, wait_for

from tierwatch.agent.netutil import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def get(server, token: str, path: str, **params):
    r = httpx.get(
        f"{server.url}{path}",
        params=params,
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    r.raise_for_status()
    return r.json()


def reachable(server, token: str, names: list[str]) -> bool:
    nodes = {n["name"]: n for n in get(server, token, "/api/v1/nodes")["nodes"]}
    return all(n in nodes and nodes[n]["state"] != "unreachable" for n in names)


def suspect_notices(server, token: str) -> list[dict]:
    alerts = get(server, token, "/api/v1/alerts", kind="control_plane")["alerts"]
    return [a for a in alerts if a["status"] == "firing"]


def policy_isolations(server, token: str) -> list[dict]:
    entries = get(server, token, "/api/v1/audit", actor="policy", action="isolate")
    return [e for e in entries if e["outcome"] == "ok"]


@pytest.mark.parametrize(
    ("agents", "server_down_s", "db_paused_s", "window_s"),
    [
        pytest.param(5, 6, 14, 30, id="quick"),
        pytest.param(20, 60, 60, 300, id="full", marks=pytest.mark.soak),
    ],
)
def test_an_outage_of_the_server_or_its_database_isolates_no_node(
    tmp_path: Path, agents: int, server_down_s: float, db_paused_s: float, window_s: float
) -> None:
    pg = start_postgres()
    port = free_port()
    env = {
        "TIERWATCH_POLICY__ENABLED": "true",
        "TIERWATCH_POLICY__UNREACHABLE_S": "3",
        "TIERWATCH_POLICY__BREAKER_PCT": "100",
        "TIERWATCH_POLICY__CONTROL_PLANE_WINDOW_S": str(window_s),
        "TIERWATCH_BACKGROUND_TICK_S": "0.5",
    }
    server = make_server(tmp_path / "server", pg.url, port=port, **env)
    started = []
    try:
        server.start()
        viewer = server.token("viewer")
        names = [f"gpu-node-{i:02d}" for i in range(agents)]
        for name in names:
            agent = make_agent(
                tmp_path / "agents",
                node=name,
                server_url=server.url,
                token=server.token("agent", name),
                interval=1.0,
            )
            agent.proc.start()
            started.append(agent)
        wait_for(
            lambda: reachable(server, viewer, names), timeout=120, what="every agent reporting"
        )

        # 1. The server stops; every node ages past the 3 s limit while nothing listens.
        server.stop()
        time.sleep(server_down_s)  # the outage itself
        server = make_server(tmp_path / "server2", pg.url, port=port, **env)
        server.start()
        wait_for(
            lambda: suspect_notices(server, viewer),
            timeout=30,
            what=f"a control plane suspect alert\n{server.proc.log_tail()}",
        )
        wait_for(
            lambda: reachable(server, viewer, names),
            timeout=90,
            what="every agent reporting after the restart",
        )
        assert policy_isolations(server, viewer) == []
        [notice] = suspect_notices(server, viewer)
        assert "listening for only" in notice["summary"]
        assert notice["details"]["nodes_not_isolated"]
        wait_for(  # every node back: the next pass resolves the alert
            lambda: get(server, viewer, "/api/v1/alerts", kind="control_plane", status="resolved")[
                "alerts"
            ],
            timeout=30,
            what="the control plane suspect alert to resolve",
        )

        # 2. Its PostgreSQL hangs: requests and the leader's passes wait, agents time out.
        pg.pause()
        try:
            time.sleep(db_paused_s)  # the outage itself
        finally:
            pg.resume()
        wait_for(
            lambda: len(suspect_notices(server, viewer)) == 2,
            timeout=60,
            what=(
                "a second control plane suspect alert; alerts: "
                f"{get(server, viewer, '/api/v1/alerts', kind='control_plane')['alerts']}\n"
                f"{server.proc.log_tail(6000)}"
            ),
        )
        wait_for(
            lambda: reachable(server, viewer, names),
            timeout=90,
            what="every agent reporting after the database came back",
        )
        assert policy_isolations(server, viewer) == []
        nodes = get(server, viewer, "/api/v1/nodes")["nodes"]
        assert [n["name"] for n in nodes if n.get("isolation")] == []
        newest = suspect_notices(server, viewer)[0]
        assert "on the database" in newest["summary"] or "stall" in newest["summary"]
    finally:
        for agent in started:
            agent.stop()
        server.stop()
        pg.stop()

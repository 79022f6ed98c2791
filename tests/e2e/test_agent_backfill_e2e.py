"""After an outage a real agent's newest state reaches a real server first, and the spool is
backfilled behind it (issue 14; order in ``agent.sendorder``).

The agent starts while its server is down, so everything it reports waits in the spool: the
first report (samples), then three XIDs pushed at once, the newest a fatal XID 48. The long
interval keeps the periodic report from adding a newer batch meanwhile, so the XID 48 push
stays the newest. When the server starts, the node must turn unhealthy for XID 48 (the
newest batch) before the backfilled XID 79 arrives, and that backfilled fatal XID must still
become a reason.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from procs import make_agent, make_server, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def get(server, token: str, path: str, **params):
    r = httpx.get(
        f"{server.url}{path}", params=params, headers={"Authorization": f"Bearer {token}"}
    )
    r.raise_for_status()
    return r.json()


def agent_status(agent) -> dict:
    try:
        return httpx.get(f"{agent.url}/v1/status", timeout=2).json()
    except httpx.HTTPError:
        return {}  # not listening yet


def test_after_an_outage_the_newest_state_goes_first_and_the_backlog_follows(
    tmp_path: Path, db_url: str
) -> None:
    server = make_server(tmp_path / "server", db_url)  # not started yet: the outage
    viewer = server.token("viewer")
    agent = make_agent(
        tmp_path / "agents",
        node="node-a",
        server_url=server.url,
        token=server.token("agent", "node-a"),
        interval=60.0,
    )
    agent.proc.start()
    try:
        wait_for(
            lambda: agent_status(agent).get("consecutive_failures", 0) >= 1,
            timeout=30,
            what=f"the agent failing to reach the server\n{agent.proc.log_tail()}",
        )
        for gpu, xid in ((3, 79), (1, 13), (5, 48)):  # oldest to newest
            r = httpx.post(
                f"{agent.url}/v1/inject",
                json={"fault": "xid", "gpu": gpu, "value": xid},
                headers={"Authorization": f"Bearer {agent.token}"},
            )
            assert r.status_code == 200, r.text
        wait_for(lambda: agent_status(agent)["spool_depth"] == 4, timeout=10, what="4 spooled")

        server.start()  # the server comes back
        wait_for(
            lambda: agent_status(agent)["spool_depth"] == 0,
            timeout=30,
            what=f"the spool delivered\n{agent.proc.log_tail()}",
        )
        node = get(server, viewer, "/api/v1/nodes/node-a")
        assert node["reports"] | {"epoch": None} == {
            "epoch": None,
            "first_seq": 1,
            "last_seq": 4,
            "batches": 4,
            "missing": 0,
            "dropped_by_agent": 0,
        }
        assert agent_status(agent)["delivered_batches"] == 4  # each once
        assert len(node["gpus"]) == 8
        assert all(g["ts"] for g in node["gpus"])  # the first report's samples

        events = get(server, viewer, "/api/v1/events", node="node-a")
        arrived = sorted((e for e in events if e["kind"] == "xid"), key=lambda e: e["id"])
        assert [e["code"] for e in arrived] == [48, 79, 13]  # newest, then the backlog
        [state] = [e for e in events if e["kind"] == "state"]
        assert state["data"] == {"from": "healthy", "to": "unhealthy"}
        assert "XID 48" in state["message"]  # sick from the newest batch ...
        assert "XID 79" not in state["message"]  # ... before the backfill came

        fatal = {(r["gpu"], r["key"]) for r in node["reasons"] if r["rule"] == "xid"}
        assert fatal == {(5, "48"), (3, "79")}  # the backfilled fatal XID is a reason too
        assert node["state"] == "unhealthy"
    finally:
        agent.stop()
        server.stop()

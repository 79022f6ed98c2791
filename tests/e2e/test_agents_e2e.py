"""End to end with real processes: a server and simulated agents on loopback ports."""

from __future__ import annotations

import subprocess
import time

import httpx
import pytest
from procs import BIN, make_server, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def nodes(server, token):
    r = httpx.get(f"{server.url}/api/v1/nodes", headers={"Authorization": f"Bearer {token}"})
    r.raise_for_status()
    return {n["name"]: n for n in r.json()["nodes"]}


def node(server, token, name):
    r = httpx.get(f"{server.url}/api/v1/nodes/{name}", headers={"Authorization": f"Bearer {token}"})
    r.raise_for_status()
    return r.json()


def agent_status(agent):
    return httpx.get(f"{agent.url}/v1/status", timeout=2).json()


def test_inject_xid_79_turns_node_unhealthy_with_catalog_action(server, start_agent):
    viewer = server.token("viewer")
    a = start_agent("node-a")
    b = start_agent("node-b")

    def both_healthy():
        ns = nodes(server, viewer)
        return all(
            n in ns
            and ns[n]["state"] == "healthy"
            and len(ns[n]["gpus"]) == 8
            and all(g["ts"] for g in ns[n]["gpus"])
            for n in ("node-a", "node-b")
        )

    wait_for(both_healthy, timeout=30, what="both nodes healthy with 8 GPUs")
    assert nodes(server, viewer)["node-a"]["simulated"] is True

    started = time.monotonic()
    out = a.inject("xid", "79", "--gpu", "3", check=False)
    assert out.returncode == 0, out.stderr

    def flagged():
        n = node(server, viewer, "node-a")
        xid = [r for r in n["reasons"] if r["rule"] == "xid" and r["key"] == "79"]
        return n if n["state"] == "unhealthy" and xid else None

    n = wait_for(flagged, timeout=15, interval=0.05, what="node-a unhealthy with XID 79")
    print(f"XID 79 visible in the API {time.monotonic() - started:.2f}s after the inject command")
    [reason] = [r for r in n["reasons"] if r["rule"] == "xid"]
    assert reason["gpu"] == 3
    assert reason["action"] == "RESTART_BM"
    assert "XID 79" in reason["message"]
    assert nodes(server, viewer)["node-b"]["state"] == "healthy"
    assert b.proc.running


def test_inject_is_refused_with_a_message_when_agent_is_unreachable(tmp_path):
    out = subprocess.run(
        [
            str(BIN / "tierwatch-agent"),
            "inject",
            "--token",
            "t",
            "--agent",
            "http://127.0.0.1:9",
            "xid",
            "79",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode != 0
    assert "127.0.0.1:9" in out.stderr


def test_server_outage_loses_no_batch(server, start_agent, tmp_path):
    """Stop the server for 5 s while two agents report every 0.25 s (at least 15 batches
    spooled each, as a 20 s outage at the default 1 s would); after restart every seq is
    there."""
    viewer = server.token("viewer")
    agents = [start_agent("node-a", interval=0.25), start_agent("node-b", interval=0.25)]
    wait_for(
        lambda: all(agent_status(a)["last_seq_acked"] >= 3 for a in agents),
        timeout=30,
        what="agents reporting",
    )
    server.stop()
    down_at = time.monotonic()
    # Agents keep collecting while the server is down: wait for 5 s of spooled batches.
    wait_for(
        lambda: (
            time.monotonic() - down_at >= 5
            and all(agent_status(a)["spool_depth"] >= 15 for a in agents)
        ),
        timeout=40,
        interval=0.25,
        what="5 s of outage with at least 15 batches spooled per agent",
    )
    depth = {a.node: agent_status(a)["spool_depth"] for a in agents}
    restarted = make_server(tmp_path / "server2", server.database_url, port=server.port)
    restarted.start()
    try:
        wait_for(
            lambda: all(agent_status(a)["spool_depth"] == 0 for a in agents),
            timeout=60,
            what="spools drained",
        )
        for a in agents:
            status = agent_status(a)
            reports = node(restarted, viewer, a.node)["reports"]
            assert reports["epoch"] == status["epoch"]
            assert reports["first_seq"] == 1
            assert reports["last_seq"] >= status["last_seq_acked"]
            assert reports["missing"] == 0, reports
            assert reports["batches"] == reports["last_seq"] - reports["first_seq"] + 1
            assert status["dropped_batches"] == 0
            print(f"{a.node}: spooled {depth[a.node]} batches during the outage; {reports}")
        for a in agents:  # stop them while the server is up, so their last flush succeeds
            assert a.stop() == 0
    finally:
        restarted.stop()

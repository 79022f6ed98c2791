"""Operator actions end to end, real processes on loopback: the node-local command driver on
the agent (queued while the agent is down), the slurm driver on the server (a recording
stand-in ``scontrol``), the auto-isolation policy on an injected XID 79 with its circuit
breaker, and two server replicas on one PostgreSQL database of which only one acts."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import pytest
from procs import make_agent, make_server, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def api(server, token, method, path, **kw):
    r = httpx.request(
        method,
        f"{server.url}{path}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
        **kw,
    )
    return r


def recorder(tmp_path: Path, name: str, exit_code: int = 0) -> tuple[Path, Path]:
    """An executable that appends its argv and TIERWATCH_* environment as a JSON line.

    As a stand-in ``scontrol`` it also answers ``-o show node <n>`` (not recorded) with the
    state its own ``update`` calls left: drained with their reason, or IDLE.
    """
    log = tmp_path / f"{name}.jsonl"
    state = tmp_path / f"{name}.state"
    exe = tmp_path / name
    exe.write_text(
        "#!/usr/bin/env python3\n"
        "import json, os, sys\n"
        f"state = {str(state)!r}\n"
        "if sys.argv[1:3] == ['-o', 'show']:\n"
        "    reason = open(state).read() if os.path.exists(state) else ''\n"
        "    flags = f'+DRAIN Reason={reason} [root@2026-12-02T00:00:00]' if reason else ''\n"
        "    print(f'NodeName={sys.argv[4]} State=IDLE{flags}')\n"
        "    sys.exit(0)\n"
        "if 'state=drain' in sys.argv:\n"
        "    open(state, 'w').write(sys.argv[-1].removeprefix('reason='))\n"
        "if 'state=resume' in sys.argv and os.path.exists(state):\n"
        "    os.remove(state)\n"
        f"with open({str(log)!r}, 'a') as f:\n"
        "    env = {k: v for k, v in os.environ.items() if k.startswith('TIERWATCH_') and "
        "k in ('TIERWATCH_NODE', 'TIERWATCH_ACTION', 'TIERWATCH_REASON')}\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'env': env}) + '\\n')\n"
        f"print('recorded', *sys.argv[1:])\nsys.exit({exit_code})\n"
    )
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, log


def calls(log: Path) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def inject_xid(agent, xid: int = 79, gpu: int = 3) -> None:
    out = agent.inject("xid", str(xid), "--gpu", str(gpu), check=False)
    assert out.returncode == 0, out.stderr


def command_state(server, token, cid):
    return api(server, token, "GET", f"/api/v1/commands/{cid}").json()


def test_command_driver_runs_on_the_agent_and_waits_for_a_dead_one(tmp_path, db_url):
    exe, log = recorder(tmp_path, "isolate-node")
    server = make_server(
        tmp_path / "server",
        db_url,
        TIERWATCH_ISOLATION__DRIVER="command",
        TIERWATCH_COMMANDS__REDELIVER_S="2",
    )
    server.start()
    agent = None
    try:
        op, viewer = server.token("operator"), server.token("viewer")
        token = server.token("agent", "gpu-a")

        def start():
            a = make_agent(
                tmp_path / "agents",
                node="gpu-a",
                server_url=server.url,
                token=token,
                interval=0.5,
                extra_args=["--isolation-command", str(exe)],
            )
            a.proc.start()
            return a

        agent = start()
        wait_for(
            lambda: api(server, viewer, "GET", "/api/v1/nodes/gpu-a").status_code == 200,
            timeout=30,
            what="gpu-a reported",
        )
        r = api(
            server,
            op,
            "POST",
            "/api/v1/nodes/gpu-a/isolate",
            json={"reason": "XID 79; fell off the bus"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["node"]["isolated"] is True
        cid = r.json()["command"]["id"]
        wait_for(
            lambda: command_state(server, viewer, cid)["state"] == "succeeded",
            timeout=30,
            what="isolate command succeeded on the agent",
        )
        got = command_state(server, viewer, cid)
        assert got["exit_code"] == 0
        assert "recorded isolate gpu-a" in got["output"]
        assert calls(log) == [
            {
                "argv": ["isolate", "gpu-a"],
                "env": {
                    "TIERWATCH_NODE": "gpu-a",
                    "TIERWATCH_ACTION": "isolate",
                    "TIERWATCH_REASON": "XID 79; fell off the bus",
                },
            }
        ]
        # The agent dies: a release waits in the queue and runs once it is back.
        agent.stop()
        r = api(server, op, "POST", "/api/v1/nodes/gpu-a/release", json={"reason": "repaired"})
        rid = r.json()["command"]["id"]
        assert r.json()["node"]["isolated"] is False  # the overlay changes at once
        assert command_state(server, viewer, rid)["state"] == "pending"
        agent = start()
        wait_for(
            lambda: command_state(server, viewer, rid)["state"] == "succeeded",
            timeout=30,
            what="release ran after the agent came back",
        )
        assert [c["argv"] for c in calls(log)] == [["isolate", "gpu-a"], ["release", "gpu-a"]]
        audit = api(server, viewer, "GET", "/api/v1/audit", params={"target": "gpu-a"}).json()
        # (the agent's own peer registration is audited too: not an operator action)
        assert [(e["action"], e["outcome"]) for e in audit if e["action"] != "peer_register"] == [
            ("command", "succeeded"),
            ("release", "ok"),
            ("command", "succeeded"),
            ("isolate", "ok"),
        ]
    finally:
        if agent is not None:
            agent.stop()
        server.stop()


def test_slurm_driver_drains_a_node_whose_agent_is_dead(tmp_path, own_db):
    db_url = own_db
    scontrol, log = recorder(tmp_path, "scontrol")
    server = make_server(
        tmp_path / "server",
        db_url,
        TIERWATCH_ISOLATION__DRIVER="slurm",
        TIERWATCH_ISOLATION__SCONTROL=str(scontrol),
    )
    server.start()
    try:
        op, viewer = server.token("operator"), server.token("viewer")
        agent = make_agent(
            tmp_path / "agents",
            node="gpu-b",
            server_url=server.url,
            token=server.token("agent", "gpu-b"),
            interval=0.5,
        )
        agent.proc.start()
        wait_for(
            lambda: api(server, viewer, "GET", "/api/v1/nodes/gpu-b").status_code == 200,
            timeout=30,
            what="gpu-b reported",
        )
        agent.stop(sig=9)
        r = api(
            server, op, "POST", "/api/v1/nodes/gpu-b/isolate", json={"reason": 'PSU "B" failed'}
        )
        cid = r.json()["command"]["id"]
        assert r.json()["command"]["executor"] == "server"
        wait_for(
            lambda: command_state(server, viewer, cid)["state"] == "succeeded",
            timeout=30,
            what="scontrol drain ran on the server",
        )
        r = api(server, op, "POST", "/api/v1/nodes/gpu-b/release", json={"reason": "PSU swapped"})
        rid = r.json()["command"]["id"]
        wait_for(
            lambda: command_state(server, viewer, rid)["state"] == "succeeded",
            timeout=30,
            what="scontrol resume ran on the server",
        )
        assert [c["argv"] for c in calls(log)] == [
            ["update", "nodename=gpu-b", "state=drain", 'reason=tierwatch: PSU "B" failed'],
            ["update", "nodename=gpu-b", "state=resume"],
        ]
        assert "$ " in command_state(server, viewer, cid)["output"]
    finally:
        server.stop()


def _policy_env(**extra: str) -> dict[str, str]:
    return {
        "TIERWATCH_POLICY__ENABLED": "true",
        "TIERWATCH_POLICY__BREAKER_PCT": "10",
        "TIERWATCH_POLICY__UNREACHABLE_S": "600",
        **extra,
    }


def test_policy_isolates_on_xid_79_and_the_breaker_holds(tmp_path, own_db):
    db_url = own_db
    server = make_server(tmp_path / "server", db_url, **_policy_env())
    server.start()
    agents = []
    try:
        viewer = server.token("viewer")
        for name in ("gpu-1", "gpu-2", "gpu-3"):
            a = make_agent(
                tmp_path / "agents",
                node=name,
                server_url=server.url,
                token=server.token("agent", name),
                interval=0.5,
            )
            a.proc.start()
            agents.append(a)
        wait_for(
            lambda: len(api(server, viewer, "GET", "/api/v1/nodes").json()["nodes"]) == 3,
            timeout=30,
            what="3 nodes reported",
        )
        inject_xid(agents[0])

        def isolated(name):
            return api(server, viewer, "GET", f"/api/v1/nodes/{name}").json()["isolated"]

        wait_for(lambda: isolated("gpu-1"), timeout=30, what="policy isolated gpu-1")
        node = api(server, viewer, "GET", "/api/v1/nodes/gpu-1").json()
        assert node["isolation"]["by"] == "policy"
        assert "xid" in node["isolation"]["reason"]
        assert "RESET_GPU" in node["isolation"]["reason"] or "79" in node["isolation"]["reason"]
        # 10 % of 3 nodes → 1 per window: two more XID 79s trip the breaker instead.
        inject_xid(agents[1])
        inject_xid(agents[2])

        def holding_both():
            b = api(server, viewer, "GET", "/api/v1/policy").json()["breaker"]
            return b["tripped"] and "gpu-2" in b["message"] and "gpu-3" in b["message"]

        wait_for(holding_both, timeout=30, what="breaker tripped, holding gpu-2 and gpu-3")
        assert not isolated("gpu-2")
        assert not isolated("gpu-3")
        actions = [
            (e["action"], e["target"])
            for e in api(server, viewer, "GET", "/api/v1/audit", params={"actor": "policy"}).json()
        ]
        assert actions == [("breaker_trip", "auto-isolation"), ("isolate", "gpu-1")]
        alerts = api(server, viewer, "GET", "/api/v1/alerts", params={"kind": "breaker"}).json()
        assert len(alerts["alerts"]) == 1
    finally:
        for a in agents:
            a.stop()
        server.stop()


def _fresh_pg_schema(prefix: str):
    """A freshly migrated PostgreSQL schema of its own (a generator: yields its URL, then
    drops it). The leader lock is per schema, so a server here leads whatever else holds
    the lock of the test session's schema."""
    import os
    import uuid

    from sqlalchemy import text
    from sqlalchemy.engine import make_url

    from tierwatch.server.db import make_engine
    from tierwatch.server.migrate import upgrade

    base = os.environ.get("TIERWATCH_TEST_DATABASE_URL")
    if not base:
        pytest.skip("TIERWATCH_TEST_DATABASE_URL is not set (.ci/run sets it)")
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = make_engine(base)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = (
        make_url(base)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )
    upgrade(url)
    yield url
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


@pytest.fixture
def pg_url():
    """A freshly migrated PostgreSQL schema (the leader lock is a PostgreSQL advisory lock;
    on SQLite one server runs per database file)."""
    yield from _fresh_pg_schema("tw_lead")


@pytest.fixture
def own_db(db_url):
    """The backend under test in a database of this test's own: a fresh schema on
    PostgreSQL, the (emptied) session database on SQLite."""
    if db_url.startswith("sqlite"):
        yield db_url
    else:
        yield from _fresh_pg_schema("tw_act")


@pytest.mark.postgres
def test_two_servers_on_one_database_act_once(tmp_path, pg_url):
    db_url = pg_url
    scontrol, log = recorder(tmp_path, "scontrol")
    env = _policy_env(
        TIERWATCH_ISOLATION__DRIVER="slurm", TIERWATCH_ISOLATION__SCONTROL=str(scontrol)
    )
    one = make_server(tmp_path / "one", db_url, **env)
    two = make_server(tmp_path / "two", db_url, **env)
    one.start()
    two.start()
    agent = None
    try:
        viewer = one.token("viewer")
        # The agent reports to the second replica; either may hold the lock.
        agent = make_agent(
            tmp_path / "agents",
            node="gpu-9",
            server_url=two.url,
            token=two.token("agent", "gpu-9"),
            interval=0.5,
        )
        agent.proc.start()
        wait_for(
            lambda: api(one, viewer, "GET", "/api/v1/nodes/gpu-9").status_code == 200,
            timeout=30,
            what="gpu-9 reported",
        )
        inject_xid(agent)
        wait_for(lambda: len(calls(log)) >= 1, timeout=30, what="scontrol drain ran")

        # Give the follower several ticks in which it could (wrongly) act too: 8 more
        # reports at 0.5 s (the background ticks every second).
        def seq():
            return api(one, viewer, "GET", "/api/v1/nodes/gpu-9").json()["reports"]["last_seq"]

        start = seq()
        wait_for(lambda: seq() >= start + 8, timeout=30, what="8 more reports")
        assert [c["argv"][2] for c in calls(log)] == ["state=drain"]
        entries = api(one, viewer, "GET", "/api/v1/audit", params={"actor": "policy"}).json()
        assert [(e["action"], e["outcome"]) for e in entries] == [
            ("command", "succeeded"),
            ("isolate", "ok"),
        ]
        cmds = api(one, viewer, "GET", "/api/v1/commands").json()
        assert len(cmds) == 1
        assert cmds[0]["attempts"] == 1

        # The leader goes away: the other replica takes over the background work.
        def leads(s):
            return "now the leader" in (s.workdir / "server.log").read_text()

        leader, other = (one, two) if leads(one) else (two, one)
        assert leads(leader)
        assert not leads(other)
        leader.stop()
        wait_for(lambda: leads(other), timeout=30, what="the other replica took the lock")
        op = other.token("operator")
        r = api(other, op, "POST", "/api/v1/nodes/gpu-9/release", json={"reason": "swapped"})
        rid = r.json()["command"]["id"]
        wait_for(
            lambda: command_state(other, viewer, rid)["state"] == "succeeded",
            timeout=30,
            what="release ran on the new leader",
        )
        assert [c["argv"][2] for c in calls(log)] == ["state=drain", "state=resume"]
    finally:
        if agent is not None:
            agent.stop()
        for s in (one, two):
            s.stop()

"""The agent's side of restore requests and rollbacks: checking a restore command, keeping it
across a restart, handing it to the ranks, retiring it, and dropping a diverged future from
the replicas and the persistent tier (a real AgentRuntime, its local API through TestClient,
its reports to a receiver)."""

from __future__ import annotations

import shutil

import pytest
from agent_helpers import AUTHORITY, TOKEN, wait_until
from ckpt_helpers import ckpt_events, write_step
from fastapi.testclient import TestClient

from tierwatch.agent.checkpoint.format.layout import MemoryLayout, step_dirname
from tierwatch.agent.checkpoint.tierstore.requests import parse_restore_command
from tierwatch.agent.collectors.simulated import SimulatedCollector
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.protocol import Command
from tierwatch.agent.runtime import AgentRuntime
from tierwatch.agent.server import create_app

JOB = "rb-job"
JOB_AUTH = AUTHORITY.job_auth(JOB)
GOOD = {
    "request_id": 3,
    "job_id": JOB,
    "step": 5,
    "tier": None,
    "reason": "SDC after 5",
    "actor": "alice",
}


def command(**args) -> Command:
    return Command(id="cmd-1", kind="restore", args=args)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({k: v for k, v in GOOD.items() if k != "request_id"}, "request_id is missing"),
        ({**GOOD, "request_id": 0}, "request_id must be an integer"),
        ({**GOOD, "request_id": True}, "request_id must be an integer"),
        ({**GOOD, "step": -1}, "step must be an integer"),
        ({**GOOD, "step": "5"}, "step must be an integer"),
        ({k: v for k, v in GOOD.items() if k != "job_id"}, "job_id is missing"),
        ({**GOOD, "job_id": "../etc"}, "job_id"),
        ({**GOOD, "tier": "disk"}, "tier must be one of memory, peer, persistent"),
        ({**GOOD, "reason": 5}, "reason must be text"),
        ({**GOOD, "when": "now"}, "unknown args"),
        ({**GOOD, "not_after": "tomorrow"}, "not_after must be an ISO 8601 time"),
        ({**GOOD, "not_after": "2026-12-01T10:00:00"}, "not_after needs a UTC offset"),
    ],
)
def test_bad_restore_commands_are_refused_with_a_clear_message(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_restore_command(command(**args))


def test_other_kinds_are_not_restores() -> None:
    with pytest.raises(ValueError, match="not a restore"):
        parse_restore_command(Command(id="c", kind="isolate", args={}))


def make_runtime(receiver, tmp_path, persistent) -> AgentRuntime:
    settings = AgentSettings(
        node="node-a",
        server=receiver.url,
        token=TOKEN,
        interval=0.2,
        spool_dir=tmp_path / "spool",
        listen="127.0.0.1:0",
        memory_dir=tmp_path / "memory",
        state_dir=tmp_path / "state",
        persistent_url=f"file://{persistent}",
    )
    runtime = AgentRuntime(
        settings, collector=SimulatedCollector("node-a", gpus=1, seed=1), flush_timeout_s=2.0
    )
    runtime.start(serve_api=False, checkpoints=True)
    return runtime


def test_requests_survive_a_restart_are_listed_and_retired(receiver, tmp_path) -> None:
    runtime = make_runtime(receiver, tmp_path, tmp_path / "persistent")
    try:
        assert runtime.ckpt is not None
        runtime.ckpt.add_restore_request(command(**GOOD))
        runtime.ckpt.add_restore_request(
            command(**{**GOOD, "request_id": 4, "step": 6, "tier": "persistent"})
        )
        with pytest.raises(ValueError, match="tier"):
            runtime.ckpt.add_restore_request(command(**{**GOOD, "tier": "tape"}))
    finally:
        runtime.shutdown()
    runtime = make_runtime(receiver, tmp_path, tmp_path / "persistent")  # a restarted agent
    try:
        with TestClient(
            create_app(runtime), client=("127.0.0.1", 5000), headers=JOB_AUTH
        ) as client:
            got = client.get(f"/v1/ckpt/jobs/{JOB}/restore-requests").json()["requests"]
            assert [(r["request_id"], r["step"], r["tier"], r["actor"]) for r in got] == [
                (3, 5, None, "alice"),
                (4, 6, "persistent", "alice"),
            ]
            assert got[0]["reason"] == "SDC after 5"
            r = client.delete(f"/v1/ckpt/jobs/{JOB}/restore-requests/3")
            assert r.json() == {"retired": [3]}
            assert [
                x["request_id"]
                for x in client.get(f"/v1/ckpt/jobs/{JOB}/restore-requests").json()["requests"]
            ] == [4]
            # a retired request delivered again is not handed out again
            runtime.ckpt.add_restore_request(command(**GOOD))
            assert client.delete(f"/v1/ckpt/jobs/{JOB}/restore-requests/9").json() == {
                "retired": [4]
            }
            assert client.get(f"/v1/ckpt/jobs/{JOB}/restore-requests").json() == {"requests": []}
            node = {"Authorization": f"Bearer {TOKEN}"}  # the node's token may name any job
            assert (
                client.get("/v1/ckpt/jobs/..bad/restore-requests", headers=node).status_code == 422
            )
        # loopback without a credential, and another job's credential, are refused
        with TestClient(create_app(runtime), client=("127.0.0.1", 5000)) as client:
            assert client.get(f"/v1/ckpt/jobs/{JOB}/restore-requests").status_code == 401
            other = AUTHORITY.job_auth("other-job")
            r = client.get(f"/v1/ckpt/jobs/{JOB}/restore-requests", headers=other)
            assert r.status_code == 403
            assert "other-job" in r.json()["detail"]
    finally:
        runtime.shutdown()


def test_a_request_the_server_gave_up_on_is_not_served(receiver, tmp_path) -> None:
    from datetime import timedelta

    from tierwatch.agent.protocol import utcnow

    runtime = make_runtime(receiver, tmp_path, tmp_path / "persistent")
    try:
        assert runtime.ckpt is not None
        past = (utcnow() - timedelta(seconds=1)).isoformat()
        future = (utcnow() + timedelta(hours=1)).isoformat()
        runtime.ckpt.add_restore_request(command(**{**GOOD, "not_after": past}))
        runtime.ckpt.add_restore_request(command(**{**GOOD, "request_id": 4, "not_after": future}))
        with TestClient(
            create_app(runtime), client=("127.0.0.1", 5000), headers=JOB_AUTH
        ) as client:
            got = client.get(f"/v1/ckpt/jobs/{JOB}/restore-requests").json()["requests"]
        assert [r["request_id"] for r in got] == [4]
        assert got[0]["not_after"] == future
    finally:
        runtime.shutdown()


def test_rollback_drops_newer_replicas_and_persistent_steps(receiver, tmp_path) -> None:
    persistent = tmp_path / "persistent"
    runtime = make_runtime(receiver, tmp_path, persistent)
    try:
        layout = ["node-a", "node-b"]
        ml = MemoryLayout(tmp_path / "memory")
        other = tmp_path / "node-b-memory"
        for step in (4, 5, 6, 7):
            write_step(other, job_id=JOB, step=step, node="node-b", layout=layout, seed=step)
            shutil.copytree(
                MemoryLayout(other).step_dir(JOB, step), ml.replica_step_dir("node-b", JOB, step)
            )
            shutil.copytree(
                MemoryLayout(other).step_dir(JOB, step), persistent / JOB / step_dirname(step)
            )
        assert runtime.ckpt is not None
        runtime.ckpt.add_restore_request(command(**GOOD))  # request 3: step 5
        with TestClient(
            create_app(runtime), client=("127.0.0.1", 5000), headers=JOB_AUTH
        ) as client:
            r = client.post(
                f"/v1/ckpt/jobs/{JOB}/rollback",
                json={"request_id": 3, "step": 5, "persistent": True},
            )
            assert r.status_code == 200, r.text
            assert r.json() == {"evicted": {"peer": [6, 7], "persistent": [6, 7]}, "errors": []}
            again = client.post(
                f"/v1/ckpt/jobs/{JOB}/rollback",
                json={"request_id": 3, "step": 5, "persistent": True},
            )
            assert again.json()["evicted"] == {"peer": [], "persistent": []}
            assert (
                client.post(
                    f"/v1/ckpt/jobs/{JOB}/rollback", json={"request_id": 0, "step": 5}
                ).status_code
                == 422
            )
        assert sorted(p.name for p in ml.replica_job_dir("node-b", JOB).iterdir()) == [
            "step-4",
            "step-5",
        ]
        assert sorted(p.name for p in (persistent / JOB).iterdir()) == ["step-4", "step-5"]

        def evicted() -> set[tuple[str, int, int | None]]:
            runtime.tick()
            return {(e.tier, e.step, e.rank) for e in ckpt_events(receiver, kind="evicted")}

        wait_until(
            lambda: (
                {("peer", 6, 1), ("peer", 7, 1), ("persistent", 6, None), ("persistent", 7, None)}
                <= evicted()
            ),
            what="evicted events",
        )
        assert all(
            "rolled back to step 5 by restore request 3" in e.message
            for e in ckpt_events(receiver, kind="evicted")
        )
    finally:
        runtime.shutdown()

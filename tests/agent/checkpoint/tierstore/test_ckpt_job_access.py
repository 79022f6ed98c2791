"""A trainer of one job cannot touch another job's checkpoints through the local agent.

Security issue item 3 ("loopback is treated as trust"), against a real agent process: before
job credentials, a tokenless ``POST /v1/ckpt/jobs/<victim>/rollback`` from loopback answered
200 and deleted the victim's newer persistent steps; the same caller could retire (cancel) its
restore requests and inject checkpoint events for it.
"""

from __future__ import annotations

import json

import httpx
import pytest
from agent_helpers import AUTHORITY, TestAuthority, wait_until
from ckpt_helpers import ckpt_events, wait_more_batches, write_step

from tierwatch.agent.checkpoint.format.layout import step_dirname
from tierwatch.agent.protocol import Command

VICTIM = "victim-job"
ATTACKER = "attacker-job"


def restore(request_id: int, step: int) -> Command:
    return Command(
        id=f"c{request_id}",
        kind="restore",
        args={"request_id": request_id, "job_id": VICTIM, "step": step, "tier": None},
    )


@pytest.fixture
def victim_agent(make_agent, persistent_dir):
    a = make_agent("node-a", replication=0).start()
    for step in (4, 5, 6):
        write_step(a.memory_dir, job_id=VICTIM, step=step, node="node-a", layout=["node-a"])
        (persistent_dir / VICTIM / step_dirname(step)).mkdir(parents=True)
        (persistent_dir / VICTIM / step_dirname(step) / "x").write_bytes(b"kept")
    return a


def persisted(persistent_dir) -> list[str]:
    return sorted(p.name for p in (persistent_dir / VICTIM).iterdir())


def test_without_a_credential_loopback_is_refused_everywhere(victim_agent, persistent_dir):
    url = victim_agent.url
    calls = [
        (
            "POST",
            f"/v1/ckpt/jobs/{VICTIM}/rollback",
            {"request_id": 1, "step": 0, "persistent": True},
        ),
        ("DELETE", f"/v1/ckpt/jobs/{VICTIM}/restore-requests/99", None),
        ("GET", f"/v1/ckpt/jobs/{VICTIM}/restore-requests", None),
        ("GET", f"/v1/ckpt/jobs/{VICTIM}/available", None),
        ("POST", f"/v1/ckpt/jobs/{VICTIM}/stage", {"step": 4, "files": []}),
        ("POST", "/v1/ckpt/notify", {"job_id": VICTIM, "step": 4}),
        ("POST", "/v1/ckpt/events", {"events": []}),
        ("GET", "/v1/ckpt/info", None),
        ("POST", "/v1/trainer/latency", []),
        ("POST", "/v1/inject", {"fault": "clear"}),
    ]
    for method, path, body in calls:
        r = httpx.request(method, url + path, json=body)
        assert r.status_code == 401, (method, path, r.text)
        assert "loopback alone grants nothing" in r.json()["detail"]
    assert persisted(persistent_dir) == ["step-4", "step-5", "step-6"]


def test_another_jobs_credential_cannot_roll_back_cancel_or_inject(
    victim_agent, receiver, persistent_dir
):
    url = victim_agent.url
    attacker = AUTHORITY.job_auth(ATTACKER)  # a valid credential, of another job
    rollback = {"request_id": 1, "step": 0, "persistent": True}
    r = httpx.post(f"{url}/v1/ckpt/jobs/{VICTIM}/rollback", json=rollback, headers=attacker)
    assert r.status_code == 403
    assert f"may not act for job '{VICTIM}'" in r.json()["detail"]
    r = httpx.delete(f"{url}/v1/ckpt/jobs/{VICTIM}/restore-requests/99", headers=attacker)
    assert r.status_code == 403
    r = httpx.post(
        f"{url}/v1/ckpt/jobs/{VICTIM}/stage", json={"step": 4, "files": []}, headers=attacker
    )
    assert r.status_code == 403
    fake = {
        "job_id": VICTIM,
        "step": 7777,
        "tier": "persistent",
        "kind": "committed",
        "ts": "2026-12-01T00:00:00Z",
    }
    r = httpx.post(f"{url}/v1/ckpt/events", json={"events": [fake]}, headers=attacker)
    assert r.status_code == 403
    # a batch mixing its own job with the victim's is refused whole
    own = {**fake, "job_id": ATTACKER}
    r = httpx.post(f"{url}/v1/ckpt/events", json={"events": [own, fake]}, headers=attacker)
    assert r.status_code == 403
    # a credential signed by another key is not a credential at all
    forged = TestAuthority(kid=AUTHORITY.kid).job_auth(VICTIM)
    r = httpx.post(f"{url}/v1/ckpt/jobs/{VICTIM}/rollback", json=rollback, headers=forged)
    assert r.status_code == 401
    assert persisted(persistent_dir) == ["step-4", "step-5", "step-6"]
    wait_more_batches(receiver, "node-a", 2)
    assert not [e for e in ckpt_events(receiver) if e.step == 7777]


def test_the_jobs_own_rollback_needs_a_restore_request_it_received(victim_agent, persistent_dir):
    url = victim_agent.url
    own = AUTHORITY.job_auth(VICTIM)
    body = {"request_id": 12345, "step": 0, "persistent": True}
    r = httpx.post(f"{url}/v1/ckpt/jobs/{VICTIM}/rollback", json=body, headers=own)
    assert r.status_code == 409
    assert "no restore request 12345" in r.json()["detail"]
    assert persisted(persistent_dir) == ["step-4", "step-5", "step-6"]
    # the operator's restore request for step 5 reaches the agent (as the server sends it)
    victim_agent.receiver.commands.append(restore(7, 5).model_dump(mode="json"))

    def delivered() -> bool:
        r = httpx.get(f"{url}/v1/ckpt/jobs/{VICTIM}/restore-requests", headers=own)
        return [x["request_id"] for x in r.json()["requests"]] == [7]

    wait_until(delivered, timeout=20, what="restore request 7 delivered")
    above = {"request_id": 7, "step": 6, "persistent": True}
    r = httpx.post(f"{url}/v1/ckpt/jobs/{VICTIM}/rollback", json=above, headers=own)
    assert r.status_code == 409
    assert "above it" in r.json()["detail"]
    ok = {"request_id": 7, "step": 5, "persistent": True}
    r = httpx.post(f"{url}/v1/ckpt/jobs/{VICTIM}/rollback", json=ok, headers=own)
    assert r.status_code == 200, r.text
    assert r.json()["evicted"]["persistent"] == [6]
    assert persisted(persistent_dir) == ["step-4", "step-5"]
    # once retired, a late rank on this node may still roll back for request 7
    r = httpx.delete(f"{url}/v1/ckpt/jobs/{VICTIM}/restore-requests/7", headers=own)
    assert r.json() == {"retired": [7]}
    r = httpx.post(f"{url}/v1/ckpt/jobs/{VICTIM}/rollback", json=ok, headers=own)
    assert r.status_code == 200
    # the node's own agent token (its administrator) is accepted for any job
    r = httpx.get(f"{url}/v1/ckpt/jobs/{VICTIM}/available", headers=victim_agent.auth)
    assert r.status_code == 200


def test_a_request_planted_in_the_memory_folder_is_neither_served_nor_obeyed(
    victim_agent, persistent_dir
):
    """The memory folder is writable by every trainer of the node; the agent keeps restore
    requests in its own state folder, so a file planted where they used to live is nothing."""
    planted = victim_agent.memory_dir / "jobs" / VICTIM / "restore-requests"
    planted.mkdir(parents=True)
    (planted / "request-9.json").write_text(
        json.dumps(
            {
                "request_id": 9,
                "job_id": VICTIM,
                "step": 4,
                "tier": None,
                "reason": "planted",
                "actor": "another user",
            }
        )
    )
    own = AUTHORITY.job_auth(VICTIM)
    url = victim_agent.url
    r = httpx.get(f"{url}/v1/ckpt/jobs/{VICTIM}/restore-requests", headers=own)
    assert r.json() == {"requests": []}
    body = {"request_id": 9, "step": 4, "persistent": True}
    r = httpx.post(f"{url}/v1/ckpt/jobs/{VICTIM}/rollback", json=body, headers=own)
    assert r.status_code == 409
    assert persisted(persistent_dir) == ["step-4", "step-5", "step-6"]

"""Steps pinned by pending restore requests: the agent's replica eviction and persistent
retention keep them until the request is retired or expires, then retention resumes.

A real :class:`CheckpointService` (memory store, request store, tier worker, persistent tier
on a ``file://`` URL); replicas arrive through the store's receiving path as a peer's PUT
does, and one persistent pass runs the worker's real upload, ``.metadata`` commit and
retention. The trainer's side (memory retention, rank 0's decision) is in
tests/agent/checkpoint/training/test_maybe_rollback.py and tests/e2e/test_rollback.py.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import xxhash
from agent_helpers import TOKEN, wait_until
from ckpt_helpers import keys_with_credentials, write_step

from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    MemoryLayout,
    commit_name,
    manifest_name,
    parse_step_dirname,
    shard_name,
    step_dirname,
)
from tierwatch.agent.checkpoint.tierstore.api import CheckpointService
from tierwatch.agent.checkpoint.tierstore.store import StoreError
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.protocol import CheckpointEvent, Command, utcnow

JOB = "pin-job"


def service(tmp_path: Path, node: str = "node-a") -> tuple[CheckpointService, list]:
    events: list[CheckpointEvent] = []
    settings = AgentSettings(
        node=node,
        server="http://127.0.0.1:9",
        token=TOKEN,
        spool_dir=tmp_path / "spool",
        memory_dir=tmp_path / "memory",
        state_dir=tmp_path / "state",
        persistent_url=f"file://{tmp_path / 'persistent'}",
        memory_budget=64 * 2**20,
    )
    keys = keys_with_credentials(tmp_path / "keys", JOB)
    return CheckpointService(settings, emit=events.append, keys=keys), events


def ask(
    svc: CheckpointService, request_id: int, step: int, *, expires_in_s: float | None = None
) -> None:
    """Deliver a restore command to the agent as its command executor does."""
    args = {
        "request_id": request_id,
        "job_id": JOB,
        "step": step,
        "tier": None,
        "reason": "pin test",
        "actor": "pytest",
    }
    if expires_in_s is not None:
        args["not_after"] = (utcnow() + timedelta(seconds=expires_in_s)).isoformat()
    svc.add_restore_request(Command(id=f"cmd-{request_id}", kind="restore", args=args))


def push_replica_step(
    svc: CheckpointService, src_dir: Path, step: int, keep_peer: list[int]
) -> list[int]:
    """node-b's rank 1 commits ``step`` (rank 0's decision: ``keep_peer``) and its agent
    pushes the files to this holder, commit marker last. Returns the steps evicted."""
    write_step(
        src_dir,
        job_id=JOB,
        step=step,
        node="node-b",
        layout=["node-a", "node-b"],
        retain={"memory": [step], "peer": keep_peer, "persistent": []},
        seed=step,
        shard_bytes=4096,
    )
    d = MemoryLayout(src_dir).step_dir(JOB, step)
    evicted: list[int] = []
    for name in (shard_name(1), manifest_name(1), commit_name(1)):
        data = (d / name).read_bytes()
        got = svc.store.receive_replica(
            src_node="node-b",
            job_id=JOB,
            step=step,
            name=name,
            chunks=[data],
            xxh3=xxhash.xxh3_64(data).hexdigest(),
            size=len(data),
        )
        evicted += [s for s, _ in got.evicted]
    return evicted


def replica_steps(svc: CheckpointService) -> list[int]:
    d = svc.store.layout.replica_job_dir("node-b", JOB)
    return sorted(parse_step_dirname(p.name) for p in d.iterdir())


def test_replica_eviction_keeps_pinned_steps_until_retired_or_expired(tmp_path) -> None:
    svc, _events = service(tmp_path)
    src = tmp_path / "node-b-memory"
    ask(svc, 3, 1)  # the operator wants step 1 back; the ranks have not acted yet
    for step in range(1, 5):
        push_replica_step(svc, src, step, keep_peer=[step - 1, step])
    assert replica_steps(svc) == [1, 3, 4]  # keep_peer 2, and the pinned step 1
    assert svc.store.pinned_steps(JOB) == {1: [3]}

    # over the budget: the 507 says which pinned steps hold memory
    with pytest.raises(StoreError) as exc:
        svc.store.begin_replica(
            src_node="node-b", job_id=JOB, step=9, name=shard_name(1), xxh3="0" * 16, size=2**40
        )
    assert exc.value.status == 507
    assert "keeps step 1 (request 3) while those restore requests are pending" in exc.value.message

    # the ranks served request 3 and retired it: the next commit marker evicts step 1
    assert svc.requests.retire(JOB, 3) == [3]
    assert svc.store.pinned_steps(JOB) == {}
    assert push_replica_step(svc, src, 5, keep_peer=[4, 5]) == [1, 3]
    assert replica_steps(svc) == [4, 5]

    # a request the server gives up on (not_after) pins only until then
    ask(svc, 4, 5, expires_in_s=1.0)
    for step in (6, 7):
        push_replica_step(svc, src, step, keep_peer=[step - 1, step])
    assert replica_steps(svc) == [5, 6, 7]
    wait_until(lambda: not svc.store.pinned_steps(JOB), timeout=10, what="request 4 to expire")
    assert push_replica_step(svc, src, 8, keep_peer=[7, 8]) == [5, 6]
    assert replica_steps(svc) == [7, 8]


def test_persistent_retention_keeps_pinned_steps_until_retired_or_expired(tmp_path) -> None:
    svc, events = service(tmp_path)  # the agent of rank 0's node writes .metadata
    pdir = tmp_path / "persistent" / JOB

    def persist(step: int) -> list[int]:
        write_step(
            svc.store.root,
            job_id=JOB,
            step=step,
            node="node-a",
            layout=["node-a"],
            persist=True,
            retain={"memory": [step], "peer": [step], "persistent": [step]},
            seed=step,
            shard_bytes=4096,
        )
        svc.worker.persistent_pass()  # upload, .metadata commit, retention
        assert (pdir / step_dirname(step) / METADATA).is_file()
        return sorted(parse_step_dirname(p.name) for p in pdir.iterdir())

    ask(svc, 5, 2)
    assert persist(1) == [1]
    assert persist(2) == [2]  # keep_persistent 1
    assert persist(3) == [2, 3]  # step 2 pinned by request 5
    assert persist(4) == [2, 4]
    evicted = {e.step: e.message for e in events if e.kind == "evicted" and e.tier == "persistent"}
    assert sorted(evicted) == [1, 3]
    assert "pinned [2]" in evicted[3]

    svc.requests.retire(JOB, 5)  # served: retention resumes
    assert persist(5) == [5]

    ask(svc, 6, 5, expires_in_s=1.0)
    assert persist(6) == [5, 6]
    wait_until(lambda: not svc.requests.pending(JOB), timeout=10, what="request 6 to expire")
    assert persist(7) == [7]

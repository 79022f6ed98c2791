"""The agent's tiered checkpoint store with real agent processes on loopback.

Steps are written into the memory folders by ``ckpt_helpers.write_step`` exactly as the
trainer writes them; the agents replicate, persist, evict, list and stage them; their reports
go to a real HTTP receiver, where the tests read the checkpoint events.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

import httpx
import pytest
from agent_helpers import AUTHORITY, wait_until
from ckpt_helpers import (
    CkptAgent,
    PeerAs,
    ckpt_events,
    evict_memory_step,
    read_json,
    wait_event,
    wait_more_batches,
    write_step,
)

from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    MemoryLayout,
    manifest_name,
    shard_name,
    step_dirname,
)
from tierwatch.agent.checkpoint.format.manifest import load_manifest, verify_file, xxh3_file

pytestmark = [pytest.mark.slow]

JOB = "job-1"
JOB_AUTH = AUTHORITY.job_auth(JOB)


def urls(*agents: CkptAgent) -> dict[str, str]:
    return {a.node: a.url for a in agents}


# ---------------------------------------------------------------------------------------
def test_agent_json_and_info(make_agent):
    a = make_agent("node-a", memory_budget="8MiB").start()
    info_file = read_json(a.memory_dir / "agent.json")
    assert info_file["node"] == "node-a"
    assert info_file["peer_url"] == a.url
    assert info_file["memory_budget_bytes"] == 8 * 1024**2
    assert info_file["persistent_url"].startswith("file://")
    assert info_file["pid"] == a.popen.pid
    assert info_file["started_at"].endswith("+00:00")
    assert not list(a.memory_dir.glob(".tmp-*"))  # written atomically
    info = httpx.get(f"{a.url}/v1/ckpt/info", headers=a.auth).json()
    assert info["node"] == "node-a"
    assert info["memory_dir"] == str(a.memory_dir)
    assert info["peer_url"] == a.url
    assert info["memory_budget_bytes"] == 8 * 1024**2
    assert info["persistent_url"] == info_file["persistent_url"]
    assert info["replication"] == 1
    assert info["peer_tier"] is True


def test_events_and_notify_are_queued_into_reports(make_agent, receiver):
    a = make_agent("node-a").start()
    ts = "2026-01-01T00:00:00Z"
    body = {
        "events": [
            {
                "job_id": JOB,
                "step": 5,
                "tier": "memory",
                "kind": "committed",
                "rank": 0,
                "world_size": 2,
                "ts": ts,
                "bytes": 10,
                "seconds": 0.5,
            }
        ],
        "progress": [
            {
                "job_id": JOB,
                "rank": 0,
                "world_size": 2,
                "step": 6,
                "ts": ts,
                "layout": ["node-a", "node-b"],
            }
        ],
        "restores": [
            {
                "job_id": JOB,
                "rank": 0,
                "world_size": 2,
                "step": 5,
                "ts": ts,
                "seconds": 1.0,
                "files_by_tier": {"memory": 2},
            }
        ],
    }
    r = httpx.post(f"{a.url}/v1/ckpt/events", json=body, headers=JOB_AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"queued": {"events": 1, "progress": 1, "restores": 1}}
    wait_event(receiver, job_id=JOB, step=5, tier="memory", kind="committed")
    batches = receiver.stored()
    assert any(b.progress and b.progress[0].layout == ["node-a", "node-b"] for b in batches)
    assert any(b.restores and b.restores[0].files_by_tier == {"memory": 2} for b in batches)
    bad = httpx.post(
        f"{a.url}/v1/ckpt/events", json={"events": [{"job_id": JOB}]}, headers=JOB_AUTH
    )
    assert bad.status_code == 422
    assert httpx.post(
        f"{a.url}/v1/ckpt/notify", json={"job_id": JOB, "step": 1}, headers=JOB_AUTH
    ).json() == {"ok": True}
    assert (
        httpx.post(
            f"{a.url}/v1/ckpt/notify", json={"job_id": "../x", "step": 1}, headers=a.auth
        ).status_code
        == 422
    )


def test_two_agents_replicate_to_each_other_and_evict_per_retain(make_agent, receiver):
    a, b = make_agent("node-a"), make_agent("node-b")
    layout = ["node-a", "node-a", "node-b", "node-b"]
    peers = urls(a, b)
    a.start()
    b.start()
    for step, retain in ((1, [1]), (2, [1, 2]), (3, [3])):
        for agent in (a, b):
            write_step(
                agent.memory_dir,
                job_id=JOB,
                step=step,
                node=agent.node,
                layout=layout,
                peer_urls=peers,
                retain={"memory": retain, "peer": retain, "persistent": []},
            )
            agent.notify(JOB, step)
        for src, holder, ranks in ((a, b, (0, 1)), (b, a, (2, 3))):
            for r in ranks:
                wait_event(
                    receiver,
                    node=src.node,
                    job_id=JOB,
                    step=step,
                    tier="peer",
                    kind="committed",
                    rank=r,
                    agent=src,
                )
            rdir = holder.replica_dir(src.node, JOB, step)
            for r in ranks:
                manifest = load_manifest(rdir / manifest_name(r))
                for f in manifest.files:  # every listed file arrived intact
                    assert verify_file(rdir / f.name, f) is None
                    assert (rdir / f.name).read_bytes() == (
                        src.step_dir(JOB, step) / f.name
                    ).read_bytes()
                assert (rdir / f"commit-{r}.json").read_bytes() == (
                    src.step_dir(JOB, step) / f"commit-{r}.json"
                ).read_bytes()
            assert (METADATA in os.listdir(rdir)) == (src is a)
            assert not [n for n in os.listdir(rdir) if n.startswith(".tmp")]
        if step == 2:  # retain peer [1, 2]: step 1 stays
            assert b.replica_dir("node-a", JOB, 1).is_dir()
    # step 3 keeps only itself: the holders evicted steps 1 and 2 when its marker arrived
    for holder, src in ((b, a), (a, b)):
        for old in (1, 2):
            wait_until(
                lambda h=holder, s=src, o=old: not h.replica_dir(s.node, JOB, o).exists(),
                timeout=10,
                what=f"step {old} evicted on {holder.node}",
            )
            wait_event(
                receiver, node=holder.node, job_id=JOB, step=old, tier="peer", kind="evicted"
            )
    assert read_json(a.step_dir(JOB, 3) / ".tier-0.json")["peer"]["done"] is True


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("/v1/peer/replicas/node-b/%2E%2E/1/__2_0.distcp", "job_id"),
        ("/v1/peer/replicas/%2E%2E/job-1/1/__2_0.distcp", "node name"),
        ("/v1/peer/replicas/node-b/job-1/1/%2E%2E", "file name"),
        ("/v1/peer/replicas/node-b/job-1/1/agent.json", "file name"),
        ("/v1/peer/replicas/node-b/job-1/1/.tier-0.json", "file name"),
        ("/v1/peer/replicas/node-b/job-1/-1/__2_0.distcp", "step"),
    ],
)
def test_bad_names_are_422(make_agent, receiver, path, needle):
    a = make_agent("node-a").start()
    b = PeerAs("node-b", receiver)
    body = b"hello"
    r = b.request(
        "PUT",
        f"{a.url}{path}",
        to="node-a",
        content=body,
        headers={"X-Tierwatch-Xxh3": xxh3_of(body)},
    )
    assert r.status_code == 422, r.text
    assert needle in r.text
    assert not (a.memory_dir / "replicas").exists() or not any(
        p.is_file() for p in (a.memory_dir / "replicas").rglob("*")
    )
    assert not (a.memory_dir.parent / "job-1").exists()
    # %2F decodes to "/": the path has one segment too many and matches no route.
    r = b.request("GET", f"{a.url}/v1/peer/files/job-1/1/%2E%2E%2Fagent.json", to="node-a")
    assert r.status_code == 404, r.text
    assert r.json() == {"detail": "Not Found"}
    r = b.request(
        "GET", f"{a.url}/v1/peer/files/job-1/1/__0_0.distcp?tier=peer&src=%2E%2E", to="node-a"
    )
    assert r.status_code == 422
    r = httpx.get(f"{a.url}/v1/ckpt/jobs/%2E%2E/available", headers=a.auth)
    assert r.status_code == 422


def xxh3_of(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_64(data).hexdigest()


def test_upload_with_wrong_checksum_is_409_and_leaves_nothing(make_agent, receiver):
    a = make_agent("node-a").start()
    b = PeerAs("node-b", receiver)
    body = os.urandom(300_000)
    url = f"{a.url}/v1/peer/replicas/node-b/{JOB}/1/__2_0.distcp"

    def put(digest: str) -> httpx.Response:
        return b.request(
            "PUT", url, to="node-a", content=body, headers={"X-Tierwatch-Xxh3": digest}
        )

    r = put("0" * 16)
    assert r.status_code == 409, r.text
    assert "does not match" in r.json()["detail"]
    replicas = a.memory_dir / "replicas"
    assert not replicas.exists() or not [p for p in replicas.rglob("*") if p.is_file()]
    r = put("nothex")
    assert r.status_code == 422
    r = put(xxh3_of(body))
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == len(body)
    assert a.replica_dir("node-b", JOB, 1).joinpath("__2_0.distcp").read_bytes() == body


def test_memory_budget_refuses_with_507_and_failed_events(make_agent, receiver):
    a = make_agent("node-a")
    b = make_agent("node-b", memory_budget="256KiB")
    a.start()
    b.start()
    big = os.urandom(512 * 1024)
    r = PeerAs("node-a").request(  # node-a's own key is its agent's; any certified one signs
        "PUT",
        f"{b.url}/v1/peer/replicas/node-a/{JOB}/1/__0_0.distcp",
        to="node-b",
        content=big,
        headers={"X-Tierwatch-Xxh3": xxh3_of(big)},
    )
    assert r.status_code == 507, r.text
    assert "memory budget" in r.json()["detail"]
    assert "--memory-budget" in r.json()["detail"]
    wait_event(
        receiver,
        node="node-b",
        job_id=JOB,
        step=1,
        tier="peer",
        kind="failed",
        contains="memory budget",
    )
    # the same through replication: node-a's worker reports the refusal naming the file
    layout = ["node-a", "node-b"]
    write_step(
        a.memory_dir,
        job_id=JOB,
        step=2,
        node="node-a",
        layout=layout,
        peer_urls=urls(a, b),
        shard_bytes=512 * 1024,
    )
    a.notify(JOB, 2)
    ev = wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=2,
        tier="peer",
        kind="failed",
        contains="__0_0.distcp",
        agent=a,
    )
    assert "507" in ev.message
    assert "node-b" in ev.message
    assert not [p for p in (b.memory_dir / "replicas").rglob("*") if p.is_file()]
    for f in load_manifest(a.step_dir(JOB, 2) / manifest_name(0)).files:
        assert verify_file(a.step_dir(JOB, 2) / f.name, f) is None  # memory tier untouched


def test_persistent_upload_writes_metadata_last_and_applies_retention(
    make_agent, receiver, persistent_dir
):
    a = make_agent("node-a", replication=0)
    b = make_agent("node-b", replication=0)
    layout = ["node-a", "node-b"]
    retain = {"memory": [1], "peer": [], "persistent": [1]}
    for agent in (a, b):
        write_step(
            agent.memory_dir,
            job_id=JOB,
            step=1,
            node=agent.node,
            layout=layout,
            persist=True,
            retain=retain,
        )
    a.start()  # node-b's agent is down: rank 1's manifest cannot reach the persistent tier
    pstep = persistent_dir / JOB / "step-1"
    wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=1,
        tier="persistent",
        kind="committed",
        rank=0,
        agent=a,
    )
    assert (pstep / shard_name(0)).is_file()
    assert (pstep / manifest_name(0)).is_file()
    wait_more_batches(receiver, "node-a", 5)  # the worker polled several times meanwhile
    assert not (pstep / manifest_name(1)).exists()
    assert not (pstep / METADATA).exists()  # never before every rank's manifest
    meta = (a.step_dir(JOB, 1) / METADATA).read_bytes()
    # the trainer may drop the step from memory before the other nodes are done
    evict_memory_step(a.memory_dir, JOB, 1, [0])
    b.start()
    wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=1,
        tier="persistent",
        kind="committed",
        rank=None,
        agent=a,
    )
    # .metadata got its name last: its inode changed (rename) after every other file's
    meta_time = (pstep / METADATA).stat().st_ctime_ns
    for name in (shard_name(0), shard_name(1), manifest_name(0), manifest_name(1)):
        assert (pstep / name).stat().st_ctime_ns <= meta_time
    assert (pstep / METADATA).read_bytes() == meta
    assert sorted(os.listdir(pstep)) == sorted(
        [METADATA, shard_name(0), shard_name(1), manifest_name(0), manifest_name(1)]
    )
    assert not ckpt_events(receiver, node="node-b", tier="persistent", rank=None)
    # retention: step 2 keeps [1, 2], step 3 keeps [2, 3] -> step 1 removed after step 3
    for step, keep in ((2, [1, 2]), (3, [2, 3])):
        for agent in (a, b):
            write_step(
                agent.memory_dir,
                job_id=JOB,
                step=step,
                node=agent.node,
                layout=layout,
                persist=True,
                retain={"memory": [step], "peer": [], "persistent": keep},
            )
            agent.notify(JOB, step)
        wait_event(
            receiver,
            node="node-a",
            job_id=JOB,
            step=step,
            tier="persistent",
            kind="committed",
            rank=None,
            agent=a,
        )
        if step == 2:
            assert (persistent_dir / JOB / "step-1" / METADATA).exists()
    wait_event(receiver, node="node-a", job_id=JOB, step=1, tier="persistent", kind="evicted")
    assert sorted(os.listdir(persistent_dir / JOB)) == ["step-2", "step-3"]
    assert (persistent_dir / JOB / "step-3" / METADATA).exists()
    avail = httpx.get(
        f"{a.url}/v1/ckpt/jobs/{JOB}/available", params={"persistent": 1}, headers=JOB_AUTH
    ).json()
    pers = [e for e in avail["entries"] if e["tier"] == "persistent"]
    assert sorted({(e["step"], e["rank"]) for e in pers}) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert all(e["holder"] == "persistent" for e in pers)
    assert pers[0]["url"] == f"file://{persistent_dir}/{JOB}/step-{pers[0]['step']}"


def test_unwritable_persistent_tier_is_a_failed_event_and_memory_stays(
    make_agent, receiver, tmp_path
):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where the persistent folder should be")
    a = make_agent("node-a", persistent_url=f"file://{blocker}/ckpt").start()
    write_step(a.memory_dir, job_id=JOB, step=1, node="node-a", layout=["node-a"], persist=True)
    a.notify(JOB, 1)
    ev = wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=1,
        tier="persistent",
        kind="failed",
        rank=0,
        agent=a,
    )
    assert shard_name(0) in ev.message
    assert str(blocker) in ev.message
    one = wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        tier="peer",
        kind="failed",
        contains="job runs on one node",
    )
    assert one.message == "job runs on one node: no peer tier"
    wait_more_batches(receiver, "node-a", 3)
    assert len(ckpt_events(receiver, tier="peer", kind="failed")) == 1  # reported once
    for f in load_manifest(a.step_dir(JOB, 1) / manifest_name(0)).files:
        assert verify_file(a.step_dir(JOB, 1) / f.name, f) is None
    assert (
        httpx.get(f"{a.url}/v1/ckpt/info", headers=a.auth).status_code == 200
    )  # the agent goes on


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024 * 1024, 1024 * 1024))


def test_full_persistent_tier_is_a_failed_event(make_agent, receiver, tmp_path):
    # RLIMIT_FSIZE holds for root too: any file the agent writes stops at 1 MiB (EFBIG).
    a = make_agent("node-a", preexec_fn=_limit_file_size).start()
    write_step(
        a.memory_dir,
        job_id=JOB,
        step=1,
        node="node-a",
        layout=["node-a"],
        persist=True,
        shard_bytes=3 * 1024 * 1024,
    )
    a.notify(JOB, 1)
    ev = wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=1,
        tier="persistent",
        kind="failed",
        rank=0,
        agent=a,
    )
    assert shard_name(0) in ev.message
    assert "File too large" in ev.message
    for f in load_manifest(a.step_dir(JOB, 1) / manifest_name(0)).files:
        assert verify_file(a.step_dir(JOB, 1) / f.name, f) is None


def test_restarted_agent_catches_up_and_does_not_redo(make_agent, receiver, persistent_dir):
    a, b = make_agent("node-a"), make_agent("node-b")
    layout = ["node-a", "node-b"]
    peers = urls(a, b)
    b.start()
    # node-a's agent is down while its rank commits steps 1 and 2
    for step in (1, 2):
        write_step(
            a.memory_dir,
            job_id=JOB,
            step=step,
            node="node-a",
            layout=layout,
            peer_urls=peers,
            persist=True,
            retain={"memory": [1, 2], "peer": [1, 2], "persistent": [1, 2]},
        )
    a.start()
    wait_event(
        receiver, node="node-a", job_id=JOB, step=2, tier="peer", kind="committed", rank=0, agent=a
    )
    wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=2,
        tier="persistent",
        kind="committed",
        rank=0,
        agent=a,
    )
    assert b.replica_dir("node-a", JOB, 2).joinpath(shard_name(0)).is_file()
    assert not b.replica_dir("node-a", JOB, 1).exists()  # superseded: only the newest
    assert not (persistent_dir / JOB / "step-1").exists()
    progress = read_json(a.step_dir(JOB, 2) / ".tier-0.json")
    assert progress["peer"]["done"] is True
    assert progress["persistent"]["uploaded"] is True
    first_epoch = {bt.epoch for bt in receiver.stored() if bt.node == "node-a"}
    a.stop()
    a.start()
    wait_more_batches(receiver, "node-a", 8)
    new = [
        e
        for bt in receiver.stored()
        if bt.node == "node-a" and bt.epoch not in first_epoch
        for e in bt.checkpoint_events
        if e.kind == "committed"
    ]
    assert new == []  # finished work is not redone
    # the trainer moves on to step 3; the restarted agent handles it
    write_step(
        a.memory_dir,
        job_id=JOB,
        step=3,
        node="node-a",
        layout=layout,
        peer_urls=peers,
        retain={"memory": [3], "peer": [3], "persistent": [2]},
    )
    a.notify(JOB, 3)
    wait_event(
        receiver, node="node-a", job_id=JOB, step=3, tier="peer", kind="committed", rank=0, agent=a
    )
    # the trainer evicts step 2 from memory: the agent drops its progress file with it
    evict_memory_step(a.memory_dir, JOB, 2, [0])
    wait_until(
        lambda: not a.step_dir(JOB, 2).exists(),
        timeout=10,
        what="progress of the evicted memory step cleaned up",
    )


def test_available_and_stage_fall_back_past_corrupt_sources(make_agent, receiver, persistent_dir):
    a, b = make_agent("node-a"), make_agent("node-b")
    layout = ["node-a", "node-b"]
    peers = urls(a, b)
    a.start()
    b.start()
    for agent in (a, b):
        write_step(
            agent.memory_dir,
            job_id=JOB,
            step=4,
            node=agent.node,
            layout=layout,
            peer_urls=peers,
            persist=True,
        )
        agent.notify(JOB, 4)
    wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=4,
        tier="persistent",
        kind="committed",
        rank=None,
        agent=a,
    )
    wait_event(
        receiver, node="node-b", job_id=JOB, step=4, tier="peer", kind="committed", rank=1, agent=b
    )

    avail = httpx.get(f"{a.url}/v1/ckpt/jobs/{JOB}/available", headers=JOB_AUTH).json()
    assert avail["node"] == "node-a"
    assert avail["peer_url"] == a.url
    got = sorted((e["tier"], e["holder"], e["src"], e["step"], e["rank"]) for e in avail["entries"])
    assert got == [("memory", "node-a", "node-a", 4, 0), ("peer", "node-a", "node-b", 4, 1)]
    assert all(e["url"] == a.url for e in avail["entries"])
    rank1 = next(e for e in avail["entries"] if e["rank"] == 1)["manifest"]
    entry = next(f for f in rank1["files"] if f["name"] == shard_name(1))
    with_pers = httpx.get(
        f"{a.url}/v1/ckpt/jobs/{JOB}/available?persistent=1", headers=JOB_AUTH
    ).json()
    assert {e["tier"] for e in with_pers["entries"]} == {"memory", "peer", "persistent"}

    # corrupt node-a's replica of rank 1's shard (flip a byte) and node-b's memory copy
    # (truncate to zero): staging falls back to the persistent tier
    replica = a.replica_dir("node-b", JOB, 4) / shard_name(1)
    data = bytearray(replica.read_bytes())
    data[100] ^= 0xFF
    replica.write_bytes(bytes(data))
    sources = [
        {"tier": "peer", "holder": "node-a", "url": a.url, "src": "node-b"},
        {"tier": "memory", "holder": "node-b", "url": b.url, "src": "node-b"},
        {
            "tier": "persistent",
            "holder": "persistent",
            "url": f"file://{persistent_dir}/{JOB}/step-4",
            "src": "node-b",
        },
    ]
    meta = next(
        f for f in load_manifest(a.step_dir(JOB, 4) / manifest_name(0)).files if f.name == METADATA
    )
    files = [
        {
            "name": METADATA,
            "size": meta.size,
            "xxh3": meta.xxh3,
            "sources": [{"tier": "memory", "holder": "node-a", "url": a.url, "src": "node-a"}],
        },
        {"name": shard_name(1), **{k: entry[k] for k in ("size", "xxh3")}, "sources": sources},
    ]

    def stage():
        r = httpx.post(
            f"{a.url}/v1/ckpt/jobs/{JOB}/stage",
            json={"step": 4, "files": files},
            headers=JOB_AUTH,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return r.json()

    out = stage()
    assert out["ok"] is True, out
    assert out["dir"] == str(a.memory_dir / "restore" / JOB / "step-4")
    assert out["files"] == [
        {"name": METADATA, "tier": "memory", "holder": "node-a"},
        {"name": shard_name(1), "tier": "memory", "holder": "node-b"},
    ]
    assert len(out["errors"]) == 1
    assert shard_name(1) in out["errors"][0]
    assert "peer:node-a" in out["errors"][0]
    ev = wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=4,
        tier="peer",
        kind="failed",
        contains=shard_name(1),
    )
    assert "checksum" in ev.message
    staged = Path(out["dir"])
    # the own-memory file is a hard link, the remote one a verified copy
    assert (staged / METADATA).stat().st_ino == (a.step_dir(JOB, 4) / METADATA).stat().st_ino
    assert xxh3_file(staged / shard_name(1)) == (entry["size"], entry["xxh3"])

    # a second stage of the same step reuses what is staged; a new step removes the old one
    (staged / shard_name(1)).unlink()
    (b.step_dir(JOB, 4) / shard_name(1)).write_bytes(b"")
    out = stage()
    assert out["ok"] is True, out
    assert out["files"][1] == {"name": shard_name(1), "tier": "persistent", "holder": "persistent"}
    assert len(out["errors"]) == 2
    assert any("memory:node-b" in e and shard_name(1) in e for e in out["errors"])
    wait_event(
        receiver, node="node-a", job_id=JOB, step=4, tier="memory", kind="failed", contains="node-b"
    )
    assert xxh3_file(staged / shard_name(1)) == (entry["size"], entry["xxh3"])

    # every source bad: ok false, the file named
    for f in files[1:]:
        f["sources"] = sources[:2]
    (staged / shard_name(1)).unlink()
    out = stage()
    assert out["ok"] is False
    assert any("every source failed" in e and shard_name(1) in e for e in out["errors"])
    # staging another step removes this job's other restore folders
    r = httpx.post(
        f"{a.url}/v1/ckpt/jobs/{JOB}/stage", json={"step": 5, "files": []}, headers=JOB_AUTH
    )
    assert r.json()["ok"] is True
    assert not staged.exists()
    bad = httpx.post(
        f"{a.url}/v1/ckpt/jobs/{JOB}/stage",
        json={"step": 4, "files": [{**files[0], "name": "../../agent.json"}]},
        headers=JOB_AUTH,
    )
    assert bad.status_code == 422


def test_restarted_metadata_writer_finishes_a_waiting_step(make_agent, receiver, persistent_dir):
    a = make_agent("node-a", replication=0)
    b = make_agent("node-b", replication=0)
    layout = ["node-a", "node-b"]
    for agent in (a, b):
        write_step(
            agent.memory_dir, job_id=JOB, step=7, node=agent.node, layout=layout, persist=True
        )
    a.start()
    wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=7,
        tier="persistent",
        kind="committed",
        rank=0,
        agent=a,
    )
    a.stop()
    evict_memory_step(a.memory_dir, JOB, 7, [0])  # gone from memory while the agent was down
    a.start()
    b.start()
    wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=7,
        tier="persistent",
        kind="committed",
        rank=None,
        agent=a,
    )
    pstep = persistent_dir / JOB / "step-7"
    assert sorted(os.listdir(pstep)) == sorted(
        [METADATA, shard_name(0), shard_name(1), manifest_name(0), manifest_name(1)]
    )
    assert not ckpt_events(receiver, node="node-b", tier="persistent", rank=None)


def test_two_local_ranks_stage_the_same_files_at_once(make_agent, receiver):
    a, b = make_agent("node-a"), make_agent("node-b")
    layout = ["node-a", "node-b"]
    a.start()
    b.start()
    m = write_step(
        b.memory_dir, job_id=JOB, step=2, node="node-b", layout=layout, shard_bytes=2 * 1024 * 1024
    )[1]
    entry = m.files[0]
    files = [
        {
            "name": entry.name,
            "size": entry.size,
            "xxh3": entry.xxh3,
            "sources": [{"tier": "memory", "holder": "node-b", "url": b.url, "src": "node-b"}],
        }
    ]
    results: list[dict] = []

    def stage() -> None:
        r = httpx.post(
            f"{a.url}/v1/ckpt/jobs/{JOB}/stage",
            json={"step": 2, "files": files},
            headers=JOB_AUTH,
            timeout=60,
        )
        results.append(r.json())

    import threading

    threads = [threading.Thread(target=stage) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r["ok"] for r in results] == [True, True], results
    assert all(r["errors"] == [] for r in results)
    staged = a.memory_dir / "restore" / JOB / "step-2"
    assert xxh3_file(staged / entry.name) == (entry.size, entry.xxh3)
    assert sorted(os.listdir(staged)) == [entry.name]  # no temporary files left


def test_unreachable_peer_is_a_failed_event_then_retried(make_agent, receiver):
    a, b = make_agent("node-a"), make_agent("node-b")  # node-b's agent not started yet
    PeerAs("node-b", receiver, url=b.url)  # the registry knows node-b from before it went down
    layout = ["node-a", "node-b"]
    a.start()
    write_step(a.memory_dir, job_id=JOB, step=1, node="node-a", layout=layout, peer_urls=urls(a, b))
    a.notify(JOB, 1)
    ev = wait_event(
        receiver, node="node-a", job_id=JOB, step=1, tier="peer", kind="failed", rank=0, agent=a
    )
    assert shard_name(0) in ev.message
    assert "cannot push to node-b" in ev.message
    assert "retrying" in ev.message
    # while node-b stays down, newer steps fail too: one outage, reported once a minute
    for step in (2, 3):
        write_step(
            a.memory_dir, job_id=JOB, step=step, node="node-a", layout=layout, peer_urls=urls(a, b)
        )
        a.notify(JOB, step)
        wait_more_batches(receiver, "node-a", 2)  # several worker passes fail meanwhile
    failed = ckpt_events(receiver, node="node-a", job_id=JOB, tier="peer", kind="failed")
    assert len(failed) == 1, [e.message for e in failed]
    b.start()
    wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=3,
        tier="peer",
        kind="committed",
        rank=0,
        agent=a,
        timeout=60,
    )
    assert (b.replica_dir("node-a", JOB, 3) / "commit-0.json").is_file()


# (s3:// is no longer unusable: s3fs is a runtime dependency. An unreachable or missing
# bucket is a write problem, tested against moto_server in test_persister_s3.py.)
@pytest.mark.parametrize("url", ["foo://bar", "nosuchfs://bucket/x"])
def test_unusable_persistent_url_keeps_memory_and_peer_tiers(make_agent, receiver, url):
    a, b = make_agent("node-a", persistent_url=url), make_agent("node-b", persistent_url=url)
    layout = ["node-a", "node-b"]
    peers = urls(a, b)
    a.start()
    b.start()
    info = httpx.get(f"{a.url}/v1/ckpt/info", headers=a.auth).json()
    assert info["persistent_url"] == url
    assert info["persistent_error"]
    warning = [ln for ln in a.log_tail().splitlines() if "persistent tier unavailable" in ln]
    assert warning
    assert "WARNING" in warning[0]
    assert "checkpoint store disabled" not in a.log_tail()
    for step in (1, 2):
        for agent in (a, b):
            write_step(
                agent.memory_dir,
                job_id=JOB,
                step=step,
                node=agent.node,
                layout=layout,
                peer_urls=peers,
                persist=True,
            )
            agent.notify(JOB, step)
        for agent, rank in ((a, 0), (b, 1)):
            wait_event(
                receiver,
                node=agent.node,
                job_id=JOB,
                step=step,
                tier="peer",
                kind="committed",
                rank=rank,
                agent=agent,
            )
            ev = wait_event(
                receiver,
                node=agent.node,
                job_id=JOB,
                step=step,
                tier="persistent",
                kind="failed",
                rank=rank,
                agent=agent,
            )
            assert info["persistent_error"] in ev.message
    wait_more_batches(receiver, "node-a", 3)
    # one failed event per step, not one per scan
    assert len(ckpt_events(receiver, node="node-a", tier="persistent", kind="failed")) == 2
    avail = httpx.get(
        f"{a.url}/v1/ckpt/jobs/{JOB}/available", params={"persistent": 1}, headers=JOB_AUTH
    ).json()
    assert {e["tier"] for e in avail["entries"]} == {"memory", "peer"}
    assert any("unavailable" in e for e in avail["errors"])


def test_unwritable_file_url_warns_at_start(make_agent, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a regular file where the persistent folder should be")
    a = make_agent("node-a", persistent_url=f"file://{blocker}/ckpt").start()
    wait_until(lambda: "looks unwritable" in a.log_tail(), timeout=10, what="start warning")
    line = next(ln for ln in a.log_tail().splitlines() if "looks unwritable" in ln)
    assert "WARNING" in line
    assert str(blocker) in line
    assert httpx.get(f"{a.url}/v1/ckpt/info", headers=a.auth).json()["persistent_error"] is None


def _persistent_step_of_world(
    tmp_path: Path, persistent_dir: Path, step: int, world: int
) -> dict[str, bytes]:
    """Put a complete ``world``-rank step into the persistent tier; return its files."""
    scratch = tmp_path / f"scratch-{world}"
    write_step(scratch, job_id=JOB, step=step, node="old", layout=["old"] * world, seed=7)
    src = MemoryLayout(scratch).step_dir(JOB, step)
    dst = persistent_dir / JOB / step_dirname(step)
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.name.startswith(("__", "manifest-", ".metadata")):
            (dst / p.name).write_bytes(p.read_bytes())
    return {p.name: p.read_bytes() for p in dst.iterdir()}


@pytest.mark.parametrize("old_world", [4, 1])
def test_persistent_step_of_another_world_size_is_left_alone(
    make_agent, receiver, tmp_path, persistent_dir, old_world
):
    before = _persistent_step_of_world(tmp_path, persistent_dir, 1, old_world)
    a, b = make_agent("node-a"), make_agent("node-b")
    layout = ["node-a"] if old_world == 4 else ["node-a", "node-b"]
    agents = [a] if old_world == 4 else [a, b]
    for agent in agents:
        agent.start()
        write_step(
            agent.memory_dir,
            job_id=JOB,
            step=1,
            node=agent.node,
            layout=layout,
            peer_urls=urls(*agents),
            persist=True,
        )
        agent.notify(JOB, 1)
    for rank, agent in enumerate(agents):
        ev = wait_event(
            receiver,
            node=agent.node,
            job_id=JOB,
            step=1,
            tier="persistent",
            kind="failed",
            rank=rank,
            agent=agent,
        )
        assert "already holds a checkpoint of another world size/model" in ev.message
        assert "left alone" in ev.message
    wait_more_batches(receiver, "node-a", 3)
    dst = persistent_dir / JOB / "step-1"
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before  # untouched
    assert not ckpt_events(receiver, tier="persistent", kind="committed")
    assert len(ckpt_events(receiver, node="node-a", tier="persistent", kind="failed")) == 1


def test_upload_cut_off_mid_body_leaves_nothing_and_no_traceback(make_agent, receiver):
    import socket

    a = make_agent("node-a").start()
    b = PeerAs("node-b", receiver)
    total, sent = 4 * 1024 * 1024, 2 * 1024 * 1024 + 123
    path = f"/v1/peer/replicas/node-b/{JOB}/1/__2_0.distcp"
    signed = "".join(f"{k}: {v}\r\n" for k, v in b.auth("node-a", "PUT", a.url + path).items())
    head = (
        f"PUT {path} HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{a.port}\r\n{signed}"
        f"X-Tierwatch-Xxh3: {'0' * 16}\r\nContent-Length: {total}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", a.port), timeout=10) as s:
        s.sendall(head)
        s.sendall(os.urandom(sent))
        # let the agent write the first buffered chunk to its temporary file
        wait_until(
            lambda: any(a.memory_dir.rglob(".tmp-upload-*")),
            timeout=10,
            what="temporary upload file",
        )
    wait_until(
        lambda: "disconnected" in a.log_tail(),
        timeout=15,
        what=f"disconnect logged\n{a.log_tail()}",
    )
    log_text = a.log_tail(20000)
    assert "Traceback" not in log_text
    assert "Exception in ASGI application" not in log_text
    assert "ClientDisconnect" not in log_text
    lines = [ln for ln in log_text.splitlines() if "disconnected" in ln]
    assert len(lines) == 1
    assert "__2_0.distcp" in lines[0]
    wait_until(
        lambda: not [p for p in a.memory_dir.rglob("*") if p.is_file() and p.name != "agent.json"],
        timeout=10,
        what="partial upload removed",
    )
    info = httpx.get(f"{a.url}/v1/ckpt/info", headers=a.auth).json()
    assert info["memory_used_bytes"] < 4096  # the reservation is released
    assert (
        b.request(
            "PUT",
            f"{a.url}/v1/peer/replicas/node-b/{JOB}/1/__2_0.distcp",
            to="node-a",
            content=b"ok",
            headers={"X-Tierwatch-Xxh3": xxh3_of(b"ok")},
        ).status_code
        == 200
    )


def test_agent_json_is_rewritten_when_the_memory_folder_is_deleted(make_agent):
    import shutil

    a = make_agent("node-a").start()
    first = read_json(a.memory_dir / "agent.json")
    shutil.rmtree(a.memory_dir)
    wait_until(
        lambda: (a.memory_dir / "agent.json").is_file(),
        timeout=10,
        what=f"agent.json rewritten\n{a.log_tail()}",
    )
    again = read_json(a.memory_dir / "agent.json")
    assert again == first
    (a.memory_dir / "agent.json").unlink()
    wait_until(
        lambda: (a.memory_dir / "agent.json").is_file(),
        timeout=10,
        what="agent.json rewritten again",
    )
    assert httpx.get(f"{a.url}/v1/ckpt/info", headers=a.auth).status_code == 200

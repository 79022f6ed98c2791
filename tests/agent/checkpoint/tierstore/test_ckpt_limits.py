"""Resource and file-system limits of the agent's checkpoint store (security issue, item 6).

- A replica PUT must announce its size (Content-Length), which is reserved against the memory
  budget before a byte is written; an upload never writes more; partial uploads count.
- Downloads (restore staging from peers and from the persistent tier) read raw bytes with
  ``Accept-Encoding: identity`` and stop as soon as more than the manifest's size arrives.
- Files in the trainer-writable memory folder are opened with ``O_NOFOLLOW`` per component
  and must be regular: a planted link is never pushed, persisted, served or staged.
- Every endpoint of the agent has a body limit (``agent/bodylimit.py``).

The tests named ``test_wired_*`` (at the end) need the body-limit middleware wired into
``agent/server.py``'s ``create_app`` (``app.add_middleware(BodyLimit)``); every other test
here works on the store, the clients and the real agent as they are.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import xxhash
from agent_helpers import AUTHORITY, wait_until
from ckpt_helpers import SIGNATURE, CkptAgent, PeerAs, wait_event, write_step

from tierwatch.agent.bodylimit import AGENT_LIMITS
from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    MemoryLayout,
    commit_name,
    manifest_name,
    shard_name,
)
from tierwatch.agent.checkpoint.format.manifest import (
    CommitMarker,
    FileEntry,
    make_manifest,
    sign_commit,
)
from tierwatch.agent.checkpoint.tierstore.persister import PersistentError, PersistentTier
from tierwatch.agent.checkpoint.tierstore.replicator import PeerClient, PeerError
from tierwatch.agent.checkpoint.tierstore.restore_staging import RestoreStager, StageRequest
from tierwatch.agent.checkpoint.tierstore.store import UPLOAD_TMP_PREFIX, MemoryStore, StoreError
from tierwatch.agent.fsutil import atomic_write_json

JOB = "job-1"


class StubRegistry:
    """Where a :class:`PeerClient` looks peers up, for fetches from the loopback holder: it
    names each holder's URL and signs nothing (the holder checks no identity)."""

    def __init__(self, urls: dict[str, str] | None = None) -> None:
        self.urls = urls or {}

    def peer(self, node: str) -> Any:
        url = self.urls.get(node)
        return None if url is None else type("Cert", (), {"url": url})()

    def headers(self, **_: Any) -> dict[str, str]:
        return {}


JOB_AUTH = AUTHORITY.job_auth(JOB)
MiB = 1024 * 1024


def xxh3_of(data: bytes) -> str:
    return xxhash.xxh3_64(data).hexdigest()


# -- a misbehaving holder on loopback ----------------------------------------------------
BOMB_PLAIN = 64 * MiB  # what the gzip bomb expands to
BOMB = gzip.compress(b"\0" * BOMB_PLAIN, compresslevel=9)
EXACT = os.urandom(1000)


class _Holder(BaseHTTPRequestHandler):
    """Answers ``GET /<kind>/v1/peer/files/...`` the way ``kind`` says."""

    protocol_version = "HTTP/1.1"
    server: _HolderServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.requests.append(dict(self.headers))
        kind = self.path.split("/")[1]
        try:
            if kind == "gzip":  # 64 KiB on the wire, 64 MiB once decoded
                self._head({"Content-Encoding": "gzip", "Content-Length": str(len(BOMB))})
                self.wfile.write(BOMB)
            elif kind == "long":  # honest Content-Length, far above the manifest's size
                self._head({"Content-Length": str(16 * MiB)})
                self._stream(16 * MiB)
            elif kind == "endless":  # no Content-Length: the body runs until the server stops
                self._head({"Connection": "close"})
                self._stream(256 * MiB)
            elif kind == "exact":
                self._head({"Content-Length": str(len(EXACT))})
                self.wfile.write(EXACT)
            else:
                self._head({"Content-Length": "0"}, status=404)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the agent stopped reading: as it should

    def _head(self, headers: dict[str, str], status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _stream(self, total: int) -> None:
        chunk = b"x" * (64 * 1024)
        sent = 0
        while sent < total and not self.server.stopping.is_set():
            self.wfile.write(chunk)
            sent += len(chunk)
        self.server.sent.append(sent)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


class _HolderServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Holder)
        self.requests: list[dict[str, str]] = []
        self.sent: list[int] = []
        self.stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def holder() -> Iterator[_HolderServer]:
    server = _HolderServer()
    t = threading.Thread(target=server.serve_forever, name="evil-holder", daemon=True)
    t.start()
    yield server
    server.stopping.set()
    server.shutdown()
    server.server_close()
    t.join(10)


class _Counting:
    """A binary sink that only counts what is written to it."""

    def __init__(self) -> None:
        self.n = 0

    def write(self, b: bytes) -> int:
        self.n += len(b)
        return len(b)


def fetch(holder: _HolderServer, kind: str, out: Any, max_bytes: int) -> int:
    client = PeerClient(StubRegistry())  # type: ignore[arg-type]
    try:
        return client.fetch_to(
            url=f"{holder.url}/{kind}",
            holder="evil",
            job_id=JOB,
            step=1,
            name=shard_name(0),
            tier="memory",
            src=None,
            out=out,
            max_bytes=max_bytes,
        )
    finally:
        client.close()


# -- downloads stop at the manifest's size -----------------------------------------------
def test_a_gzip_bomb_from_a_peer_is_refused_unread(holder: _HolderServer) -> None:
    out = _Counting()
    with pytest.raises(PeerError, match="Content-Encoding gzip"):
        fetch(holder, "gzip", out, 1000)
    assert out.n == 0  # nothing decoded, nothing written
    assert holder.requests[-1]["Accept-Encoding"] == "identity"


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("long", f"announced {16 * MiB} bytes, more than the manifest's 1000"),
        ("endless", "sent more than the manifest's 1000 bytes; the download was stopped"),
    ],
)
def test_a_peer_that_sends_more_than_the_manifest_is_stopped(
    holder: _HolderServer, kind: str, message: str
) -> None:
    out = _Counting()
    with pytest.raises(PeerError, match=message):
        fetch(holder, kind, out, 1000)
    assert out.n <= 1000


def test_a_peer_that_sends_the_manifest_size_is_read(holder: _HolderServer) -> None:
    out = _Counting()
    assert fetch(holder, "exact", out, len(EXACT)) == len(EXACT)
    assert out.n == len(EXACT)


def stager(
    tmp_path: Path, events: list[Any], holder: _HolderServer
) -> tuple[RestoreStager, MemoryLayout]:
    layout = MemoryLayout(tmp_path / "mem")
    layout.root.mkdir(parents=True, exist_ok=True)
    persistent = PersistentTier(f"file://{tmp_path / 'persistent'}")
    urls = {n: f"{holder.url}/{k}" for n, k in (("node-x", "gzip"), ("node-z", "endless"))}
    urls["node-y"] = f"{holder.url}/exact"
    peer = PeerClient(StubRegistry(urls))  # type: ignore[arg-type]
    return (
        RestoreStager(layout, node="node-a", peer=peer, emit=events.append, persistent=persistent),
        layout,
    )


def test_staging_stops_every_source_at_the_manifest_size(
    tmp_path: Path, holder: _HolderServer
) -> None:
    events: list[Any] = []
    st, layout = stager(tmp_path, events, holder)
    big = tmp_path / "persistent" / JOB / "step-1" / shard_name(0)
    big.parent.mkdir(parents=True)
    big.write_bytes(EXACT + b"more")  # the persistent copy is longer than the manifest says
    sources = [
        # the URLs a rank names are not followed: the registry's are (StubRegistry)
        {"tier": "memory", "holder": "node-x", "url": "http://ignored.invalid"},
        {"tier": "memory", "holder": "node-z"},
        {"tier": "persistent", "holder": "persistent"},
        {"tier": "memory", "holder": "node-y"},
    ]
    req = StageRequest.model_validate(
        {
            "step": 1,
            "files": [
                {
                    "name": shard_name(0),
                    "size": len(EXACT),
                    "xxh3": xxh3_of(EXACT),
                    "sources": sources,
                }
            ],
        }
    )
    out = st.stage(JOB, req)
    assert out["ok"] is True, out
    assert out["files"] == [{"name": shard_name(0), "tier": "memory", "holder": "node-y"}]
    assert len(out["errors"]) == 3, out["errors"]
    assert "Content-Encoding gzip" in out["errors"][0]
    assert "more than the manifest's 1000 bytes" in out["errors"][1]
    assert "more than the manifest's 1000 bytes" in out["errors"][2]
    assert [e.kind for e in events] == ["failed"] * 3
    staged = layout.restore_dir(JOB, 1)
    assert sorted(p.name for p in staged.iterdir()) == [shard_name(0)]  # no partial files
    assert (staged / shard_name(0)).read_bytes() == EXACT


def test_staging_never_links_or_copies_a_planted_link(
    tmp_path: Path, holder: _HolderServer
) -> None:
    events: list[Any] = []
    st, layout = stager(tmp_path, events, holder)
    secret = tmp_path / "secret"
    secret.write_bytes(EXACT)
    step_dir = layout.step_dir(JOB, 1)
    step_dir.mkdir(parents=True)
    (step_dir / shard_name(0)).symlink_to(secret)
    req = StageRequest.model_validate(
        {
            "step": 1,
            "files": [
                {
                    "name": shard_name(0),
                    "size": len(EXACT),
                    "xxh3": xxh3_of(EXACT),  # the trainer knows the secret's checksum
                    "sources": [{"tier": "memory", "holder": "node-a"}],
                }
            ],
        }
    )
    out = st.stage(JOB, req)
    assert out["ok"] is False
    assert "a symbolic link" in out["errors"][0]
    assert list(layout.restore_dir(JOB, 1).iterdir()) == []


# -- the budget: size required, reserved first, partial uploads count ---------------------
def test_a_replica_without_a_size_is_411_and_reserves_nothing(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path / "mem", node="node-a", budget_bytes=10_000)
    with pytest.raises(StoreError) as exc:
        store.begin_replica(
            src_node="node-b", job_id=JOB, step=1, name=shard_name(1), xxh3="0" * 16, size=None
        )
    assert exc.value.status == 411
    assert "Content-Length" in exc.value.message
    assert "memory budget" in exc.value.message
    assert store.used_bytes() == 0


def test_an_upload_counts_its_announced_size_once_while_in_progress(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path / "mem", node="node-a", budget_bytes=100_000)
    data = os.urandom(60_000)
    up = store.begin_replica(
        src_node="node-b", job_id=JOB, step=1, name=shard_name(1), xxh3=xxh3_of(data), size=60_000
    )
    assert store.used_bytes() == 60_000  # reserved before a byte is written
    up.write(data[:40_000])
    assert up.tmp.stat().st_size == 40_000
    assert store.used_bytes() == 60_000  # the partial file is not counted on top
    with pytest.raises(StoreError) as exc:  # 60000 reserved + 50000 > 100000
        store.begin_replica(
            src_node="node-b", job_id=JOB, step=1, name=shard_name(2), xxh3="0" * 16, size=50_000
        )
    assert exc.value.status == 507
    up.write(data[40_000:])
    up.finish()
    assert store.used_bytes() == 60_000


def test_a_partial_upload_left_behind_counts_in_the_budget(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path / "mem", node="node-a", budget_bytes=10_000)
    d = store.layout.replica_step_dir("node-b", JOB, 1)
    d.mkdir(parents=True)
    # a killed agent's upload: no reservation of this store owns it, its bytes are in memory
    (d / f"{UPLOAD_TMP_PREFIX}{shard_name(1)}.{'d' * 32}").write_bytes(b"x" * 7000)
    assert store.used_bytes() == 7000
    with pytest.raises(StoreError) as exc:
        store.begin_replica(
            src_node="node-b", job_id=JOB, step=2, name=shard_name(1), xxh3="0" * 16, size=5000
        )
    assert exc.value.status == 507
    assert "7000 of 10000 bytes used" in exc.value.message


def test_a_replica_is_never_written_through_a_linked_folder(tmp_path: Path) -> None:
    store = MemoryStore(tmp_path / "mem", node="node-a", budget_bytes=10_000)
    elsewhere = tmp_path / "other-job-folder"
    elsewhere.mkdir()
    store.layout.replicas_dir.mkdir()
    (store.layout.replicas_dir / "node-b").symlink_to(elsewhere)  # planted by a rank
    before = store.used_bytes()
    data = b"replica bytes"
    up = store.begin_replica(
        src_node="node-b", job_id=JOB, step=1, name=shard_name(1), xxh3=xxh3_of(data), size=13
    )
    with pytest.raises(StoreError) as exc:
        up.write(data)
    assert exc.value.status == 500
    assert "a symbolic link" in exc.value.message
    assert list(elsewhere.rglob("*")) == []
    assert store.used_bytes() == before  # the reservation is released


# -- serving: no links, regular files only ------------------------------------------------
def planted(tmp_path: Path) -> tuple[MemoryStore, Path]:
    """A store with step 1 of JOB (one regular shard) and a secret outside it."""
    store = MemoryStore(tmp_path / "mem", node="node-a", budget_bytes=2**30)
    d = store.layout.step_dir(JOB, 1)
    d.mkdir(parents=True)
    (d / shard_name(0)).write_bytes(b"shard 0")
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0")
    return store, secret


def test_a_linked_file_is_not_served(tmp_path: Path) -> None:
    store, secret = planted(tmp_path)
    (store.layout.step_dir(JOB, 1) / shard_name(1)).symlink_to(secret)
    kw: dict[str, Any] = {"job_id": JOB, "step": 1, "name": shard_name(1), "tier": "memory"}
    for call in (store.file_path, store.open_file):
        with pytest.raises(StoreError) as exc:
            call(**kw, src=None)
        assert exc.value.status == 403
        assert "a symbolic link" in exc.value.message
    f, size = store.open_file(job_id=JOB, step=1, name=shard_name(0), tier="memory", src=None)
    with f:
        assert (f.read(), size) == (b"shard 0", 7)
    with pytest.raises(StoreError) as exc:
        store.open_file(job_id=JOB, step=1, name=shard_name(5), tier="memory", src=None)
    assert exc.value.status == 404


@pytest.mark.parametrize("linked", ["step", "job", "replica"])
def test_a_linked_folder_is_not_served(tmp_path: Path, linked: str) -> None:
    store, _ = planted(tmp_path)
    other = tmp_path / "other"  # e.g. another job's step folder
    other.mkdir()
    (other / shard_name(0)).write_bytes(b"another job's shard")
    tier, src = "memory", None
    if linked == "step":
        store.layout.step_dir(JOB, 2).symlink_to(other)
        step = 2
    elif linked == "job":
        store.layout.job_dir("job-2").symlink_to(other.parent)
        (other.parent / "step-1").symlink_to(other)
        step, job = 1, "job-2"
    else:
        store.layout.replica_job_dir("node-b", JOB).parent.mkdir(parents=True)
        store.layout.replica_job_dir("node-b", JOB).symlink_to(store.layout.job_dir(JOB))
        step, tier, src = 1, "peer", "node-b"
    job = "job-2" if linked == "job" else JOB
    for call in (store.file_path, store.open_file):
        with pytest.raises(StoreError) as exc:
            call(job_id=job, step=step, name=shard_name(0), tier=tier, src=src)
        assert exc.value.status == 403, exc.value.message
        assert "a symbolic link" in exc.value.message


def test_the_persistent_tier_uploads_no_link_and_no_file_of_another_size(tmp_path: Path) -> None:
    store, secret = planted(tmp_path)
    tier = PersistentTier(f"file://{tmp_path / 'persistent'}")
    d = store.layout.step_dir(JOB, 1)
    (d / shard_name(1)).symlink_to(secret)
    entry = FileEntry(
        name=shard_name(1), size=secret.stat().st_size, xxh3=xxh3_of(secret.read_bytes())
    )
    with pytest.raises(PersistentError, match="a symbolic link"):
        tier.put_file(d / shard_name(1), JOB, 1, shard_name(1), expect=entry, root=store.root)
    with pytest.raises(PersistentError, match="a symbolic link"):  # without the root too
        tier.put_file(d / shard_name(1), JOB, 1, shard_name(1), expect=entry)
    wrong = FileEntry(name=shard_name(0), size=3, xxh3="0" * 16)
    with pytest.raises(PersistentError, match="7 bytes, the manifest says 3 bytes; not uploaded"):
        tier.put_file(d / shard_name(0), JOB, 1, shard_name(0), expect=wrong, root=store.root)
    assert not (tmp_path / "persistent").exists() or not [
        p for p in (tmp_path / "persistent").rglob("*") if p.is_file()
    ]


# -- with real agents ---------------------------------------------------------------------
def commit(memory_dir: Path, step: int, layout: list[str], peer_urls: dict[str, str]) -> None:
    """Write rank 0's manifest (read through whatever the files are) and commit marker."""
    d = MemoryLayout(memory_dir).step_dir(JOB, step)
    m = make_manifest(
        job_id=JOB,
        step=step,
        rank=0,
        world_size=len(layout),
        node=layout[0],
        directory=d,
        names=[shard_name(0), METADATA],
        signature=SIGNATURE,
        created_at="2026-01-01T00:00:00+00:00",
        key=AUTHORITY.manifest_key(JOB),
    )
    atomic_write_json(d / manifest_name(0), m)
    atomic_write_json(
        d / commit_name(0),
        sign_commit(
            CommitMarker(
                job_id=JOB,
                step=step,
                rank=0,
                world_size=len(layout),
                persist=True,
                retain={"memory": [step], "peer": [step], "persistent": [step]},
                layout=layout,
                peer_urls=peer_urls,
                created_at="2026-01-01T00:00:00+00:00",
            ),
            AUTHORITY.manifest_key(JOB),
        ),
    )


def two_agents(make_agent: Any) -> tuple[CkptAgent, CkptAgent, list[str], dict[str, str]]:
    a, b = make_agent("node-a"), make_agent("node-b")
    a.start()
    b.start()
    return a, b, ["node-a", "node-b"], {a.node: a.url, b.node: b.url}


def nothing_left_node_a(b: CkptAgent, persistent_dir: Path, secret: bytes) -> None:
    got = [p for p in (b.memory_dir / "replicas").rglob("*") if p.is_file()]
    got += [p for p in persistent_dir.rglob("*") if p.is_file()]
    assert not [p for p in got if p.read_bytes() == secret], got
    assert not [p for p in got if p.name == shard_name(0)], got


def test_a_linked_shard_is_neither_pushed_nor_persisted(
    make_agent, receiver, persistent_dir, tmp_path
):
    a, b, layout, peers = two_agents(make_agent)
    secret = os.urandom(4096)
    (tmp_path / "secret").write_bytes(secret)  # /etc/passwd, another job's shard, …
    write_step(a.memory_dir, job_id=JOB, step=1, node="node-a", layout=layout, commit=False)
    shard = a.step_dir(JOB, 1) / shard_name(0)
    shard.unlink()
    shard.symlink_to(tmp_path / "secret")
    commit(a.memory_dir, 1, layout, peers)  # its manifest lists the secret's size and xxh3
    a.notify(JOB, 1)
    for tier in ("peer", "persistent"):
        ev = wait_event(
            receiver,
            node="node-a",
            job_id=JOB,
            step=1,
            tier=tier,
            kind="failed",
            contains="a symbolic link",
            agent=a,
        )
        assert str(shard) in ev.message
    nothing_left_node_a(b, persistent_dir, secret)


@pytest.mark.parametrize("linked", ["step", "job"])
def test_a_linked_step_or_job_folder_is_neither_pushed_nor_persisted(
    make_agent, receiver, persistent_dir, tmp_path, linked
):
    a, b, layout, peers = two_agents(make_agent)
    outside = tmp_path / "outside-mem"  # a complete, committed step outside the memory folder
    manifests = write_step(
        outside, job_id=JOB, step=1, node="node-a", layout=layout, peer_urls=peers, persist=True
    )
    if linked == "step":
        a.step_dir(JOB, 1).parent.mkdir(parents=True)
        a.step_dir(JOB, 1).symlink_to(MemoryLayout(outside).step_dir(JOB, 1))
        where = a.step_dir(JOB, 1)
    else:
        MemoryLayout(a.memory_dir).jobs_dir.mkdir(parents=True)
        MemoryLayout(a.memory_dir).job_dir(JOB).symlink_to(MemoryLayout(outside).job_dir(JOB))
        where = MemoryLayout(a.memory_dir).job_dir(JOB)
    a.notify(JOB, 1)
    ev = wait_event(
        receiver, node="node-a", job_id=JOB, tier="peer", kind="failed", contains=str(where)
    )
    assert "a symbolic link" in ev.message
    secret = (MemoryLayout(outside).step_dir(JOB, 1) / shard_name(0)).read_bytes()
    assert manifests[0].files  # the step was complete: only the link stopped it
    nothing_left_node_a(b, persistent_dir, secret)
    # nothing was written into the linked folder either (no .tier-0.json progress)
    assert not (MemoryLayout(outside).step_dir(JOB, 1) / ".tier-0.json").exists()


def test_a_linked_commit_marker_is_not_read_into_an_event(make_agent, receiver, tmp_path):
    a, b, layout, peers = two_agents(make_agent)
    secret = tmp_path / "shadow"
    secret.write_bytes(b"root:SECRET-HASH:19000:0:99999:7:::\n")
    write_step(a.memory_dir, job_id=JOB, step=1, node="node-a", layout=layout, commit=False)
    (a.step_dir(JOB, 1) / commit_name(0)).symlink_to(secret)
    a.notify(JOB, 1)
    ev = wait_event(
        receiver,
        node="node-a",
        job_id=JOB,
        step=1,
        kind="failed",
        contains="unreadable commit marker",
        agent=a,
    )
    assert "a symbolic link" in ev.message
    assert "SECRET" not in ev.message  # a parse error would have quoted the file's start
    assert not [p for p in (b.memory_dir / "replicas").rglob("*") if p.is_file()]


def test_served_files_are_regular_files_reached_without_links(make_agent, receiver, tmp_path):
    a = make_agent("node-a").start()
    b = PeerAs("node-b", receiver)
    write_step(a.memory_dir, job_id=JOB, step=1, node="node-a", layout=["node-a", "node-b"])
    secret = tmp_path / "secret"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n")
    (a.step_dir(JOB, 1) / shard_name(1)).symlink_to(secret)
    a.step_dir(JOB, 2).symlink_to(a.step_dir(JOB, 1))
    os.mkfifo(a.step_dir(JOB, 1) / shard_name(2))  # a plain open would hang the server thread

    def get(step: int, name: str) -> httpx.Response:
        url = f"{a.url}/v1/peer/files/{JOB}/{step}/{name}"
        return b.request("GET", url, to="node-a", timeout=10)

    assert get(1, shard_name(0)).status_code == 200
    for step, name, what in [
        (1, shard_name(1), "a symbolic link"),
        (2, shard_name(0), "a symbolic link"),
        (1, shard_name(2), "a FIFO"),
    ]:
        r = get(step, name)
        assert r.status_code == 403, r.text
        assert what in r.json()["detail"]
        assert b"root:" not in r.content


def test_stage_through_the_agent_stops_at_the_manifest_size(make_agent, receiver, holder):
    a = make_agent("node-a").start()
    PeerAs("node-x", receiver, url=f"{holder.url}/gzip")  # where the registry says they are
    PeerAs("node-z", receiver, url=f"{holder.url}/endless")
    body = {
        "step": 3,
        "files": [
            {
                "name": shard_name(0),
                "size": 1000,
                "xxh3": xxh3_of(EXACT),
                "sources": [
                    {"tier": "memory", "holder": "node-x"},
                    {"tier": "memory", "holder": "node-z"},
                ],
            }
        ],
    }
    r = httpx.post(f"{a.url}/v1/ckpt/jobs/{JOB}/stage", json=body, headers=JOB_AUTH, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["ok"] is False
    assert "Content-Encoding gzip" in out["errors"][0]
    assert "more than the manifest's 1000 bytes" in out["errors"][1]
    assert all(h["Accept-Encoding"] == "identity" for h in holder.requests)
    staged = MemoryLayout(a.memory_dir).restore_dir(JOB, 3)
    assert list(staged.iterdir()) == []


def test_a_chunked_replica_put_is_411(make_agent, receiver):
    a = make_agent("node-a").start()
    url = f"{a.url}/v1/peer/replicas/node-b/{JOB}/1/{shard_name(1)}"

    def body() -> Iterator[bytes]:
        yield b"x" * 1000

    r = PeerAs("node-b", receiver).request(
        "PUT",
        url,
        to="node-a",
        content=body(),  # no Content-Length: Transfer-Encoding chunked
        headers={"X-Tierwatch-Xxh3": "0" * 16},
    )
    assert r.status_code == 411, r.text
    assert "needs Content-Length" in r.json()["detail"]
    assert not (a.memory_dir / "replicas").exists() or not list(
        (a.memory_dir / "replicas").rglob("*.distcp")
    )


def test_an_upload_in_progress_counts_in_memory_used(make_agent, receiver):
    a = make_agent("node-a", memory_budget="64MiB").start()

    def used() -> int:
        info = httpx.get(f"{a.url}/v1/ckpt/info", headers=a.auth, timeout=5).json()
        return info["memory_used_bytes"]

    base = used()
    conn = http.client.HTTPConnection("127.0.0.1", a.port, timeout=10)
    try:
        path = f"/v1/peer/replicas/node-b/{JOB}/1/{shard_name(1)}"
        conn.putrequest("PUT", path)
        signed = PeerAs("node-b", receiver).auth("node-a", "PUT", a.url + path)
        for k, v in {
            **signed,
            "X-Tierwatch-Xxh3": "0" * 16,
            "Content-Length": str(8 * MiB),
        }.items():
            conn.putheader(k, v)
        conn.endheaders()
        conn.send(b"x" * 4096)  # the rest never comes
        wait_until(lambda: used() >= base + 8 * MiB, timeout=10, what="8 MiB reserved")
        assert used() < base + 8 * MiB + 4096  # the partial file is not counted on top
    finally:
        conn.close()  # the sender goes away: the reservation and the partial file go
    wait_until(lambda: used() == base, timeout=10, what="reservation released")


def test_every_agent_endpoint_has_a_body_limit(make_agent):
    a = make_agent("node-a").start()
    spec = httpx.get(f"{a.url}/openapi.json", timeout=5).json()
    routes = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert routes, spec
    listed = {(r.method, r.path) for r in AGENT_LIMITS}
    assert routes - listed == set(), "endpoints without an entry in agent/bodylimit.py"
    assert listed - routes == set(), "entries in agent/bodylimit.py for no endpoint"


# -- need the wiring: app.add_middleware(BodyLimit) in agent/server.py --------------------
def raw(port: int, head: str, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send a request as bytes (headers as given, then ``body``) and read the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.connect()
        assert conn.sock is not None
        conn.sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        resp = http.client.HTTPResponse(conn.sock, method=head.split()[0])
        resp.begin()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def test_wired_a_control_body_over_its_limit_is_413_unread(make_agent):
    a = make_agent("node-a").start()
    auth = JOB_AUTH["Authorization"]
    status, out = raw(
        a.port,
        f"POST /v1/ckpt/jobs/{JOB}/stage HTTP/1.1\nHost: x\nAuthorization: {auth}\n"
        f"Content-Type: application/json\nContent-Length: {64 * MiB}\n",
    )  # the 64 MiB never come: the answer does not wait for them
    assert status == 413, out
    assert out["detail"].startswith(
        "POST /v1/ckpt/jobs/{job_id}/stage takes at most 33554432 bytes of body"
    )
    r = httpx.post(
        f"{a.url}/v1/ckpt/notify", content=b" " * 8192, headers={**JOB_AUTH, "Content-Type": "x"}
    )
    assert r.status_code == 413, r.text
    assert "takes at most 4096 bytes of body" in r.json()["detail"]


def test_wired_a_chunked_control_body_is_cut_at_its_limit(make_agent):
    a = make_agent("node-a").start()
    auth = JOB_AUTH["Authorization"]
    chunk = b"2000\r\n" + b" " * 0x2000 + b"\r\n"
    status, out = raw(
        a.port,
        f"POST /v1/ckpt/notify HTTP/1.1\nHost: x\nAuthorization: {auth}\n"
        "Content-Type: application/json\nTransfer-Encoding: chunked\n",
        chunk * 2 + b"0\r\n\r\n",
    )
    assert status == 413, out
    got = re.fullmatch(
        r"POST /v1/ckpt/notify takes at most 4096 bytes of body; reading stopped after (\d+) "
        "bytes",
        out["detail"],
    )
    assert got is not None, out
    assert 4096 < int(got[1]) <= 2 * 0x2000  # cut at the first message past the limit


def test_wired_a_body_on_an_endpoint_without_one_is_413(make_agent):
    a = make_agent("node-a").start()
    r = httpx.request("GET", f"{a.url}/v1/ckpt/info", content=b"x" * 100, headers=a.auth, timeout=5)
    assert r.status_code == 413, r.text
    assert r.json()["detail"] == (
        "GET /v1/ckpt/info takes no request body; this request's Content-Length is 100 bytes"
    )

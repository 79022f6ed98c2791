"""Peers authenticate as nodes, and a holder deals only with the nodes of the job.

Security issue items 1 and 2, against real agent processes (the receiver stands in for the
server's registry: it certifies node keys and answers a job's registered nodes). Before: one
peer token opened every job's files on every node, and pushes went, with that token, to the
URLs a trainer wrote into its commit marker (``peer_urls``) or named in a stage request.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import xxhash
from agent_helpers import AUTHORITY, TestAuthority
from ckpt_helpers import PeerAs, wait_event, write_step
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tierwatch.agent.checkpoint.format.layout import shard_name
from tierwatch.agent.peer_identity import CERT_HEADER, SCHEME, public_key_text, sign_request

JOB = "peer-job"


class Listener:
    """An attacker's HTTP endpoint: records every request it gets (headers included)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                listener.requests.append({"path": self.path, **dict(self.headers)})
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_PUT = do_DELETE = do_POST = _any  # noqa: N815 - http.server API

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    ear = Listener()
    yield ear
    ear.stop()


@pytest.fixture
def holder(make_agent, receiver):
    """node-a's agent holding step 1 of the job in memory; the job runs on node-a and
    node-b (rank 0 on a, rank 1 on b)."""
    receiver.open_jobs = False
    receiver.register_job(JOB, ["node-a", "node-b"], ["node-a", "node-b"])
    a = make_agent("node-a", replication=0).start()
    write_step(a.memory_dir, job_id=JOB, step=1, node="node-a", layout=["node-a", "node-b"])
    return a


def file_url(a, name: str = shard_name(0)) -> str:
    return f"{a.url}/v1/peer/files/{JOB}/1/{name}"


def test_a_request_without_a_node_identity_is_refused(holder):
    for method, url in (
        ("GET", file_url(holder)),
        ("PUT", f"{holder.url}/v1/peer/replicas/node-b/{JOB}/1/{shard_name(1)}"),
        ("DELETE", f"{holder.url}/v1/peer/replicas/node-b/{JOB}/1"),
    ):
        for headers in ({}, {"Authorization": "Bearer peer-secret-for-tests"}):
            body = b"x" * 4 if method == "PUT" else None
            r = httpx.request(method, url, headers=headers, content=body)
            assert r.status_code == 401, (method, r.text)
            assert "agents authenticate to each other as nodes" in r.json()["detail"]


def test_forged_misaddressed_replayed_or_reused_proofs_are_refused(holder, receiver):
    b = PeerAs("node-b", receiver)
    url = file_url(holder)
    assert b.request("GET", url, to="node-a").status_code == 200
    # a certificate the server never issued (another key, same key id)
    forger = TestAuthority(kid=AUTHORITY.kid)
    key = Ed25519PrivateKey.generate()
    forged = forger.node_certificate("node-b", "http://x", public_key_text(key))
    proof = sign_request(
        key, sender="node-b", receiver="node-a", method="GET", path=url[len(holder.url) :]
    )
    r = httpx.get(url, headers={"Authorization": f"{SCHEME} {proof}", CERT_HEADER: forged})
    assert r.status_code == 401
    assert "node certificate refused" in r.json()["detail"]
    # a proof made for node-c, sent to node-a (what a peer could replay to another)
    r = httpx.get(url, headers=b.auth("node-c", "GET", url))
    assert r.status_code == 401
    assert "not for node node-a" in r.json()["detail"]
    # the same proof twice
    once = b.auth("node-a", "GET", url)
    assert httpx.get(url, headers=once).status_code == 200
    r = httpx.get(url, headers=once)
    assert r.status_code == 401
    assert "replay" in r.json()["detail"]
    # a proof for one file used for another, or for a GET used for a DELETE
    other = file_url(holder, shard_name(1))
    r = httpx.get(other, headers=b.auth("node-a", "GET", url))
    assert r.status_code == 401
    assert "another method or path" in r.json()["detail"]
    # a proof signed with another key than the certificate names
    stolen = {**b.auth("node-a", "GET", url), CERT_HEADER: PeerAs("node-b").certificate}
    assert httpx.get(url, headers=stolen).status_code == 401


def test_files_are_served_only_to_the_nodes_of_the_job(holder, receiver):
    url = file_url(holder)
    assert PeerAs("node-b", receiver).request("GET", url, to="node-a").status_code == 200
    r = PeerAs("node-c", receiver).request("GET", url, to="node-a")  # certified, other job
    assert r.status_code == 403
    assert f"node-c is not a node of job {JOB}" in r.json()["detail"]
    assert set(r.json()) == {"detail"}  # the answer carries no file bytes


def test_a_node_pushes_and_deletes_only_its_own_ranks_replicas(holder, receiver):
    b, c = PeerAs("node-b", receiver), PeerAs("node-c", receiver)
    body = b"replica bytes"
    digest = {"X-Tierwatch-Xxh3": xxhash.xxh3_64(body).hexdigest()}

    def put(who: PeerAs, src: str, name: str) -> httpx.Response:
        url = f"{holder.url}/v1/peer/replicas/{src}/{JOB}/1/{name}"
        return who.request("PUT", url, to="node-a", content=body, headers=digest)

    r = put(b, "node-c", shard_name(1))  # speaking for another node
    assert r.status_code == 403
    assert "only its own replicas" in r.json()["detail"]
    r = put(b, "node-b", shard_name(0))  # rank 0 runs on node-a in the pinned layout
    assert r.status_code == 403
    assert "rank 0 of job peer-job runs on node-a, not on node-b" in r.json()["detail"]
    r = put(c, "node-c", shard_name(1))  # a node outside the job
    assert r.status_code == 403
    assert not (holder.memory_dir / "replicas").exists() or not list(
        (holder.memory_dir / "replicas").rglob("*.distcp")
    )
    assert put(b, "node-b", shard_name(1)).status_code == 200
    url = f"{holder.url}/v1/peer/replicas/node-b/{JOB}/1"
    assert c.request("DELETE", url, to="node-a").status_code == 403
    r = b.request("DELETE", url, to="node-a")
    assert r.status_code == 200
    assert r.json() == {"deleted": True}


def test_pushes_go_to_the_registry_never_to_urls_a_trainer_wrote(make_agent, receiver, listener):
    a, b = make_agent("node-a"), make_agent("node-b")
    a.start()
    b.start()
    layout = ["node-a", "node-b"]
    # the trainer's marker points node-b (and an unregistered node) at the attacker
    evil = {"node-a": listener.url, "node-b": listener.url}
    write_step(a.memory_dir, job_id=JOB, step=1, node="node-a", layout=layout, peer_urls=evil)
    a.notify(JOB, 1)
    wait_event(receiver, node="node-a", job_id=JOB, step=1, tier="peer", kind="committed", agent=a)
    assert (b.replica_dir("node-a", JOB, 1) / shard_name(0)).is_file()
    write_step(
        a.memory_dir,
        job_id=JOB,
        step=2,
        node="node-a",
        layout=["node-a", "node-evil"],
        peer_urls={"node-evil": listener.url},
    )
    a.notify(JOB, 2)
    ev = wait_event(
        receiver, node="node-a", job_id=JOB, step=2, tier="peer", kind="failed", agent=a
    )
    assert "node-evil is not in the server's registry" in ev.message
    assert listener.requests == []  # no request, so no credential, ever reached it
    # a stage request naming the attacker's URL for node-b's files fetches from node-b
    files = [
        {
            "name": shard_name(1),
            "size": 1,
            "xxh3": "0" * 16,
            "sources": [{"tier": "memory", "holder": "node-b", "url": listener.url}],
        }
    ]
    r = httpx.post(
        f"{a.url}/v1/ckpt/jobs/{JOB}/stage",
        json={"step": 1, "files": files},
        headers=AUTHORITY.job_auth(JOB),
        timeout=30,
    )
    assert r.status_code == 200
    assert r.json()["ok"] is False  # node-b holds no such file: it was asked, not the listener
    assert any("memory:node-b" in e for e in r.json()["errors"])
    assert listener.requests == []

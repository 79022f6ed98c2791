"""Helpers for the agent's checkpoint tests (imported as ``ckpt_helpers``).

:func:`write_step` writes a step into a node's memory folder exactly as a training rank does
(docs/checkpointing.md, "Save"): each rank's shard (random bytes; rank 0 also ``.metadata``) in
``.tmp-step-<N>-<r>/``, renamed into ``step-<N>/``, then ``manifest-<r>.json`` built with
:func:`~tierwatch.agent.checkpoint.format.manifest.make_manifest` by reading the files back, and
once every local manifest exists, ``commit-<r>.json`` with rank 0's decision. That file layout is
the exact interface between the trainer and the agent.

:class:`CkptAgent` is a real ``tierwatch-agent run`` process on an ephemeral loopback port,
reporting to a :class:`~agent_helpers.Receiver`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import httpx
from agent_helpers import AUTHORITY, Receiver, wait_until
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from procs import BIN, base_env, free_port

from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    MemoryLayout,
    commit_name,
    manifest_name,
    shard_name,
)
from tierwatch.agent.checkpoint.format.manifest import CommitMarker, make_manifest, sign_commit
from tierwatch.agent.fsutil import atomic_write_json
from tierwatch.agent.peer_identity import CERT_HEADER, SCHEME, public_key_text, sign_request
from tierwatch.agent.protocol import CheckpointEvent

SIGNATURE = "sig-test"


def write_job(memory_dir: Path, job_id: str, layout: list[str], **extra: Any) -> None:
    """Write ``jobs/<job>/job.json`` as rank 0 would (world_size, layout, signature)."""
    ml = MemoryLayout(memory_dir)
    ml.job_dir(job_id).mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        ml.job_file(job_id),
        {"world_size": len(layout), "layout": layout, "signature": SIGNATURE, **extra},
    )


def write_step(
    memory_dir: Path,
    *,
    job_id: str,
    step: int,
    node: str,
    layout: list[str],
    peer_urls: dict[str, str] | None = None,
    persist: bool = False,
    retain: dict[str, list[int]] | None = None,
    shard_bytes: int = 64 * 1024,
    commit: bool = True,
    seed: int | None = None,
    key: bytes | None | str = "job",
) -> dict[int, Any]:
    """Write the files of ``node``'s ranks for one step, as the trainer does.

    Args:
        memory_dir: The node's memory folder.
        job_id, step: The step.
        node: This node; its ranks are those ``layout`` places on it.
        layout: Node of every rank.
        peer_urls: Agent URL of each node (goes into the commit markers).
        persist: Rank 0's decision to persist the step.
        retain: Steps each tier keeps (default: this step only).
        shard_bytes: Size of each random shard (bytes); ``.metadata`` is 1 KiB.
        commit: Write the commit markers.
        seed: Seed for the random bytes (default: random).
        key: The manifest key that signs the manifests and commit markers: ``"job"`` (the
            job's own, as :data:`AUTHORITY` issues it: what a rank with the job's credential
            writes), other bytes (a forger's), or None (unsigned).

    Returns:
        ``{rank: Manifest}`` of the ranks written.
    """
    import random

    rng = random.Random(seed)
    if key == "job":
        key = AUTHORITY.manifest_key(job_id)
    assert key is None or isinstance(key, bytes)
    ml = MemoryLayout(memory_dir)
    world = len(layout)
    ranks = [r for r, n in enumerate(layout) if n == node]
    write_job(memory_dir, job_id, layout)
    step_dir = ml.step_dir(job_id, step)
    step_dir.mkdir(parents=True, exist_ok=True)
    manifests = {}
    for r in ranks:
        tmp = ml.tmp_step_dir(job_id, step, r)
        tmp.mkdir(parents=True, exist_ok=True)
        names = [shard_name(r)]
        (tmp / shard_name(r)).write_bytes(rng.randbytes(shard_bytes))
        if r == 0:
            (tmp / METADATA).write_bytes(rng.randbytes(1024))
            names.append(METADATA)
        for name in names:
            os.replace(tmp / name, step_dir / name)
        tmp.rmdir()
        m = make_manifest(
            job_id=job_id,
            step=step,
            rank=r,
            world_size=world,
            node=node,
            directory=step_dir,
            names=names,
            signature=SIGNATURE,
            created_at="2026-01-01T00:00:00+00:00",
            key=key,
        )
        atomic_write_json(step_dir / manifest_name(r), m)
        manifests[r] = m
    if commit:
        for r in ranks:
            marker = CommitMarker(
                job_id=job_id,
                step=step,
                rank=r,
                world_size=world,
                persist=persist,
                retain=retain or {"memory": [step], "peer": [step], "persistent": [step]},
                layout=layout,
                peer_urls=peer_urls or {},
                created_at="2026-01-01T00:00:00+00:00",
            )
            if key is not None:
                marker = sign_commit(marker, key)
            atomic_write_json(step_dir / commit_name(r), marker)
    return manifests


def evict_memory_step(memory_dir: Path, job_id: str, step: int, ranks: list[int]) -> None:
    """Remove ranks' files of a memory step, as the trainer does for steps it does not keep."""
    d = MemoryLayout(memory_dir).step_dir(job_id, step)
    for r in ranks:
        for name in (commit_name(r), manifest_name(r), shard_name(r), METADATA):
            if name != METADATA or r == 0:
                (d / name).unlink(missing_ok=True)


class PeerAs:
    """Another node, as a test plays it: its own key, certified by the test authority (and
    known to ``receiver``'s registry), signing peer requests as that node."""

    def __init__(
        self, node: str, receiver: Receiver | None = None, url: str = "http://127.0.0.1:9"
    ) -> None:
        self.node = node
        self.key = Ed25519PrivateKey.generate()
        self.certificate = AUTHORITY.node_certificate(node, url, public_key_text(self.key))
        if receiver is not None:
            with receiver.lock:
                receiver.certificates[node] = {"url": url, "certificate": self.certificate}

    def auth(self, to: str, method: str, url: str) -> dict[str, str]:
        """The headers of one request to node ``to`` (``url``: the whole URL as sent)."""
        split = urlsplit(url)
        path = unquote(split.path) + (f"?{split.query}" if split.query else "")
        proof = sign_request(self.key, sender=self.node, receiver=to, method=method, path=path)
        return {"Authorization": f"{SCHEME} {proof}", CERT_HEADER: self.certificate}

    def request(self, method: str, url: str, *, to: str, **kw: Any) -> httpx.Response:
        """``httpx.request`` signed for node ``to`` (``headers=`` are added to)."""
        headers = {**kw.pop("headers", {}), **self.auth(to, method, url)}
        return httpx.request(method, url, headers=headers, **kw)


@dataclass
class CkptAgent:
    """A ``tierwatch-agent run`` process with a memory folder, on an ephemeral port."""

    node: str
    workdir: Path
    receiver: Receiver
    persistent_url: str
    port: int = field(default_factory=free_port)
    replication: int = 1
    memory_budget: str | None = None
    extra_args: list[str] = field(default_factory=list)
    preexec_fn: Callable[[], None] | None = None
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        """This node's agent token (the receiver knows which node it is bound to)."""
        return self.receiver.token_for(self.node)

    @property
    def auth(self) -> dict[str, str]:
        """``Authorization`` header of this node's agent token (its administrator)."""
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def memory_dir(self) -> Path:
        return self.workdir / self.node / "mem"

    @property
    def log_path(self) -> Path:
        return self.workdir / self.node / "agent.log"

    def start(self) -> CkptAgent:
        """Start the process and wait until its checkpoint API answers and agent.json is
        written."""
        d = self.workdir / self.node
        d.mkdir(parents=True, exist_ok=True)
        args = [
            str(BIN / "tierwatch-agent"),
            "run",
            "--node",
            self.node,
            "--server",
            self.receiver.url,
            "--token",
            self.token,
            "--state-dir",
            str(d / "state"),
            "--collector",
            "simulated",
            "--sim-gpus",
            "1",
            "--interval",
            "0.2",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--spool-dir",
            str(d / "spool"),
            "--memory-dir",
            str(self.memory_dir),
            "--persistent-url",
            self.persistent_url,
            "--replication",
            str(self.replication),
            "--ckpt-scan-interval",
            "0.2",
            *self.extra_args,
        ]
        if self.memory_budget:
            args += ["--memory-budget", self.memory_budget]
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.popen = subprocess.Popen(
            args, env=base_env(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=self.preexec_fn
        )  # noqa: PLW1509
        log.close()
        self.starts += 1
        wait_until(self._ready, timeout=30, what=f"agent {self.node} up\n{self.log_tail()}")
        return self

    def _ready(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            raise AssertionError(f"agent {self.node} exited:\n{self.log_tail()}")
        try:
            r = httpx.get(f"{self.url}/v1/ckpt/info", headers=self.auth, timeout=1)
            if r.status_code != 200:
                return False
        except httpx.HTTPError:
            return False
        # the local API answers before the checkpoint store has written agent.json, and
        # before the server's registry has certified this node
        with self.receiver.lock:
            certified = self.node in self.receiver.certificates
        return certified and (self.memory_dir / "agent.json").is_file()

    def stop(self) -> int | None:
        """SIGTERM and wait (SIGKILL after 15 s)."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        code = self.popen.returncode
        self.popen = None
        return code

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def notify(self, job_id: str, step: int) -> None:
        r = httpx.post(
            f"{self.url}/v1/ckpt/notify",
            json={"job_id": job_id, "step": step},
            headers=AUTHORITY.job_auth(job_id),
            timeout=5,
        )
        assert r.status_code == 200, r.text

    def replica_dir(self, src: str, job_id: str, step: int) -> Path:
        return MemoryLayout(self.memory_dir).replica_step_dir(src, job_id, step)

    def step_dir(self, job_id: str, step: int) -> Path:
        return MemoryLayout(self.memory_dir).step_dir(job_id, step)


def ckpt_events(
    receiver: Receiver, *, node: str | None = None, epoch: str | None = None, **match: Any
) -> list[CheckpointEvent]:
    """Checkpoint events the receiver got (optionally from one node/epoch, matching fields)."""
    out = []
    for b in receiver.stored():
        if node is not None and b.node != node:
            continue
        if epoch is not None and b.epoch != epoch:
            continue
        for e in b.checkpoint_events:
            if all(getattr(e, k) == v for k, v in match.items()):
                out.append(e)
    return out


def wait_event(
    receiver: Receiver,
    *,
    timeout: float = 20,
    what: str = "event",
    contains: str | None = None,
    agent: CkptAgent | None = None,
    **match: Any,
) -> CheckpointEvent:
    """Wait for a checkpoint event matching ``match`` (and ``contains`` in its message)."""

    def found() -> CheckpointEvent | None:
        for e in ckpt_events(receiver, **match):
            if contains is None or contains in e.message:
                return e
        return None

    extra = f"\n{agent.log_tail()}" if agent is not None else ""
    return wait_until(found, timeout=timeout, what=f"{what} {match} {contains or ''}{extra}")


def batches_from(receiver: Receiver, node: str) -> int:
    """How many batches the receiver stored from ``node``."""
    return sum(1 for b in receiver.stored() if b.node == node)


def wait_more_batches(receiver: Receiver, node: str, n: int, timeout: float = 20) -> None:
    """Wait until ``node`` sent ``n`` more batches (each agent pass runs at least once per
    batch interval here, so this lets the agent's worker run several times)."""
    start = batches_from(receiver, node)
    wait_until(
        lambda: batches_from(receiver, node) >= start + n,
        timeout=timeout,
        what=f"{n} more batches from {node}",
    )


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def mtime_ns(path: Path) -> int:
    return path.stat().st_mtime_ns


def monotonic() -> float:
    return time.monotonic()


def keys_with_credentials(folder: Path, *job_ids: str) -> Any:
    """The agent's :class:`~tierwatch.agent.credential_keys.ServerKeys` (on :data:`AUTHORITY`'s
    key set, from a file in ``folder``) after each job's ranks sent their credential, so it
    knows those jobs' manifest keys: for an in-process ``CheckpointService``."""
    from tierwatch.agent.credential_keys import ServerKeys

    folder.mkdir(parents=True, exist_ok=True)
    keys = ServerKeys(
        server=None, token=None, keys_file=Path(AUTHORITY.write_keys(folder / "jwks"))
    )
    keys.load()
    for job_id in job_ids:
        keys.verify_job(AUTHORITY.job_credential(job_id))
    return keys

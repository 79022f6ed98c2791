"""A simulated cluster for checkpoint tests: a server, agents as nodes, training ranks.

Every node is a real ``tierwatch-agent`` process with its own name, port and memory folder;
every rank is a real Python process running a training script with torch.distributed
(gloo) on loopback. Everything listens on 127.0.0.1 ephemeral ports and is stopped by the
fixture that made it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from procs import BIN, REPO_ROOT, Proc, Server, base_env, free_port, make_server, wait_for

PEER_TOKEN = "peer-" + "t" * 40
TRAIN_GPT = REPO_ROOT / "examples" / "train_gpt.py"


@dataclass
class Node:
    """One simulated node: its agent process and memory folder."""

    name: str
    port: int
    memory_dir: Path
    proc: Proc
    args: list[str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Node:
        self.proc = Proc(self.name, self.args, self.proc.env, self.proc.log_path).start()
        wait_for(lambda: httpx.get(f"{self.url}/v1/ckpt/info", timeout=1).status_code == 200,
                 timeout=30, what=f"agent {self.name}\n{self.proc.log_tail()}")
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.stop(sig)

    def wipe_memory(self) -> None:
        shutil.rmtree(self.memory_dir, ignore_errors=True)


@dataclass
class Cluster:
    """A server (optional) and agents on one machine."""

    root: Path
    persistent_dir: Path
    server: Server | None = None
    nodes: dict[str, Node] = field(default_factory=dict)
    ranks: list[Proc] = field(default_factory=list)

    @property
    def persistent_url(self) -> str:
        return f"file://{self.persistent_dir}"

    def add_node(self, name: str, *, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, start: bool = True) -> Node:
        port = free_port()
        d = self.root / "nodes" / name
        d.mkdir(parents=True, exist_ok=True)
        server_url = self.server.url if self.server else "http://127.0.0.1:9"
        token = self.server.token("agent", name) if self.server else "no-server-token"
        args = [
            str(BIN / "tierwatch-agent"), "run", "--node", name, "--server", server_url,
            "--token", token, "--collector", "simulated", "--interval", "1",
            "--listen", f"127.0.0.1:{port}", "--spool-dir", str(d / "spool"),
            "--sim-gpus", "2", "--memory-dir", str(d / "memory"),
            "--persistent-url", self.persistent_url, "--ckpt-scan-interval", "0.5",
            *(extra_args or []),
        ]
        proc = Proc(name, args, base_env(TIERWATCH_PEER_TOKEN=PEER_TOKEN, **(env or {})),
                    d / "agent.log")
        node = Node(name, port, d / "memory", proc, args)
        self.nodes[name] = node
        if start:
            node.start()
        return node

    def launch(self, script_args: list[str], *, placement: list[str], log_dir: Path,
               script: Path = TRAIN_GPT, env: dict[str, str] | None = None) -> list[Proc]:
        """Start one process per rank; ``placement[r]`` is the node of rank r."""
        port = free_port()
        world = len(placement)
        procs = []
        log_dir.mkdir(parents=True, exist_ok=True)
        for rank, name in enumerate(placement):
            local = placement[:rank].count(name)
            e = base_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                         TIERWATCH_AGENT_URL=self.nodes[name].url,
                         PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", **(env or {}))
            p = Proc(f"rank{rank}", [sys.executable, str(script), *script_args], e,
                     log_dir / f"rank{rank}.out")
            procs.append(p.start())
        self.ranks = procs
        return procs

    def wait_ranks(self, procs: list[Proc], timeout: float) -> list[int]:
        """Wait for every rank to exit; their return codes."""
        def done() -> bool:
            return all(not p.running for p in procs)

        try:
            wait_for(done, timeout=timeout, interval=0.2, what="ranks to exit")
        except TimeoutError:
            tails = "\n".join(f"--- {p.name}\n{p.log_tail(1500)}" for p in procs)
            raise TimeoutError(f"ranks still running after {timeout}s\n{tails}") from None
        codes = [p.stop() for p in procs]
        return [c if c is not None else -1 for c in codes]

    def kill_ranks(self, procs: list[Proc] | None = None) -> None:
        for p in procs or self.ranks:
            if p.running:
                p.stop(signal.SIGKILL)

    def stop(self) -> None:
        self.kill_ranks()
        for node in self.nodes.values():  # signal every agent first, then wait for each
            if node.proc.popen is not None and node.proc.running:
                node.proc.popen.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            node.stop()
        if self.server:
            self.server.stop()


def start_cluster(root: Path, *, with_server: bool) -> Cluster:
    """A cluster whose server (when wanted) uses a SQLite file under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root=root, persistent_dir=root / "persistent")
    cluster.persistent_dir.mkdir()
    if with_server:
        cluster.server = make_server(root / "server", f"sqlite:///{root / 'server.db'}")
        cluster.server.start()
    return cluster


def committed_steps(node: Node, job: str, rank: int) -> list[int]:
    """Steps whose commit marker of ``rank`` exists in the node's memory tier."""
    d = node.memory_dir / "jobs" / job
    if not d.is_dir():
        return []
    return sorted(int(p.parent.name.split("-")[1]) for p in d.glob(f"step-*/commit-{rank}.json"))


def read_losses(log_dir: Path, rank: int = 0) -> dict[int, float]:
    """step → loss from a rank's JSON-lines log (the last line of a step wins)."""
    out: dict[int, float] = {}
    path = log_dir / f"rank-{rank}.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                out[rec["step"]] = rec["loss"]
    return out


def read_restores(log_dir: Path, rank: int = 0) -> list[int | None]:
    """The ``restored_from`` value of every run of a rank, in order."""
    seen: list[int | None] = []
    path = log_dir / f"rank-{rank}.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)["restored_from"]
        if not seen or seen[-1] != r:
            seen.append(r)
    return seen


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
    """``tierwatch-agent ARGS`` with output captured."""
    return subprocess.run([str(BIN / "tierwatch-agent"), *args], capture_output=True,
                          text=True, timeout=timeout, env=base_env(**(env or {})))


__all__ = ["Cluster", "Node", "PEER_TOKEN", "committed_steps", "os", "read_losses",
           "read_restores", "run_cli", "start_cluster"]

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
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import warm
from agent_helpers import AUTHORITY, Receiver
from procs import BIN, REPO_ROOT, Proc, Server, base_env, free_port, make_server, wait_for

from tierwatch.agent.checkpoint.format.layout import parse_step_dirname

TRAIN_GPT = REPO_ROOT / "examples" / "train_gpt.py"


# The small GPT every checkpoint test trains (train_gpt.py's model and data options).
TINY_GPT = ["--width", "32", "--layers", "1", "--block", "32", "--corpus-bytes", "200000",
            "--batch-size", "4", "--warmup", "4"]  # fmt: skip


@dataclass
class Node:
    """One simulated node: its agent process and memory folder."""

    name: str
    port: int
    memory_dir: Path
    proc: Proc
    args: list[str]
    token: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict[str, str]:
        """``Authorization`` header of this node's agent token (the node's administrator)."""
        return {"Authorization": f"Bearer {self.token}"}

    def start(self) -> Node:
        self.proc = Proc(self.name, self.args, self.proc.env, self.proc.log_path).start()
        wait_for(
            lambda: (
                httpx.get(f"{self.url}/v1/ckpt/info", headers=self.auth, timeout=1).status_code
                == 200
            ),
            timeout=30,
            what=f"agent {self.name}\n{self.proc.log_tail()}",
        )
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.proc.stop(sig)

    def wipe_memory(self) -> None:
        shutil.rmtree(self.memory_dir, ignore_errors=True)


@dataclass
class InProcessNode:
    """A node whose agent is an :class:`~tierwatch.agent.runtime.AgentRuntime` in the test
    process: the real agent code (local API, checkpoint store, reporter, command path) on an
    ephemeral port, so a test can hand it a command the way the agent's command executor
    does. Its reports go to the cluster's server, or (none) stay in its spool."""

    name: str
    memory_dir: Path
    spool_dir: Path
    settings: Any
    receiver: Any = None  # the cluster's stand-in server, when it has no server
    runtime: Any = None
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.runtime.api_port}"

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def auth(self) -> dict[str, str]:
        """``Authorization`` header of this node's agent token."""
        return {"Authorization": f"Bearer {self.settings.token.get_secret_value()}"}

    def start(self) -> InProcessNode:
        from tierwatch.agent.runtime import AgentRuntime

        self.runtime = AgentRuntime(self.settings)
        self.runtime.start()
        self._count_request_reads()
        self.thread = threading.Thread(
            target=self.runtime.run, name=f"agent-{self.name}", daemon=True
        )
        self.thread.start()
        wait_for(
            lambda: (
                httpx.get(f"{self.url}/v1/ckpt/info", headers=self.auth, timeout=1).status_code
                == 200
            ),
            timeout=30,
            what=f"in-process agent {self.name}",
        )
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:  # noqa: ARG002 - as Node.stop
        if self.runtime is not None and self.running:
            self.runtime.stop()
            assert self.thread is not None
            self.thread.join(30)

    def _count_request_reads(self) -> None:
        """Count the ranks' reads of ``GET /v1/ckpt/jobs/{job}/restore-requests`` per job (the
        agent's own reads, for pins, are quiet and not counted)."""
        self.request_reads: dict[str, int] = {}
        store = self.runtime.ckpt.requests
        pending = store.pending

        def counted(job_id: str, *, quiet: bool = False) -> Any:
            out = pending(job_id, quiet=quiet)
            if not quiet:
                self.request_reads[job_id] = self.request_reads.get(job_id, 0) + 1
            return out

        store.pending = counted

    def deliver(self, command: Any) -> None:
        """Hand ``command`` to the agent as its command executor does for a restore."""
        self.runtime.ckpt.add_restore_request(command)

    def deliver_and_wait_read(self, command: Any, timeout: float = 30) -> None:
        """:meth:`deliver`, then wait until this node's ranks have read the job's requests
        twice: the second read started after the delivery, so every local rank's poller now
        holds the request (and the step it pins)."""
        job = command.args["job_id"]
        before = self.request_reads.get(job, 0)
        self.deliver(command)
        wait_for(
            lambda: self.request_reads.get(job, 0) >= before + 2,
            timeout=timeout,
            interval=0.02,
            what=f"{self.name}'s ranks reading {job}'s restore requests",
        )

    def spooled_restores(self) -> list[dict[str, Any]]:
        """Restore reports in the batches this agent built: those it has not delivered (its
        spool) and those the cluster's receiver, standing in for the server, holds."""
        out: list[dict[str, Any]] = []
        if self.receiver is not None:
            for batch in self.receiver.stored():
                if batch.node == self.name:
                    out += [r.model_dump(mode="json") for r in batch.restores]
        for p in sorted(self.spool_dir.glob("*.json")):
            try:
                out += json.loads(p.read_text()).get("restores", [])
            except (OSError, ValueError):
                continue
        return out


def runs_of(lines: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A rank's log (``read_log``) split where the step goes back: a rollback or a restart."""
    out: list[list[dict[str, Any]]] = [[]]
    for x in lines:
        if out[-1] and x["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(x)
    return out


class Background:
    """``fn()`` on a thread; :meth:`join` waits for it and raises what it raised."""

    def __init__(self, fn: Any) -> None:
        self.error: BaseException | None = None
        self.result: Any = None

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to join()
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float = 300) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"background work still running after {timeout}s")
        if self.error is not None:
            raise self.error
        return self.result


def run_in_thread(fn: Any) -> Background:
    """Start ``fn()`` in the background (see :class:`Background`)."""
    return Background(fn)


@dataclass
class Gate:
    """The file a gated trainer (``train_gpt.py --gate FILE``) waits on before each step: the
    test, not a sleep, sets the pace of the run."""

    path: Path

    def open(self, steps: int) -> None:
        """Let steps ``0 … steps-1`` run (atomically, as the trainer expects)."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(str(steps))
        os.replace(tmp, self.path)

    def step_until(
        self, first: int, last: int, done: Any, *, log_dir: Path, timeout: float = 60
    ) -> int:
        """Open steps one by one from ``first`` up to ``last``, each once rank 0 has logged
        the one before, until ``done()`` holds; returns the number of steps then open.

        Raises:
            TimeoutError: a step was not logged within ``timeout``, or ``done`` never held.
        """
        for n in range(first, last + 1):
            self.open(n)
            if done():
                return n
            wait_for(
                lambda n=n: done() or any(x.get("step") == n - 1 for x in read_log(log_dir)[-3:]),
                timeout=timeout,
                what=f"step {n - 1} logged",
            )
        if done():
            return last
        raise TimeoutError(f"steps up to {last} ran and the condition still does not hold")


def restore_command(
    *,
    request_id: int,
    job_id: str,
    step: int,
    tier: str | None = None,
    reason: str = "test rollback",
    actor: str = "pytest",
) -> Any:
    """A ``restore`` Command exactly as the server sends it to each of the job's agents."""
    from tierwatch.agent.protocol import Command

    return Command(
        id=uuid.uuid4().hex[:24],
        kind="restore",
        args={
            "request_id": request_id,
            "job_id": job_id,
            "step": step,
            "tier": tier,
            "reason": reason,
            "actor": actor,
        },
    )


@dataclass
class Cluster:
    """A server (optional) and agents on one machine."""

    root: Path
    persistent_dir: Path
    server: Server | None = None
    # without a server, a receiver stands in for it (ingest, public keys, node certificates,
    # the peer and job registry; tests/helpers/agent_helpers.py)
    receiver: Receiver | None = None
    nodes: dict[str, Any] = field(default_factory=dict)  # Node or InProcessNode
    ranks: list[Proc] = field(default_factory=list)

    @property
    def persistent_url(self) -> str:
        return f"file://{self.persistent_dir}"

    def control_plane(self, name: str) -> tuple[str, str]:
        """(server URL, agent token of node ``name``): the server's, or the receiver's."""
        if self.server:
            return self.server.url, self.server.token("agent", name)
        if self.receiver is None:
            self.receiver = Receiver()
        return self.receiver.url, self.receiver.token_for(name)

    def job_credential(self, job_id: str, nodes: list[str]) -> str:
        """The credential of ``job_id`` on ``nodes``: registered with the server (as a
        launcher does), or with the receiver and signed by the test authority."""
        if self.server:
            return self.server.job_credential(job_id, nodes)
        if self.receiver is not None:
            self.receiver.register_job(job_id, nodes)
        return AUTHORITY.job_credential(job_id)

    def add_node(
        self,
        name: str,
        *,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        start: bool = True,
    ) -> Node:
        port = free_port()
        d = self.root / "nodes" / name
        d.mkdir(parents=True, exist_ok=True)
        server_url, token = self.control_plane(name)
        args = [
            str(BIN / "tierwatch-agent"),
            "run",
            "--node",
            name,
            "--server",
            server_url,
            "--token",
            token,
            "--collector",
            "simulated",
            "--interval",
            "1",
            "--listen",
            f"127.0.0.1:{port}",
            "--spool-dir",
            str(d / "spool"),
            "--sim-gpus",
            "2",
            "--memory-dir",
            str(d / "memory"),
            "--persistent-url",
            self.persistent_url,
            "--ckpt-scan-interval",
            "0.5",
            "--state-dir",
            str(d / "state"),
            *(extra_args or []),
        ]
        # A test that stops the receiver must not wait on a whole shutdown flush.
        flush = {} if self.server else {"TIERWATCH_SHUTDOWN_FLUSH_S": "0.2"}
        proc = Proc(
            name,
            args,
            base_env(**{**flush, **(env or {})}),
            d / "agent.log",
        )
        node = Node(name, port, d / "memory", proc, args, token)
        self.nodes[name] = node
        if start:
            node.start()
        return node

    def add_inprocess_node(self, name: str, *, start: bool = True) -> InProcessNode:
        """A node whose agent runs in the test process (see :class:`InProcessNode`)."""
        from tierwatch.agent.config import AgentSettings

        d = self.root / "nodes" / name
        d.mkdir(parents=True, exist_ok=True)
        server_url, token = self.control_plane(name)
        settings = AgentSettings(
            node=name,
            server=server_url,
            token=token,
            collector="simulated",
            interval=1,
            listen="127.0.0.1:0",
            spool_dir=d / "spool",
            sim_gpus=2,
            memory_dir=d / "memory",
            persistent_url=self.persistent_url,
            ckpt_scan_interval=0.5,
            state_dir=d / "state",
            log_level="INFO",
            shutdown_flush_s=1.0 if self.server else 0.2,
        )
        node = InProcessNode(name, d / "memory", d / "spool", settings, self.receiver)
        self.nodes[name] = node
        if start:
            node.start()
        return node

    def launch(
        self,
        script_args: list[str],
        *,
        placement: list[str],
        log_dir: Path,
        script: Path = TRAIN_GPT,
        env: dict[str, str] | None = None,
        job_id: str | None = None,
    ) -> list[Proc]:
        """Start one process per rank; ``placement[r]`` is the node of rank r.

        The job (``job_id``, default: the script's ``--job-id``, else ``gpt-small``) is
        registered on the placement's nodes first and its credential handed to every rank in
        ``TIERWATCH_JOB_CREDENTIAL``, as a launcher does; an ``env`` that sets it wins."""
        if job_id is None:
            job_id = (
                script_args[script_args.index("--job-id") + 1]
                if "--job-id" in script_args
                else "gpt-small"
            )
        env = dict(env or {})
        if "TIERWATCH_JOB_CREDENTIAL" not in env:
            env["TIERWATCH_JOB_CREDENTIAL"] = self.job_credential(job_id, placement)
        port = free_port()
        world = len(placement)
        procs = []
        log_dir.mkdir(parents=True, exist_ok=True)
        for rank, name in enumerate(placement):
            local = placement[:rank].count(name)
            e = base_env(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(local),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TIERWATCH_AGENT_URL=self.nodes[name].url,
                PYTHONPATH=str(REPO_ROOT),
                OMP_NUM_THREADS="1",
                **(env or {}),
            )
            procs.append(
                warm.start_rank(f"rank{rank}", script, script_args, e, log_dir / f"rank{rank}.out")
            )
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
            proc = getattr(node, "proc", None)
            if proc is not None and proc.popen is not None and proc.running:
                proc.popen.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            node.stop()
        if self.server:
            self.server.stop()
        if self.receiver is not None:
            self.receiver.stop()


def start_cluster(
    root: Path, *, with_server: bool, server_env: dict[str, str] | None = None
) -> Cluster:
    """A cluster whose server (when wanted) uses a SQLite file under ``root``; ``server_env``
    adds ``TIERWATCH_*`` settings to the server process."""
    root.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(root=root, persistent_dir=root / "persistent")
    cluster.persistent_dir.mkdir()
    if with_server:
        cluster.server = make_server(
            root / "server", f"sqlite:///{root / 'server.db'}", **(server_env or {})
        )
        cluster.server.start()
    return cluster


def committed_steps(node: Node, job: str, rank: int) -> list[int]:
    """Steps whose commit marker of ``rank`` exists in the node's memory tier."""
    d = node.memory_dir / "jobs" / job
    if not d.is_dir():
        return []
    return sorted(parse_step_dirname(p.parent.name) for p in d.glob(f"step-*/commit-{rank}.json"))


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


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``tierwatch-agent ARGS`` with output captured."""
    return subprocess.run(
        [str(BIN / "tierwatch-agent"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=base_env(**(env or {})),
    )


def read_log(log_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Every line of a rank's JSON-lines log, in order (runs and rollbacks included)."""
    path = log_dir / f"rank-{rank}.jsonl"
    return (
        [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    )


__all__ = [
    "Background",
    "Cluster",
    "Gate",
    "InProcessNode",
    "Node",
    "TINY_GPT",
    "committed_steps",
    "read_log",
    "read_losses",
    "read_restores",
    "restore_command",
    "run_cli",
    "run_in_thread",
    "runs_of",
    "start_cluster",
]

"""The demo's simulated cluster: a tierwatch-server and one tierwatch-agent per node.

Every node is a real ``tierwatch-agent run --collector simulated`` process (``nvml`` when
this machine has NVIDIA GPUs: then every node reads the same real GPUs) with its own name,
local API port (127.0.0.1), memory-tier folder and spool; all of them share one persistent
tier (a folder under the demo's state dir). The server runs with SQLite and the
auto-isolation policy on. Nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

BIN = Path(sys.executable).parent


def end_child(proc: subprocess.Popen[bytes] | None, sig: int, timeout: float) -> None:
    """Send ``sig`` to a still-running child and wait for it; SIGKILL after ``timeout`` s."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def detach() -> None:
    """In a child, before exec: a session of its own (a terminal's Ctrl-C reaches only the
    demo, which then stops its children in order, after the final report), and SIGTERM
    when the demo dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``), so nothing outlives
    it."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def wait_http(
    url: str, timeout: float, *, alive: Any, headers: dict[str, str] | None = None
) -> bool:
    """Poll ``url`` until it answers 200 (True), or ``alive()`` turns False or ``timeout``
    seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and alive():
        try:
            if httpx.get(url, headers=headers, timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def port_free(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 can be bound now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def nvml_gpus(nvml: Any = None) -> int:
    """How many GPUs NVML shows on this machine (0 without NVML, a driver or a GPU).

    ``nvml``: a pynvml module (default: nvidia-ml-py's), as the agent's NVML collector
    takes it.
    """
    from tierwatch.agent.collectors.nvml import NvmlCollector

    collector = NvmlCollector(nvml=nvml)
    try:
        return int(collector.nvml.nvmlDeviceGetCount()) if collector.is_available() else 0
    except Exception:  # noqa: BLE001 - any NVML trouble means: simulate
        return 0
    finally:
        try:
            collector.shutdown()
        except Exception:  # noqa: BLE001 - nothing to release
            pass


def server_env(
    var: Path,
    *,
    report: Path,
    policy_unreachable_s: float,
    quiet_s: float,
    prometheus_url: str = "",
) -> dict[str, str]:
    """The server's environment in the demo (its own ``TIERWATCH_*`` only).

    The demo compresses time (failures a minute apart), so it sets what a cluster would set
    in hours: the policy isolates a node unreachable for ``policy_unreachable_s`` seconds;
    its breaker allows 2 of the 5 nodes per 2 minutes; the health engine keeps an XID, ECC
    or temperature reason for ``quiet_s`` seconds after its last finding (so a repaired node
    shows healthy again); the policy also acts on ``CHECK_COOLING`` (a GPU past its slowdown
    temperature takes the job down in the demo). With ``prometheus_url`` (``DEMO_PROMETHEUS=1``,
    :mod:`demo.prometheus`) the node charts read from that Prometheus.
    """
    quiet = {
        "xid": quiet_s,
        "ecc_uncorrectable": quiet_s,
        "temperature": quiet_s,
        "xid_repeat": quiet_s,
    }
    return {
        "TIERWATCH_DATABASE_URL": f"sqlite:///{var / 'tierwatch.db'}",
        "TIERWATCH_SECRET_KEY": secrets.token_urlsafe(48),
        # the demo serves plain HTTP on loopback: a Secure cookie would not come back from
        # every browser (Safari), and the dashboard sign-in would fail
        "TIERWATCH_SESSION_COOKIE_SECURE": "0",
        "TIERWATCH_POLICY__ENABLED": "true",
        "TIERWATCH_POLICY__UNREACHABLE_S": f"{policy_unreachable_s:g}",
        "TIERWATCH_POLICY__BREAKER_PCT": "40",
        "TIERWATCH_POLICY__BREAKER_WINDOW_S": "120",
        # time is compressed (1 s reports, 3 s unreachable): the control-plane guard's window
        # after the server starts shrinks with it (300 s by default)
        "TIERWATCH_POLICY__CONTROL_PLANE_WINDOW_S": "10",
        "TIERWATCH_POLICY__ACTIONS": json.dumps(
            ["RESET_GPU", "RESTART_BM", "REPLACE_GPU", "CHECK_COOLING"]
        ),
        "TIERWATCH_HEALTH__QUIET_PERIOD_S": json.dumps(quiet),
        "TIERWATCH_BACKGROUND_TICK_S": "0.5",
        "TIERWATCH_DEMO_REPORT": str(report),
        **({"TIERWATCH_PROMETHEUS_URL": prometheus_url} if prometheus_url else {}),
    }


@dataclass
class Node:
    """One simulated node: its agent process (when running) and its folders."""

    name: str
    port: int
    memory_dir: Path
    spool_dir: Path
    state_dir: Path
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    token: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict[str, str]:
        """``Authorization`` header of the node's agent token (the agent accepts faults and
        its own info only with it: loopback alone grants nothing)."""
        return {"Authorization": f"Bearer {self.token}"}

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the agent (a no-op while it runs)."""
        if self.running:
            return
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=detach
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until the agent's local API answers.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout`` seconds.
        """
        if not wait_http(
            f"{self.url}/v1/ckpt/info", timeout, alive=lambda: self.running, headers=self.auth
        ):
            raise RuntimeError(
                f"agent {self.name} exited or did not answer in {timeout:g} s; see {self.log_path}"
            )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Signal the agent and wait for it (SIGKILL after ``timeout``)."""
        end_child(self.proc, sig, timeout)
        if self.log is not None:
            self.log.close()
            self.log = None

    def wipe_memory(self) -> None:
        """Lose the node's memory tier (and the replicas it held for its peers)."""
        shutil.rmtree(self.memory_dir, ignore_errors=True)

    def drop_replicas(self) -> int:
        """Remove the peer replicas this node holds; returns how many step folders went."""
        root = self.memory_dir / "replicas"
        steps = list(root.glob("*/*/step-*")) if root.is_dir() else []
        shutil.rmtree(root, ignore_errors=True)
        return len(steps)

    def inject(self, fault: str, gpu: int | None = None, value: float | None = None) -> str:
        """Inject a fault into the agent's simulated collector (``POST /v1/inject``).

        Raises:
            RuntimeError: the agent refused it (the message says why).
        """
        body: dict[str, Any] = {"fault": fault}
        if gpu is not None:
            body["gpu"] = gpu
        if value is not None:
            body["value"] = value
        r = httpx.post(f"{self.url}/v1/inject", json=body, headers=self.auth, timeout=5)
        if r.status_code != 200:
            raise RuntimeError(f"agent {self.name} refused {body}: {r.status_code} {r.text}")
        return str(r.json().get("message", fault))


@dataclass
class Cluster:
    """The server and the nodes; owns their processes.

    Attributes:
        url: the server's base URL; token: an operator token (dashboard sign-in and API).
    """

    var: Path
    port: int
    agent_port: int
    gpus: int
    interval_s: float
    report: Path
    policy_unreachable_s: float = 3.0
    quiet_s: float = 5.0
    collector: str = "simulated"  # or "nvml": every agent reads this machine's real GPUs
    prometheus_url: str = ""  # the node charts read from this Prometheus (DEMO_PROMETHEUS=1)
    env: dict[str, str] = field(default_factory=dict)
    nodes: dict[str, Node] = field(default_factory=dict)
    server: subprocess.Popen[bytes] | None = None
    token: str = ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def logs(self) -> Path:
        return self.var / "logs"

    @property
    def persistent_dir(self) -> Path:
        return self.var / "persistent"

    def agent_targets(self, count: int) -> list[str]:
        """The ``host:port`` of the first ``count`` nodes' agents (their local API serves
        ``/metrics``): what a Prometheus scrapes (:mod:`demo.prometheus`)."""
        return [f"127.0.0.1:{self.agent_port + i}" for i in range(count)]

    def _cli(self, *args: str) -> str:
        return subprocess.run(
            [str(BIN / "tierwatch-server"), *args],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    def start_server(self) -> None:
        """Fresh database, migrations, an operator token, then ``serve``; waits for /healthz.

        Raises:
            RuntimeError: the server did not come up in 60 s (its log is named).
        """
        self.var.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        for stale in self.var.glob("tierwatch.db*"):
            stale.unlink()
        base = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
        self.env = {
            **base,
            **server_env(
                self.var,
                report=self.report,
                policy_unreachable_s=self.policy_unreachable_s,
                quiet_s=self.quiet_s,
                prometheus_url=self.prometheus_url,
            ),
        }
        self._cli("migrate")
        self.token = self._cli("token", "create", "--role", "operator", "--label", "demo")
        log = open(self.logs / "server.log", "wb")  # noqa: SIM115 - lives as long as the child
        self.server = subprocess.Popen(
            [
                str(BIN / "tierwatch-server"),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=detach,
        )
        server = self.server
        if not wait_http(f"{self.url}/healthz", 60, alive=lambda: server.poll() is None):
            raise RuntimeError(f"the server did not start; see {self.logs / 'server.log'}")

    def add_node(self, name: str, index: int) -> Node:
        """Create node ``name`` (an agent token, its folders, its argv) and start its agent."""
        token = self._cli("token", "create", "--role", "agent", "--node", name)
        d = self.var / "nodes" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        token_file = d / "agent-token"  # not argv: every local user can read argv
        token_file.write_text(token)
        token_file.chmod(0o600)
        port = self.agent_port + index
        node = Node(
            name=name,
            port=port,
            memory_dir=d / "memory",
            spool_dir=d / "spool",
            state_dir=d / "state",
            log_path=self.logs / f"{name}.log",
            token=token,
            argv=[
                str(BIN / "tierwatch-agent"),
                "run",
                "--node",
                name,
                "--server",
                self.url,
                "--token-file",
                str(token_file),
                "--collector",
                self.collector,
                "--interval",
                f"{self.interval_s:g}",
                "--listen",
                f"127.0.0.1:{port}",
                "--spool-dir",
                str(d / "spool"),
                "--memory-dir",
                str(d / "memory"),
                "--state-dir",
                str(d / "state"),
                "--persistent-url",
                self.persistent_dir.resolve().as_uri(),
                "--ckpt-scan-interval",
                "0.5",
                *(
                    ["--sim-gpus", str(self.gpus), "--sim-seed", str(index + 1)]
                    if self.collector == "simulated"
                    else []
                ),
            ],
            env={
                **{k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")},
            },
        )
        self.nodes[name] = node
        node.start()
        return node

    # -- the server's view -------------------------------------------------------------
    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One REST call as the demo's operator."""
        return httpx.request(
            method,
            f"{self.url}/api/v1{path}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
            **kw,
        )

    def job_credential(self, job_id: str, nodes: list[str]) -> str:
        """Register ``job_id`` on ``nodes`` (``POST /api/v1/jobs/{job_id}/credential``, as a
        launcher does) and return the job credential its ranks show their agents.

        Raises:
            RuntimeError: the server refused (the message says why).
        """
        r = self.api(
            "POST",
            f"/jobs/{job_id}/credential",
            json={"nodes": list(dict.fromkeys(nodes)), "world_size": len(nodes)},
        )
        if r.status_code != 200:
            raise RuntimeError(f"cannot register job {job_id}: {r.status_code} {r.text}")
        return str(r.json()["credential"])

    def node_views(self) -> dict[str, dict[str, Any]]:
        """``GET /api/v1/nodes`` by name (state, isolated, last_seen …)."""
        r = self.api("GET", "/nodes")
        r.raise_for_status()
        return {n["name"]: n for n in r.json()["nodes"]}

    def stop(self) -> None:
        """Stop the agents (they flush their last batch), then the server."""
        for node in self.nodes.values():
            if node.running and node.proc is not None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes.values():
            node.stop()
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            try:
                self.server.wait(15)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()

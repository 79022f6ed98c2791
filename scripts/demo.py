"""`make demo`: a control plane and simulated GPU nodes on this machine.

Starts tierwatch-server on http://127.0.0.1:8000 (SQLite under var/) and 4 agents with 8
simulated GPUs each, prints the dashboard URL, a sign-in token and commands to inject faults,
then runs until Ctrl-C (or for --seconds, then exits 0).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=0, help="run this long (0: until Ctrl-C)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--interval", type=float, default=2.0, help="agent report interval (s)")
    parser.add_argument("--agent-port", type=int, default=9470, help="first agent's local port")
    parser.add_argument("--var-dir", type=Path, default=REPO / "var" / "demo", help="state dir")
    args = parser.parse_args()
    VAR = args.var_dir  # noqa: N806

    ports = [args.port] + [args.agent_port + i for i in range(args.nodes)]
    busy = [p for p in ports if not port_free(p)]
    if busy:
        print(
            f"error: port(s) {busy} on 127.0.0.1 are in use (another demo running?); stop that "
            "process or pass --port / --agent-port",
            file=sys.stderr,
        )
        return 2

    VAR.mkdir(parents=True, exist_ok=True)
    db = VAR / "tierwatch.db"
    # A fresh database each run, so the spools of a previous run go too (their batches would
    # replay old readings into it).
    for stale in VAR.glob("tierwatch.db*"):
        stale.unlink()
    shutil.rmtree(VAR / "spool", ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
    env.update(
        TIERWATCH_DATABASE_URL=f"sqlite:///{db}",
        TIERWATCH_SECRET_KEY=secrets.token_urlsafe(48),
    )

    def cli(*a: str) -> str:
        return subprocess.run(
            [str(BIN / "tierwatch-server"), *a], env=env, check=True, capture_output=True, text=True
        ).stdout.strip()

    cli("migrate")
    signin = cli("token", "create", "--role", "operator", "--label", "demo")
    nodes = [f"gpu-node-{i + 1:02d}" for i in range(args.nodes)]
    agent_tokens = {n: cli("token", "create", "--role", "agent", "--node", n) for n in nodes}

    procs: list[subprocess.Popen[bytes]] = []
    logs = VAR / "logs"
    logs.mkdir(exist_ok=True)

    def spawn(name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> None:
        log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the child
        procs.append(
            subprocess.Popen(argv, env={**env, **(extra_env or {})}, stdout=log, stderr=log)
        )

    url = f"http://127.0.0.1:{args.port}"
    spawn("server", [str(BIN / "tierwatch-server"), "serve", "--port", str(args.port)])
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or procs[0].poll() is not None:
            print(f"error: the server did not start; see {logs / 'server.log'}", file=sys.stderr)
            stop(procs)
            return 1
        time.sleep(0.2)

    for i, node in enumerate(nodes):
        spawn(
            node,
            [
                str(BIN / "tierwatch-agent"), "run",
                "--node", node, "--server", url, "--token", agent_tokens[node],
                "--collector", "simulated", "--interval", str(args.interval),
                "--listen", f"127.0.0.1:{args.agent_port + i}",
                "--spool-dir", str(VAR / "spool" / node),
                "--memory-dir", str(VAR / "memory" / node),
                "--sim-gpus", str(args.gpus), "--sim-seed", str(i + 1),
                "--sim-job", "demo-allreduce", "--sim-rank", str(i),
            ],
        )

    print(
        f"""
tierwatch demo is running ({args.nodes} simulated nodes x {args.gpus} GPUs)

  dashboard : {url}/
  sign in   : {signin}
  API       : curl -H 'Authorization: Bearer {signin}' {url}/api/v1/nodes
  metrics   : curl {url}/metrics
  logs      : {logs}

Inject a fault into a node (agent ports {args.agent_port}..{args.agent_port + args.nodes - 1}):
  .venv/bin/tierwatch-agent inject --agent http://127.0.0.1:{args.agent_port} xid 79 --gpu 3
  .venv/bin/tierwatch-agent inject --agent http://127.0.0.1:{args.agent_port + 1} thermal --gpu 0
  .venv/bin/tierwatch-agent inject --agent http://127.0.0.1:{args.agent_port + 2} straggle
  .venv/bin/tierwatch-agent inject --agent http://127.0.0.1:{args.agent_port} clear
""",
        flush=True,
    )

    stopping = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    end = time.monotonic() + args.seconds if args.seconds > 0 else None
    failed = None
    while not stopping and (end is None or time.monotonic() < end):
        for p in procs:
            if p.poll() is not None:
                failed = p
                break
        if failed:
            break
        time.sleep(0.5)
    stop(procs)
    if failed is not None:
        print(f"error: a demo process exited early ({failed.args[0]}); see {logs}", file=sys.stderr)
        return 1
    print("demo stopped", flush=True)
    return 0


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop the agents first and wait for them (they flush their last batch to the running
    server), then the server; SIGKILL what does not stop within 15 s."""
    server, agents = procs[:1], procs[1:]
    for group in (agents, server):
        for p in group:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in group:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (KeyboardInterrupt, subprocess.CalledProcessError) as exc:
        # Ctrl-C during set-up (the children started so far got the same SIGINT).
        what = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"set-up failed: {exc}"
        print(f"demo {what}", file=sys.stderr)
        sys.exit(130 if isinstance(exc, KeyboardInterrupt) else 1)

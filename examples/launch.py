"""Start a training script on several simulated nodes of one machine, one process per rank.

Each simulated node is a tierwatch agent with its own URL; its ranks get
``TIERWATCH_AGENT_URL`` pointing at it, and the usual torch.distributed environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``)::

    python examples/launch.py --node node-a=http://127.0.0.1:9471 \\
        --node node-b=http://127.0.0.1:9472 --ranks-per-node 2 -- \\
        examples/train_gpt.py --job-id gpt-small --steps 200

With ``--standby GO_FILE --nnodes N`` the ranks start before their nodes are known: each
imports its libraries and waits until a supervisor writes GO_FILE
(``{"nodes": [[NAME, AGENT_URL], ...]}``); ``TIERWATCH_GO_FILE`` tells the script where it
is (``examples/train_gpt.py`` reads it). The demo keeps such a warm incarnation ready so a
relaunch after a failure skips Python's and torch's start-up. ``--ranks-file`` writes every
rank's pid and node, for a supervisor that needs to find a rank.

On a real cluster use ``torchrun`` (or Slurm's ``srun``) and set ``TIERWATCH_AGENT_URL`` per
node instead. When one rank exits with an error, the launcher stops the others (they would
wait in a collective until it times out) and exits with that rank's code.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from tierwatch.agent.netutil import free_port


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, even by kill -9
    (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing), so no rank outlives its launcher."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def parse_node(spec: str, p: argparse.ArgumentParser) -> tuple[str, str]:
    """``NAME=URL`` → (name, url); exits with a usage error otherwise."""
    name, sep, url = spec.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        p.error(f"--node {spec!r}: use NAME=http://HOST:PORT")
    return name, url


def read_go(path: str, nnodes: int) -> list[tuple[str, str]]:
    """The nodes a go file names.

    Raises:
        ValueError: not ``{"nodes": [[NAME, URL], …]}`` with ``nnodes`` entries.
    """
    with open(path) as f:
        body = json.load(f)
    nodes = body.get("nodes") if isinstance(body, dict) else None
    if (
        not isinstance(nodes, list)
        or len(nodes) != nnodes
        or not all(
            isinstance(n, list) and len(n) == 2 and all(isinstance(x, str) for x in n)
            for n in nodes
        )
    ):
        raise ValueError(
            f'{path}: expected {{"nodes": [[NAME, AGENT_URL], …]}} with '
            f"{nnodes} nodes, got {body!r}"
        )
    return [(n[0], n[1]) for n in nodes]


def wait_for_go(
    path: str, nnodes: int, procs: list[subprocess.Popen[bytes]]
) -> list[tuple[str, str]] | None:
    """Block until ``path`` exists and names the nodes; None when a rank died first or
    the file is malformed (the error is printed)."""
    while not os.path.exists(path):
        if any(q.poll() is not None for q in procs):
            print(
                "[launch] a standby rank exited before the go file came",
                file=sys.stderr,
                flush=True,
            )
            return None
        time.sleep(0.05)
    try:
        return read_go(path, nnodes)
    except (OSError, ValueError) as exc:
        print(f"[launch] {exc}", file=sys.stderr, flush=True)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one process per rank over simulated nodes")
    p.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NAME=AGENT_URL",
        help="a simulated node and its agent's URL (repeat per node)",
    )
    p.add_argument(
        "--standby",
        default=None,
        metavar="GO_FILE",
        help="start the ranks now, before their nodes are known: each imports its "
        'libraries, then waits for GO_FILE ({"nodes": [[NAME, AGENT_URL], …]}, '
        "written atomically by a supervisor); a warm relaunch skips the imports",
    )
    p.add_argument(
        "--nnodes", type=int, default=0, help="with --standby: how many nodes GO_FILE will name"
    )
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--master-port", type=int, default=0, help="default: a free port")
    p.add_argument(
        "--ranks-file",
        default=None,
        metavar="PATH",
        help='write {"ranks": [{rank, pid, node}]} here once every rank started '
        "(a supervisor uses it to find the process of a rank)",
    )
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = p.parse_args(argv)
    script = [a for a in args.script if a != "--"] if args.script[:1] == ["--"] else args.script
    if not script:
        p.error("give the training script after --")
    if args.ranks_per_node < 1:
        p.error("--ranks-per-node must be ≥ 1")
    if bool(args.standby) == bool(args.node):
        p.error("give the nodes (--node NAME=URL …) or --standby GO_FILE --nnodes N, not both")
    if args.standby and args.nnodes < 1:
        p.error("--standby needs --nnodes N (N ≥ 1): the number of nodes GO_FILE will name")
    nodes = [parse_node(spec, p) for spec in args.node]
    nnodes = args.nnodes if args.standby else len(nodes)
    world = nnodes * args.ranks_per_node
    port = args.master_port or free_port()
    procs: list[subprocess.Popen[bytes]] = []
    for n in range(nnodes):
        for local in range(args.ranks_per_node):
            rank = n * args.ranks_per_node + local
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(local),
                LOCAL_WORLD_SIZE=str(args.ranks_per_node),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            if args.standby:
                env["TIERWATCH_GO_FILE"] = os.path.abspath(args.standby)
            else:
                env.update(TIERWATCH_AGENT_URL=nodes[n][1], TIERWATCH_NODE=nodes[n][0])
            procs.append(
                subprocess.Popen([sys.executable, *script], env=env, preexec_fn=_die_with_parent)
            )
    if args.standby:
        nodes = wait_for_go(args.standby, nnodes, procs)
        if nodes is None:
            stop = [q for q in procs if q.poll() is None]
            for q in stop:
                q.terminate()
            return 1

    if args.ranks_file:
        placed = [
            {"rank": r, "pid": q.pid, "node": nodes[r // args.ranks_per_node][0]}
            for r, q in enumerate(procs)
        ]
        tmp = f"{args.ranks_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"ranks": placed, "master_port": port}, f)
        os.replace(tmp, args.ranks_file)

    def stop_all(sig: int = signal.SIGTERM) -> None:
        for q in procs:
            if q.poll() is None:
                q.send_signal(sig)

    signal.signal(signal.SIGTERM, lambda *_: stop_all())

    def exit_code(rc: int) -> int:
        return 128 - rc if rc < 0 else rc  # killed by signal N → 128 + N, as a shell says

    code = 0
    try:
        while True:
            codes = [q.poll() for q in procs]  # poll every rank, so a dead one is seen
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                rank, rc = bad[0]
                code = exit_code(rc)
                print(
                    f"[launch] rank {rank} exited with {code}; stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
                stop_all()
                break
            if all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        code = 130
    for q in procs:
        try:
            q.wait(30)
        except subprocess.TimeoutExpired:
            q.kill()
            q.wait(10)
    return code


if __name__ == "__main__":
    sys.exit(main())

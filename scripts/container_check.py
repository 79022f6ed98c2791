"""``make container-check``: start docker-compose.yml's topology inside the images ``make
images`` built, check it against the running containers, print a table and write it into
docs/deployment.md ("Container check").

What runs: the server, the compose ``bootstrap`` and ``register-job`` one-shots, 3 agents and a
3-rank trainer, each in its own working container of its image (``buildah from``), started
with ``buildah run --isolation chroot`` with the image's entry point and user, the compose
file's command, environment, volumes and restart policy. PostgreSQL is the host's (a fresh
database, dropped at the end). The addresses are rewritten for the host's loopback
(scripts/compose_plan.py says how and why); each node's memory tier is a tmpfs shared by its
agent and trainer through a bind mount, as the compose file's tmpfs volume is.

Checks, in order: the health checks of the server and agents pass (run inside each
container, as compose runs them); the bootstrap wrote one token per node (mode 0600, uid
10001) and register-job the job credential; nodes are healthy; the trainer commits steps to
memory, peer and persistent; an XID 79 injected on node-2 makes it unhealthy; a trainer
killed with SIGKILL comes back (compose's ``restart: on-failure``) and resumes from the
memory tier.

Needs root (tmpfs mounts, chown to uid 10001), buildah and the images. Not part of ``make
test``: it takes minutes.

    make images && make container-check
    CONTAINER_CHECK_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/x make container-check
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.docs_section import replace_section  # noqa: E402
from scripts import compose_plan  # noqa: E402

COMPOSE = REPO / "docker-compose.yml"
DOC = REPO / "docs" / "deployment.md"
HEAD = "## Container check (make container-check)"
PREFIX = "tierwatch-check-"
UID = 10001
JOB = "gpt-compose"
NODES = ("node-1", "node-2", "node-3")
TIERS = ("memory", "peer", "persistent")
DEFAULT_DB = "postgresql+psycopg://postgres@127.0.0.1:5432/tierwatch_container_check"


class CheckFailed(RuntimeError):
    """A check did not pass (the message says what was seen)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, every_s: float = 1.0) -> Any:
    """Call ``probe`` until it returns something truthy; raise CheckFailed after
    ``timeout_s`` with the last value or error it gave."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got:
                return got
            last = got
        except Exception as exc:  # noqa: BLE001 - reported below
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(every_s)
    raise CheckFailed(f"{what}: not within {timeout_s:g} s (last: {last})")


# --- buildah ----------------------------------------------------------------------------------


class Buildah:
    """The few buildah calls the check makes (vfs storage, chroot isolation, as ``make
    images`` builds)."""

    def __init__(self) -> None:
        if shutil.which("buildah") is None:
            raise SystemExit("container-check: buildah missing (Debian: apt-get install buildah)")
        self.base = ["buildah", "--storage-driver", os.environ.get("STORAGE_DRIVER", "vfs")]
        self.isolation = os.environ.get("BUILDAH_ISOLATION", "chroot")

    def call(self, *args: str, check: bool = True) -> str:
        out = subprocess.run([*self.base, *args], capture_output=True, text=True)
        if check and out.returncode != 0:
            raise RuntimeError(f"buildah {' '.join(args[:2])}: {out.stderr.strip()}")
        return out.stdout.strip()

    def image_config(self, image: str) -> dict[str, Any]:
        """The image's OCI config (Entrypoint, User, Env, WorkingDir)."""
        out = subprocess.run(
            [*self.base, "inspect", "--type", "image", image], capture_output=True, text=True
        )
        if out.returncode != 0:
            raise SystemExit(f"container-check: no image {image}: run `make images` first")
        return json.loads(out.stdout)["OCIv1"]["config"]

    def fresh_container(self, name: str, image: str) -> None:
        self.call("rm", name, check=False)
        self.call("from", "--pull=false", "--name", name, image)

    def run_argv(self, ctr: str, svc: compose_plan.Service, argv: list[str]) -> list[str]:
        cmd = [*self.base, "run", "--isolation", self.isolation]
        for m in svc.mounts:
            cmd += ["-v", m.option()]
        for k, v in svc.env.items():
            cmd += ["--env", f"{k}={v}"]
        return [*cmd, ctr, "--", *argv]

    def exec(self, ctr: str, argv: list[str], timeout_s: float = 60) -> subprocess.CompletedProcess:
        """Run a command in a running service's container (``docker exec``; shares its root
        file system, not its bind mounts)."""
        return subprocess.run(
            [*self.base, "run", "--isolation", self.isolation, ctr, "--", *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


# --- the running services ---------------------------------------------------------------------


@dataclass
class Running:
    svc: compose_plan.Service
    container: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    starts: int = 0
    exits: list[int] = field(default_factory=list)


class Stack:
    """The services started in their containers, with compose's restart policies applied by
    a watcher thread (``on-failure``: again after a non-zero exit; ``unless-stopped``: again
    after any exit)."""

    def __init__(self, buildah: Buildah, workdir: Path) -> None:
        self.b = buildah
        self.workdir = workdir
        self.running: dict[str, Running] = {}
        self.stopping = False
        self.lock = threading.Lock()
        self.watcher = threading.Thread(target=self._watch, daemon=True)

    def start(self, svc: compose_plan.Service, entrypoint: list[str]) -> Running:
        ctr = PREFIX + svc.name
        self.b.fresh_container(ctr, svc.image)
        run = Running(svc, ctr, [*entrypoint, *svc.command], self.workdir / f"{svc.name}.log")
        self._spawn(run)
        with self.lock:
            self.running[svc.name] = run
        if not self.watcher.is_alive():
            self.watcher.start()
        return run

    def _spawn(self, run: Running) -> None:
        log = open(run.log, "a")  # noqa: SIM115 - the child keeps it
        log.write(f"--- start {run.starts + 1} at {datetime.now(UTC).isoformat()}\n")
        log.flush()
        run.proc = subprocess.Popen(
            self.b.run_argv(run.container, run.svc, run.argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one process group: buildah, its runtime and the command
        )
        log.close()
        run.starts += 1

    def _watch(self) -> None:
        while not self.stopping:
            with self.lock:
                runs = list(self.running.values())
            for run in runs:
                rc = run.proc.poll() if run.proc else None
                if rc is None or len(run.exits) >= run.starts:
                    continue
                run.exits.append(rc)
                policy = run.svc.restart
                if not self.stopping and (
                    policy == "unless-stopped" or (policy == "on-failure" and rc != 0)
                ):
                    time.sleep(1.0)
                    self._spawn(run)
            time.sleep(0.5)

    def wait_exit(self, name: str, timeout_s: float) -> int:
        run = self.running[name]
        assert run.proc is not None
        try:
            return run.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise CheckFailed(f"{name} did not finish within {timeout_s:g} s") from exc

    def kill(self, name: str) -> None:
        """SIGKILL every process of the service's container (buildah, its runtime, the
        command): what ``docker kill`` does."""
        run = self.running[name]
        assert run.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        self.stopping = True
        for run in self.running.values():
            if run.proc and run.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for run in self.running.values():
            if run.proc:
                try:
                    run.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(run.proc.pid, signal.SIGKILL)
                    run.proc.wait()
        for run in self.running.values():
            self.b.call("rm", run.container, check=False)

    def tail(self, name: str, lines: int = 15) -> str:
        run = self.running.get(name)
        if run is None or not run.log.exists():
            return ""
        return "\n".join(run.log.read_text(errors="replace").splitlines()[-lines:])


# --- the database ----------------------------------------------------------------------------


def reset_database(url: str, *, drop_only: bool = False) -> None:
    """Create ``url``'s database afresh on its server (dropped first when it exists)."""
    import sqlalchemy as sa

    target = sa.engine.make_url(url)
    admin = sa.create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{target.database}" WITH (FORCE)')
        if not drop_only:
            c.exec_driver_sql(f'CREATE DATABASE "{target.database}"')
    admin.dispose()


# --- the checks --------------------------------------------------------------------------------


@dataclass
class Row:
    check: str
    ok: bool
    detail: str
    seconds: float


class Check:
    def __init__(self, topology: compose_plan.Topology, stack: Stack, b: Buildah) -> None:
        self.t = topology
        self.stack = stack
        self.b = b
        self.rows: list[Row] = []
        server = topology.service("server")
        self.api = f"http://127.0.0.1:{server.port}"
        self.viewer: str | None = None
        self.http = httpx.Client(timeout=10)

    def row(self, check: str, fn: Callable[[], str]) -> bool:
        t0 = time.monotonic()
        try:
            detail, ok = fn(), True
        except Exception as exc:  # noqa: BLE001 - a failed check is a row, not a crash
            detail, ok = f"{type(exc).__name__}: {exc}", False
        self.rows.append(Row(check, ok, detail, time.monotonic() - t0))
        print(f"container-check: {'ok  ' if ok else 'FAIL'} {check}: {detail}", flush=True)
        return ok

    def healthy(self, name: str, timeout_s: float = 120) -> str:
        svc = self.t.service(name)
        assert svc.health is not None
        ctr = PREFIX + name

        def probe() -> bool:
            run = self.stack.running[name]
            if run.proc and run.proc.poll() is not None and svc.restart == "no":
                raise CheckFailed(f"{name} exited {run.proc.returncode}:\n{self.stack.tail(name)}")
            return self.b.exec(ctr, svc.health, timeout_s=10).returncode == 0

        wait_for(f"{name}'s health check", probe, timeout_s, every_s=2)
        return f"`{' '.join(svc.health[:2])} …` exits 0 inside the container"

    def get(self, path: str) -> Any:
        r = self.http.get(self.api + path, headers={"Authorization": f"Bearer {self.viewer}"})
        r.raise_for_status()
        return r.json()

    def nodes(self) -> dict[str, dict[str, Any]]:
        return {n["name"]: n for n in self.get("/api/v1/nodes")["nodes"]}

    def job(self) -> dict[str, Any] | None:
        r = self.http.get(
            f"{self.api}/api/v1/jobs/{JOB}", headers={"Authorization": f"Bearer {self.viewer}"}
        )
        return r.json() if r.status_code == 200 else None


def tokens_written(volume: Path) -> str:
    """The bootstrap's token files: one per node, mode 0600, owned by uid 10001."""
    found = []
    for node in NODES:
        f = volume / f"{node}.token"
        st = f.stat()
        if st.st_size == 0 or st.st_mode & 0o077 or st.st_uid != UID:
            mode = oct(st.st_mode & 0o777)
            raise CheckFailed(f"{f}: size {st.st_size}, mode {mode}, uid {st.st_uid}")
        found.append(f.name)
    return f"{', '.join(found)}: mode 0600, uid {UID}"


def run_checks(check: Check, stack: Stack, topology: compose_plan.Topology, entry: dict) -> None:
    b = check.b
    vols = stack.workdir / "volumes"

    def start(name: str) -> None:
        stack.start(topology.service(name), entry[topology.service(name).image])

    start("server")
    if not check.row("server health check", lambda: check.healthy("server", 180)):
        raise CheckFailed("the server never became healthy:\n" + stack.tail("server", 30))

    def one_shot(name: str) -> str:
        start(name)
        rc = stack.wait_exit(name, 180)
        if rc != 0:
            raise CheckFailed(f"exit {rc}:\n{stack.tail(name)}")
        return "exit 0"

    check.row("bootstrap (agent tokens) completes", lambda: one_shot("bootstrap"))
    check.row("bootstrap's token files", lambda: tokens_written(vols / "agent-tokens"))
    check.row("register-job (job credential) completes", lambda: one_shot("register-job"))

    def credential() -> str:
        f = vols / "job-credential" / f"{JOB}.credential"
        st = f.stat()
        if st.st_mode & 0o077 or st.st_uid != UID:
            raise CheckFailed(f"{f}: mode {oct(st.st_mode & 0o777)}, uid {st.st_uid}")
        return f"{f.name}: mode 0600, uid {UID}"

    check.row("the job credential file", credential)

    # a viewer token for reading the API, made in the server's container with its environment,
    # as an operator would (`docker compose exec server tierwatch-server token create ...`)
    server = topology.service("server")
    out = subprocess.run(
        b.run_argv(
            PREFIX + "server",
            server,
            [*entry[server.image], "tierwatch-server", "token", "create", "--role", "viewer",
             "--label", "container-check"],
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    if out.returncode != 0:
        raise CheckFailed(f"viewer token: {out.stderr.strip()}")
    check.viewer = out.stdout.strip().splitlines()[-1]

    for n in ("agent-1", "agent-2", "agent-3"):
        start(n)
    for n in ("agent-1", "agent-2", "agent-3"):
        check.row(f"{n} health check", lambda n=n: check.healthy(n, 120))

    def nodes_healthy() -> str:
        def probe() -> dict | None:
            nodes = check.nodes()
            if all(nodes.get(n, {}).get("state") == "healthy" for n in NODES):
                return nodes
            return None

        nodes = wait_for("node-1..3 healthy", probe, 90)
        gpus = sum(len(nodes[n].get("gpus") or []) for n in NODES)
        return f"node-1..3 healthy on the server ({gpus} simulated GPUs)"

    check.row("nodes healthy", nodes_healthy)

    for n in ("trainer-1", "trainer-2", "trainer-3"):
        start(n)

    def three_tiers() -> str:
        def probe() -> dict | None:
            job = check.job()
            tiers = (job or {}).get("tiers") or {}
            steps = {t: (tiers.get(t) or {}).get("newest_step") for t in TIERS}
            return steps if all(v is not None for v in steps.values()) else None

        steps = wait_for("steps in memory, peer and persistent", probe, 420, every_s=3)
        return ", ".join(f"{t} step {s}" for t, s in steps.items())

    if not check.row("trainer checkpoints to memory, peer and persistent", three_tiers):
        raise CheckFailed("no checkpoint in all three tiers:\n" + stack.tail("trainer-1", 30))

    def xid_79() -> str:
        agent = topology.service("agent-2")
        token = (vols / "agent-tokens" / "node-2.token").read_text().strip()
        r = check.http.post(
            f"http://127.0.0.1:{agent.port}/v1/inject",
            json={"fault": "xid", "gpu": 1, "value": 79},
            headers={"Authorization": f"Bearer {token}"},
        )
        r.raise_for_status()

        def probe() -> dict | None:
            node = check.nodes().get("node-2") or {}
            return node if node.get("state") == "unhealthy" else None

        node = wait_for("node-2 unhealthy", probe, 60)
        reasons = "; ".join(x["message"] for x in node.get("reasons") or [])[:160]
        return f"node-2 unhealthy: {reasons}"

    check.row("injected XID 79 makes the node unhealthy", xid_79)

    def killed_trainer_resumes() -> str:
        before = {r["ts"] for r in (check.job() or {}).get("restores") or []}
        killed_at = datetime.now(UTC)
        stack.kill("trainer-2")

        def probe() -> dict | None:
            for r in (check.job() or {}).get("restores") or []:
                if r["ts"] not in before and r["rank"] == 1 and r["step"] is not None:
                    return r
            return None

        r = wait_for("a restore by rank 1 after the kill", probe, 420, every_s=3)
        tiers = r["files_by_tier"]
        if not r["ok"] or not tiers.get("memory") or tiers.get("persistent"):
            raise CheckFailed(f"not a restore from the memory tier: {r}")
        restarts = {n: stack.running[n].starts - 1 for n in ("trainer-1", "trainer-2", "trainer-3")}
        waited = (datetime.fromisoformat(r["ts"]) - killed_at).total_seconds()
        return (
            f"rank 1 restored step {r['step']} ({r['steps_lost']} step(s) lost) in "
            f"{r['seconds']:.2f} s, files by tier {r['files_by_tier']}, {waited:.0f} s after "
            f"the kill; restarts {restarts}"
        )

    check.row("a killed trainer container resumes from memory", killed_trainer_resumes)

    for n in ("server", "agent-1", "agent-2", "agent-3"):
        check.row(f"{n} health check at the end", lambda n=n: check.healthy(n, 30))
    check.row(
        "the memory tiers are tmpfs, and every file written is uid 10001's",
        lambda: volumes_owned(vols, topology),
    )


def volumes_owned(vols: Path, topology: compose_plan.Topology) -> str:
    """Each tmpfs volume is mounted as one, and every file under every volume belongs to uid
    10001 (no container wrote as root)."""
    mounts = {
        ln.split()[1]: ln.split()[2] for ln in Path("/proc/self/mounts").read_text().splitlines()
    }
    for t in topology.tmpfs:
        if mounts.get(str(t.host)) != "tmpfs":
            raise CheckFailed(f"{t.host} is not a tmpfs mount")
    files = 0
    for path in vols.rglob("*"):
        st = path.lstat()
        if st.st_uid != UID:
            raise CheckFailed(f"{path} belongs to uid {st.st_uid}")
        files += 1
    tiers = sum(1 for p in (vols).glob("memory-node-*/**/*") if p.is_file())
    return f"{len(topology.tmpfs)} tmpfs mounts; {files} files and folders, {tiers} in memory tiers"


# --- the table -------------------------------------------------------------------------------


NOT_RUN = [
    "Docker's or podman's own runtime: the containers ran under `buildah run --isolation "
    "chroot`, which gives each its own root file system and mounts but the host's network, "
    "PID and IPC namespaces, no cgroup limits and no seccomp profile",
    "compose networking: no service DNS names and no published ports; every address was "
    "rewritten to a distinct loopback port (scripts/compose_plan.py)",
    "the compose `postgres:16` service: the host's PostgreSQL served a fresh database",
    "compose's own `depends_on`/`restart`/`healthcheck` machinery: the check applies the "
    "file's conditions, restart policies and health commands itself",
    "the `gpu` profile (no GPU here) and Kubernetes (no cluster; the manifests are checked by "
    "`make test`, tests/deploy/test_kubernetes.py)",
]


def table(rows: list[Row], meta: dict[str, str]) -> str:
    lines = [
        f"Run {meta['when']} on this machine ({meta['builder']}; images "
        f"{meta['images']}). {sum(r.ok for r in rows)} of {len(rows)} checks passed.",
        "",
        "| check | result | what was seen | s |",
        "|---|---|---|---|",
    ]
    for r in rows:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(f"| {r.check} | {'pass' if r.ok else 'FAIL'} | {detail} | {r.seconds:.0f} |")
    lines += ["", "What this did not exercise:", ""]
    lines += [f"- {x}" for x in NOT_RUN]
    return "\n".join(lines)


def main() -> int:
    if os.geteuid() != 0:
        raise SystemExit("container-check: run as root (tmpfs mounts and chown to uid 10001)")
    b = Buildah()
    workdir = REPO / "var" / "container-check"
    for m in _mounted_under(workdir):
        subprocess.run(["umount", m], check=False)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    compose = yaml.safe_load(COMPOSE.read_text())
    ports = {n: free_port() for n in ("server", "agent-1", "agent-2", "agent-3", "MASTER_PORT")}
    db = os.environ.get("CONTAINER_CHECK_DATABASE_URL", DEFAULT_DB)
    env = dict(os.environ)
    env["TIERWATCH_SECRET_KEY"] = secrets.token_urlsafe(48)
    topology = compose_plan.plan(compose, env=env, ports=ports, database_url=db, workdir=workdir)
    left = compose_plan.addresses_left(topology, compose)
    if left:
        raise SystemExit("container-check: addresses not rewritten:\n" + "\n".join(left))
    entry: dict[str, list[str]] = {}
    versions = []
    for svc in topology.services:
        if svc.image not in entry:
            cfg = b.image_config(svc.image)
            entry[svc.image] = list(cfg.get("Entrypoint") or [])
            versions.append(f"{svc.image} user {cfg.get('User')}")
    for s in topology.services:
        for m in s.mounts:
            m.host.mkdir(parents=True, exist_ok=True)
    for t in topology.tmpfs:
        subprocess.run(["mount", "-t", "tmpfs", "-o", t.options, "tmpfs", str(t.host)], check=True)
    for d in (workdir / "volumes").iterdir():
        os.chown(d, UID, UID)
    reset_database(db)
    stack = Stack(b, workdir)
    check = Check(topology, stack, b)
    t0 = time.monotonic()
    try:
        run_checks(check, stack, topology, entry)
    except CheckFailed as exc:
        check.rows.append(Row("(stopped early)", False, str(exc).splitlines()[0], 0))
        print(f"container-check: stopped: {exc}", file=sys.stderr)
    finally:
        stack.stop()
        for t in topology.tmpfs:
            subprocess.run(["umount", str(t.host)], check=False)
        with contextlib.suppress(Exception):
            reset_database(db, drop_only=True)
    meta = {
        "when": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "builder": b.call("--version"),
        "images": ", ".join(f"`{v}`" for v in versions),
    }
    block = table(check.rows, meta) + f"\n\nWall time: {time.monotonic() - t0:.0f} s.\n"
    print(block)
    replace_section(DOC, HEAD, "make container-check", block)
    print(f"container-check: logs in {workdir}; wrote {DOC.relative_to(REPO)}")
    return 0 if check.rows and all(r.ok for r in check.rows) else 1


def mount_table() -> dict[str, str]:
    """Mount point -> file system type, from /proc/self/mounts (empty where unreadable)."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return {}
    return {ln.split()[1]: ln.split()[2] for ln in lines}


def _mounted_under(path: Path) -> list[str]:
    return [m for m in mount_table() if m.startswith(str(path))]


if __name__ == "__main__":
    raise SystemExit(main())

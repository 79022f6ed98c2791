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
import stat
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
_TRAINER_DEPENDS = {
    "register-job": "service_completed_successfully",
    **{f"agent-{i}": "service_healthy" for i in (1, 2, 3)},
}
# what run_checks starts, in this order, and the depends_on conditions its waits implement; main
# refuses a compose file that says otherwise (the check would not follow it)
DEPENDS: dict[str, dict[str, str]] = {
    "server": {},
    "bootstrap": {"server": "service_healthy"},
    "register-job": {"server": "service_healthy"},
    **{
        f"agent-{i}": {"server": "service_healthy", "bootstrap": "service_completed_successfully"}
        for i in (1, 2, 3)
    },
    **{f"trainer-{i}": dict(_TRAINER_DEPENDS) for i in (1, 2, 3)},
}


class CheckFailed(RuntimeError):
    """A check did not pass (the message says what was seen)."""


def free_ports(names: list[str]) -> dict[str, int]:
    """A distinct free loopback port per name (every socket is held until all are chosen, so
    the kernel cannot hand out one port twice)."""
    socks: list[socket.socket] = []
    try:
        for _ in names:
            socks.append(socket.socket())
            socks[-1].bind(("127.0.0.1", 0))
        return {n: s.getsockname()[1] for n, s in zip(names, socks, strict=True)}
    finally:
        for s in socks:
            s.close()


def plan_problems(topology: compose_plan.Topology) -> list[str]:
    """Where the compose file's services or their ``depends_on`` differ from what
    ``run_checks`` starts and waits for (``DEPENDS``), or a service has no ``command:`` (the
    image's CMD would run with addresses the plan never saw). Empty when the check can
    follow the file."""
    have = {s.name: s for s in topology.services}
    out = []
    if set(have) != set(DEPENDS):
        missing, extra = sorted(set(DEPENDS) - set(have)), sorted(set(have) - set(DEPENDS))
        out.append(f"the check starts {sorted(DEPENDS)}: missing {missing}, extra {extra}")
    for name, svc in have.items():
        if name in DEPENDS and svc.depends_on != DEPENDS[name]:
            out.append(f"{name}: depends_on {svc.depends_on}, the check waits as {DEPENDS[name]}")
        if not svc.command:
            out.append(f"{name}: no command: in the compose file")
    return out


def restarts(policy: str, rc: int) -> bool:
    """Whether compose's restart policy starts a service again after it exited with ``rc``
    (``on-failure:N``'s retry limit is not applied)."""
    if policy in ("always", "unless-stopped"):
        return True
    if policy == "on-failure" or policy.startswith("on-failure:"):
        return rc != 0
    return False


def stale_runs(proc: Path = Path("/proc")) -> list[int]:
    """Process ids of ``buildah ... run ... tierwatch-check-<service>`` still running: an
    earlier check killed before it could clean up (each is its process group's leader)."""
    pids = []
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (d / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if (
            argv
            and Path(argv[0]).name == "buildah"
            and "run" in argv
            and any(a.startswith(PREFIX) for a in argv)
        ):
            pids.append(int(d.name))
    return sorted(pids)


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
                if not self.stopping and restarts(run.svc.restart, rc):
                    time.sleep(1.0)
                    with self.lock:  # stop() sets stopping under the lock: no spawn after it
                        if self.stopping:
                            return
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
        with self.lock:
            self.stopping = True
        if self.watcher.is_alive():
            self.watcher.join(timeout=10)
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

    def healthy(self, name: str, timeout_s: float = 120, *, never_exited: bool = False) -> str:
        """Wait for the service's health check to pass inside its container. With
        ``never_exited``, fail too when the service exited at any time (a crash its restart
        policy papered over)."""
        svc = self.t.service(name)
        assert svc.health is not None
        ctr = PREFIX + name
        run = self.stack.running[name]

        def probe() -> bool:
            if run.proc and run.proc.poll() is not None and svc.restart == "no":
                raise CheckFailed(f"{name} exited {run.proc.returncode}:\n{self.stack.tail(name)}")
            return self.b.exec(ctr, svc.health, timeout_s=10).returncode == 0

        try:
            wait_for(f"{name}'s health check", probe, timeout_s, every_s=2)
        except CheckFailed as exc:
            raise CheckFailed(f"{exc}; exits {run.exits}:\n{self.stack.tail(name)}") from None
        if never_exited and run.exits:
            raise CheckFailed(f"{name} exited during the run (exit codes {run.exits}), restarted")
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


def private_file(f: Path) -> str:
    """``f`` is a non-empty regular file (not a link) of uid 10001 that neither its group
    nor others can read or write; returns its mode (``0600``)."""
    st = f.lstat()
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or mode & 0o077 or st.st_uid != UID:
        kind = "file" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise CheckFailed(f"{f}: {kind}, size {st.st_size}, mode {mode:04o}, uid {st.st_uid}")
    return f"{mode:04o}"


def tokens_written(volume: Path) -> str:
    """The bootstrap's token files: one per node, private to uid 10001."""
    modes = {private_file(volume / f"{node}.token") for node in NODES}
    names = ", ".join(f"{node}.token" for node in NODES)
    return f"{names}: mode {', '.join(sorted(modes))}, uid {UID}"


def credential_written(volume: Path) -> str:
    """register-job's job credential file, private to uid 10001."""
    f = volume / f"{JOB}.credential"
    return f"{f.name}: mode {private_file(f)}, uid {UID}"


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

    # compose starts no dependent of a failed one-shot or of an unhealthy service
    # (service_completed_successfully / service_healthy): neither does the check
    if not check.row("bootstrap (agent tokens) completes", lambda: one_shot("bootstrap")):
        raise CheckFailed("bootstrap failed: the agents depend on it")
    check.row("bootstrap's token files", lambda: tokens_written(vols / "agent-tokens"))
    if not check.row("register-job (job credential) completes", lambda: one_shot("register-job")):
        raise CheckFailed("register-job failed: the trainers depend on it")
    check.row("the job credential file", lambda: credential_written(vols / "job-credential"))

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
    printed = out.stdout.strip().splitlines()
    if out.returncode != 0 or not printed:
        raise CheckFailed(f"viewer token: exit {out.returncode}: {out.stderr.strip()}")
    check.viewer = printed[-1]

    for n in ("agent-1", "agent-2", "agent-3"):
        start(n)
    agents_ok = [
        check.row(f"{n} health check", lambda n=n: check.healthy(n, 120))
        for n in ("agent-1", "agent-2", "agent-3")
    ]
    if not all(agents_ok):
        raise CheckFailed("an agent never became healthy: the trainers depend on all three")

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
        before = {(r["ts"], r["rank"]) for r in (check.job() or {}).get("restores") or []}
        killed_at = datetime.now(UTC)
        stack.kill("trainer-2")

        def probe() -> dict[int, dict] | None:
            new: dict[int, dict] = {}
            for r in (check.job() or {}).get("restores") or []:
                if (r["ts"], r["rank"]) not in before and r["step"] is not None:
                    new.setdefault(r["rank"], r)
            return new if set(new) >= {0, 1, 2} else None

        by_rank = wait_for("a restore by ranks 0, 1 and 2 after the kill", probe, 420, every_s=3)
        r = by_rank[1]
        if not r["files_by_tier"].get("memory"):
            raise CheckFailed(f"rank 1 did not restore from its memory tier: {r}")
        for rank in (0, 1, 2):
            x = by_rank[rank]
            if not x["ok"] or x["files_by_tier"].get("persistent") or x["step"] != r["step"]:
                want = f"a restore of step {r['step']} with nothing from persistent"
                raise CheckFailed(f"rank {rank}: not {want}: {x}")
        trainers = ("trainer-1", "trainer-2", "trainer-3")
        restarted = {n: stack.running[n].starts - 1 for n in trainers}
        waited = (datetime.fromisoformat(r["ts"]) - killed_at).total_seconds()
        others = "; ".join(f"rank {k} {by_rank[k]['files_by_tier']}" for k in (0, 2))
        return (
            f"rank 1 restored step {r['step']} ({r['steps_lost']} step(s) lost) in "
            f"{r['seconds']:.2f} s, files by tier {r['files_by_tier']} ({others}), "
            f"{waited:.0f} s after the kill; restarts {restarted}"
        )

    check.row("a killed trainer container resumes from memory", killed_trainer_resumes)

    for n in ("server", "agent-1", "agent-2", "agent-3"):
        check.row(
            f"{n} health check at the end",
            lambda n=n: check.healthy(n, 30, never_exited=True),
        )
    check.row(
        "the memory tiers are tmpfs, and every file written is uid 10001's",
        lambda: volumes_owned(vols, topology),
    )


def volumes_owned(
    vols: Path, topology: compose_plan.Topology, mounts: dict[str, str] | None = None
) -> str:
    """Each tmpfs volume is mounted as one and holds files (the containers wrote into the
    tmpfs, not into a folder it hides), and every file under every volume belongs to uid
    10001 (no container wrote as root). ``mounts``: mount point -> type (``mount_table()``)."""
    mounts = mount_table() if mounts is None else mounts
    tiers = 0
    for t in topology.tmpfs:
        if mounts.get(str(t.host)) != "tmpfs":
            raise CheckFailed(f"{t.host} is not a tmpfs mount")
        n = sum(1 for p in t.host.rglob("*") if p.is_file())
        if n == 0:
            raise CheckFailed(f"{t.host}: no file in this tmpfs")
        tiers += n
    files = 0
    for path in vols.rglob("*"):
        st = path.lstat()
        if st.st_uid != UID:
            raise CheckFailed(f"{path} belongs to uid {st.st_uid}")
        files += 1
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
        check = r.check.replace("|", "\\|")
        lines.append(f"| {check} | {'pass' if r.ok else 'FAIL'} | {detail} | {r.seconds:.0f} |")
    lines += ["", "What this did not exercise:", ""]
    lines += [f"- {x}" for x in NOT_RUN]
    return "\n".join(lines)


def _exit_on_signal(signum: int, _frame: Any) -> None:
    """SIGTERM / SIGHUP (``timeout``, a closed terminal) end the check through its cleanup,
    like Ctrl-C: the containers' processes run in their own sessions and would outlive it."""
    raise SystemExit(128 + signum)


def main() -> int:
    if os.geteuid() != 0:
        raise SystemExit("container-check: run as root (tmpfs mounts and chown to uid 10001)")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    b = Buildah()
    stale = stale_runs()
    if stale:
        raise SystemExit(
            f"container-check: containers of an earlier check still run (pids {stale}); "
            "end them first: " + "; ".join(f"kill -- -{p}" for p in stale)
        )
    workdir = REPO / "var" / "container-check"
    for m in _mounted_under(workdir):
        subprocess.run(["umount", m], check=False)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    compose = yaml.safe_load(COMPOSE.read_text())
    ports = free_ports(["server", "agent-1", "agent-2", "agent-3", "MASTER_PORT"])
    db = os.environ.get("CONTAINER_CHECK_DATABASE_URL", DEFAULT_DB)
    env = dict(os.environ)
    env["TIERWATCH_SECRET_KEY"] = secrets.token_urlsafe(48)
    topology = compose_plan.plan(compose, env=env, ports=ports, database_url=db, workdir=workdir)
    left = compose_plan.addresses_left(topology, compose)
    if left:
        raise SystemExit("container-check: addresses not rewritten:\n" + "\n".join(left))
    problems = plan_problems(topology)
    if problems:
        says = "\n".join(problems)
        raise SystemExit(f"container-check: the check does not follow this compose file:\n{says}")
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
    reset_database(db)  # first: an unreachable PostgreSQL stops the check with nothing to undo
    stack = Stack(b, workdir)
    check = Check(topology, stack, b)
    mounted: list[Path] = []
    t0 = time.monotonic()
    try:
        for t in topology.tmpfs:
            opts = ["-o", t.options] if t.options else []
            subprocess.run(["mount", "-t", "tmpfs", *opts, "tmpfs", str(t.host)], check=True)
            mounted.append(t.host)
        for d in (workdir / "volumes").iterdir():
            os.chown(d, UID, UID)
        run_checks(check, stack, topology, entry)
    except CheckFailed as exc:
        check.rows.append(Row("(stopped early)", False, str(exc).splitlines()[0], 0))
        print(f"container-check: stopped: {exc}", file=sys.stderr)
    finally:
        # a second Ctrl-C (or SIGTERM) must not cut the cleanup short
        sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
        try:
            stack.stop()
            for m in reversed(mounted):
                subprocess.run(["umount", str(m)], check=False)
            with contextlib.suppress(Exception):
                reset_database(db, drop_only=True)
            check.http.close()
        finally:
            for sig, handler in saved.items():
                signal.signal(sig, handler)
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
    """Mount points at or under ``path``, deepest first."""
    inside = [m for m in mount_table() if m == str(path) or m.startswith(f"{path}/")]
    return sorted(inside, key=len, reverse=True)


if __name__ == "__main__":
    raise SystemExit(main())

"""Checkpoint benchmark: what a save costs the training loop, and how fast each tier restores.

Run ``.venv/bin/python bench/checkpoint.py`` (a model + AdamW state of ≥ 1 GB, 20 measured
steps per method) or ``BENCH_QUICK=1 ...`` (≈ 100 MB, 8 steps, under 2 minutes).

Part 1, in this process (one rank, one agent as its node; the agent runs as its own process
and uploads to the persistent tier while training goes on):

1. Blocking time of the training thread per checkpoint, median over the measured steps:
   ``torch.save`` + fsync to the disk, ``dcp.save`` to the disk, ``dcp.async_save`` (default
   stager; the wait for the previous save counts), and TieredCheckpointer (time in
   ``save()`` plus the optimizer pre-hook's wait).
2. Step time when saving with TieredCheckpointer every step and every 10 steps, against
   steps without checkpointing measured in the same run.

Part 2, with two rank processes on two agents (simulated nodes, memory folders on
/dev/shm):

3. Restore time from the memory tier (processes restarted), the peer tier (one node's agent
   restarted with an empty memory folder) and the persistent tier (both memory folders
   wiped; the page cache is dropped through /proc/sys/vm/drop_caches when this process may
   write it, which the table says).
4. Persistent upload throughput (bytes of the step ÷ time from the commit marker to
   ``.metadata`` in the persistent folder) against a raw fsync'd sequential write of the same
   size to the same disk.

The background work shares this machine's cores with training; nothing is pinned or
isolated. Results go into docs/benchmarks.md ("Checkpoint (bench/checkpoint.py)").
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import torch
import torch.distributed.checkpoint as dcp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from ckpt_worker import build, step  # noqa: E402

from tierwatch import TieredCheckpointer  # noqa: E402
from tierwatch.agent.checkpoint.format.layout import step_dirname  # noqa: E402
from tierwatch.agent.netutil import free_port  # noqa: E402

BIN = Path(sys.executable).parent
QUICK = os.environ.get("BENCH_QUICK") == "1"
WIDTH, LAYERS = (1024, 8) if QUICK else (3072, 10)
MEASURED = 8 if QUICK else 20
BATCH = 8


class ControlPlane:
    """A tierwatch-server on loopback (SQLite): it issues the agents' node certificates and
    the jobs' credentials, as on a cluster (the peer tier needs its registry)."""

    def __init__(self, root: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
        self.env.update(
            TIERWATCH_DATABASE_URL=f"sqlite:///{root / 'server.db'}",
            TIERWATCH_SECRET_KEY="bench-" + "k" * 40,
            TIERWATCH_PRUNE_INTERVAL_S="0",
        )
        self.cli("migrate")
        self.log = root / "server.log"
        self.proc = subprocess.Popen(
            [
                str(BIN / "tierwatch-server"),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            env=self.env,
            stdout=open(self.log, "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        wait(lambda: httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200, 60, "server")

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            [str(BIN / "tierwatch-server"), *args],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()

    def agent_token(self, node: str) -> str:
        return self.cli("token", "create", "--role", "agent", "--node", node)

    def job_credential(self, job_id: str, nodes: list[str]) -> str:
        return self.cli("job", "credential", job_id, *[x for n in nodes for x in ("--node", n)])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


def wait(pred, timeout: float, what: str):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if v := pred():
                return v
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


class Agent:
    """A tierwatch-agent process (simulated collector, no server)."""

    def __init__(self, root: Path, name: str, persistent_url: str, cp: ControlPlane) -> None:
        self.name = name
        self.token = cp.agent_token(name)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.memory_dir = Path("/dev/shm") / f"tw-bench-{os.getpid()}" / name
        self.log = root / f"{name}.log"
        self.args = [
            str(BIN / "tierwatch-agent"),
            "run",
            "--node",
            name,
            "--server",
            cp.url,
            "--token",
            self.token,
            "--state-dir",
            str(root / name / "state"),
            "--collector",
            "simulated",
            "--sim-gpus",
            "1",
            "--interval",
            "5",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--spool-dir",
            str(root / name),
            "--memory-dir",
            str(self.memory_dir),
            "--persistent-url",
            persistent_url,
            "--ckpt-scan-interval",
            "0.5",
            "--log-level",
            "WARNING",
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Agent:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
        self.proc = subprocess.Popen(
            self.args,
            env=env,
            stdout=open(self.log, "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        wait(
            lambda: (
                httpx.get(
                    f"{self.url}/v1/ckpt/info",
                    headers={"Authorization": f"Bearer {self.token}"},
                    timeout=1,
                ).status_code
                == 200
            ),
            30,
            f"agent {self.name}",
        )
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for s in optim.state.values():
        n += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
    return n


def part1(root: Path, disk: Path, cp: ControlPlane) -> dict:
    agent = Agent(root, "bench-a", f"file://{disk / 'persistent'}", cp).start()
    os.environ["TIERWATCH_AGENT_URL"] = agent.url
    model, optim = build(WIDTH, LAYERS, seed=1)
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    for _ in range(2):
        step(model, optim, BATCH, WIDTH)
    size = state_bytes(model, optim)
    out: dict = {"state_bytes": size, "results": {}}
    sd = {"model": model, "optim": optim}

    def plain_sd() -> dict:
        return {"model": model.state_dict(), "optim": optim.state_dict()}

    def timed_steps(n: int) -> list[float]:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            step(model, optim, BATCH, WIDTH)
            ts.append(time.perf_counter() - t0)
        return ts

    baseline: list[float] = []  # steps without checkpointing, a block before every method

    def base_block() -> None:
        baseline.extend(timed_steps(max(4, MEASURED // 2)))

    # torch.save + fsync
    base_block()
    blocks, steps = [], []
    for _ in range(MEASURED):
        t0 = time.perf_counter()
        step(model, optim, BATCH, WIDTH)
        t1 = time.perf_counter()
        with open(disk / "torch_save.pt", "wb") as f:
            torch.save(plain_sd(), f)
            f.flush()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        blocks.append(t2 - t1)
        steps.append(t2 - t0)
    out["results"]["torch.save + fsync"] = {"blocking_s": median(blocks), "step_s": mean(steps)}

    # dcp.save (synchronous)
    base_block()
    blocks, steps = [], []
    for i in range(MEASURED):
        t0 = time.perf_counter()
        step(model, optim, BATCH, WIDTH)
        t1 = time.perf_counter()
        dcp.save(plain_sd(), checkpoint_id=str(disk / "dcp" / step_dirname(i % 2)), no_dist=True)
        t2 = time.perf_counter()
        blocks.append(t2 - t1)
        steps.append(t2 - t0)
    out["results"]["dcp.save"] = {"blocking_s": median(blocks), "step_s": mean(steps)}

    # dcp.async_save (default stager); waiting for the previous save counts as blocking
    base_block()
    blocks, steps = [], []
    fut = None
    for i in range(MEASURED):
        t0 = time.perf_counter()
        step(model, optim, BATCH, WIDTH)
        t1 = time.perf_counter()
        if fut is not None:
            fut.result()
        fut = dcp.async_save(
            plain_sd(), checkpoint_id=str(disk / "dcpa" / step_dirname(i % 2)), no_dist=True
        )
        t2 = time.perf_counter()
        blocks.append(t2 - t1)
        steps.append(t2 - t0)
    if fut is not None:
        fut.result()
    out["results"]["dcp.async_save"] = {"blocking_s": median(blocks), "step_s": mean(steps)}

    # TieredCheckpointer every step and every 10 steps
    for label, every in (
        ("TieredCheckpointer, every step", 1),
        ("TieredCheckpointer, every 10 steps", 10),
    ):
        base_block()
        ckpt = TieredCheckpointer(
            f"bench-{every}",
            persist_every=10,
            latency_every=0,
            job_credential=cp.job_credential(f"bench-{every}", [agent.name]),
        )
        n = MEASURED if every == 1 else (40 if QUICK else 100)
        saves, hooks, steps = [], [], []
        for i in range(n):
            t0 = time.perf_counter()
            step(model, optim, BATCH, WIDTH)
            t1 = time.perf_counter()
            hooks.append(ckpt._hook_wait)  # pre-hook wait in this step's optimizer.step()
            if i % every == 0:
                ckpt.save(i, sd)
            t2 = time.perf_counter()
            saves.append(t2 - t1 if i % every == 0 else None)
            steps.append(t2 - t0)
        # blocking of the save after step i = time in save() + the pre-hook wait in step i+1
        blocks = [
            s + (hooks[i + 1] if i + 1 < n else 0.0) for i, s in enumerate(saves) if s is not None
        ]
        ckpt.close()
        out["results"][label] = {
            "blocking_s": median(blocks),
            "step_s": mean(steps),
            "saves": len(blocks),
            "allocations": ckpt._stager.allocations,
        }
    base_block()
    out["results"]["no checkpoint"] = {
        "step_s": mean(baseline),
        "step_median_s": median(baseline),
        "steps": len(baseline),
    }
    agent.stop()
    shutil.rmtree(agent.memory_dir, ignore_errors=True)
    return out


def run_ranks(agents: list[Agent], args: list[str], credential: str, timeout: float = 900) -> None:
    port = free_port()
    procs = []
    for rank, agent in enumerate(agents):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(len(agents)),
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TIERWATCH_AGENT_URL=agent.url,
            TIERWATCH_JOB_CREDENTIAL=credential,
            BENCH_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(REPO / "bench" / "ckpt_worker.py"), *args], env=env
            )
        )
    for p in procs:
        if p.wait(timeout) != 0:
            raise RuntimeError(f"worker exited with {p.returncode}")


def part2(root: Path, disk: Path, cp: ControlPlane) -> dict:
    persistent = disk / "persistent2"
    agents = [Agent(root, f"bench-n{i}", f"file://{persistent}", cp).start() for i in range(2)]
    credential = cp.job_credential("bench-tiers", [a.name for a in agents])
    common = ["--job-id", "bench-tiers", "--width", str(WIDTH), "--layers", str(LAYERS)]
    out: dict = {}
    try:
        t0 = time.monotonic()
        run_ranks(
            agents, ["--mode", "train", "--steps", "2", "--persist-every", "1", *common], credential
        )
        # persistent step 1 complete = its .metadata exists; commit marker time → .metadata
        marker = next(
            (agents[0].memory_dir / "jobs" / "bench-tiers" / "step-1").glob("commit-0.json")
        )
        meta = persistent / "bench-tiers" / "step-1" / ".metadata"
        wait(meta.exists, 900, "persistent .metadata of step 1")
        upload_s = meta.stat().st_mtime - marker.stat().st_mtime
        step_bytes = sum(f.stat().st_size for f in meta.parent.iterdir() if f.is_file())
        out["persistent_upload"] = {"bytes": step_bytes, "seconds": upload_s}
        # replicas in place on both nodes
        wait(
            lambda: all(
                any((a.memory_dir / "replicas").rglob("step-1/commit-*.json")) for a in agents
            ),
            600,
            "peer replicas of step 1",
        )
        out["train_wall_s"] = time.monotonic() - t0

        def restore(label: str) -> None:
            path = root / f"restore-{label}.json"
            run_ranks(agents, ["--mode", "restore", "--out", str(path), *common], credential)
            out[f"restore_{label}"] = json.loads(path.read_text())

        restore("memory")
        agents[1].stop()
        shutil.rmtree(agents[1].memory_dir, ignore_errors=True)
        agents[1].start()
        restore("peer")
        for a in agents:
            a.stop()
            shutil.rmtree(a.memory_dir, ignore_errors=True)
            a.start()
        dropped = False
        with contextlib.suppress(OSError):
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            dropped = True
        out["cache_dropped"] = dropped
        restore("persistent")

        # raw fsync'd sequential write of the same size to the same disk
        raw = disk / "raw.bin"
        chunk = os.urandom(4 << 20)
        t1 = time.perf_counter()
        with open(raw, "wb") as f:
            left = step_bytes
            while left > 0:
                f.write(chunk[: min(left, len(chunk))])
                left -= len(chunk)
            f.flush()
            os.fsync(f.fileno())
        out["raw_write"] = {"bytes": step_bytes, "seconds": time.perf_counter() - t1}
    finally:
        for a in agents:
            a.stop()
            shutil.rmtree(a.memory_dir.parent, ignore_errors=True)
    return out


def fmt_s(x: float) -> str:
    return f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def report(p1: dict, p2: dict, when: datetime | None = None) -> str:
    r = p1["results"]
    base = r["no checkpoint"]["step_s"]
    torch_b = r["torch.save + fsync"]["blocking_s"]
    async_b = r["dcp.async_save"]["blocking_s"]
    lines = [
        f"- date: {when or datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, no GPU (CPU tensors)",
        f"- state: {p1['state_bytes'] / 2**30:.2f} GiB (model {WIDTH}×{WIDTH} × {LAYERS} "
        f"Linear + AdamW), {MEASURED} measured steps per method (every 10 steps: "
        f"{r['TieredCheckpointer, every 10 steps']['saves']} saves); blocking = median, step "
        "time = mean (so the saving step counts)",
        "",
        "| method | blocking per checkpoint (median) | vs torch.save+fsync | vs dcp.async_save |"
        " mean step time | step overhead vs no checkpoint |",
        "|---|---|---|---|---|---|",
        f"| no checkpoint ({r['no checkpoint']['steps']} steps in blocks between the methods)"
        f" | – | | | {fmt_s(base)} | |",
    ]
    for name in (
        "torch.save + fsync",
        "dcp.save",
        "dcp.async_save",
        "TieredCheckpointer, every step",
        "TieredCheckpointer, every 10 steps",
    ):
        v = r[name]
        b = v["blocking_s"]
        lines.append(
            f"| {name} | {fmt_s(b)} | ×{b / torch_b:.3f} | ×{b / async_b:.2f} | "
            f"{fmt_s(v['step_s'])} | {100 * (v['step_s'] / base - 1):+.1f} % |"
        )
    lines.append("")
    lines.append(
        "| restore (2 ranks on 2 nodes) | step | seconds (rank 0) | files per tier "
        "(rank 0) | phases |"
    )
    lines.append("|---|---|---|---|---|")
    for tier in ("memory", "peer", "persistent"):
        rep = p2[f"restore_{tier}"]
        phases = rep["message"].split(";")[0].removeprefix("phases: ")
        lines.append(
            f"| from {tier} | {rep['step']} | {fmt_s(rep['seconds'])} | "
            f"{rep['files_by_tier']} | {phases} |"
        )
    up = p2["persistent_upload"]
    raw = p2["raw_write"]
    up_bps = up["bytes"] / max(up["seconds"], 1e-9)
    raw_bps = raw["bytes"] / max(raw["seconds"], 1e-9)
    lines += [
        "",
        "| write to the persistent disk | bytes | seconds | throughput | ratio |",
        "|---|---|---|---|---|",
        f"| persistent tier upload (commit marker → .metadata) | {up['bytes']} | "
        f"{up['seconds']:.2f} | {up_bps / 2**20:.0f} MiB/s | ×{up_bps / raw_bps:.2f} |",
        f"| raw fsync'd sequential write (peer) | {raw['bytes']} | {raw['seconds']:.2f} | "
        f"{raw_bps / 2**20:.0f} MiB/s | |",
        "",
        "Page cache dropped before the persistent restore: "
        + (
            "yes"
            if p2["cache_dropped"]
            else "no (not permitted here), so the persistent read is warm"
        )
        + "."
        " The persistent folder is on this machine's disk, which the host caches; a"
        " network filesystem or object store would be slower.",
        "",
        "Notes:",
        "",
        "- Every method's background work (copying, DCP writing, checksums, the agent's"
        " replication and upload) runs on the same 2 cores as the training step; nothing is"
        " isolated. The benchmark model (square Linear layers, batch 8) makes the training step"
        " bound by memory bandwidth, which the background copies use too, so lowering the"
        " background threads' priority (nice 10) cannot give the cycles back.",
        "- Saving every step: a save's background work takes longer than one step here, and at"
        " most one save is in flight, so `save(N+1)` waits for step N's commit; the blocking"
        " time is then the part of the background work the step did not cover. On a GPU node"
        " the step runs on the GPU and the background work on otherwise idle host cores.",
        "- Restore phases: `template` is torch's optimizer-state initialisation for a fresh"
        " optimizer (`get_optimizer_state_dict` runs one zero-gradient optimizer step);"
        " `agree+stage` is the ranks' agreement plus assembling the files (hard links from"
        " local memory, HTTP from the other node's agent, or reads from the persistent folder);"
        " `load` is `dcp.load` plus `set_*_state_dict`.",
        "- Persistent throughput: bytes of the step over the time from rank 0's commit marker to"
        " `.metadata` appearing in the persistent folder (both agents upload their ranks' files"
        " at the same time as they replicate to each other); the peer is one fsync'd"
        " sequential write of the same size to the same disk, right after. This disk's speed"
        " varies from run to run, so only the ratio within one run means anything.",
    ]
    return "\n".join(lines)


def write_doc(block: str) -> None:
    path = REPO / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    head = "## Checkpoint (bench/checkpoint.py)"
    cmd = f"### `{'BENCH_QUICK=1 ' if QUICK else ''}.venv/bin/python bench/checkpoint.py`"
    sections = text.split(head)
    body = sections[1] if len(sections) > 1 else "\n"
    blocks = [b for b in body.split("### ") if b.strip()]
    keep = [b for b in blocks if not ("### " + b).startswith(cmd)]
    new = "\n\n".join(["### " + b.strip() for b in keep] + [cmd + "\n\n" + block])
    path.write_text(sections[0].rstrip() + "\n\n" + head + "\n\n" + new + "\n")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--render":
        # Re-render the table of a finished run from its raw.json (same measurements).
        raw = Path(sys.argv[2])
        data = json.loads(raw.read_text())
        when = datetime.fromtimestamp(raw.stat().st_mtime, UTC)
        block = report(data["part1"], data["part2"], when)
        print(block)
        write_doc(block)
        return 0
    root = Path(tempfile.mkdtemp(prefix="tw-bench-"))
    disk = REPO / "var" / "bench-checkpoint"
    shutil.rmtree(disk, ignore_errors=True)
    disk.mkdir(parents=True)
    try:
        cp = ControlPlane(root)
        try:
            p1 = part1(root, disk, cp)
            p2 = part2(root, disk, cp)
        finally:
            cp.stop()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    block = report(p1, p2)
    print(block)
    write_doc(block)
    (root / "raw.json").write_text(json.dumps({"part1": p1, "part2": p2}, default=str))
    print(f"\nraw results: {root / 'raw.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

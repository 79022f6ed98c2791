"""The checkpoint control path at scale, without processes: what the restore agreement and
the commit decision gather and cost per decision, at world sizes 64 to 1,024.

Measured on the real code: ``agreement.merge_available`` + ``agreement.choose_step`` (the
restore agreement every rank runs on the gathered ``available`` answers) and
``commit_decision.decide_commit`` (rank 0's commit and retention decision). The inputs are
what the agents answer today, built from real :class:`Manifest` objects:

- each node holds ``RANKS_PER_NODE`` ranks; each rank's agent answers with its node's
  memory-tier manifests (``KEEP_MEMORY`` steps × the node's ranks), the peer replicas it
  holds for the next node (the same count), and the persistent tier's manifests of **every**
  rank for ``KEEP_PERSISTENT`` steps (each agent lists the persistent tier itself);
- the answers are all-gathered into every rank (``all_gather_object``: pickled), and every
  rank runs the agreement on all of them.

Per world size the table gives the bytes one rank receives, the bytes all ranks receive
together, the CPU one rank spends on the decision (median of ``REPEATS``), and the same for
the commit exchange (each rank's ``(error, pinned steps)``, and rank 0's decision). The
peer in the same run is the commit exchange itself: O(world) per decision, which is what a
restore agreement that asks each node once and lets rank 0 decide would also be.

Usage::

    .venv/bin/python bench/control_path.py [--worlds 64,128,256,512,1024] [--no-doc]

``BENCH_QUICK=1``: world sizes 64 and 256, 3 repeats.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import pickle
import platform
import statistics
import sys
import time
from pathlib import Path

from docs_section import replace_section

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tierwatch.agent.checkpoint.format import agreement  # noqa: E402
from tierwatch.agent.checkpoint.format.manifest import FileEntry, Manifest  # noqa: E402
from tierwatch.agent.checkpoint.training.commit_decision import (  # noqa: E402
    History,
    decide_commit,
)

DOC = REPO / "docs" / "benchmarks.md"
HEAD = "## Checkpoint control path (bench/control_path.py)"
QUICK = os.environ.get("BENCH_QUICK") == "1"
RANKS_PER_NODE = 8
KEEP_MEMORY = 2
KEEP_PERSISTENT = 3
REPEATS = 3 if QUICK else 5
WORLDS = (64, 256) if QUICK else (64, 128, 256, 512, 1024)
JOB = "llm-70b"


def manifest(step: int, rank: int, world: int) -> Manifest:
    """A rank's manifest as a real save writes it: one shard file (rank 0 also the
    ``.metadata``), the state signature, the save id."""
    files = [FileEntry(name=f"__{rank}_0.distcp", size=1 << 30, xxh3=f"{rank:016x}")]
    if rank == 0:
        files.append(FileEntry(name=".metadata", size=1 << 20, xxh3="f" * 16))
    return Manifest(
        job_id=JOB,
        step=step,
        rank=rank,
        world_size=world,
        node=f"node-{rank // RANKS_PER_NODE:04d}",
        files=files,
        signature="a" * 32,
        created_at="2026-12-03T12:00:00+00:00",
        save_id=f"{step:032x}",
    )


def answers(world: int) -> list[dict]:
    """Every rank's agent's ``available`` answer (JSON-shaped, as the agents send them)."""
    nodes = world // RANKS_PER_NODE
    memory_steps = [100 - i for i in range(KEEP_MEMORY)]
    persistent_steps = [100 - 10 * i for i in range(KEEP_PERSISTENT)]
    persistent = [
        {
            "tier": "persistent",
            "holder": "persistent",
            "url": f"s3://ckpt/{JOB}/step-{s}",
            "step": s,
            "rank": r,
            "manifest": manifest(s, r, world).model_dump(mode="json"),
        }
        for s in persistent_steps
        for r in range(world)
    ]
    by_node = []
    for n in range(nodes):
        local = range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)
        peer_of = ((n - 1) % nodes) * RANKS_PER_NODE
        entries = [
            {
                "tier": "memory",
                "holder": f"node-{n:04d}",
                "url": f"http://node-{n:04d}:9470",
                "step": s,
                "rank": r,
                "manifest": manifest(s, r, world).model_dump(mode="json"),
            }
            for s in memory_steps
            for r in local
        ] + [
            {
                "tier": "peer",
                "holder": f"node-{n:04d}",
                "url": f"http://node-{n:04d}:9470",
                "step": s,
                "rank": r,
                "manifest": manifest(s, r, world).model_dump(mode="json"),
            }
            for s in memory_steps
            for r in range(peer_of, peer_of + RANKS_PER_NODE)
        ]
        by_node.append({"entries": entries + persistent})
    # the ranks of one node ask the same agent: the same answer, once per rank
    return [by_node[r // RANKS_PER_NODE] for r in range(world)]


def cpu_median(fn, repeats: int) -> float:
    """Median process CPU seconds of ``fn()``."""
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        runs.append(time.process_time() - t0)
    return statistics.median(runs)


def measure(world: int) -> dict[str, float]:
    gathered = answers(world)
    # all_gather_object pickles each rank's answer on its own and every rank receives all of
    # them: the sum of the ranks' pickles (one pickle per node here: its ranks' are equal)
    per_node = [
        len(pickle.dumps(gathered[r], protocol=pickle.HIGHEST_PROTOCOL))
        for r in range(0, world, RANKS_PER_NODE)
    ]
    restore_bytes = sum(per_node) * RANKS_PER_NODE
    repeats = REPEATS if world <= 256 else 1

    def agree() -> None:
        views = agreement.merge_available(gathered)
        step, _ = agreement.choose_step(views, world)
        assert step == 100, step

    restore_cpu = cpu_median(agree, repeats)
    outcomes: list[str | None] = [None] * world
    pins = [(None, []) for _ in range(world)]
    commit_bytes = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in pins)
    history = History((90, 95), (90,))

    def commit() -> None:
        decision, _ = decide_commit(
            100,
            outcomes,
            history,
            persist_every=10,
            keep={"memory": 2, "peer": 2, "persistent": 3},
        )
        assert decision.committed

    commit_cpu = cpu_median(commit, max(REPEATS, 20))
    return {
        "world": world,
        "entries": sum(len(a["entries"]) for a in gathered),
        "restore_bytes_rank": restore_bytes,
        "restore_bytes_all": restore_bytes * world,
        "restore_cpu_rank": restore_cpu,
        "restore_cpu_all": restore_cpu * world,
        "commit_bytes_rank": commit_bytes,
        "commit_cpu": commit_cpu,
    }


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(rows: list[dict[str, float]]) -> str:
    out = [
        "| world size | entries gathered | restore: bytes per rank | restore: bytes, all ranks "
        "| restore: CPU per rank | restore: CPU, all ranks | commit: bytes per rank "
        "| commit: CPU (rank 0) | restore/commit bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['world']:,} | {r['entries']:,} | {human(r['restore_bytes_rank'])} "
            f"| {human(r['restore_bytes_all'])} | {r['restore_cpu_rank'] * 1000:,.0f} ms "
            f"| {r['restore_cpu_all']:,.1f} s | {human(r['commit_bytes_rank'])} "
            f"| {r['commit_cpu'] * 1e6:,.0f} µs "
            f"| ×{r['restore_bytes_rank'] / r['commit_bytes_rank']:,.0f} |"
        )
    return "\n".join(out)


def growth(rows: list[dict[str, float]]) -> str:
    first, last = rows[0], rows[-1]
    w = last["world"] / first["world"]
    b = last["restore_bytes_rank"] / first["restore_bytes_rank"]
    c = last["restore_cpu_rank"] / max(first["restore_cpu_rank"], 1e-9)
    k = last["commit_bytes_rank"] / first["commit_bytes_rank"]
    return (
        f"From world size {first['world']:,} to {last['world']:,} (×{w:g}): one rank's restore "
        f"gather grows ×{b:,.1f} and its decision CPU ×{c:,.1f} (all ranks together: "
        f"×{b * w:,.0f} bytes), the commit exchange ×{k:,.1f}. The restore's growth is "
        f"quadratic in the world size: every rank's agent lists every rank's persistent "
        f"manifests, and every rank receives every rank's answer."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default=",".join(str(w) for w in WORLDS))
    parser.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    for world in worlds:
        if world % RANKS_PER_NODE:
            parser.error(f"--worlds: {world} is not a multiple of {RANKS_PER_NODE}")
        rows.append(measure(world))
        r = rows[-1]
        print(
            f"world {world}: restore {human(r['restore_bytes_rank'])}/rank, "
            f"{r['restore_cpu_rank'] * 1000:.0f} ms CPU/rank; commit "
            f"{human(r['commit_bytes_rank'])}/rank",
            flush=True,
        )
    text = table(rows)
    print(text)
    print(growth(rows))
    if not args.no_doc:
        cpu = platform.processor() or platform.machine()
        block = "\n".join(
            [
                f"- date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
                f"- machine: {os.cpu_count()} CPUs (nproc), {cpu}; one process, no network",
                f"- command: `.venv/bin/python bench/control_path.py"
                f"{' (BENCH_QUICK=1)' if QUICK else ''}`",
                f"- shape: {RANKS_PER_NODE} ranks per node, memory and peer tiers "
                f"{KEEP_MEMORY} steps, persistent {KEEP_PERSISTENT} steps; CPU is process "
                f"time, the median of {REPEATS} runs up to world size 256, one run above",
                "",
                text,
                "",
                growth(rows)
                + " Bytes are the sum of every rank's pickled answer (what `all_gather_object` "
                "moves to each rank); CPU is `merge_available` + `choose_step` on one rank, "
                "which every rank runs. This is the restore control path as built today; the "
                "fix the checkpoint issue asks for (each node's agent asked once, a per-step "
                "index on the persistent tier, rank 0 decides and broadcasts) is not built yet.",
            ]
        )
        write_doc(block)
        print(f"wrote {DOC.relative_to(REPO)}")
    return 0


def write_doc(block: str) -> None:
    """Replace this benchmark's section of docs/benchmarks.md (the others stay)."""
    replace_section(DOC, HEAD, ".venv/bin/python bench/control_path.py", block)


if __name__ == "__main__":
    sys.exit(main())

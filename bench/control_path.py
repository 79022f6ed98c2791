"""The checkpoint control path at scale, without processes: what the restore agreement and
the commit decision gather and cost per decision, at world sizes 64 to 1,024.

Measured on the real code: ``agreement.merge_available`` + ``agreement.choose_step`` (the
restore agreement every rank runs on the gathered ``available`` answers),
``restore.askers`` (which ranks ask their node's agent, and which list the persistent tier)
and ``commit_decision.decide_commit`` (rank 0's commit and retention decision). The inputs are
what the agents answer, built from real :class:`Manifest` objects:

- each node holds ``RANKS_PER_NODE`` ranks; a node's agent answers with its memory-tier
  manifests (``KEEP_MEMORY`` steps × the node's ranks) and the peer replicas it holds for
  the next node (the same count), plus, when asked to, the persistent tier's manifests of
  every rank for ``KEEP_PERSISTENT`` steps;
- the contributions are all-gathered into every rank (``all_gather_object``: pickled), and
  every rank runs the agreement on all of them.

Per world size the table gives the bytes one rank receives and the CPU one rank spends on
the decision, for the product's plan (one rank per node asks; two list the persistent tier)
and for the peer, measured in the same run on the same data: every rank asks its agent for
every tier (the design before ``askers``, and what a rank-local restore does). Then the
commit exchange (each rank's ``(error, pinned steps)``, and rank 0's decision).

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
from tierwatch.agent.checkpoint.training.restore import askers  # noqa: E402

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


def answers(world: int, plan: dict[int, bool] | None) -> list[dict | None]:
    """What each rank contributes to the gather: its node agent's ``available`` answer
    (JSON-shaped, as the agents send them), or None for a rank that does not ask.

    Args:
        world: The world size.
        plan: ``restore.askers()``'s plan (rank → lists the persistent tier); None: every rank
            asks, with the persistent tier (the design before the per-node plan).
    """
    nodes = world // RANKS_PER_NODE
    memory_steps = [100 - i for i in range(KEEP_MEMORY)]
    persistent_steps = [100 - 10 * i for i in range(KEEP_PERSISTENT)]

    def entry(tier: str, node: int | None, step: int, rank: int) -> dict:
        # new strings per entry, as JSON-decoded answers have (pickle shares equal objects)
        return {
            "tier": tier,
            "holder": "persistent" if node is None else f"node-{node:04d}",
            "url": f"s3://ckpt/{JOB}/step-{step}"
            if node is None
            else f"http://node-{node:04d}:9470",
            "step": step,
            "rank": rank,
            "manifest": manifest(step, rank, world).model_dump(mode="json"),
        }

    persistent = [entry("persistent", None, s, r) for s in persistent_steps for r in range(world)]
    by_node = []
    for n in range(nodes):
        local = range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)
        peer_of = ((n - 1) % nodes) * RANKS_PER_NODE
        entries = [entry("memory", n, s, r) for s in memory_steps for r in local] + [
            entry("peer", n, s, r)
            for s in memory_steps
            for r in range(peer_of, peer_of + RANKS_PER_NODE)
        ]
        by_node.append(({"entries": entries + persistent}, {"entries": entries}))
    out: list[dict | None] = []
    for r in range(world):
        with_persistent, without = by_node[r // RANKS_PER_NODE]
        if plan is None:
            out.append(with_persistent)
        elif r in plan:
            out.append(with_persistent if plan[r] else without)
        else:
            out.append(None)
    return out


def cpu_median(fn, repeats: int) -> float:
    """Median process CPU seconds of ``fn()``."""
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        runs.append(time.process_time() - t0)
    return statistics.median(runs)


def restore_cost(gathered: list[dict | None], world: int) -> tuple[int, float]:
    """(bytes one rank receives, CPU seconds of one rank's decision) for ``gathered``."""
    # all_gather_object pickles each rank's contribution on its own and every rank receives
    # all of them (equal contributions pickled once and counted per rank)
    sizes: dict[int, int] = {}
    total = 0
    for a in gathered:
        if id(a) not in sizes:
            sizes[id(a)] = len(pickle.dumps(a, protocol=pickle.HIGHEST_PROTOCOL))
        total += sizes[id(a)]

    def agree() -> None:
        views = agreement.merge_available(gathered)
        step, _ = agreement.choose_step(views, world)
        assert step == 100, step

    return total, cpu_median(agree, REPEATS if world <= 256 else 1)


def measure(world: int) -> dict[str, float]:
    nodes = [f"node-{r // RANKS_PER_NODE:04d}" for r in range(world)]
    before_bytes, before_cpu = restore_cost(answers(world, None), world)
    now = answers(world, askers(nodes))
    restore_bytes, restore_cpu = restore_cost(now, world)
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
        "entries": sum(len(a["entries"]) for a in now if a),
        "before_bytes_rank": before_bytes,
        "before_cpu_rank": before_cpu,
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
        "| world size | entries gathered | restore: bytes per rank | peer: every rank asks, "
        "bytes per rank | ratio | restore: CPU per rank | peer: CPU per rank | ratio "
        "| commit: bytes per rank | commit: CPU (rank 0) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['world']:,} | {r['entries']:,} | {human(r['restore_bytes_rank'])} "
            f"| {human(r['before_bytes_rank'])} "
            f"| ×{r['restore_bytes_rank'] / r['before_bytes_rank']:.3f} "
            f"| {r['restore_cpu_rank'] * 1000:,.0f} ms | {r['before_cpu_rank'] * 1000:,.0f} ms "
            f"| ×{r['restore_cpu_rank'] / max(r['before_cpu_rank'], 1e-9):.3f} "
            f"| {human(r['commit_bytes_rank'])} | {r['commit_cpu'] * 1e6:,.0f} µs |"
        )
    return "\n".join(out)


def growth(rows: list[dict[str, float]]) -> str:
    first, last = rows[0], rows[-1]
    w = last["world"] / first["world"]

    def g(key: str) -> float:
        return last[key] / max(first[key], 1e-9)

    return (
        f"From world size {first['world']:,} to {last['world']:,} (×{w:g}): one rank's restore "
        f"gather grows ×{g('restore_bytes_rank'):,.1f} and its decision CPU "
        f"×{g('restore_cpu_rank'):,.1f}; with every rank asking its agent for every tier (the "
        f"peer, the design before) ×{g('before_bytes_rank'):,.1f} and "
        f"×{g('before_cpu_rank'):,.1f}, quadratic; the commit exchange grows "
        f"×{g('commit_bytes_rank'):,.1f}."
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
            f"{r['restore_cpu_rank'] * 1000:.0f} ms CPU/rank (peer "
            f"{human(r['before_bytes_rank'])}, {r['before_cpu_rank'] * 1000:.0f} ms); commit "
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
                "which every rank runs. The restore asks one rank per node and lists the "
                "persistent tier on two nodes (`restore.askers`); every rank still receives "
                "every node's answer and decides on its own (rank 0 deciding and broadcasting, "
                "and a per-step index on the persistent tier, are not built).",
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

"""What tiered checkpointing keeps of a training run that fails at Llama 3's mix, against
persistent-only checkpointing at Young's interval on the same failures (the peer, computed
in the same run from its measured costs; see demo/report.py).

Runs ``scripts/demo.py`` once per seed (``BENCH_SEEDS``, default ``3,4,7``) for
``BENCH_SECONDS`` (default 180; ``BENCH_QUICK=1``: 60) at ``DEMO_MTBF`` 60 s, prints a
table of the reports, and writes it to docs/benchmarks.md ("Demo (bench/demo.py)"). The
medians over the runs are what to quote; one run is one failure schedule.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
QUICK = os.environ.get("BENCH_QUICK") == "1"
SECONDS = float(os.environ.get("BENCH_SECONDS", "60" if QUICK else "180"))
SEEDS = [int(s) for s in os.environ.get("BENCH_SEEDS", "3,4,7").split(",") if s.strip()]
HEAD = "## Demo (bench/demo.py)"


def run(seed: int, root: Path) -> dict:
    """One demo run; its report.

    Raises:
        RuntimeError: the demo exited non-zero (its output tail is in the message).
    """
    var = root / f"seed-{seed}"
    report = var / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "demo.py"),
            "--seconds",
            f"{SECONDS:g}",
            "--mtbf",
            "60",
            "--seed",
            str(seed),
            "--collector",
            "simulated",
            "--var-dir",
            str(var),
            "--report",
            str(report),
        ],
        capture_output=True,
        text=True,
    )
    print(proc.stdout[-3000:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"demo seed {seed} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return json.loads(report.read_text())


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.1f} %"


def table(reports: dict[int, dict]) -> str:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"- date: {when}",
        f"- machine: {os.cpu_count()} CPUs, {platform.machine()}, no GPU (simulated nodes, "
        "gloo ranks on the CPU)",
        f"- runs: `scripts/demo.py --seconds {SECONDS:g} --mtbf 60`, one per seed; 5 agents "
        "(4 in use + 1 spare), 4 ranks, each step 0.25 s of stand-in GPU time",
        "",
        "| seed | failures (component → restore tier, down s) | recovered | tiers used | "
        "effective training time | persistent-only at Young's τ | ratio | δ (s) | τ (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    effs, bases = [], []
    for seed, r in reports.items():
        fails = (
            "; ".join(
                f"{f['component']} → {f['restore_tier'] or '-'}, "
                f"{f['downtime_s'] if f['downtime_s'] is not None else '-'}"
                for f in r["failures"]
            )
            or "none"
        )
        ok = sum(1 for f in r["failures"] if f["recovered"])
        eff, base = r["effective_training_time"], r["baseline_persistent_only"]
        b = r.get("baseline") or {}
        if eff is not None and base:
            effs.append(eff)
            bases.append(base)
        ratio = f"{eff / base:.2f}×" if eff is not None and base else "n/a"
        lines.append(
            f"| {seed} | {fails} | {ok}/{len(r['failures'])} | "
            f"{', '.join(r['tiers_used']) or 'none'} | {pct(eff)} | {pct(base)} | "
            f"{ratio} | {b.get('checkpoint_s', 'n/a')} | {b.get('interval_s', 'n/a')} |"
        )
    if effs:
        lines += [
            "",
            f"Median over {len(effs)} runs: effective **{pct(statistics.median(effs))}"
            f"**, persistent-only **{pct(statistics.median(bases))}**, ratio "
            f"{statistics.median(e / b for e, b in zip(effs, bases, strict=True)):.2f}×.",
        ]
    lines += [
        "",
        "Effective training time: compute seconds of the steps that survived / wall "
        "time. The persistent-only peer is played on the same run's failures from its "
        "measured costs (δ: memory write + persistent upload of a step; downtime less "
        "the restore, plus a persistent restore), scaled by the run's compute share.",
    ]
    return "\n".join(lines)


def write_doc(block: str) -> None:
    """Replace this benchmark's section of docs/benchmarks.md (the others stay)."""
    path = REPO / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    cmd = f"### `{'BENCH_QUICK=1 ' if QUICK else ''}.venv/bin/python bench/demo.py`"
    before, _, after = text.partition(HEAD)
    rest = ""
    if after:  # keep the sections after ours
        nxt = after.find("\n## ")
        rest = after[nxt:] if nxt >= 0 else ""
    path.write_text(before.rstrip() + "\n\n" + HEAD + "\n\n" + cmd + "\n\n" + block + "\n" + rest)


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="tw-bench-demo-"))
    reports = {seed: run(seed, root) for seed in SEEDS}
    block = table(reports)
    print(block)
    write_doc(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())

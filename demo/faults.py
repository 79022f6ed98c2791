"""Which failures the demo injects, and when (pure: no I/O besides reading the table).

The failure mix is Meta's Llama 3 405B pre-training interruption table (Dubey et al., "The
Llama 3 Herd of Models", 2024, Table 5: 419 unexpected interruptions in 54 days on 16,384
H100 GPUs), shipped as ``app/data/llama3_interruptions.csv`` with the columns
``component, category, interruptions, percent, failure_class``. A failure's component is
drawn with weight = its interruption count.

Times are *stratified*: a run of ``seconds`` at a demo MTBF ``M`` gets ``n = ⌊seconds / M⌋``
failures; the window after the warm-up (and before a tail left for the last recovery) is cut
into ``n`` equal slots and each failure lands at a uniform random moment of its own slot. So
every run of a given length has the same number of failures, and a seed replays them.
"""

from __future__ import annotations

import csv
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CATALOG = Path(__file__).resolve().parent.parent / "app" / "data" / "llama3_interruptions.csv"
FAILURE_CLASSES = ("node", "process", "rack", "rollback")
COLUMNS = ("component", "category", "interruptions", "percent", "failure_class")


class CatalogError(ValueError):
    """The interruption table cannot be used (the message names the file, row and fix)."""


@dataclass(frozen=True)
class FailureKind:
    """One row of the interruption table.

    Attributes:
        component: e.g. ``Faulty GPU``; category: e.g. ``GPU``; interruptions: the count in
        the 54-day run (the draw weight); failure_class: ``node`` (the node must go),
        ``process`` (a restart on the same nodes), ``rack`` (network: a node and the copies
        it holds for its peers), ``rollback`` (silent data corruption).
    """

    component: str
    category: str
    interruptions: int
    failure_class: str


@dataclass(frozen=True)
class Effect:
    """How the demo makes a failure real on its target node.

    Attributes:
        action: ``gpu`` (inject ``fault`` into the node's simulated collector and kill the
            node's rank), ``host`` (kill the node's agent and rank, wipe its memory tier),
            ``process`` (kill the rank only), ``network`` (kill the rank and drop the peer
            replicas the node holds), ``sdc`` (corrupt a weight in the running job, then
            roll it back to a step from before the corruption).
        fault: for ``gpu``, the collector fault (``xid``, ``ecc-dbe``, ``temp``).
        value: the XID code or temperature (°C) the fault takes, else None.
    """

    action: str
    fault: str | None = None
    value: float | None = None

    def describe(self) -> str:
        """A short human description, e.g. ``XID 79 + rank killed``."""
        if self.action == "gpu":
            if self.fault == "xid":
                what = f"XID {self.value:g}"
            elif self.fault == "temp":
                what = f"GPU at {self.value:g} °C"
            elif self.fault == "ecc-dbe":
                what = "uncorrectable ECC error (XID 48)"
            else:
                what = str(self.fault)
            return f"{what} + rank killed"
        return {
            "host": "agent killed + memory tier wiped + rank killed",
            "process": "rank killed",
            "network": "rank killed + the node's peer replicas dropped",
            "sdc": "a weight corrupted in the running job",
        }[self.action]


# Per GPU component, the fault the node's collector shows (the XID NVIDIA documents for it,
# from the XID catalog in app/data/xid_catalog.csv: 79 fallen off the bus → RESTART_BM,
# 48 double-bit ECC → WORKFLOW_XID_48, 95 uncontained error → RESET_GPU, 119 GSP RPC timeout
# → RESET_GPU; a failed thermal interface shows as a GPU above its slowdown temperature).
GPU_EFFECTS: dict[str, Effect] = {
    "Faulty GPU": Effect("gpu", "xid", 79),
    "GPU HBM3 Memory": Effect("gpu", "ecc-dbe"),
    "GPU SRAM Memory": Effect("gpu", "xid", 95),
    "GPU System Processor": Effect("gpu", "xid", 119),
    "GPU Thermal Interface + Sensor": Effect("gpu", "temp", 97),
}


def effect_of(kind: FailureKind, *, real_gpus: bool = False) -> Effect:
    """The demo's way of making ``kind`` happen (see :class:`Effect`).

    Rules: ``rollback`` → sdc; ``process`` → process; ``rack`` → network; ``node``: a GPU
    component → its :data:`GPU_EFFECTS` entry (an unlisted GPU component: XID 79), any other
    component (host parts, unplanned maintenance) → host. With ``real_gpus`` (the agents read
    real GPUs through NVML, where nothing can be injected) a GPU fault is made real as a
    lost host instead: the node still has to go, and tierwatch sees its silence.
    """
    if real_gpus and kind.failure_class == "node":
        return Effect("host")
    if kind.failure_class == "rollback":
        return Effect("sdc")
    if kind.failure_class == "process":
        return Effect("process")
    if kind.failure_class == "rack":
        return Effect("network")
    if kind.category == "GPU":
        return GPU_EFFECTS.get(kind.component, Effect("gpu", "xid", 79))
    return Effect("host")


def load_catalog(path: Path = CATALOG) -> list[FailureKind]:
    """Read the interruption table.

    Returns:
        The rows, in file order.

    Raises:
        CatalogError: the file is missing, a column is missing, a count is not a positive
            integer, a failure class is unknown, or no row has a count.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(f"cannot read the interruption table {path}: {exc}") from exc
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise CatalogError(
            f"{path}: missing column(s) {', '.join(missing)}; the header must "
            f"be {','.join(COLUMNS)}"
        )
    rows = []
    for line, row in enumerate(reader, start=2):
        try:
            count = int(row["interruptions"])
        except (TypeError, ValueError):
            count = -1
        if count < 0:
            raise CatalogError(
                f"{path} line {line}: interruptions must be a whole number ≥ 0, "
                f"got {row['interruptions']!r}"
            )
        if row["failure_class"] not in FAILURE_CLASSES:
            raise CatalogError(
                f"{path} line {line}: failure_class {row['failure_class']!r} is "
                f"not one of {', '.join(FAILURE_CLASSES)}"
            )
        rows.append(FailureKind(row["component"], row["category"], count, row["failure_class"]))
    if not any(r.interruptions for r in rows):
        raise CatalogError(f"{path}: no row has any interruptions to draw from")
    return rows


@dataclass(frozen=True)
class PlannedFailure:
    """A failure the demo will inject.

    Attributes:
        index: 0, 1, … in time order; at_s: seconds after training started; kind: the row
        drawn; rank: the rank whose node it strikes (0 … world_size − 1).
    """

    index: int
    at_s: float
    kind: FailureKind
    rank: int

    @property
    def effect(self) -> Effect:
        return effect_of(self.kind)


def failure_count(seconds: float, mtbf_s: float) -> int:
    """``⌊seconds / mtbf_s⌋``: the failures a run of that length gets.

    Raises:
        ValueError: ``mtbf_s`` ≤ 0 or ``seconds`` < 0.
    """
    if mtbf_s <= 0:
        raise ValueError(f"DEMO_MTBF must be > 0 seconds, got {mtbf_s:g}")
    if seconds < 0:
        raise ValueError(f"DEMO_SECONDS must be ≥ 0, got {seconds:g}")
    return int(seconds // mtbf_s)


def pick(catalog: list[FailureKind], components: list[str]) -> list[FailureKind]:
    """The rows named by ``components`` (exact component names), in that order.

    Raises:
        CatalogError: a name is not a component of the table (the message lists them).
    """
    by = {k.component: k for k in catalog}
    unknown = [c for c in components if c not in by]
    if unknown:
        raise CatalogError(
            f"unknown component(s) {', '.join(map(repr, unknown))}; choose from: {', '.join(by)}"
        )
    return [by[c] for c in components]


def schedule(
    catalog: list[FailureKind],
    *,
    seconds: float,
    mtbf_s: float,
    seed: int,
    world_size: int,
    warmup_s: float,
    tail_s: float,
    forced: list[FailureKind] | None = None,
) -> Iterator[PlannedFailure]:
    """The failures of a run, in time order (see the module docs for the stratification).

    Args:
        catalog: rows of the interruption table (weights = ``interruptions``).
        seconds: run length after training starts; 0 means until stopped (an endless
            schedule: one failure in each ``mtbf_s`` slot after the warm-up).
        mtbf_s: the demo's mean time between failures (s).
        seed: the random seed (the same seed and arguments give the same failures).
        world_size: ranks of the job (a failure strikes one rank's node).
        warmup_s: no failure before this (s); tail_s: none in the last ``tail_s`` seconds,
            so the last recovery fits in the run.
        forced: when given, the failures are these kinds in turn (cycled) instead of
            drawn; the times and target ranks are drawn as usual.

    Raises:
        ValueError: bad ``mtbf_s``/``seconds``, ``world_size`` < 1, or a window after the
            warm-up and before the tail shorter than a second while failures are due.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be ≥ 1, got {world_size}")
    n = failure_count(seconds, mtbf_s)
    rng = random.Random(seed)
    weights = [k.interruptions for k in catalog]
    if seconds > 0:
        start, end = warmup_s, seconds - tail_s
        if n and end - start < 1.0:
            raise ValueError(
                f"a {seconds:g} s run leaves no time for its {n} failure(s) after the "
                f"{warmup_s:g} s warm-up and before the {tail_s:g} s recovery tail: run "
                f"longer (DEMO_SECONDS ≥ {warmup_s + tail_s + 1:g}) or raise DEMO_MTBF"
            )
        slot = (end - start) / n if n else 0.0
        slots: Iterator[int] = iter(range(n))
    else:
        start, slot = warmup_s, mtbf_s
        slots = itertools.count()
    for i in slots:
        at = start + slot * (i + rng.random())
        kind = rng.choices(catalog, weights=weights)[0]
        if forced:
            kind = forced[i % len(forced)]
        yield PlannedFailure(i, round(at, 3), kind, rng.randrange(world_size))

"""``GET /metrics``: Prometheus exposition of the latest-value tables.

The server exports the ``tierwatch_*`` state series (node state, isolation, maintenance,
XID counts, checkpoint tiers and lag, the command queue, the policy breaker). GPU series are
the agents' to export: each agent serves dcgm-exporter's format on its own ``/metrics``
(``tierwatch.agent.exporter``), so Prometheus scrapes every node as it scrapes
dcgm-exporter. Re-exporting every GPU here is opt-in (``TIERWATCH_METRICS_GPU_SERIES=1``):
it puts every node behind one ``instance`` label (docs/operations.md says how to relabel)
and costs a scrape time proportional to the fleet.

Re-exported GPU gauges use dcgm-exporter's metric names and its ``Hostname``, ``gpu`` and
``UUID`` labels. They are exposed as gauges: a prometheus-client Counter would append
``_total`` and break the names. Only live values are exported: nothing of an unreachable
node, nor of a GPU whose newest sample is stale (``rules.rule_stale_telemetry``'s limit), so
a dead node's last readings never pass for current ones. Collection is a pure read done on
demand (a custom collector), never a background copy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import maintenance
from tierwatch.server.checkpoints import service as checkpoint_service
from tierwatch.server.fleet import rules
from tierwatch.server.fleet.models import Gpu, Node, XidCount
from tierwatch.server.fleet.service import STATES, effective_state

# (dcgm-exporter name, our column, help text, transform)
DCGM_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_GPU_TEMP", "temperature_c", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "power_w", "Power draw (in W)."),
    ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "power_limit_w", "Power management limit (in W)."),
    ("DCGM_FI_DEV_GPU_UTIL", "utilization_pct", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "memory_used_mib", "Framebuffer memory used (in MiB)."),
    (
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "ecc_sbe_volatile",
        "Total number of single-bit volatile ECC errors.",
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "ecc_dbe_volatile",
        "Total number of double-bit volatile ECC errors.",
    ),
    (
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "ecc_sbe_aggregate",
        "Total number of single-bit persistent ECC errors.",
    ),
    (
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "ecc_dbe_aggregate",
        "Total number of double-bit persistent ECC errors.",
    ),
    (
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "remapped_rows_correctable",
        "Number of remapped rows for correctable errors.",
    ),
    (
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "remapped_rows_uncorrectable",
        "Number of remapped rows for uncorrectable errors.",
    ),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "row_remap_failure", "Whether remapping of rows has failed."),
    (
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "row_remap_pending",
        "Whether a row remap is pending (GPU reset needed).",
    ),
    # dcgm-exporter's DCGM_FI_DEV_PCIE_REPLAY_COUNTER is refused by promtool's linter (a name
    # may not contain its type), so the PCIe replay count is exported under our own name.
    ("tierwatch_gpu_pcie_replays", "pcie_replay_count", "PCIe replay count since boot."),
    (
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        "throttle_reasons",
        "Current clock throttle reasons (bitmask).",
    ),
    (
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "nvlink_crc_errors",
        "Total number of NVLink CRC errors.",
    ),
    (
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "nvlink_replay_errors",
        "Total number of NVLink replay errors.",
    ),
    (
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "nvlink_recovery_errors",
        "Total number of NVLink recovery errors.",
    ),
)
# dcgm-exporter also exports a ``modelName`` label; promtool's linter rejects camelCase label
# names, so it is left out (the model is on the API and dashboard).
GPU_LABELS = ["gpu", "UUID", "Hostname"]


class FleetCollector(Collector):
    """Yields metric families from the database on each scrape."""

    def __init__(
        self, factory: sessionmaker[Session], th: rules.HealthThresholds, gpu_series: bool
    ) -> None:
        self._factory = factory
        self._th = th
        self._gpu_series = gpu_series

    def collect(self) -> Iterator[Metric]:
        with self._factory() as session:
            yield from collect_fleet(session, self._th, gpu_series=self._gpu_series)
            yield from collect_checkpoints(session)
            yield from collect_actions(session)


def collect_fleet(
    session: Session, th: rules.HealthThresholds, *, gpu_series: bool = False
) -> Iterator[Metric]:
    """All fleet metric families from the latest-value tables (pure read).

    Args:
        gpu_series: also re-export each live GPU's dcgm-exporter gauges (see the module's
            docstring for what counts as live).
    """
    now = utcnow()
    nodes = {n.id: n for n in session.scalars(select(Node))}
    gpus = list(session.scalars(select(Gpu).order_by(Gpu.node_id, Gpu.index))) if gpu_series else []
    families = {
        name: GaugeMetricFamily(name, help_, labels=GPU_LABELS) for name, _, help_ in DCGM_GAUGES
    }
    xid_last = GaugeMetricFamily(
        "DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", labels=GPU_LABELS
    )
    last_xid: dict[tuple[int, int], tuple[Any, int]] = {}
    counts = CounterMetricFamily(
        "tierwatch_xid_events",
        "XID occurrences per node, GPU and code (every occurrence counted).",
        labels=["Hostname", "gpu", "xid"],
    )
    for c in session.scalars(select(XidCount)):
        node = nodes.get(c.node_id)
        if node is None:
            continue
        counts.add_metric([node.name, str(c.gpu_index), str(c.xid)], c.count)
        key = (c.node_id, c.gpu_index)
        if c.last_ts is not None and (key not in last_xid or c.last_ts > last_xid[key][0]):
            last_xid[key] = (c.last_ts, c.xid)
    for g in gpus:
        node = nodes.get(g.node_id)
        if node is None or not _live(node, g.ts, now, th):
            continue
        labels = [str(g.index), g.uuid, node.name]
        for name, column, _ in DCGM_GAUGES:
            value = getattr(g, column)
            if value is not None:
                families[name].add_metric(labels, float(value))
        xid_last.add_metric(labels, float(last_xid.get((g.node_id, g.index), (None, 0))[1]))
    if gpu_series:
        yield from families.values()
        yield xid_last
    yield counts
    state = GaugeMetricFamily(
        "tierwatch_node_state",
        "1 for the node's current effective state, 0 for the others.",
        labels=["Hostname", "state"],
    )
    isolated = GaugeMetricFamily(
        "tierwatch_node_isolated", "1 when the node is isolated.", labels=["Hostname"]
    )
    in_maintenance = GaugeMetricFamily(
        "tierwatch_node_maintenance",
        "1 while a maintenance window (the node's or the cluster's) covers the node.",
        labels=["Hostname"],
    )
    windows = maintenance.active(session, now)
    for node in nodes.values():
        current, _ = effective_state(node, now, th)
        for s in STATES:
            state.add_metric([node.name, s], 1.0 if s == current else 0.0)
        isolated.add_metric([node.name], 1.0 if node.isolated else 0.0)
        in_maintenance.add_metric([node.name], 0.0 if windows.covering(node.name) is None else 1.0)
    yield state
    yield isolated
    yield in_maintenance
    yield GaugeMetricFamily(
        "tierwatch_cluster_maintenance",
        "1 while a cluster-wide maintenance window is active.",
        value=0.0 if windows.cluster is None else 1.0,
    )


def _live(node: Node, gpu_ts: Any, now: Any, th: rules.HealthThresholds) -> bool:
    """Whether a GPU's latest values are current: its node is reachable and the sample is
    younger than the stale-telemetry limit (``th.stale_intervals`` × the node's sample period,
    ``interval_s × sample_every``)."""
    if gpu_ts is None or effective_state(node, now, th)[1]:
        return False
    if gpu_ts.tzinfo is None:  # SQLite hands back naive UTC
        gpu_ts = gpu_ts.replace(tzinfo=now.tzinfo)
    return (now - gpu_ts).total_seconds() < th.stale_intervals * node.interval_s * node.sample_every


def collect_checkpoints(session: Session) -> Iterator[Metric]:
    """Per job: the training step, and per tier the newest committed step and the lag.

    Families (labels ``job``, ``tier``): ``tierwatch_job_step`` (steps),
    ``tierwatch_checkpoint_newest_step`` (absent while a tier has no committed step),
    ``tierwatch_checkpoint_lag_steps`` (training step − newest committed step; training
    step + 1 with none), ``tierwatch_checkpoint_lag_seconds`` (absent while no step time
    is known). Definitions as in ``checkpoints.service``.
    """
    step = GaugeMetricFamily(
        "tierwatch_job_step", "Training step of the job (highest step reported).", labels=["job"]
    )
    newest = GaugeMetricFamily(
        "tierwatch_checkpoint_newest_step",
        "Newest step committed (all ranks) and not evicted in the tier.",
        labels=["job", "tier"],
    )
    lag_steps = GaugeMetricFamily(
        "tierwatch_checkpoint_lag_steps",
        "Training steps since the tier's newest committed step (step + 1 with none).",
        labels=["job", "tier"],
    )
    lag_seconds = GaugeMetricFamily(
        "tierwatch_checkpoint_lag_seconds",
        "Training time since the tier's newest committed step (in seconds).",
        labels=["job", "tier"],
    )
    for job in checkpoint_service.list_jobs(session):
        name = job["job_id"]
        if job["step"] is not None:
            step.add_metric([name], float(job["step"]))
        for tier, t in job["tiers"].items():
            if t["newest_step"] is not None:
                newest.add_metric([name, tier], float(t["newest_step"]))
            if t["lag_steps"] is not None:
                lag_steps.add_metric([name, tier], float(t["lag_steps"]))
            if t["lag_s"] is not None:
                lag_seconds.add_metric([name, tier], float(t["lag_s"]))
    yield step
    yield newest
    yield lag_steps
    yield lag_seconds


def collect_actions(session: Session) -> Iterator[Metric]:
    """The command queue and the policy breaker.

    Families: ``tierwatch_commands`` (commands per ``state`` and ``kind``, every state listed,
    0 included) and ``tierwatch_policy_breaker_tripped`` (1 while the auto-isolation circuit
    breaker holds).
    """
    from sqlalchemy import func

    from tierwatch.server.actions.models import COMMAND_STATES, CommandRow, PolicySettingsRow

    counts = dict.fromkeys(
        ((st, k) for st in COMMAND_STATES for k in ("isolate", "release", "restore")), 0
    )
    for state, kind, n in session.execute(
        select(CommandRow.state, CommandRow.kind, func.count()).group_by(
            CommandRow.state, CommandRow.kind
        )
    ):
        counts[(state, kind)] = n
    commands = GaugeMetricFamily(
        "tierwatch_commands",
        "Commands in the queue per state and kind.",
        labels=["state", "kind"],
    )
    for (state, kind), n in sorted(counts.items()):
        commands.add_metric([state, kind], float(n))
    yield commands
    row = session.get(PolicySettingsRow, 1)
    yield GaugeMetricFamily(
        "tierwatch_policy_breaker_tripped",
        "1 while the auto-isolation circuit breaker holds.",
        value=1.0 if row is not None and row.breaker_tripped_at is not None else 0.0,
    )


def make_registry(
    factory: sessionmaker[Session], th: rules.HealthThresholds, *, gpu_series: bool = False
) -> CollectorRegistry:
    """A registry holding only the fleet (and checkpoint) collector (no process metrics).

    Args:
        gpu_series: re-export live GPUs' dcgm-exporter gauges (``TIERWATCH_METRICS_GPU_SERIES``).
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(factory, th, gpu_series))
    return registry


class ScrapeCache:
    """One exposition of a registry, reused for ``ttl_s`` seconds (single flight).

    A scrape reads every node, job and command; Prometheus servers run in pairs for high
    availability, and other scrapers come and go. Each replica renders at most once per
    ``ttl_s``, whoever asks; scrapes that arrive while it renders wait for that rendering
    instead of starting their own. The series are at most ``ttl_s`` old, less than a
    Prometheus scrape interval (15 s by default).

    Args:
        registry: what to expose.
        ttl_s: how long one rendering is served (seconds; 0: render every scrape).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._body: bytes | None = None
        self._at = 0.0
        self.renders = 0

    def get(self) -> bytes:
        """The exposition text (UTF-8), rendered anew when the cached one is too old."""
        with self._lock:
            now = self._clock()
            if self._body is None or self._ttl_s <= 0 or now - self._at >= self._ttl_s:
                self._body = generate_latest(self._registry)
                self._at = self._clock()
                self.renders += 1
            return self._body

"""The agent's ``/metrics``: this node's GPUs in dcgm-exporter's format, for the node's Prometheus.

Clusters scrape one dcgm-exporter per GPU node, and the stock Grafana dashboard (id 12239)
tells the nodes apart by the scrape target's ``instance`` label. Each tierwatch agent serves
the same interface, so a Prometheus scrape job with one target per node works unchanged:

- **Names, types and HELP** are dcgm-exporter's default counters (``etc/default-counters.csv``)
  for the fields it exports by default, and the control plane's ``/metrics`` names
  (``app/metrics.py``) for the health fields of :class:`~tierwatch.agent.protocol.GpuSample`
  beyond them (ECC, NVLink errors, throttle reasons, row-remap pending, slowdown/shutdown
  thresholds, power limit): see :data:`DCGM_FIELDS`; two departures for promtool, below.
- **Labels** of a GPU line: ``gpu`` (index), ``UUID``, ``pci_bus_id``, ``device``
  (``nvidia<index>``), the model label (``model_name`` by default; dcgm-exporter's
  ``modelName``), ``GPU_I_PROFILE`` and ``GPU_I_ID`` on a MIG instance's lines,
  ``DCGM_FI_DRIVER_VERSION`` when the driver version is known, and the host label
  (``Hostname`` by default, the node's name; dcgm-exporter spells it ``hostname`` since 2026,
  so both names are settings: :class:`ExportOptions`). A label whose value is unknown is left
  out. The ``tierwatch_*`` GPU lines have the same labels but the model label and the MIG
  labels (one line per physical GPU; join them on ``instance`` and ``gpu``);
  ``tierwatch_gpu_pcie_replays``, a ``DCGM_FI_*`` field renamed, has all of them.
- **None is omitted**: a field the collector could not read has no line, never a 0.
- **MIG**: a GPU with MIG instances has one line per instance of each field, as dcgm-exporter
  has: a device-wide field (temperature, power, clocks…) repeats the GPU's value, an
  instance-scoped one (framebuffer, the engine-activity ratios; ``per_instance``) takes the
  instance's own value, or has no line when the instance has none.
- **Stale telemetry** (rule): a GPU whose collector returned its previous sample again (same
  ``ts``: the collector could not read it, see ``agent/collectors/base.py``), that is in the
  inventory without a sample, or whose readings are older than the snapshot's age limit (the
  agent loop stalled), has **no** ``DCGM_FI_*`` line: Prometheus marks its series stale
  instead of repeating old values as live. Its ``tierwatch_gpu_telemetry_stale`` line says 1,
  ``tierwatch_gpu_last_sample_timestamp_seconds`` says since when, and its
  ``tierwatch_xid_events_total`` counters stay.
- **XIDs**: ``DCGM_FI_DEV_XID_ERRORS`` holds the last XID code (0: none since the agent
  started); ``tierwatch_xid_events_total{<GPU labels>, xid}`` counts every occurrence since
  the agent started.
- **The dcgm-exporter collector** (``exports_dcgm_fields`` False on the collector): no
  ``DCGM_FI_*`` line at all, since Prometheus scrapes that exporter itself; only the
  ``tierwatch_*`` series.

promtool: a scrape passes ``promtool check metrics`` with the default options, and the names
a dashboard or rule reads stay dcgm-exporter's, by three choices:

- dcgm-exporter's counters whose name lacks ``_total`` (``TOTAL_ENERGY_CONSUMPTION``,
  ``NVLINK_BANDWIDTH_TOTAL``, ``*_REMAPPED_ROWS``) keep their names and are declared
  ``untyped`` (:func:`exposed_type`): the linter checks a counter's suffix, not an untyped
  family's, and PromQL's ``rate()``/``increase()`` do not look at the declared type.
- ``DCGM_FI_DEV_PCIE_REPLAY_COUNTER`` contains its type, which the linter rejects under any
  type: it is served as ``tierwatch_gpu_pcie_replays`` (the server's name for it), with the
  same labels.
- The model label is ``model_name``: the linter rejects the camelCase ``modelName``.

:func:`dcgm_relabel_configs` gives the scrape job's ``metric_relabel_configs`` that store those
lines under dcgm-exporter's names. ``dcgm_names`` and ``model_label`` (``ExportOptions``)
serve dcgm-exporter's exact exposition instead, with the findings :func:`lint_findings` lists.
The ``tierwatch_*`` series have no finding either way.

Rendering is pure (:func:`render`: a snapshot and options in, the exposition text out), with
prometheus-client's metric families and ``generate_latest``. :class:`MetricsState` is the
thread-safe holder the runtime updates every report interval; a scrape reads a snapshot of
it and never calls a collector.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from tierwatch.agent.protocol import GpuInfo, GpuSample, XidEvent
from tierwatch.agent.readings import MIG_READINGS, GpuExtras, MigInstance

#: Content type of the exposition (Prometheus text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

DEFAULT_HOST_LABEL = "Hostname"
DEFAULT_MODEL_LABEL = "model_name"
#: A readings snapshot older than this many report intervals counts as stale (at least
#: :data:`MIN_MAX_AGE_S` seconds), as the control plane's heartbeat window.
STALE_INTERVALS = 3
MIN_MAX_AGE_S = 5.0

#: Labels the exporter sets itself; the host and model labels may not take these names.
FIXED_LABELS: tuple[str, ...] = (
    "gpu",
    "UUID",
    "pci_bus_id",
    "device",
    "GPU_I_PROFILE",
    "GPU_I_ID",
    "DCGM_FI_DRIVER_VERSION",
    "xid",
    "collector",
    "simulated",
    "version",
)
_LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def check_label_name(name: str, setting: str) -> str:
    """Check that ``name`` can be the host or model label.

    Args:
        name: The label name, e.g. ``Hostname``.
        setting: How the setting is named in the message, e.g. ``--metrics-host-label
            (TIERWATCH_METRICS_HOST_LABEL)``.

    Returns:
        ``name``.

    Raises:
        ValueError: not a Prometheus label name (``[a-zA-Z_][a-zA-Z0-9_]*``), a reserved
            one (``__`` prefix), or one the exporter sets itself; the message says which.
    """
    if not _LABEL_NAME_RE.fullmatch(name):
        raise ValueError(
            f"{setting} {name!r} is not a Prometheus label name: use letters, digits and "
            "'_', not starting with a digit (e.g. Hostname or hostname)"
        )
    if name.startswith("__"):
        raise ValueError(f"{setting} {name!r}: names starting with '__' are reserved by Prometheus")
    if name in FIXED_LABELS:
        raise ValueError(
            f"{setting} {name!r} is a label /metrics sets itself ({', '.join(FIXED_LABELS)}); "
            "pick another name"
        )
    return name


@dataclass(frozen=True)
class ExportOptions:
    """How :func:`render` names things.

    Attributes:
        host_label: Name of the label that holds the node's name (dcgm-exporter: ``Hostname``
            until 2026, ``hostname`` since).
        model_label: Name of the label that holds the GPU model (dcgm-exporter:
            ``modelName``, which promtool's linter rejects; default ``model_name``).
        dcgm_fields: Export the ``DCGM_FI_*`` families (False with the dcgm-exporter
            collector).
        dcgm_names: Serve dcgm-exporter's exact names and types, which promtool's linter
            rejects: ``DCGM_FI_DEV_PCIE_REPLAY_COUNTER`` (default: ``tierwatch_gpu_pcie_replays``)
            and its counters without ``_total`` as ``counter`` (default: ``untyped``).

    Raises:
        ValueError: a label name is invalid (:func:`check_label_name`), or both are the same.
    """

    host_label: str = DEFAULT_HOST_LABEL
    model_label: str = DEFAULT_MODEL_LABEL
    dcgm_fields: bool = True
    dcgm_names: bool = False

    def __post_init__(self) -> None:
        check_label_name(self.host_label, "host label")
        check_label_name(self.model_label, "model label")
        if self.host_label == self.model_label:
            raise ValueError(
                f"the host and model labels are both {self.host_label!r}: give them two names"
            )


@dataclass(frozen=True)
class DcgmField:
    """One ``DCGM_FI_*`` family and where its value comes from.

    Attributes:
        name: The metric name, exactly dcgm-exporter's.
        kind: ``gauge`` or ``counter`` (as dcgm-exporter declares it; the ``# TYPE`` line says
            :func:`exposed_type`).
        help: The HELP text.
        sample: The :class:`GpuSample` field that holds the value.
        extra: The :class:`GpuExtras` field that holds it; it wins over ``sample`` when
            both are set and it is not None (``FB_USED``: NVML's version-2 ``used``).
        per_instance: Instance-scoped on MIG GPUs: an instance's line takes the
            :class:`MigInstance` field named ``extra`` (no line when it has none).
        lint_name: The name served instead of ``name`` unless ``dcgm_names`` is set, for a
            name promtool's linter rejects whatever its type (it contains its type).
    """

    name: str
    kind: Literal["gauge", "counter"]
    help: str
    sample: str | None = None
    extra: str | None = None
    per_instance: bool = False
    lint_name: str | None = None

    def served_name(self, options: ExportOptions) -> str:
        """The family's name on ``/metrics`` under ``options``."""
        if self.lint_name is not None and not options.dcgm_names:
            return self.lint_name
        return self.name

    def served_type(self, options: ExportOptions) -> str:
        """The family's ``# TYPE`` under ``options`` (:func:`exposed_type`)."""
        return self.kind if options.dcgm_names else exposed_type(self.kind, self.name)


_F = DcgmField
#: Every ``DCGM_FI_*`` family of the agent's ``/metrics``, in exposition order. The first
#: block is dcgm-exporter's default counters (names, types, HELP as its default-counters.csv);
#: the second the health fields of GpuSample under the server's ``/metrics`` names and types.
DCGM_FIELDS: tuple[DcgmField, ...] = (
    _F("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", extra="sm_clock_mhz"),
    _F("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", extra="mem_clock_mhz"),
    _F("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", extra="memory_temp_c"),
    _F("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", sample="temperature_c"),
    _F("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", sample="power_w"),
    _F(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Total energy consumption since boot (in mJ).",
        extra="total_energy_mj",
    ),
    _F(
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
        "counter",
        "Total number of PCIe retries.",
        sample="pcie_replay_count",
        lint_name="tierwatch_gpu_pcie_replays",
    ),
    _F("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", sample="utilization_pct"),
    _F(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "gauge",
        "Memory utilization (in %).",
        extra="mem_copy_util_pct",
    ),
    _F("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %).", extra="enc_util_pct"),
    _F("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %).", extra="dec_util_pct"),
    _F(
        "DCGM_FI_DEV_FB_FREE",
        "gauge",
        "Framebuffer memory free (in MiB).",
        extra="fb_free_mib",
        per_instance=True,
    ),
    _F(
        "DCGM_FI_DEV_FB_USED",
        "gauge",
        "Framebuffer memory used (in MiB).",
        sample="memory_used_mib",
        extra="fb_used_mib",
        per_instance=True,
    ),
    _F(
        "DCGM_FI_DEV_FB_RESERVED",
        "gauge",
        "Framebuffer memory reserved (in MiB).",
        extra="fb_reserved_mib",
        per_instance=True,
    ),
    _F(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "Total NVLink bandwidth counters for all lanes.",
        extra="nvlink_bandwidth_total",
    ),
    _F(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Remapped rows for uncorrectable errors.",
        sample="remapped_rows_uncorrectable",
    ),
    _F(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Remapped rows for correctable errors.",
        sample="remapped_rows_correctable",
    ),
    _F(
        "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "gauge",
        "Whether remapping of rows has failed.",
        sample="row_remap_failure",
    ),
    _F(
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "gauge",
        "Ratio of time the graphics engine is active.",
        extra="prof_gr_engine_active_ratio",
        per_instance=True,
    ),
    _F(
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "gauge",
        "Ratio of cycles the tensor (HMMA) pipe is active.",
        extra="prof_pipe_tensor_active_ratio",
        per_instance=True,
    ),
    _F(
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "gauge",
        "Ratio of cycles the device memory interface is active.",
        extra="prof_dram_active_ratio",
        per_instance=True,
    ),
    _F(
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "gauge",
        "PCIe bytes transmitted per second (headers + payload).",
        extra="prof_pcie_tx_bps",
    ),
    _F(
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "gauge",
        "PCIe bytes received per second (headers + payload).",
        extra="prof_pcie_rx_bps",
    ),
    # -- GpuSample's health fields beyond the defaults (the server's /metrics names) ------
    _F(
        "DCGM_FI_DEV_SLOWDOWN_TEMP",
        "gauge",
        "Slowdown temperature threshold (in C).",
        sample="slowdown_temp_c",
    ),
    _F(
        "DCGM_FI_DEV_SHUTDOWN_TEMP",
        "gauge",
        "Shutdown temperature threshold (in C).",
        sample="shutdown_temp_c",
    ),
    _F(
        "DCGM_FI_DEV_POWER_MGMT_LIMIT",
        "gauge",
        "Power management limit (in W).",
        sample="power_limit_w",
    ),
    _F(
        "DCGM_FI_DEV_FB_TOTAL",
        "gauge",
        "Framebuffer memory total (in MiB).",
        sample="memory_total_mib",
        per_instance=True,
    ),
    _F(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "gauge",
        "Total number of single-bit volatile ECC errors.",
        sample="ecc_sbe_volatile",
    ),
    _F(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "gauge",
        "Total number of double-bit volatile ECC errors.",
        sample="ecc_dbe_volatile",
    ),
    _F(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "gauge",
        "Total number of single-bit persistent ECC errors.",
        sample="ecc_sbe_aggregate",
    ),
    _F(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "gauge",
        "Total number of double-bit persistent ECC errors.",
        sample="ecc_dbe_aggregate",
    ),
    _F(
        "DCGM_FI_DEV_ROW_REMAP_PENDING",
        "gauge",
        "Whether a row remap is pending (GPU reset needed).",
        sample="row_remap_pending",
    ),
    _F(
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        "gauge",
        "Current clock throttle reasons (bitmask).",
        sample="throttle_reasons",
    ),
    _F(
        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
        "gauge",
        "Total number of NVLink CRC errors (flit and data, summed over links).",
        sample="nvlink_crc_errors",
    ),
    _F(
        "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
        "gauge",
        "Total number of NVLink replay errors.",
        sample="nvlink_replay_errors",
    ),
    _F(
        "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
        "gauge",
        "Total number of NVLink recovery errors.",
        sample="nvlink_recovery_errors",
    ),
)
XID_ERRORS = _F("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.")

XID_EVENTS = "tierwatch_xid_events"
STALE = "tierwatch_gpu_telemetry_stale"
LAST_SAMPLE = "tierwatch_gpu_last_sample_timestamp_seconds"
AGENT_INFO = "tierwatch_agent_info"


def exposed_type(kind: str, name: str) -> str:
    """The ``# TYPE`` a ``DCGM_FI_*`` family is served under by default.

    dcgm-exporter declares some counters under names without ``_total``; promtool's linter
    (Prometheus 2.42 ``promlint``) rejects a counter so named but does not check an
    ``untyped`` family's suffix. So such a counter is served ``untyped`` under its own name
    (PromQL's ``rate()`` and ``increase()`` do not look at the declared type); a counter named
    ``..._total`` stays a counter.

    Args:
        kind: ``gauge`` or ``counter``, as dcgm-exporter declares the field.
        name: The family's name.

    Returns:
        ``gauge``, ``counter`` or ``untyped``.
    """
    if kind == "counter" and not name.endswith("_total"):
        return "untyped"
    return kind


def lint_findings(name: str, kind: str, options: ExportOptions) -> set[str]:
    """The ``promtool check metrics`` findings (Prometheus 2.42's wording) a ``DCGM_FI_*``
    family gets under ``options``: none with the defaults; with ``modelName`` as the model
    label, a camelCase one; with ``dcgm_names``, dcgm-exporter's own (a counter without
    ``_total``, a name that contains its type).

    Args:
        name: The name served (:meth:`DcgmField.served_name`).
        kind: The type served (:meth:`DcgmField.served_type`).
        options: The export options.

    Returns:
        promtool's lines, e.g. ``DCGM_FI_DEV_PCIE_REPLAY_COUNTER counter metrics should have
        "_total" suffix``.
    """
    found = set()
    if re.search(r"[a-z][A-Z]", options.model_label):
        found.add(f"{name} label names should be written in 'snake_case' not 'camelCase'")
    if kind == "counter" and not name.endswith("_total"):
        found.add(f'{name} counter metrics should have "_total" suffix')
    lower = name.lower()
    for typename in ("counter", "gauge", "histogram", "summary"):
        if f"_{typename}_" in lower or lower.endswith(f"_{typename}"):
            found.add(f"{name} metric name should not include type '{typename}'")
    return found


def dcgm_relabel_configs(model_label: str = DEFAULT_MODEL_LABEL) -> list[dict[str, object]]:
    """A scrape job's ``metric_relabel_configs`` that make Prometheus store an agent's
    default (promtool-clean) lines under dcgm-exporter's names: the model label as
    ``modelName``, and each renamed family (``tierwatch_gpu_pcie_replays``) under its
    dcgm-exporter name. For sites whose dashboards, rules or alerts key on those names.

    Args:
        model_label: The agents' ``--metrics-model-label``.

    Returns:
        Rules as Prometheus's configuration takes them: copy a non-empty ``model_label`` into
        ``modelName`` and drop ``model_label``, then one ``__name__`` rewrite per renamed
        family.
    """
    rules: list[dict[str, object]] = [
        {"source_labels": [model_label], "regex": "(.+)", "target_label": "modelName"},
        {"regex": model_label, "action": "labeldrop"},
    ]
    for spec in DCGM_FIELDS:
        if spec.lint_name is not None:
            rules.append(
                {
                    "source_labels": ["__name__"],
                    "regex": re.escape(spec.lint_name),
                    "target_label": "__name__",
                    "replacement": spec.name,
                }
            )
    return rules


# -- the snapshot ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuState:
    """What ``/metrics`` knows about one GPU of the inventory.

    Attributes:
        info: Index, UUID and model.
        sample: The latest sample (None: never read).
        extras: The extra readings of the latest live collection (None: none).
        pci_bus_id, driver_version: The last known identity (kept while the GPU is stale, so
            its series keep their labels).
        stale: The telemetry is stale (see the module docs); its ``DCGM_FI_*`` lines are left
            out.
        last_xid: The last XID code seen since the agent started (0: none).
        xid_counts: Occurrences of each XID code since the agent started.
    """

    info: GpuInfo
    sample: GpuSample | None = None
    extras: GpuExtras | None = None
    pci_bus_id: str | None = None
    driver_version: str | None = None
    stale: bool = False
    last_xid: int = 0
    xid_counts: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything one scrape renders.

    Attributes:
        node: The node's name (the host label's value).
        collector: The collector's name (``nvml``, ``dcgm-exporter``, ``simulated``).
        simulated: Whether the readings are made up.
        version: The agent's version.
        gpus: The GPUs of the inventory, by index.
    """

    node: str
    collector: str
    simulated: bool
    version: str
    gpus: tuple[GpuState, ...] = ()


# -- rendering ------------------------------------------------------------------------------
def gpu_labels(
    gpu: GpuState, node: str, options: ExportOptions, *, model: bool = True
) -> dict[str, str]:
    """The label set of ``gpu``'s lines, without MIG labels; labels without a value are
    left out.

    Args:
        gpu: The GPU.
        node: The host label's value.
        options: The label names.
        model: Include the model label (the ``DCGM_FI_*`` lines do; the ``tierwatch_*``
            lines do not: one line per physical GPU, and no camelCase finding when the model
            label is set to ``modelName``).
    """
    labels = {
        "gpu": str(gpu.info.index),
        "UUID": gpu.info.uuid,
        "pci_bus_id": gpu.pci_bus_id or "",
        "device": f"nvidia{gpu.info.index}",
        options.model_label: gpu.info.name if model else "",
        options.host_label: node,
        "DCGM_FI_DRIVER_VERSION": gpu.driver_version or "",
    }
    return {k: v for k, v in labels.items() if v}


def _number(value: float | int | bool | None) -> float | None:
    return None if value is None else float(value)


def _device_value(spec: DcgmField, gpu: GpuState) -> float | None:
    if spec is XID_ERRORS:
        return float(gpu.last_xid)
    if spec.extra is not None and gpu.extras is not None:
        value = getattr(gpu.extras, spec.extra)
        if value is not None:
            return _number(value)
    if spec.sample is not None and gpu.sample is not None:
        return _number(getattr(gpu.sample, spec.sample))
    return None


def _instance_value(spec: DcgmField, gpu: GpuState, instance: MigInstance) -> float | None:
    if not spec.per_instance:
        return _device_value(spec, gpu)
    if spec.extra is None or spec.extra not in MIG_READINGS:
        return None
    return _number(getattr(instance, spec.extra))


def _dcgm_families(snapshot: MetricsSnapshot, options: ExportOptions) -> Iterator[Metric]:
    live = [g for g in snapshot.gpus if not g.stale and g.sample is not None]
    for spec in (*DCGM_FIELDS, XID_ERRORS):
        name = spec.served_name(options)
        family = Metric(name, spec.help, spec.served_type(options))
        for gpu in live:
            labels = gpu_labels(gpu, snapshot.node, options)
            mig = gpu.extras.mig if gpu.extras is not None else []
            if not mig:
                value = _device_value(spec, gpu)
                if value is not None:
                    family.add_sample(name, labels, value)
                continue
            for instance in mig:
                value = _instance_value(spec, gpu, instance)
                if value is not None:
                    mig_labels = {
                        "GPU_I_PROFILE": instance.profile,
                        "GPU_I_ID": str(instance.gpu_instance_id),
                    }
                    family.add_sample(name, {**labels, **mig_labels}, value)
        if family.samples:
            yield family


def _tierwatch_families(snapshot: MetricsSnapshot, options: ExportOptions) -> Iterator[Metric]:
    info = Metric(AGENT_INFO, "The agent behind this endpoint (value 1).", "gauge")
    info.add_sample(
        AGENT_INFO,
        {
            options.host_label: snapshot.node,
            "collector": snapshot.collector,
            "simulated": "true" if snapshot.simulated else "false",
            "version": snapshot.version,
        },
        1.0,
    )
    yield info
    stale = Metric(
        STALE,
        "1 while the GPU's telemetry is stale (its DCGM_FI_* lines are left out), else 0.",
        "gauge",
    )
    last = Metric(
        LAST_SAMPLE,
        "When the collector last read the GPU (Unix time, in seconds).",
        "gauge",
    )
    xids = Metric(
        XID_EVENTS,
        "XID errors of the GPU per code since the agent started (every occurrence counted).",
        "counter",
    )
    for gpu in snapshot.gpus:
        labels = gpu_labels(gpu, snapshot.node, options, model=False)
        stale.add_sample(STALE, labels, 1.0 if gpu.stale or gpu.sample is None else 0.0)
        if gpu.sample is not None:
            last.add_sample(LAST_SAMPLE, labels, gpu.sample.ts.timestamp())
        for code, count in sorted(gpu.xid_counts.items()):
            xids.add_sample(f"{XID_EVENTS}_total", {**labels, "xid": str(code)}, float(count))
    for family in (stale, last, xids):
        if family.samples:
            yield family


def collect(snapshot: MetricsSnapshot, options: ExportOptions) -> Iterator[Metric]:
    """The metric families of one scrape (pure; families without samples are left out).

    Args:
        snapshot: What the agent knows (see :class:`MetricsSnapshot`).
        options: Label names and whether ``DCGM_FI_*`` families are exported.

    Yields:
        prometheus-client metric families: the ``DCGM_FI_*`` ones (when
        ``options.dcgm_fields``), then ``tierwatch_agent_info``,
        ``tierwatch_gpu_telemetry_stale``, ``tierwatch_gpu_last_sample_timestamp_seconds``
        and ``tierwatch_xid_events``.
    """
    if options.dcgm_fields:
        yield from _dcgm_families(snapshot, options)
    yield from _tierwatch_families(snapshot, options)


class _OneShot(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(snapshot: MetricsSnapshot, options: ExportOptions) -> bytes:
    """The Prometheus text exposition of one scrape (pure).

    Families, HELP and samples are as prometheus-client's ``generate_latest`` writes them
    (labels sorted by name); dcgm-exporter's counters without ``_total`` are ``untyped``
    (:func:`exposed_type`), or with ``dcgm_names`` counters declared under their own names
    (``# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter``), as dcgm-exporter declares them.

    Args:
        snapshot: What the agent knows.
        options: Label names and whether ``DCGM_FI_*`` families are exported.

    Returns:
        UTF-8 text (:data:`CONTENT_TYPE`).
    """
    text = generate_latest(_OneShot(collect(snapshot, options)))
    if not options.dcgm_names:
        return text
    # generate_latest writes a counter family's # HELP/# TYPE under <name>_total (OpenMetrics
    # naming); dcgm-exporter writes them under the counter's own name
    lines = []
    for line in text.decode().splitlines(keepends=True):
        if line.startswith(("# HELP ", "# TYPE ")):
            name, sep, rest = line[7:].partition(" ")
            bare = name.removesuffix("_total")
            if bare != name and bare in _BARE_COUNTERS:
                line = f"{line[:7]}{bare}{sep}{rest}"
        lines.append(line)
    return "".join(lines).encode()


#: dcgm-exporter's counters whose name has no ``_total`` (served as counters with
#: ``dcgm_names``).
_BARE_COUNTERS = frozenset(
    s.name for s in DCGM_FIELDS if s.kind == "counter" and not s.name.endswith("_total")
)


# -- the runtime's holder -------------------------------------------------------------------
class MetricsState:
    """The readings ``/metrics`` serves: updated by the runtime once per report interval,
    read by scrapes (thread-safe; a scrape never calls the collector).

    Args:
        node: The node's name.
        collector: The collector's name.
        simulated: Whether the collector's readings are made up.
        version: The agent's version.
        max_age_s: Readings older than this (seconds, monotonic) count as stale (None:
            never; the runtime passes ``max(3 × interval, 5 s)``).
    """

    def __init__(
        self,
        *,
        node: str,
        collector: str,
        simulated: bool,
        version: str,
        max_age_s: float | None = None,
    ) -> None:
        self.node = node
        self.collector = collector
        self.simulated = simulated
        self.version = version
        self.max_age_s = max_age_s
        self._lock = threading.Lock()
        self._inventory: list[GpuInfo] = []
        self._samples: dict[int, GpuSample] = {}
        self._stale: dict[int, bool] = {}
        self._extras: dict[int, GpuExtras] = {}
        self._identity: dict[int, tuple[str | None, str | None]] = {}
        self._xid_counts: dict[int, dict[int, int]] = {}
        self._last_xid: dict[int, int] = {}
        self._updated_at: float | None = None

    def update(
        self,
        inventory: Iterable[GpuInfo],
        samples: Iterable[GpuSample],
        extras: Mapping[int, GpuExtras],
        now: float | None = None,
    ) -> None:
        """Take one collection's results.

        A GPU's sample is stale when its ``ts`` is not newer than the previous collection's
        (the collector repeated its cached sample), and a GPU of the inventory without a
        sample is stale too.

        Args:
            inventory: The collector's GPUs.
            samples: What ``collect()`` returned.
            extras: What ``extras()`` returned right after.
            now: ``time.monotonic()`` of the collection (None: now).
        """
        with self._lock:
            self._inventory = list(inventory)
            seen = set()
            for sample in samples:
                previous = self._samples.get(sample.index)
                self._stale[sample.index] = previous is not None and sample.ts <= previous.ts
                self._samples[sample.index] = sample
                seen.add(sample.index)
            for info in self._inventory:
                if info.index not in seen:
                    self._stale[info.index] = True
            self._extras = {i: e for i, e in extras.items() if not self._stale.get(i, True)}
            for i, e in self._extras.items():
                old_pci, old_driver = self._identity.get(i, (None, None))
                self._identity[i] = (e.pci_bus_id or old_pci, e.driver_version or old_driver)
            self._updated_at = time.monotonic() if now is None else now

    def count_xid(self, event: XidEvent) -> None:
        """Count one XID occurrence (from any thread)."""
        with self._lock:
            counts = self._xid_counts.setdefault(event.gpu, {})
            counts[event.xid] = counts.get(event.xid, 0) + 1
            self._last_xid[event.gpu] = event.xid

    def snapshot(self, now: float | None = None) -> MetricsSnapshot:
        """What a scrape renders now.

        Args:
            now: ``time.monotonic()`` now (None: now); readings older than ``max_age_s``
                are all stale.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            too_old = (
                self.max_age_s is not None
                and self._updated_at is not None
                and now - self._updated_at > self.max_age_s
            )
            gpus = []
            for info in sorted(self._inventory, key=lambda g: g.index):
                i = info.index
                pci, driver = self._identity.get(i, (None, None))
                gpus.append(
                    GpuState(
                        info=info,
                        sample=self._samples.get(i),
                        extras=self._extras.get(i),
                        pci_bus_id=pci,
                        driver_version=driver,
                        stale=too_old or self._stale.get(i, True),
                        last_xid=self._last_xid.get(i, 0),
                        xid_counts=dict(self._xid_counts.get(i, {})),
                    )
                )
        return MetricsSnapshot(
            node=self.node,
            collector=self.collector,
            simulated=self.simulated,
            version=self.version,
            gpus=tuple(gpus),
        )

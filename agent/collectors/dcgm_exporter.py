"""GPU health scraped from a dcgm-exporter already running on the node.

dcgm-exporter (NVIDIA) serves DCGM fields as Prometheus text at ``/metrics`` (port 9400 by
default), one series per GPU labelled ``gpu`` (index), ``UUID``, ``device``, ``modelName``,
``Hostname`` (and more). This collector scrapes that page with httpx, parses it with
``prometheus_client.parser.text_string_to_metric_families`` and maps the DCGM field names onto
:class:`~tierwatch.agent.protocol.GpuSample`.

Name matching: prometheus_client strips a ``_total`` suffix from *counter family* names and
appends ``_total`` to the sample names (``..._COUNT_TOTAL`` becomes a sample
``..._COUNT_TOTAL_total``), so every name is compared with its ``_total``/``_TOTAL`` suffixes
removed, case-insensitively.

XID: ``DCGM_FI_DEV_XID_ERRORS`` holds the *last* XID value of each GPU. An
:class:`~tierwatch.agent.protocol.XidEvent` is emitted when it changes to a nonzero value
between two scrapes. The first scrape (:meth:`DcgmExporterCollector.start`) sets the baseline,
and a nonzero value found then is reported as an ``XidEvent`` with ``before_start=True``
(``ts`` is the scrape; when it occurred is unknown): the agent may have been restarted on a
node whose GPU already hit a fatal XID. Which codes matter, and whether the operator already
acknowledged that value, is the server's call (``fleet.rules.rule_xid_before_start``); the
agent sends every nonzero value and never counts it as an occurrence in its ``/metrics``.
Limit: a repeat of the same code between two scrapes cannot be seen. Use the NVML collector
when every XID must be counted (NVML delivers only the XIDs that occur while it listens, so
it has no pre-start value).

Stale telemetry: when the scrape fails (or a GPU is missing from it), the GPU's last sample is
returned unchanged with its old ``ts``, plus an ``exporter_unreachable`` event.

The agent's own ``/metrics``: with this collector it exports no ``DCGM_FI_*`` series
(:attr:`~tierwatch.agent.collectors.base.GpuCollector.exports_dcgm_fields` is False), only its
``tierwatch_*`` ones. The node's Prometheus already scrapes the exporter this collector reads;
a second copy under the same names would double every series of the stock dashboard.

Source: dcgm-exporter's default counters (etc/default-counters.csv) and DCGM field ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tierwatch.agent.collectors.base import CollectorError, GpuCollector, XidCallback
from tierwatch.agent.protocol import GPU_METRIC_TYPES, GpuInfo, GpuSample, XidEvent, utcnow
from tierwatch.agent.urlsafe import redact_url

log = logging.getLogger(__name__)


def _norm(name: str) -> str:
    name = name.upper()
    while name.endswith("_TOTAL"):
        name = name[: -len("_TOTAL")]
    return name


# DCGM field name -> GpuSample field (units already match: °C, W, %, MiB, counts).
_SIMPLE_FIELDS: dict[str, str] = {
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
    "DCGM_FI_DEV_SLOWDOWN_TEMP": "slowdown_temp_c",
    "DCGM_FI_DEV_SHUTDOWN_TEMP": "shutdown_temp_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": "power_limit_w",
    "DCGM_FI_DEV_GPU_UTIL": "utilization_pct",
    "DCGM_FI_DEV_FB_USED": "memory_used_mib",
    "DCGM_FI_DEV_FB_TOTAL": "memory_total_mib",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "ecc_sbe_volatile",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_dbe_volatile",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "ecc_sbe_aggregate",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "ecc_dbe_aggregate",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "remapped_rows_correctable",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "remapped_rows_uncorrectable",
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "row_remap_pending",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "row_remap_failure",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "pcie_replay_count",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "throttle_reasons",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "throttle_reasons",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": "nvlink_replay_errors",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": "nvlink_recovery_errors",
}
# Fields summed into one GpuSample field.
_SUM_FIELDS: dict[str, str] = {
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": "nvlink_crc_errors",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": "nvlink_crc_errors",
}
_INT_FIELDS = {name for name, kind in GPU_METRIC_TYPES.items() if kind is int}
_BOOL_FIELDS = {name for name, kind in GPU_METRIC_TYPES.items() if kind is bool}
_FB_FREE = "DCGM_FI_DEV_FB_FREE"
_FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
_XID = "DCGM_FI_DEV_XID_ERRORS"

_SIMPLE = {_norm(k): v for k, v in _SIMPLE_FIELDS.items()}
_SUM = {_norm(k): v for k, v in _SUM_FIELDS.items()}


@dataclass
class ExporterGpu:
    """What one scrape says about one GPU.

    Attributes:
        index: GPU index (label ``gpu``).
        uuid: Label ``UUID``.
        model: Label ``modelName``.
        fields: ``GpuSample`` field values found (°C, W, %, MiB, counts).
        xid: Value of ``DCGM_FI_DEV_XID_ERRORS`` (the last XID code; 0 = none), if exported.
    """

    index: int
    uuid: str = ""
    model: str = ""
    fields: dict[str, float | int | bool] = field(default_factory=dict)
    xid: int | None = None


def parse_exposition(text: str) -> dict[int, ExporterGpu]:
    """Parse dcgm-exporter's ``/metrics`` text into per-GPU readings.

    Series without a numeric ``gpu`` label, NaN values and unknown metrics are ignored;
    when a GPU has several series of one metric (e.g. MIG instances), the first wins.
    ``memory_total_mib`` is ``FB_USED + FB_FREE (+ FB_RESERVED)`` when ``FB_TOTAL`` is absent.

    Args:
        text: Prometheus text exposition format.

    Returns:
        Readings by GPU index.

    Raises:
        ValueError: the text is not valid Prometheus exposition format.
    """
    gpus: dict[int, ExporterGpu] = {}
    extra: dict[int, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            gpu_label = sample.labels.get("gpu")
            if gpu_label is None or not gpu_label.isdigit():
                continue
            value = sample.value
            if value != value:  # NaN
                continue
            index = int(gpu_label)
            gpu = gpus.get(index)
            if gpu is None:
                gpu = gpus[index] = ExporterGpu(index=index)
            gpu.uuid = gpu.uuid or sample.labels.get("UUID", "")
            gpu.model = gpu.model or sample.labels.get("modelName", "")
            name = _norm(sample.name)
            if name in _SIMPLE:
                target = _SIMPLE[name]
                if target not in gpu.fields:
                    gpu.fields[target] = _convert(target, value)
            elif name in _SUM:
                target = _SUM[name]
                gpu.fields[target] = int(gpu.fields.get(target, 0)) + int(value)
            elif name == _norm(_XID):
                if gpu.xid is None:
                    gpu.xid = int(value)
            elif name in (_norm(_FB_FREE), _norm(_FB_RESERVED)):
                extra.setdefault(index, {}).setdefault(name, float(value))
    for index, gpu in gpus.items():
        used = gpu.fields.get("memory_used_mib")
        free = extra.get(index, {}).get(_norm(_FB_FREE))
        if "memory_total_mib" not in gpu.fields and used is not None and free is not None:
            reserved = extra[index].get(_norm(_FB_RESERVED), 0.0)
            gpu.fields["memory_total_mib"] = float(used) + free + reserved
    return gpus


def _convert(target: str, value: float) -> float | int | bool:
    if target in _BOOL_FIELDS:
        return bool(value)
    if target in _INT_FIELDS:
        return int(value)
    return float(value)


class DcgmExporterCollector(GpuCollector):
    """Reads GPU health from a dcgm-exporter ``/metrics`` endpoint.

    Args:
        url: The exporter's metrics URL, e.g. ``http://127.0.0.1:9400/metrics``.
        timeout_s: HTTP timeout of one scrape, seconds.
    """

    name = "dcgm-exporter"
    simulated = False
    exports_dcgm_fields = False  # Prometheus scrapes the exporter itself (module docs)

    def __init__(self, url: str, timeout_s: float = 3.0) -> None:
        super().__init__()
        self.url = url
        self.shown_url = redact_url(url)  # for messages: never the credentials
        self._client = httpx.Client(timeout=timeout_s)
        self._inventory: list[GpuInfo] = []
        self._last: dict[int, GpuSample] = {}
        self._last_xid: dict[int, int] = {}
        self._failing = False

    def _scrape(self) -> dict[int, ExporterGpu]:
        """Fetch and parse the metrics page.

        Raises:
            CollectorError: the exporter is unreachable, answers non-200, or the page is
                not Prometheus text.
        """
        try:
            resp = self._client.get(self.url)
        except httpx.HTTPError as exc:
            raise CollectorError(f"cannot reach dcgm-exporter at {self.shown_url}: {exc}") from exc
        if resp.status_code != 200:
            raise CollectorError(
                f"dcgm-exporter at {self.shown_url} answered HTTP {resp.status_code}"
            )
        try:
            return parse_exposition(resp.text)
        except ValueError as exc:
            raise CollectorError(f"cannot parse {self.shown_url}: {exc}") from exc

    def is_available(self) -> bool:
        """True when the exporter answers with at least one GPU."""
        try:
            return bool(self._scrape())
        except CollectorError as exc:
            log.info("dcgm-exporter not available: %s", exc)
            return False

    def start(self, on_xid: XidCallback) -> None:
        """Scrape once to learn the inventory and the XID baseline.

        A nonzero ``DCGM_FI_DEV_XID_ERRORS`` at this scrape is handed to ``on_xid`` as an
        :class:`~tierwatch.agent.protocol.XidEvent` with ``before_start=True`` (module docs);
        a zero or missing gauge reports nothing.

        Raises:
            CollectorError: the exporter cannot be scraped or lists no GPU.
        """
        super().start(on_xid)
        gpus = self._scrape()
        if not gpus:
            raise CollectorError(f"dcgm-exporter at {self.shown_url} lists no GPU (no 'gpu' label)")
        self._inventory = [
            GpuInfo(
                index=g.index,
                uuid=g.uuid or f"dcgm-gpu-{g.index}",
                name=g.model[:128],
                memory_total_mib=g.fields.get("memory_total_mib"),
            )
            for g in sorted(gpus.values(), key=lambda g: g.index)
        ]
        now = utcnow()
        for g in sorted(gpus.values(), key=lambda g: g.index):
            if g.xid is not None:
                self._last_xid[g.index] = g.xid
                if g.xid:
                    self.emit_xid(
                        XidEvent(
                            gpu=g.index,
                            xid=g.xid,
                            ts=now,
                            message=f"dcgm-exporter {_XID} showed {g.xid} at the agent's "
                            "first scrape: seen before the agent started (time unknown)",
                            before_start=True,
                        )
                    )

    def inventory(self) -> list[GpuInfo]:
        """The GPUs found at :meth:`start`."""
        return list(self._inventory)

    def collect(self) -> list[GpuSample]:
        """Scrape once; on failure return the previous samples with their old ``ts``."""
        try:
            gpus = self._scrape()
        except CollectorError as exc:
            if not self._failing:
                self._failing = True
                self.add_event(
                    "exporter_unreachable",
                    f"{exc}; last samples are repeated with their old timestamps",
                )
            return [self._last[i] for i in sorted(self._last)]
        if self._failing:
            self._failing = False
            self.add_event("exporter_recovered", f"dcgm-exporter at {self.shown_url} answers again")
        now = utcnow()
        samples = []
        for info in self._inventory:
            gpu = gpus.get(info.index)
            if gpu is None:
                if info.index in self._last:
                    samples.append(self._last[info.index])
                continue
            sample = self.build_sample({"index": gpu.index, "ts": now, **gpu.fields})
            self._last[gpu.index] = sample
            samples.append(sample)
            self._check_xid(gpu, now)
        return samples

    def _check_xid(self, gpu: ExporterGpu, now: datetime) -> None:
        if gpu.xid is None:
            return
        previous = self._last_xid.get(gpu.index)
        self._last_xid[gpu.index] = gpu.xid
        if gpu.xid and previous is not None and gpu.xid != previous:
            self.emit_xid(
                XidEvent(
                    gpu=gpu.index,
                    xid=gpu.xid,
                    ts=now,
                    message="dcgm-exporter DCGM_FI_DEV_XID_ERRORS changed",
                )
            )
        elif gpu.xid and previous is None:
            self.emit_xid(
                XidEvent(
                    gpu=gpu.index,
                    xid=gpu.xid,
                    ts=now,
                    message="dcgm-exporter DCGM_FI_DEV_XID_ERRORS appeared",
                )
            )

    def shutdown(self) -> None:
        """Close the HTTP client."""
        self._client.close()

"""Health rules: pure functions from GPU samples, XID events and latencies to findings.

Every rule returns :class:`Finding` objects (what is wrong now, with evidence);
:func:`merge_reasons` folds findings into the node's stored :class:`Reason` list (what stays
active, with first/last seen and a per-rule quiet period), and :func:`node_state` turns the
reasons into the node's state. Nothing here does I/O (apart from the XID catalog, read once
from the package) or reads the clock: ``now`` is always a parameter.

Sources of the defaults: the "Health model" table of docs/design.md,
NVML's definitions of the fields (``nvmlDeviceGetTemperatureThreshold``,
``nvmlDeviceGetTotalEccErrors``, ``nvmlDeviceGetRemappedRows``,
``nvmlDeviceGetCurrentClocksEventReasons``, ``nvmlDeviceGetPcieReplayCounter``,
``nvmlDeviceGetNvLinkErrorCounter``) and NVIDIA's XID catalog (``app/data/xid_catalog.csv``).

Boundaries are inclusive ("at least") wherever the design says "≥" or "for N × interval",
and exclusive where it says "over" (rates, straggler factor).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field, field_validator

from tierwatch.agent.protocol import (
    HW_THROTTLE_MASK,
    THROTTLE_HW_POWER_BRAKE_SLOWDOWN,
    THROTTLE_HW_THERMAL_SLOWDOWN,
    GpuSample,
    throttle_reason_names,
)
from tierwatch.server.fleet import xid_catalog

Severity = Literal["degraded", "unhealthy"]
STATE_ORDER: dict[str, int] = {"healthy": 0, "degraded": 1, "unhealthy": 2}

# Rule ids.
RULE_TEMPERATURE = "temperature"
RULE_ECC_UNCORRECTABLE = "ecc_uncorrectable"
RULE_ROW_REMAP = "row_remap"
RULE_XID = "xid"
RULE_XID_REPEAT = "xid_repeat"
RULE_XID_BEFORE_START = "xid_before_start"
RULE_THROTTLING = "throttling"
RULE_PCIE_REPLAY = "pcie_replay"
RULE_NVLINK = "nvlink"
RULE_STRAGGLER = "straggler"
RULE_STALE_TELEMETRY = "stale_telemetry"
RULES: tuple[str, ...] = (
    RULE_TEMPERATURE,
    RULE_ECC_UNCORRECTABLE,
    RULE_ROW_REMAP,
    RULE_XID,
    RULE_XID_REPEAT,
    RULE_XID_BEFORE_START,
    RULE_THROTTLING,
    RULE_PCIE_REPLAY,
    RULE_NVLINK,
    RULE_STRAGGLER,
    RULE_STALE_TELEMETRY,
)
# The rules :func:`evaluate_gpu` runs (pass as ``evaluated_rules`` to :func:`merge_reasons`).
GPU_SAMPLE_RULES: frozenset[str] = frozenset(
    {
        RULE_TEMPERATURE,
        RULE_ECC_UNCORRECTABLE,
        RULE_ROW_REMAP,
        RULE_THROTTLING,
        RULE_PCIE_REPLAY,
        RULE_NVLINK,
    }
)
XID_RULES: frozenset[str] = frozenset({RULE_XID, RULE_XID_REPEAT})
# Rules whose findings come only from new events (XIDs, latency reports): no new event means
# no finding, so their reasons expire by quiet period even when not evaluated.
EVENT_RULES: frozenset[str] = frozenset({RULE_XID, RULE_XID_REPEAT, RULE_STRAGGLER})
# Rules whose reasons stay until an operator acknowledges them (no quiet period): what they
# report is never reported as gone (a pre-start XID value is only seen again, or not).
ACK_ONLY_RULES: frozenset[str] = frozenset({RULE_XID_BEFORE_START})

# Our own action codes (the XID rules pass on the catalog's codes, see xid_catalog).
ACTION_REPLACE_GPU = "REPLACE_GPU"
ACTION_CHECK_COOLING = "CHECK_COOLING"
ACTION_INVESTIGATE_POWER = "INVESTIGATE_POWER"
ACTION_INVESTIGATE_LINK = "INVESTIGATE_LINK"
ACTION_INVESTIGATE_STRAGGLER = "INVESTIGATE_STRAGGLER"
ACTION_CHECK_AGENT = "CHECK_AGENT"
ACTION_RESET_GPU = "RESET_GPU"
ACTION_RESET_GPU_TO_REMAP = "RESET_GPU_TO_REMAP"
ACTION_UNKNOWN_XID = "UNEXPECTED_ERR_REPORT_ISSUE"
RULE_ACTIONS: dict[str, str] = {
    ACTION_REPLACE_GPU: "Replace the GPU: it has no spare rows left to remap memory faults.",
    ACTION_CHECK_COOLING: "Check the node's cooling: fans, airflow, inlet temperature.",
    ACTION_INVESTIGATE_POWER: "Check the node's power delivery: PSUs, power brake, power cap.",
    ACTION_INVESTIGATE_LINK: "Check the GPU's PCIe or NVLink connection: seating, cables, risers.",
    ACTION_INVESTIGATE_STRAGGLER: (
        "Find why this rank is slow (GPU clocks, network, host load); isolate the node if "
        "it persists."
    ),
    ACTION_CHECK_AGENT: "Check the node agent and its collector: the GPU's metrics stopped.",
    ACTION_RESET_GPU_TO_REMAP: "Reset the GPU when convenient so the pending row remap applies.",
}


def describe_action(action: str) -> str:
    """Human description of any recommended action code (ours or the XID catalog's)."""
    if action in RULE_ACTIONS:
        return RULE_ACTIONS[action]
    return xid_catalog.describe_action(action)


DEFAULT_QUIET_PERIOD_S: dict[str, float] = {
    RULE_XID: 3600.0,
    RULE_ECC_UNCORRECTABLE: 3600.0,
    RULE_XID_REPEAT: 1800.0,
    RULE_ROW_REMAP: 0.0,
    RULE_TEMPERATURE: 30.0,
    RULE_THROTTLING: 30.0,
    RULE_PCIE_REPLAY: 300.0,
    RULE_NVLINK: 300.0,
    RULE_STRAGGLER: 60.0,
    RULE_STALE_TELEMETRY: 0.0,
}


class HealthThresholds(BaseModel):
    """Thresholds of the health rules (nested in the server settings as ``health``).

    Set from the environment as ``TIERWATCH_HEALTH__<FIELD>``; ``quiet_period_s`` takes a JSON
    object, and the rules it leaves out keep their defaults.

    Attributes:
        default_slowdown_temp_c: Slowdown threshold (°C) assumed when NVML gives none.
        temp_degraded_margin_c: Degraded at slowdown threshold minus this many °C.
        pcie_replay_per_min: PCIe replays per minute above which a GPU is degraded.
        rate_min_window_s: Error rates are computed over at least this span (s), so a single
            error between two closely spaced reports is not read as a high per-minute rate.
        nvlink_errors_per_min: NVLink CRC + replay + recovery errors per minute above which
            a GPU is degraded.
        xid_repeat_count: A non-fatal XID seen this many times on one GPU ...
        xid_repeat_window_s: ... within this many seconds makes the GPU degraded.
        straggler_factor: A rank slower than this × the job median ...
        straggler_consecutive: ... for this many consecutive samples is a straggler.
        heartbeat_missed_intervals: A node with no report for this many report intervals is
            unreachable.
        stale_intervals: A GPU whose newest sample is this many report intervals old while
            its node still reports is degraded (stale telemetry).
        quiet_period_s: Per rule id, seconds a reason stays active after its last finding
            (0: it clears as soon as the condition does). Rules not listed use 0.
    """

    default_slowdown_temp_c: float = Field(90.0, gt=0, le=200)
    temp_degraded_margin_c: float = Field(5.0, ge=0)
    pcie_replay_per_min: float = Field(10.0, ge=0)
    nvlink_errors_per_min: float = Field(10.0, ge=0)
    rate_min_window_s: float = Field(60.0, ge=0)
    xid_repeat_count: int = Field(2, ge=1)
    xid_repeat_window_s: float = Field(600.0, gt=0)
    straggler_factor: float = Field(3.0, gt=0)
    straggler_consecutive: int = Field(3, ge=1)
    heartbeat_missed_intervals: float = Field(3.0, gt=0)
    stale_intervals: float = Field(3.0, gt=0)
    quiet_period_s: dict[str, float] = Field(default_factory=lambda: dict(DEFAULT_QUIET_PERIOD_S))

    @field_validator("quiet_period_s")
    @classmethod
    def _merge_quiet_defaults(cls, value: dict[str, float]) -> dict[str, float]:
        negative = sorted(rule for rule, seconds in value.items() if seconds < 0)
        if negative:
            raise ValueError(f"quiet periods must be >= 0 s; negative for {', '.join(negative)}")
        return {**DEFAULT_QUIET_PERIOD_S, **value}

    def quiet_period(self, rule: str) -> float:
        """Seconds a reason of ``rule`` stays after its last finding (0 when not configured)."""
        return self.quiet_period_s.get(rule, 0.0)


@dataclass(frozen=True)
class Finding:
    """One rule's verdict that something is wrong now.

    Attributes:
        rule: Rule id (see :data:`RULES`).
        severity: ``degraded`` or ``unhealthy``.
        gpu: GPU index, or None for a node-level finding (straggler).
        key: Tells apart reasons of one rule on one GPU (the XID code for the XID rules,
            ``<job_id>:<rank>`` for stragglers, ``""`` otherwise).
        message: Human text, e.g. ``XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS on GPU 3``.
        action: Recommended action code: the catalog's for XIDs, else one of ours
            (:data:`RULE_ACTIONS`, ``RESET_GPU``).
        evidence: JSON-serialisable values that triggered it (numbers, strings, lists).
        at: When the condition was observed (the sample's or event's ``ts``), aware UTC.
    """

    rule: str
    severity: Severity
    gpu: int | None
    key: str
    message: str
    action: str
    evidence: dict[str, Any] = field(hash=False)
    at: datetime

    @property
    def identity(self) -> tuple[str, int | None, str]:
        """(rule, gpu, key): the reason this finding refreshes."""
        return (self.rule, self.gpu, self.key)


@dataclass(frozen=True)
class XidRecord:
    """One XID occurrence on one GPU (``ts`` aware UTC). Equal records are the same event."""

    gpu: int
    xid: int
    ts: datetime


@dataclass(frozen=True)
class Reason:
    """An active reason for a node's state, as stored.

    Attributes mirror :class:`Finding`; ``first_seen`` is the first finding's ``at`` and
    ``last_seen`` the newest finding's ``at``.
    """

    rule: str
    severity: Severity
    gpu: int | None
    key: str
    message: str
    action: str
    evidence: dict[str, Any] = field(hash=False)
    first_seen: datetime
    last_seen: datetime

    @property
    def identity(self) -> tuple[str, int | None, str]:
        """(rule, gpu, key): one stored reason per identity."""
        return (self.rule, self.gpu, self.key)


MAX_EVIDENCE_OCCURRENCES = 20


def _check_pair(prev: GpuSample | None, cur: GpuSample) -> None:
    if prev is not None and prev.index != cur.index:
        raise ValueError(f"samples of different GPUs compared: {prev.index} and {cur.index}")


def _fmt(value: float) -> str:
    return f"{value:g}"


# --- temperature -------------------------------------------------------------------------------


def rule_temperature(cur: GpuSample, th: HealthThresholds) -> list[Finding]:
    """GPU temperature against its slowdown threshold.

    Source: docs/design.md "Health model"; the slowdown threshold is NVML's
    ``NVML_TEMPERATURE_THRESHOLD_SLOWDOWN`` (``cur.slowdown_temp_c``), else
    ``th.default_slowdown_temp_c`` (90 °C).

    Args:
        cur: The newest sample; ``temperature_c`` in °C.
        th: Thresholds.

    Returns:
        Unhealthy when temperature ≥ slowdown, degraded when ≥ slowdown − margin, else
        nothing (also nothing when the temperature is unknown). Action ``CHECK_COOLING``.
    """
    if cur.temperature_c is None:
        return []
    from_nvml = cur.slowdown_temp_c is not None
    slowdown = th.default_slowdown_temp_c if cur.slowdown_temp_c is None else cur.slowdown_temp_c
    degraded_at = slowdown - th.temp_degraded_margin_c
    temp = cur.temperature_c
    severity: Severity
    if temp >= slowdown:
        severity, what = "unhealthy", "at or above its slowdown threshold"
    elif temp >= degraded_at:
        severity, what = "degraded", "near its slowdown threshold"
    else:
        return []
    return [
        Finding(
            rule=RULE_TEMPERATURE,
            severity=severity,
            gpu=cur.index,
            key="",
            message=(
                f"GPU {cur.index} at {_fmt(temp)} °C, {what} ({_fmt(slowdown)} °C"
                f"{'' if from_nvml else ', assumed'})"
            ),
            action=ACTION_CHECK_COOLING,
            evidence={
                "temperature_c": temp,
                "slowdown_temp_c": slowdown,
                "slowdown_source": "nvml" if from_nvml else "default",
                "degraded_at_c": degraded_at,
            },
            at=cur.ts,
        )
    ]


# --- ECC, row remapping -----------------------------------------------------------------------


def rule_ecc_uncorrectable(prev: GpuSample | None, cur: GpuSample) -> list[Finding]:
    """Any increase of the volatile uncorrectable (double-bit) ECC count.

    Source: docs/design.md "Health model"; the count is NVML's ``nvmlDeviceGetTotalEccErrors``
    (``NVML_MEMORY_ERROR_TYPE_UNCORRECTED``, ``NVML_VOLATILE_ECC``), which resets with the
    driver or a GPU reset.

    The first sample of a GPU (``prev`` None) is a baseline: a non-zero count there happened
    at an unknown time, possibly before an earlier reset was handled, so it raises nothing
    (a fresh DBE also shows as XID 48 and as row remapping). A decrease is a reset, not an
    increase. Unknown counts (None) raise nothing.

    Args:
        prev: The GPU's previous sample, or None.
        cur: The newest sample.

    Returns:
        One unhealthy finding with action ``RESET_GPU`` when the count rose, else nothing.

    Raises:
        ValueError: ``prev`` and ``cur`` are samples of different GPUs.
    """
    increase = _counter_increase(prev, cur, "ecc_dbe_volatile")
    if increase is None:
        return []
    return [
        Finding(
            rule=RULE_ECC_UNCORRECTABLE,
            severity="unhealthy",
            gpu=cur.index,
            key="",
            message=(
                f"GPU {cur.index}: {increase} new uncorrectable ECC error"
                f"{'s' if increase != 1 else ''} (volatile count {cur.ecc_dbe_volatile})"
            ),
            action=ACTION_RESET_GPU,
            evidence={
                "ecc_dbe_volatile": cur.ecc_dbe_volatile,
                "previous": prev.ecc_dbe_volatile if prev is not None else None,
                "increase": increase,
            },
            at=cur.ts,
        )
    ]


def rule_row_remap(cur: GpuSample) -> list[Finding]:
    """Row-remapping state of the GPU's memory.

    Source: docs/design.md "Health model"; NVML's ``nvmlDeviceGetRemappedRows`` (``isPending``: a
    remap waits for the next GPU reset; ``failureOccurred``: a remap failed, no spare rows).

    Args:
        cur: The newest sample.

    Returns:
        Failure: one unhealthy finding, action ``REPLACE_GPU`` (it covers a pending remap
        too). Pending only: one degraded finding, action ``RESET_GPU_TO_REMAP``. Both have key
        ``""`` so a pending remap that fails updates the same reason. Else nothing.
    """
    evidence = {
        "row_remap_pending": bool(cur.row_remap_pending),
        "row_remap_failure": bool(cur.row_remap_failure),
        "remapped_rows_correctable": cur.remapped_rows_correctable,
        "remapped_rows_uncorrectable": cur.remapped_rows_uncorrectable,
    }
    if cur.row_remap_failure:
        severity: Severity = "unhealthy"
        message = f"GPU {cur.index}: row remapping failed (no spare memory rows left)"
        action = ACTION_REPLACE_GPU
    elif cur.row_remap_pending:
        severity = "degraded"
        message = f"GPU {cur.index}: row remap pending, applies at the next GPU reset"
        action = ACTION_RESET_GPU_TO_REMAP
    else:
        return []
    return [
        Finding(
            rule=RULE_ROW_REMAP,
            severity=severity,
            gpu=cur.index,
            key="",
            message=message,
            action=action,
            evidence=evidence,
            at=cur.ts,
        )
    ]


# --- XID ---------------------------------------------------------------------------------------


def _xid_verdict(
    gpu: int, code: int, count: int, count_in_window: int, th: HealthThresholds
) -> tuple[str, Severity, str, str] | None:
    """(rule, severity, message, action) of XID ``code`` on ``gpu``, or None (no finding).

    ``count`` is the number of new occurrences, ``count_in_window`` those within the repeat
    window; the classes are those listed in :func:`rule_xid`.
    """
    many = f" ({count} occurrences)" if count > 1 else ""
    info = xid_catalog.lookup(code)
    if info is None:
        message = f"XID {code} (not in NVIDIA's catalog) on GPU {gpu}{many}"
        return RULE_XID, "degraded", message, ACTION_UNKNOWN_XID
    if info.fatal:
        return RULE_XID, "unhealthy", f"XID {code} {info.mnemonic} on GPU {gpu}{many}", info.action
    if count_in_window >= th.xid_repeat_count:
        message = (
            f"XID {code} {info.mnemonic} on GPU {gpu}: {count_in_window} "
            f"occurrences within {_fmt(th.xid_repeat_window_s)} s"
        )
        return RULE_XID_REPEAT, "degraded", message, info.action
    return None


def rule_xid(
    new: list[XidRecord],
    recent: list[XidRecord],
    th: HealthThresholds,
    now: datetime,
) -> list[Finding]:
    """Classify newly arrived XID events with NVIDIA's XID catalog.

    Source: docs/design.md "Health model"; classes and actions from NVIDIA's XID catalog
    (:mod:`tierwatch.server.fleet.xid_catalog`).

    One finding per (GPU, XID code) among ``new``, key ``str(code)``:

    - catalog ``FATAL``: rule ``xid``, unhealthy, the catalog action, on every occurrence;
    - catalog ``NONFATAL``: rule ``xid_repeat``, degraded with the catalog action when the
      code occurred on that GPU at least ``th.xid_repeat_count`` times with ``ts`` after
      ``now - th.xid_repeat_window_s`` (counting ``new`` and ``recent``); else nothing;
    - not in the catalog: rule ``xid``, degraded, action ``UNEXPECTED_ERR_REPORT_ISSUE``.

    Every occurrence counts: evidence gives ``count`` (occurrences in ``new``),
    ``count_in_window`` and the occurrence times. ``new`` and ``recent`` may overlap (the
    caller may already have stored the new events): they are combined as multisets, so an
    event in both counts once while two identical events in ``new`` count twice.

    Args:
        new: Events that just arrived (any order).
        recent: Earlier stored events (the caller leaves out ones before an acknowledgement).
        th: Thresholds (``xid_repeat_count``, ``xid_repeat_window_s``).
        now: Current time, aware UTC; the repeat window ends here (events after ``now`` are
            counted too, tolerating clock skew).

    Returns:
        Findings ordered by GPU, then XID code.
    """
    if not new:
        return []
    window_start = now - timedelta(seconds=th.xid_repeat_window_s)
    combined = Counter(new) | Counter(recent)
    in_window: Counter[tuple[int, int]] = Counter()
    for rec, n in combined.items():
        if rec.ts > window_start:
            in_window[(rec.gpu, rec.xid)] += n
    grouped: dict[tuple[int, int], list[XidRecord]] = {}
    for rec in new:
        grouped.setdefault((rec.gpu, rec.xid), []).append(rec)

    findings: list[Finding] = []
    for (gpu, code), records in sorted(grouped.items()):
        times = sorted(r.ts for r in records)
        evidence: dict[str, Any] = {
            "xid": code,
            "count": len(records),
            "count_in_window": in_window[(gpu, code)],
            "window_s": th.xid_repeat_window_s,
            # the newest few only: a burst of thousands must not bloat every API answer
            "occurrences": [t.isoformat() for t in times[-MAX_EVIDENCE_OCCURRENCES:]],
        }
        verdict = _xid_verdict(gpu, code, len(records), in_window[(gpu, code)], th)
        if verdict is not None:
            rule, severity, message, action = verdict
            findings.append(
                Finding(
                    rule=rule,
                    severity=severity,
                    gpu=gpu,
                    key=str(code),
                    message=message,
                    action=action,
                    evidence=evidence,
                    at=times[-1],
                )
            )
    return findings


def rule_xid_before_start(
    values: list[XidRecord],
    acked_xid: Mapping[int, int | None],
    th: HealthThresholds,
) -> list[Finding]:
    """Classify XID values a collector found already set when the agent started.

    Source: dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS`` (the last XID of each GPU; NVML has
    no such value: it delivers only XIDs that occur while it listens), classified with
    NVIDIA's XID catalog exactly as a live occurrence (:func:`rule_xid`, one occurrence).

    A value raises a finding when a live occurrence of its code would make the GPU
    unhealthy (catalog ``FATAL``): rule ``xid_before_start``, unhealthy, the catalog action,
    key ``str(code)``, message "... seen before the agent started ...". Non-fatal, unknown
    and zero values raise nothing (their time is unknown, so no repeat can be counted).

    The same old value comes again at every agent start; a new occurrence of the same code
    while no agent ran cannot be told from it (the gauge has no time). So a value equal to
    the GPU's ``acked_xid`` (the code of the newest XID reason an operator acknowledged on
    that GPU, forgotten at the GPU's next live XID) is the value already acknowledged and
    raises nothing; any other fatal value raises. The reason has no quiet period
    (:data:`ACK_ONLY_RULES`): it stays until acknowledged.

    Args:
        values: Pre-start values (``XidEvent.before_start``); ``ts`` is when they were read.
        acked_xid: GPU index -> its acknowledged XID code (None or absent: none).
        th: Thresholds (passed to the catalog verdict).

    Returns:
        Findings ordered by GPU, then XID code (one per pair; the newest read wins).
    """
    newest: dict[tuple[int, int], datetime] = {}
    for rec in values:
        if rec.xid == 0 or acked_xid.get(rec.gpu) == rec.xid:
            continue
        key = (rec.gpu, rec.xid)
        newest[key] = max(newest.get(key, rec.ts), rec.ts)
    findings: list[Finding] = []
    for (gpu, code), ts in sorted(newest.items()):
        verdict = _xid_verdict(gpu, code, 1, 1, th)
        if verdict is None or verdict[1] != "unhealthy":
            continue
        _, severity, message, action = verdict
        findings.append(
            Finding(
                rule=RULE_XID_BEFORE_START,
                severity=severity,
                gpu=gpu,
                key=str(code),
                message=(
                    f"{message}, seen before the agent started (DCGM_FI_DEV_XID_ERRORS "
                    f"showed {code} at the agent's first scrape; time unknown)"
                ),
                action=action,
                evidence={"xid": code, "before_start": True, "read_at": ts.isoformat()},
                at=ts,
            )
        )
    return findings


# --- throttling ---------------------------------------------------------------------------------

_HW_THROTTLE_MASK = HW_THROTTLE_MASK


def rule_throttling(cur: GpuSample, th: HealthThresholds | None = None) -> list[Finding]:
    """Hardware clock slowdown (throttling) reasons.

    Source: docs/design.md "Health model"; bits of NVML's
    ``nvmlDeviceGetCurrentClocksEventReasons``
    (``nvmlClocksEventReasonHwSlowdown``, ``...HwThermalSlowdown``,
    ``...HwPowerBrakeSlowdown``). Software reasons (power cap, SW thermal, idle, application
    clocks) are normal operation and raise nothing.

    The action: ``CHECK_COOLING`` when the HW thermal bit is set; ``INVESTIGATE_POWER`` when
    the power-brake bit is set (and not thermal). HW slowdown alone has either cause (NVML:
    temperature too high, external power brake, or power draw too high): ``CHECK_COOLING``
    when the sample's temperature is within the degraded margin of its slowdown threshold
    (see :func:`rule_temperature`), else ``INVESTIGATE_POWER``.

    Args:
        cur: The newest sample; ``throttle_reasons`` is the NVML bitmask.
        th: Thresholds for the HW-slowdown-alone temperature check (defaults when None).

    Returns:
        One degraded finding naming the active reasons (all set bits), or nothing.
    """
    mask = cur.throttle_reasons or 0
    hw = mask & _HW_THROTTLE_MASK
    if not hw:
        return []
    th = th or HealthThresholds()
    if mask & THROTTLE_HW_THERMAL_SLOWDOWN:
        action = ACTION_CHECK_COOLING
    elif mask & THROTTLE_HW_POWER_BRAKE_SLOWDOWN:
        action = ACTION_INVESTIGATE_POWER
    elif rule_temperature(cur, th):
        action = ACTION_CHECK_COOLING
    else:
        action = ACTION_INVESTIGATE_POWER
    hw_names = throttle_reason_names(hw)
    return [
        Finding(
            rule=RULE_THROTTLING,
            severity="degraded",
            gpu=cur.index,
            key="",
            message=f"GPU {cur.index} clocks throttled by hardware: {', '.join(hw_names)}",
            action=action,
            evidence={
                "throttle_reasons": mask,
                "hardware_reasons": hw_names,
                "active_reasons": throttle_reason_names(mask),
                "temperature_c": cur.temperature_c,
                "power_w": cur.power_w,
            },
            at=cur.ts,
        )
    ]


# --- PCIe replay, NVLink errors -------------------------------------------------------------------


def _counter_increase(prev: GpuSample | None, cur: GpuSample, field: str) -> int | None:
    """How much the cumulative counter ``field`` rose from ``prev`` to ``cur``.

    None when there is no previous reading, either value is unknown, or the counter did not
    rise (a decrease is a reset: a GPU reset clears volatile counters).

    Raises:
        ValueError: ``prev`` and ``cur`` are samples of different GPUs.
    """
    _check_pair(prev, cur)
    if prev is None:
        return None
    before, after = getattr(prev, field), getattr(cur, field)
    if before is None or after is None or after <= before:
        return None
    return after - before


def _per_minute(
    delta: int, prev: GpuSample, cur: GpuSample, min_window_s: float = 0.0
) -> float | None:
    """Errors per minute between two readings.

    The span is at least ``min_window_s``: with 1-5 s report intervals a single replay
    would otherwise read as 12-60 per minute, so one isolated error never trips a
    per-minute threshold while a burst still does.
    """
    seconds = (cur.ts - prev.ts).total_seconds()
    if seconds <= 0:
        return None
    return delta * 60.0 / max(seconds, min_window_s)


def rule_pcie_replay(prev: GpuSample | None, cur: GpuSample, th: HealthThresholds) -> list[Finding]:
    """PCIe replay rate (link-level retransmissions).

    Source: docs/design.md "Health model"; counter from NVML's
    ``nvmlDeviceGetPcieReplayCounter``.
    Rate = (cur − prev count) / (cur.ts − prev.ts), per minute.

    Args:
        prev: The GPU's previous sample, or None (no rate yet: nothing).
        cur: The newest sample.
        th: Thresholds (``pcie_replay_per_min``).

    Returns:
        One degraded finding, action ``INVESTIGATE_LINK``, when the rate is over the
        threshold. Nothing when a count is unknown, the counter went down (reset), or
        ``cur.ts`` is not after ``prev.ts`` (a cached or out-of-order reading).

    Raises:
        ValueError: ``prev`` and ``cur`` are samples of different GPUs.
    """
    delta = _counter_increase(prev, cur, "pcie_replay_count")
    if delta is None:
        return []
    assert prev is not None  # an increase needs a previous reading
    rate = _per_minute(delta, prev, cur, th.rate_min_window_s)
    if rate is None or rate <= th.pcie_replay_per_min:
        return []
    return [
        Finding(
            rule=RULE_PCIE_REPLAY,
            severity="degraded",
            gpu=cur.index,
            key="",
            message=(
                f"GPU {cur.index}: {rate:.1f} PCIe replays/min "
                f"(threshold {_fmt(th.pcie_replay_per_min)})"
            ),
            action=ACTION_INVESTIGATE_LINK,
            evidence={
                "rate_per_min": rate,
                "threshold_per_min": th.pcie_replay_per_min,
                "increase": delta,
                "interval_s": (cur.ts - prev.ts).total_seconds(),
                "pcie_replay_count": cur.pcie_replay_count,
            },
            at=cur.ts,
        )
    ]


_NVLINK_COUNTERS = ("nvlink_crc_errors", "nvlink_replay_errors", "nvlink_recovery_errors")


def rule_nvlink(prev: GpuSample | None, cur: GpuSample, th: HealthThresholds) -> list[Finding]:
    """NVLink error rate: CRC + replay + recovery errors, summed over links.

    Source: docs/design.md "Health model"; counters from NVML's ``nvmlDeviceGetNvLinkErrorCounter``
    (``NVML_NVLINK_ERROR_DL_CRC_FLIT``/``_CRC_DATA``, ``_DL_REPLAY``, ``_DL_RECOVERY``).

    Counters known in both samples are summed; if any of them went down the counters were
    reset and there is no rate this time.

    Args:
        prev: The GPU's previous sample, or None (no rate yet: nothing).
        cur: The newest sample.
        th: Thresholds (``nvlink_errors_per_min``).

    Returns:
        One degraded finding, action ``INVESTIGATE_LINK``, when the summed rate per minute
        is over the threshold; else nothing (also when no counter is known in both samples
        or ``cur.ts`` is not after ``prev.ts``).

    Raises:
        ValueError: ``prev`` and ``cur`` are samples of different GPUs.
    """
    _check_pair(prev, cur)
    if prev is None:
        return []
    deltas: dict[str, int] = {}
    for name in _NVLINK_COUNTERS:
        before, after = getattr(prev, name), getattr(cur, name)
        if before is None or after is None:
            continue
        if after < before:
            return []
        deltas[name] = after - before
    total = sum(deltas.values())
    if total <= 0:
        return []
    rate = _per_minute(total, prev, cur, th.rate_min_window_s)
    if rate is None or rate <= th.nvlink_errors_per_min:
        return []
    return [
        Finding(
            rule=RULE_NVLINK,
            severity="degraded",
            gpu=cur.index,
            key="",
            message=(
                f"GPU {cur.index}: {rate:.1f} NVLink errors/min "
                f"(threshold {_fmt(th.nvlink_errors_per_min)})"
            ),
            action=ACTION_INVESTIGATE_LINK,
            evidence={
                "rate_per_min": rate,
                "threshold_per_min": th.nvlink_errors_per_min,
                "increase": total,
                "increases": deltas,
                "interval_s": (cur.ts - prev.ts).total_seconds(),
            },
            at=cur.ts,
        )
    ]


# --- stale telemetry, heartbeat ------------------------------------------------------------------


def _check_interval(interval_s: float) -> None:
    if not interval_s > 0:
        raise ValueError(f"report interval must be > 0 s, got {interval_s}")


class Stamped(Protocol):
    """What the stale rule reads of a GPU's latest reading: which GPU, and when it was read
    (a ``GpuSample`` is one)."""

    @property
    def index(self) -> int: ...

    @property
    def ts(self) -> datetime: ...


def rule_stale_telemetry(
    cur: Stamped | None,
    gpu: int,
    node_last_seen: datetime,
    interval_s: float,
    th: HealthThresholds,
    now: datetime,
) -> list[Finding]:
    """A GPU whose metrics stopped updating while its node still reports.

    Source: docs/design.md "Health model" (row ``stale_telemetry``).
    ``GpuSample.ts`` is when the collector read the values, so a collector returning a
    cached reading keeps an old ``ts``.

    With ``limit = th.stale_intervals × interval_s``: the node is alive when
    ``now − node_last_seen < limit``; the GPU is stale when it has no sample or
    ``now − cur.ts ≥ limit``. A dead node raises nothing here (it is unreachable instead).

    Args:
        cur: The GPU's newest sample, or None when it never had one.
        gpu: The GPU index (of the node's inventory).
        node_last_seen: When the node last reported, aware UTC.
        interval_s: The agent's report interval (s).
        th: Thresholds (``stale_intervals``).
        now: Current time, aware UTC.

    Returns:
        One degraded finding, action ``CHECK_AGENT``, at ``now``; or nothing.

    Raises:
        ValueError: ``interval_s`` is not positive, or ``cur`` is another GPU's sample.
    """
    _check_interval(interval_s)
    if cur is not None and cur.index != gpu:
        raise ValueError(f"sample of GPU {cur.index} passed for GPU {gpu}")
    limit = th.stale_intervals * interval_s
    node_age = (now - node_last_seen).total_seconds()
    if node_age >= limit:
        return []
    age = None if cur is None else (now - cur.ts).total_seconds()
    if age is not None and age < limit:
        return []
    what = "no sample yet" if age is None else f"newest sample {age:.0f} s old"
    return [
        Finding(
            rule=RULE_STALE_TELEMETRY,
            severity="degraded",
            gpu=gpu,
            key="",
            message=(
                f"GPU {gpu} telemetry stale: {what} while the agent reports (limit {_fmt(limit)} s)"
            ),
            action=ACTION_CHECK_AGENT,
            evidence={"sample_age_s": age, "node_age_s": node_age, "limit_s": limit},
            at=now,
        )
    ]


def is_unreachable(
    last_seen: datetime | None, interval_s: float, now: datetime, th: HealthThresholds
) -> bool:
    """Whether a node missed enough reports to count as unreachable.

    Source: docs/design.md "Health model" (state ``unreachable``).

    Args:
        last_seen: When the node last reported (aware UTC), None when it never did.
        interval_s: The agent's report interval (s).
        now: Current time, aware UTC.
        th: Thresholds (``heartbeat_missed_intervals``).

    Returns:
        True when ``last_seen`` is None or ``now − last_seen ≥ heartbeat_missed_intervals ×
        interval_s``.

    Raises:
        ValueError: ``interval_s`` is not positive.
    """
    _check_interval(interval_s)
    if last_seen is None:
        return True
    return (now - last_seen).total_seconds() >= th.heartbeat_missed_intervals * interval_s


# --- straggler ------------------------------------------------------------------------------------


def straggler_ranks(
    series: Mapping[int, list[float]], th: HealthThresholds
) -> dict[int, dict[str, Any]]:
    """Ranks whose collective latency stays far above the rest of the job.

    Source: docs/design.md "Health model" (row ``straggler``).

    Samples are aligned from the end: position j is each rank's j-th last sample. A rank is
    a straggler when, for each of its last ``k = th.straggler_consecutive`` positions, its
    latency is over ``th.straggler_factor`` × the median of the OTHER ranks' latencies at
    that position. Leaving the rank out of its own median makes the rule work with 2 ranks
    (with itself included, a 2-rank median is the mean, which one rank can never exceed
    3-fold) and keeps a straggler from pulling its own baseline up. A rank with fewer than k
    samples, a position no other rank has, or a median of 0 ms yields no verdict.

    Args:
        series: rank -> that rank's latency samples (ms), oldest first.
        th: Thresholds (``straggler_factor``, ``straggler_consecutive``).

    Returns:
        rank -> evidence (``latency_ms`` and ``median_ms`` of the last k positions, oldest
        first, ``factor``, ``consecutive``, ``ranks``), for the stragglers only.
    """
    k = th.straggler_consecutive
    # Each position's values, sorted once: the median of the others is then read off the
    # sorted list with the rank's own value left out, O(log n) per rank and position, so the
    # whole check is O(k × n log n) for n ranks (it was O(k × n²): a list of the others
    # per rank and position).
    by_position = {
        j: sorted(v[-j] for v in series.values() if len(v) >= j) for j in range(1, k + 1)
    }
    result: dict[int, dict[str, Any]] = {}
    for rank, values in series.items():
        if len(values) < k:
            continue
        latencies: list[float] = []
        medians: list[float] = []
        for j in range(k, 0, -1):  # oldest of the last k first
            value = values[-j]
            median = _median_without(by_position[j], value)
            if median is None or median <= 0 or not value > th.straggler_factor * median:
                break
            latencies.append(value)
            medians.append(median)
        else:
            result[rank] = {
                "latency_ms": latencies,
                "median_ms": medians,
                "factor": th.straggler_factor,
                "consecutive": k,
                "ranks": len(series),
            }
    return result


def _median_without(ordered: list[float], value: float) -> float | None:
    """The median of ``ordered`` (sorted, holding ``value``) with one ``value`` left out;
    None when nothing is left. Equal to ``statistics.median`` of the remaining values."""
    i = bisect.bisect_left(ordered, value)
    m = len(ordered) - 1
    if m <= 0:
        return None

    def at(r: int) -> float:  # the r-th smallest of the remaining values
        return ordered[r] if r < i else ordered[r + 1]

    if m % 2:
        return at(m // 2)
    return (at(m // 2 - 1) + at(m // 2)) / 2


def rule_straggler(rank: int, job_id: str, evidence: dict[str, Any], at: datetime) -> Finding:
    """The finding for one straggler rank found by :func:`straggler_ranks`.

    Args:
        rank: The slow rank.
        job_id: The job it belongs to.
        evidence: Its entry from :func:`straggler_ranks` (copied, with job_id and rank added).
        at: Time of its newest latency sample, aware UTC.

    Returns:
        A node-level (gpu None) degraded finding, key ``<job_id>:<rank>``, action
        ``INVESTIGATE_STRAGGLER``.
    """
    latencies = evidence.get("latency_ms") or []
    medians = evidence.get("median_ms") or []
    detail = ""
    if latencies and medians:
        detail = (
            f": last {len(latencies)} all_reduce latencies "
            f"{'/'.join(f'{v:.1f}' for v in latencies)} ms vs job median "
            f"{'/'.join(f'{m:.1f}' for m in medians)} ms"
        )
    return Finding(
        rule=RULE_STRAGGLER,
        severity="degraded",
        gpu=None,
        key=f"{job_id}:{rank}",
        message=f"rank {rank} of job {job_id} is a straggler{detail}",
        action=ACTION_INVESTIGATE_STRAGGLER,
        evidence={**evidence, "job_id": job_id, "rank": rank},
        at=at,
    )


# --- per-GPU evaluation, reasons, node state ------------------------------------------------------


def evaluate_gpu(prev: GpuSample | None, cur: GpuSample, th: HealthThresholds) -> list[Finding]:
    """Run every sample-based rule on one GPU's newest sample.

    Runs, in order: temperature, uncorrectable ECC, row remapping, throttling, PCIe replay,
    NVLink (the rules in :data:`GPU_SAMPLE_RULES`).

    Args:
        prev: The GPU's previous sample, or None for its first.
        cur: The newest sample.
        th: Thresholds.

    Returns:
        All findings, in rule order.

    Raises:
        ValueError: ``prev`` and ``cur`` are samples of different GPUs.
    """
    _check_pair(prev, cur)
    return [
        *rule_temperature(cur, th),
        *rule_ecc_uncorrectable(prev, cur),
        *rule_row_remap(cur),
        *rule_throttling(cur, th),
        *rule_pcie_replay(prev, cur, th),
        *rule_nvlink(prev, cur, th),
    ]


def _reason_sort_key(reason: Reason) -> tuple[int, str, int, str]:
    return (
        -STATE_ORDER[reason.severity],
        reason.rule,
        -1 if reason.gpu is None else reason.gpu,
        reason.key,
    )


def merge_reasons(
    previous: list[Reason],
    findings: Iterable[Finding],
    now: datetime,
    th: HealthThresholds,
    evaluated_rules: set[str] | frozenset[str] | None = None,
) -> list[Reason]:
    """Fold new findings into a node's active reasons.

    - A finding upserts the reason of its identity (rule, gpu, key): ``first_seen`` is kept
      (a new reason starts at the finding's ``at``), ``last_seen`` becomes the newest ``at``,
      and severity, message, action and evidence come from the newest finding (a replayed
      finding older than the stored ``last_seen`` changes nothing but may move
      ``first_seen`` earlier).
    - A previous reason with no finding, of a rule in ``evaluated_rules``, stays while
      ``now − last_seen < th.quiet_period(rule)`` and is dropped after (quiet period 0: it
      clears with its condition).
    - A previous reason of a rule not evaluated this time is carried over unchanged, except
      for the event rules (:data:`EVENT_RULES`: xid, xid_repeat, straggler), which expire
      by quiet period either way (no new event is the same as no finding).
    - A reason of an acknowledge-only rule (:data:`ACK_ONLY_RULES`: xid_before_start) is
      always carried over: it has no quiet period.
    Acknowledgement is the caller's: it deletes the reason.

    Args:
        previous: The node's stored reasons (at most one per identity).
        findings: This evaluation's findings.
        now: Current time, aware UTC.
        th: Thresholds (``quiet_period_s``).
        evaluated_rules: Rules this evaluation ran (e.g. :data:`GPU_SAMPLE_RULES`); None
            means all rules.

    Returns:
        The reasons now active, worst severity first, then by rule, GPU (node-level first)
        and key.
    """
    merged: dict[tuple[str, int | None, str], Reason] = {r.identity: r for r in previous}
    refreshed: set[tuple[str, int | None, str]] = set()
    for finding in sorted(findings, key=lambda f: f.at):
        ident = finding.identity
        refreshed.add(ident)
        old = merged.get(ident)
        if old is None:
            first_seen = finding.at
        else:
            first_seen = min(old.first_seen, finding.at)
            if finding.at < old.last_seen:
                merged[ident] = dataclasses.replace(old, first_seen=first_seen)
                continue
        merged[ident] = Reason(
            rule=finding.rule,
            severity=finding.severity,
            gpu=finding.gpu,
            key=finding.key,
            message=finding.message,
            action=finding.action,
            evidence=dict(finding.evidence),
            first_seen=first_seen,
            last_seen=finding.at,
        )
    active = [
        reason
        for ident, reason in merged.items()
        if ident in refreshed
        or reason.rule in ACK_ONLY_RULES
        or (
            evaluated_rules is not None
            and reason.rule not in evaluated_rules
            and reason.rule not in EVENT_RULES
        )
        or (now - reason.last_seen).total_seconds() < th.quiet_period(reason.rule)
    ]
    return sorted(active, key=_reason_sort_key)


def node_state(reasons: Iterable[Reason], *, unreachable: bool) -> str:
    """A node's state from its active reasons.

    Source: docs/design.md "Health model" (``isolated`` is an overlay the caller adds).

    Args:
        reasons: The node's active reasons.
        unreachable: Whether the node missed its heartbeat (see :func:`is_unreachable`).

    Returns:
        ``unreachable`` when unreachable, else the worst reason severity (``unhealthy`` over
        ``degraded``), else ``healthy``.
    """
    if unreachable:
        return "unreachable"
    worst = "healthy"
    for reason in reasons:
        if STATE_ORDER[reason.severity] > STATE_ORDER[worst]:
            worst = reason.severity
    return worst

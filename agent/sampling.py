"""Which reports carry GPU samples: full samples every N reports, and any report in between
whose health readings changed.

At fleet scale most reports of a healthy node say nothing new: the counters the health rules
watch (ECC, row remapping, PCIe replays, NVLink errors, throttle reasons) stay put, and
temperature drifts by a degree or two. Sending every reading every interval made each GPU a
database row every 10 s (docs/benchmarks.md, "Ingest"); the cluster's Prometheus scrapes the
agent's ``/metrics`` for the full time series. So a report carries the node's samples when

- ``full_every`` reports have passed since the last one that did (the first report does);
- a counter or flag of any GPU differs from what was last sent (``HEALTH_EXACT``, and the
  hardware slowdown bits of the throttle reasons);
- a GPU's temperature moved ``temp_step_c`` or more since it was last sent, or is within
  ``near_slowdown_c`` of its slowdown threshold (the temperature rule's territory);
- the set of GPUs read changed.

Otherwise it is a heartbeat: it still carries the inventory, XIDs, latency, events and
checkpoint reports. All GPUs go together, never some: the server evaluates the sample rules
per node (``fleet.rules.merge_reasons``), so a report with some GPUs' samples would clear
the others' reasons. Each batch declares ``sample_every`` = ``full_every``, and the server
scales its stale-telemetry limit by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tierwatch.agent.protocol import HW_THROTTLE_MASK, GpuSample

#: Sample fields whose any change is news to the health rules (counters, flags); of the
#: throttle reasons, only the hardware slowdown bits (``HW_THROTTLE_MASK``) count: a power cap
#: that comes and goes under load is how a busy GPU runs.
HEALTH_EXACT: tuple[str, ...] = (
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "ecc_sbe_aggregate",
    "ecc_dbe_aggregate",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
    "row_remap_pending",
    "row_remap_failure",
    "pcie_replay_count",
    "nvlink_crc_errors",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
    "slowdown_temp_c",
    "shutdown_temp_c",
)


@dataclass
class SampleGate:
    """Decides, report by report, whether the node's samples go out (not thread-safe: the
    agent's reporting loop owns it).

    Args:
        full_every: send every GPU's sample at least every this many reports (1: always).
        temp_step_c: a temperature change this large (°C) since it was last sent is news
            (for the node page's charts; the health rules care near the threshold only).
        near_slowdown_c: within this many °C of the slowdown threshold, every report
            carries samples.

    Raises:
        ValueError: ``full_every`` below 1 or a negative threshold.
    """

    full_every: int = 6
    temp_step_c: float = 5.0
    near_slowdown_c: float = 8.0
    _since_sent: int = field(default=0, init=False)
    _sent: dict[int, tuple[Any, ...]] = field(default_factory=dict, init=False)
    _sent_temp: dict[int, float | None] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.full_every < 1:
            raise ValueError(f"full_every must be at least 1, not {self.full_every}")
        if self.temp_step_c < 0 or self.near_slowdown_c < 0:
            raise ValueError("temperature thresholds must not be negative")

    def admit(self, samples: Sequence[GpuSample]) -> bool:
        """Whether this report carries ``samples`` (all of them) or is a heartbeat.

        Records what was sent when it returns True.
        """
        send = (
            self._since_sent + 1 >= self.full_every
            or not self._sent
            or {s.index for s in samples} != set(self._sent)
            or any(self._news(s) for s in samples)
        )
        if send:
            self._since_sent = 0
            self._sent = {s.index: _exact(s) for s in samples}
            self._sent_temp = {s.index: s.temperature_c for s in samples}
        else:
            self._since_sent += 1
        return send

    def _news(self, s: GpuSample) -> bool:
        if _exact(s) != self._sent.get(s.index):
            return True
        temp, before = s.temperature_c, self._sent_temp.get(s.index)
        if (temp is None) != (before is None):
            return True
        if temp is None or before is None:
            return False
        if abs(temp - before) >= self.temp_step_c:
            return True
        slowdown = s.slowdown_temp_c
        return slowdown is not None and temp >= slowdown - self.near_slowdown_c


def _exact(s: GpuSample) -> tuple[Any, ...]:
    hw = None if s.throttle_reasons is None else s.throttle_reasons & HW_THROTTLE_MASK
    return (*(getattr(s, f) for f in HEALTH_EXACT), hw)

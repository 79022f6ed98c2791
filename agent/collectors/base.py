"""The GPU collector interface shared by the NVML, dcgm-exporter and simulated providers.

A collector is created, probed with :meth:`GpuCollector.is_available`, started once with a
callback for XID events, then polled by the agent runtime every interval with
:meth:`~GpuCollector.collect` (and :meth:`~GpuCollector.latency`). Problems that an operator
should see (a GPU that stopped answering, an unreachable exporter) are queued as
:class:`~tierwatch.agent.protocol.AgentEvent` and drained by the runtime into the next batch;
they never raise out of ``collect()``.

Stale telemetry: when a GPU cannot be read, ``collect()`` returns that GPU's last good sample
unchanged, including its old ``ts``, so the control plane sees the telemetry go stale (and
the accompanying event says why) instead of a sample of Nones that looks fresh.

Extra readings: :meth:`GpuCollector.extras` gives the dcgm-exporter counters of the last
``collect()`` that :class:`~tierwatch.agent.protocol.GpuSample` lacks
(:class:`~tierwatch.agent.readings.GpuExtras`: clocks, energy, framebuffer free/reserved,
identity labels, MIG instances), for the agent's own ``/metrics`` only; a GPU whose sample
was stale has none.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ValidationError

from tierwatch.agent.protocol import (
    AgentEvent,
    GpuInfo,
    GpuSample,
    LatencySample,
    XidEvent,
    utcnow,
)
from tierwatch.agent.readings import GpuExtras, MigInstance

log = logging.getLogger(__name__)

XidCallback = Callable[[XidEvent], None]

#: Most events a collector keeps before the runtime drains them (oldest dropped beyond).
MAX_PENDING_EVENTS = 1000

_M = TypeVar("_M", bound=BaseModel)


class CollectorError(RuntimeError):
    """A collector cannot start or work at all (e.g. NVML library missing)."""


class GpuCollector(ABC):
    """A source of GPU health readings for one node.

    Attributes:
        name: Short name sent in each report's ``collector`` field.
        simulated: True when the readings are made up (the report's ``simulated`` flag).
        exports_dcgm_fields: Whether the agent's ``/metrics`` exports this collector's
            readings under dcgm-exporter's ``DCGM_FI_*`` names. False for a collector that
            reads a dcgm-exporter the node's Prometheus already scrapes (a second copy would
            double every series).
    """

    name: str = "base"
    simulated: bool = False
    exports_dcgm_fields: ClassVar[bool] = True

    def __init__(self) -> None:
        self._events: list[AgentEvent] = []
        self._events_lock = threading.Lock()
        self._on_xid: XidCallback | None = None

    # -- lifecycle -----------------------------------------------------------------------
    @abstractmethod
    def is_available(self) -> bool:
        """Whether this provider can work on this machine (cheap probe, never raises)."""

    def start(self, on_xid: XidCallback) -> None:
        """Start collecting; XID events are handed to ``on_xid`` as soon as they are seen.

        ``on_xid`` may be called from a collector thread; it must be thread-safe and quick.

        Raises:
            CollectorError: the provider cannot start.
        """
        self._on_xid = on_xid

    def shutdown(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Stop background threads and release the provider's resources (idempotent)."""

    # -- readings ------------------------------------------------------------------------
    @abstractmethod
    def inventory(self) -> list[GpuInfo]:
        """The node's GPUs (index, UUID, model, memory), as found at start."""

    @abstractmethod
    def collect(self) -> list[GpuSample]:
        """One sample per GPU; never raises (problems become events, see module docs)."""

    def latency(self) -> list[LatencySample]:
        """Collective-latency samples produced by the collector itself (default: none)."""
        return []

    def extras(self) -> dict[int, GpuExtras]:
        """The extra readings of the last :meth:`collect`, by GPU index (default: none).

        Only GPUs read live in that collection have an entry (a stale sample has none).
        Called by the runtime right after ``collect()``, from the same thread.
        """
        return {}

    # -- events --------------------------------------------------------------------------
    def add_event(self, kind: str, message: str, gpu: int | None = None) -> None:
        """Queue an :class:`AgentEvent` for the next report and log it as a warning."""
        log.warning("%s%s: %s", kind, f" (GPU {gpu})" if gpu is not None else "", message)
        event = AgentEvent(kind=kind[:64], ts=utcnow(), message=message[:2000], gpu=gpu)
        with self._events_lock:
            self._events.append(event)
            del self._events[:-MAX_PENDING_EVENTS]

    def drain_events(self) -> list[AgentEvent]:
        """Return and forget the queued events, oldest first."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def emit_xid(self, event: XidEvent) -> None:
        """Hand one XID event to the runtime's callback (logged when not started)."""
        log.warning("XID %d on GPU %d: %s", event.xid, event.gpu, event.message)
        if self._on_xid is None:
            log.error("XID %d on GPU %d seen before start(); not reported", event.xid, event.gpu)
            return
        self._on_xid(event)

    # -- helpers for subclasses ----------------------------------------------------------
    def build_sample(self, fields: Mapping[str, Any]) -> GpuSample:
        """Validate raw readings into a :class:`GpuSample`, dropping only invalid fields.

        A value outside the protocol's range (a driver glitch such as 255 °C) becomes None and
        an ``invalid_reading`` event, so one bad field never drops the whole sample.

        Args:
            fields: ``GpuSample`` keyword arguments; must include valid ``index`` and ``ts``.

        Raises:
            pydantic.ValidationError: ``index`` or ``ts`` themselves are invalid.
        """
        return self._build(GpuSample, fields, keep=("index", "ts"), gpu=fields.get("index"))

    def build_extras(self, fields: Mapping[str, Any]) -> GpuExtras:
        """Validate raw extra readings into a :class:`GpuExtras`, as :meth:`build_sample`
        does (an out-of-range field becomes None plus an ``invalid_reading`` event).

        Args:
            fields: ``GpuExtras`` keyword arguments; must include a valid ``index``. ``mig``
                is a list of :class:`MigInstance` keyword arguments, each validated the same
                way.

        Raises:
            pydantic.ValidationError: ``index``, or a MIG instance's id or profile, is invalid.
        """
        data = dict(fields)
        gpu = data.get("index")
        data["mig"] = [
            self._build(MigInstance, m, keep=("gpu_instance_id", "profile"), gpu=gpu)
            for m in data.get("mig") or ()
        ]
        return self._build(GpuExtras, data, keep=("index", "mig"), gpu=gpu)

    def _build(
        self, model: type[_M], fields: Mapping[str, Any], *, keep: tuple[str, ...], gpu: Any
    ) -> _M:
        """``model(**fields)``, with each invalid field but those in ``keep`` set to None
        (one ``invalid_reading`` event for GPU ``gpu`` each)."""
        data = dict(fields)
        for _ in range(len(data) + 1):
            try:
                return model(**data)
            except ValidationError as exc:
                bad = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
                bad -= set(keep)
                if not bad:
                    raise
                for name in sorted(bad):
                    self.add_event(
                        "invalid_reading",
                        f"{self.name}: {name}={data.get(name)!r} is out of range; sent as null",
                        gpu=gpu,
                    )
                    data[name] = None
        return model(**data)  # pragma: no cover - loop always returns or raises

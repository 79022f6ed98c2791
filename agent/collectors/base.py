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
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from tierwatch.agent.protocol import (
    AgentEvent,
    GpuInfo,
    GpuSample,
    LatencySample,
    XidEvent,
    utcnow,
)

log = logging.getLogger(__name__)

XidCallback = Callable[[XidEvent], None]

#: Most events a collector keeps before the runtime drains them (oldest dropped beyond).
MAX_PENDING_EVENTS = 1000


class CollectorError(RuntimeError):
    """A collector cannot start or work at all (e.g. NVML library missing)."""


class GpuCollector(ABC):
    """A source of GPU health readings for one node.

    Attributes:
        name: Short name sent in each report's ``collector`` field.
        simulated: True when the readings are made up (the report's ``simulated`` flag).
    """

    name: str = "base"
    simulated: bool = False

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
        data = dict(fields)
        for _ in range(len(data) + 1):
            try:
                return GpuSample(**data)
            except ValidationError as exc:
                bad = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
                bad -= {"index", "ts"}
                if not bad:
                    raise
                for name in sorted(bad):
                    self.add_event(
                        "invalid_reading",
                        f"{self.name}: {name}={data.get(name)!r} is out of range; sent as null",
                        gpu=data.get("index"),
                    )
                    data[name] = None
        return GpuSample(**data)  # pragma: no cover - loop always returns or raises

"""GPU collectors (NVML, dcgm-exporter, simulated) behind one interface, and their choice.

Only the standard library, pydantic, httpx and prometheus-client are imported here; NVML is
loaded when an NVML collector is probed or started.
"""

from __future__ import annotations

import logging
from types import ModuleType

from tierwatch.agent.collectors.base import CollectorError, GpuCollector, XidCallback
from tierwatch.agent.collectors.dcgm_exporter import DcgmExporterCollector
from tierwatch.agent.collectors.nvml import NvmlCollector
from tierwatch.agent.collectors.simulated import SimulatedCollector
from tierwatch.agent.config import AgentSettings

__all__ = [
    "CollectorError",
    "DcgmExporterCollector",
    "GpuCollector",
    "NvmlCollector",
    "SimulatedCollector",
    "XidCallback",
    "make_collector",
]

log = logging.getLogger(__name__)


def _simulated(settings: AgentSettings) -> SimulatedCollector:
    return SimulatedCollector(
        node=settings.node or "sim-node",
        gpus=settings.sim_gpus,
        seed=settings.sim_seed,
        job=settings.sim_job,
        rank=settings.sim_rank,
    )


def make_collector(settings: AgentSettings, nvml: ModuleType | None = None) -> GpuCollector:
    """Create the collector that ``settings.collector`` asks for.

    ``auto`` picks NVML when ``nvmlInit`` succeeds, else the simulated collector (logged at
    WARNING, and every report says ``simulated: true``).

    Args:
        settings: Agent settings.
        nvml: A ``pynvml``-compatible module for the NVML collector (None: nvidia-ml-py).

    Returns:
        A collector, not yet started.

    Raises:
        CollectorError: ``nvml`` or ``dcgm-exporter`` was asked for explicitly and is not
            available.
    """
    choice = settings.collector
    if choice == "simulated":
        return _simulated(settings)
    if choice == "dcgm-exporter":
        collector = DcgmExporterCollector(settings.dcgm_exporter_url)
        if not collector.is_available():
            raise CollectorError(
                f"collector dcgm-exporter: no exporter answers at {settings.dcgm_exporter_url} "
                "(set --dcgm-exporter-url / TIERWATCH_DCGM_EXPORTER_URL)"
            )
        return collector
    nvml_collector = NvmlCollector(nvml=nvml)
    if nvml_collector.is_available():
        return nvml_collector
    if choice == "nvml":
        raise CollectorError(
            f"collector nvml: {nvml_collector.init_error or 'NVML is not available'}"
        )
    log.warning(
        "NVML is not available (%s); using the SIMULATED collector", nvml_collector.init_error
    )
    return _simulated(settings)

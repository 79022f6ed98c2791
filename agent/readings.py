"""Agent-side GPU readings beyond the wire model: what the agent's own ``/metrics`` exports.

:class:`~tierwatch.agent.protocol.GpuSample` is what the agent sends to the control plane, and
the server's columns are held to it. A node's Prometheus wants more than that: the counters
dcgm-exporter exports by default (clocks, memory temperature, energy, encoder/decoder and
memory-copy utilisation, framebuffer free/reserved, NVLink bandwidth, the DCGM profiling
``PROF_*`` ratios) and the GPU's identity labels (PCI bus id, driver version, MIG
instances). Those live here, read by the collectors next to each sample
(:meth:`~tierwatch.agent.collectors.base.GpuCollector.extras`) and never sent to the server.

As in :class:`~tierwatch.agent.protocol.GpuSample`, every reading is optional: ``None``
means the collector could not read it (unsupported on this GPU, driver or collector), never
zero, and ``/metrics`` then omits the line. Units are in the field names: ``_mhz``
megahertz, ``_c`` degrees Celsius, ``_mj`` millijoules, ``_pct`` percent, ``_mib`` mebibytes,
``_ratio`` a fraction 0-1, ``_bps`` bytes per second.

Sources: dcgm-exporter's default counters (``etc/default-counters.csv``: field names, types
and units) and the NVML calls named on each field.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
Pct = Annotated[float, Field(ge=0, le=100)]
Ratio = Annotated[float, Field(ge=0, le=1)]
Mib = Annotated[float, Field(ge=0)]
Mhz = Annotated[float, Field(ge=0, le=100_000)]


class _Model(BaseModel):
    # As the wire models: a typo is an error, NaN/Infinity are refused.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class MigInstance(_Model):
    """One MIG GPU instance of a physical GPU (labels ``GPU_I_ID`` and ``GPU_I_PROFILE``).

    The readings are the instance's own (its memory slice, its share of the engines); on the
    instance's ``/metrics`` lines they replace the physical GPU's values of the same field.

    Attributes:
        gpu_instance_id: The GPU instance id (NVML ``nvmlDeviceGetGpuInstanceId`` of the MIG
            device handle).
        profile: The profile name, e.g. ``1g.10gb`` (from the MIG device's name, which NVML
            gives as ``<model> MIG <profile>``).
        fb_used_mib: The instance's framebuffer used, MiB (``nvmlDeviceGetMemoryInfo`` of the
            MIG device handle).
        fb_free_mib: The instance's framebuffer free, MiB.
        fb_reserved_mib: The instance's reserved framebuffer, MiB.
        prof_gr_engine_active_ratio, prof_pipe_tensor_active_ratio, prof_dram_active_ratio:
            DCGM profiling ratios of the instance (0-1); only the simulator fills them (NVML
            has no such per-instance reading).
    """

    gpu_instance_id: Annotated[int, Field(ge=0, le=2**31 - 1)]
    profile: Annotated[str, Field(min_length=1, max_length=64)]
    fb_used_mib: Mib | None = None
    fb_free_mib: Mib | None = None
    fb_reserved_mib: Mib | None = None
    prof_gr_engine_active_ratio: Ratio | None = None
    prof_pipe_tensor_active_ratio: Ratio | None = None
    prof_dram_active_ratio: Ratio | None = None


class GpuExtras(_Model):
    """One reading of one GPU's dcgm-exporter counters that :class:`GpuSample` lacks.

    Attributes:
        index: GPU index (as :class:`GpuSample`'s).
        pci_bus_id: PCI bus id, e.g. ``00000000:18:00.0`` (NVML ``nvmlDeviceGetPciInfo``
            ``.busId``), label ``pci_bus_id``.
        driver_version: NVIDIA driver version, e.g. ``550.90.07`` (NVML
            ``nvmlSystemGetDriverVersion``), label ``DCGM_FI_DRIVER_VERSION``.
        sm_clock_mhz: SM clock, MHz (``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)``).
        mem_clock_mhz: Memory clock, MHz (``nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)``).
        memory_temp_c: HBM temperature, °C (``nvmlDeviceGetFieldValues`` field
            ``NVML_FI_DEV_MEMORY_TEMP``).
        total_energy_mj: Energy used since the driver was loaded, mJ
            (``nvmlDeviceGetTotalEnergyConsumption``; Volta and later).
        enc_util_pct, dec_util_pct: Video encoder / decoder utilisation, %
            (``nvmlDeviceGetEncoderUtilization`` / ``...DecoderUtilization``).
        mem_copy_util_pct: Memory (copy engine) utilisation, % (``nvmlDeviceGetUtilizationRates``
            ``.memory``).
        fb_used_mib: Framebuffer used *excluding* reserved memory, MiB (``used`` of
            ``nvmlDeviceGetMemoryInfo`` version 2), as DCGM counts ``FB_USED``. None where
            only version 1 answers (its ``used`` includes the reserved memory); ``/metrics``
            then exports :attr:`GpuSample.memory_used_mib`.
        fb_free_mib: Framebuffer free, MiB (``free`` of the same call).
        fb_reserved_mib: Framebuffer reserved by the driver and firmware, MiB (``reserved``
            of version 2).
        nvlink_bandwidth_total: DCGM's NVLink bandwidth counter summed over all lanes (a
            cumulative count); DCGM only, so NVML leaves it None.
        prof_gr_engine_active_ratio: Fraction of time the graphics engine is active (0-1).
        prof_pipe_tensor_active_ratio: Fraction of cycles the tensor (HMMA) pipe is active.
        prof_dram_active_ratio: Fraction of cycles the device memory interface is active.
        prof_pcie_tx_bps, prof_pcie_rx_bps: PCIe bytes transmitted / received per second
            (headers + payload).
        mig: The GPU's MIG instances (empty: MIG is off, or not known).

    The ``prof_*`` fields are DCGM profiling metrics: they need DCGM's profiling module, so
    NVML leaves them None (the simulator fills them).
    """

    index: Annotated[int, Field(ge=0, le=255)]
    pci_bus_id: Annotated[str, Field(max_length=32)] | None = None
    driver_version: Annotated[str, Field(max_length=80)] | None = None
    sm_clock_mhz: Mhz | None = None
    mem_clock_mhz: Mhz | None = None
    memory_temp_c: Annotated[float, Field(ge=-50, le=200)] | None = None
    total_energy_mj: Count | None = None
    enc_util_pct: Pct | None = None
    dec_util_pct: Pct | None = None
    mem_copy_util_pct: Pct | None = None
    fb_used_mib: Mib | None = None
    fb_free_mib: Mib | None = None
    fb_reserved_mib: Mib | None = None
    nvlink_bandwidth_total: Count | None = None
    prof_gr_engine_active_ratio: Ratio | None = None
    prof_pipe_tensor_active_ratio: Ratio | None = None
    prof_dram_active_ratio: Ratio | None = None
    prof_pcie_tx_bps: Annotated[float, Field(ge=0)] | None = None
    prof_pcie_rx_bps: Annotated[float, Field(ge=0)] | None = None
    mig: Annotated[list[MigInstance], Field(max_length=64)] = []


#: The identity fields of :class:`GpuExtras` (labels, not readings).
IDENTITY_FIELDS: tuple[str, ...] = ("pci_bus_id", "driver_version")
#: The reading fields of :class:`GpuExtras` (every field but ``index``, identity and ``mig``).
EXTRA_READINGS: tuple[str, ...] = tuple(
    name for name in GpuExtras.model_fields if name not in ("index", "mig", *IDENTITY_FIELDS)
)
#: The reading fields of :class:`MigInstance` (every field but its identity).
MIG_READINGS: tuple[str, ...] = tuple(
    name for name in MigInstance.model_fields if name not in ("gpu_instance_id", "profile")
)

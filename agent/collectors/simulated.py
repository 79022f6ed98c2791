"""A simulated node: plausible GPU telemetry plus a fault injector, for demos and tests.

Readings evolve per call of :meth:`SimulatedCollector.collect` (not per wall-clock second),
from one seedable :class:`random.Random`, so the same seed gives the same sequence of values
(only ``ts`` differs). Faults are injected with :meth:`SimulatedCollector.inject`:

========================  ===============================================================
fault                     effect (on GPU ``gpu``, default 0)
========================  ===============================================================
``thermal``               thermal runaway: temperature jumps to >= 80 °C and climbs 4 °C per
                          sample up to 105 °C; past the 90 °C slowdown threshold the HW/SW
                          thermal slowdown bits are set
``temp VALUE``            temperature pinned at VALUE °C (no noise)
``ecc-dbe``               volatile and aggregate uncorrectable (DBE) ECC counts +1, and
                          XID 48 ("double bit ECC error") pushed at once
``row-remap-failure``     ``row_remap_failure`` and ``row_remap_pending`` True, one more
                          uncorrectable remapped row
``xid CODE``              an XID event with that code pushed at once
``throttle``              HW slowdown and HW thermal slowdown clock-event bits set
``straggle``              (node-wide) latency samples ×10
``freeze``                telemetry stops updating: the same sample with its old ``ts``
``clear``                 clear faults of GPU ``gpu``, or of all GPUs and ``straggle`` when
                          ``gpu`` is None; volatile ECC counts reset to 0 as a GPU reset
                          would (aggregate counts stay)
========================  ===============================================================

Extra readings (:meth:`SimulatedCollector.extras`, for the agent's ``/metrics``): an H100's
clocks (SM clock follows the load, lower while throttled; HBM3 at 2619 MHz), memory
temperature a few °C above the GPU's, an energy counter that adds each sample's power over
:data:`SIM_STEP_S` seconds per ``collect()``, no video encode/decode, 512 MiB reserved
framebuffer (``memory_used_mib`` counts it, as NVML's version-1 ``used`` does), NVLink
traffic and DCGM profiling ratios that follow the load, and an HGX board's PCI bus ids. They
come from a second random generator seeded from ``seed``, so the samples' sequence is the
same with or without them. With ``mig`` a GPU has MIG instances of the given profiles, each
with its own memory slice and activity.
"""

from __future__ import annotations

import math
import random
import re
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import ClassVar, Literal, get_args

from tierwatch.agent.collectors.base import GpuCollector
from tierwatch.agent.protocol import (
    THROTTLE_HW_SLOWDOWN,
    THROTTLE_HW_THERMAL_SLOWDOWN,
    THROTTLE_SW_THERMAL_SLOWDOWN,
    GpuInfo,
    GpuSample,
    LatencySample,
    XidEvent,
    utcnow,
)
from tierwatch.agent.readings import GpuExtras, MigInstance

Fault = Literal[
    "xid",
    "thermal",
    "temp",
    "ecc-dbe",
    "row-remap-failure",
    "throttle",
    "straggle",
    "freeze",
    "clear",
]
FAULTS: tuple[str, ...] = get_args(Fault)
#: Faults that need a ``value`` (the XID code, the temperature in °C).
FAULTS_WITH_VALUE = frozenset({"xid", "temp"})

#: What a fault's effect returns: a one-line description, and the XID to emit (or None).
_Effect = tuple[str, XidEvent | None]

SIM_MODEL = "NVIDIA H100 80GB HBM3 (simulated)"
SIM_MEMORY_MIB = 81559.0
SLOWDOWN_C = 90.0
SHUTDOWN_C = 98.0
POWER_LIMIT_W = 700.0
BASE_LATENCY_MS = 2.0
SIM_DRIVER_VERSION = "550.90.07"
SIM_MAX_SM_CLOCK_MHZ = 1980.0
SIM_MEM_CLOCK_MHZ = 2619.0
SIM_RESERVED_MIB = 512.0
#: Seconds of energy (power × time) each ``collect()`` adds to the energy counter.
SIM_STEP_S = 1.0
#: PCI bus numbers of the 8 GPUs of an HGX H100 board (GPUs beyond 8 continue from 0xE0).
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
_MIG_PROFILE_RE = re.compile(r"^([1-7])g\.(\d{1,3})gb$")
_UUID_NAMESPACE = uuid.UUID("6b1f3c3e-52a4-4c55-9a4b-7d0e4a1c0b11")


class FaultError(ValueError):
    """An injected fault is unknown or its arguments are invalid (message says why)."""


def simulated_uuid(node: str, index: int) -> str:
    """Deterministic ``GPU-…`` UUID of simulated GPU ``index`` on ``node``."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node}/{index}')}"


def simulated_pci_bus_id(index: int) -> str:
    """PCI bus id of simulated GPU ``index``, as an HGX H100 board numbers them."""
    bus = _HGX_BUSES[index] if index < len(_HGX_BUSES) else 0xE0 + index - len(_HGX_BUSES)
    return f"00000000:{bus:02X}:00.0"


@dataclass
class _SimGpu:
    index: int
    base_temp_c: float
    phase: float
    temperature_c: float = 40.0
    ecc_sbe_volatile: int = 0
    ecc_dbe_volatile: int = 0
    ecc_sbe_aggregate: int = 0
    ecc_dbe_aggregate: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    pcie_replay: int = 0
    nvlink_crc: int = 0
    nvlink_replay: int = 0
    nvlink_recovery: int = 0
    # faults
    thermal: bool = False
    pinned_temp_c: float | None = None
    row_remap_failure: bool = False
    row_remap_pending: bool = False
    throttle: bool = False
    frozen: bool = False
    last: GpuSample | None = field(default=None, repr=False)
    # extra readings
    energy_mj: int = 0
    nvlink_bandwidth: int = 0
    mig: list[MigInstance] = field(default_factory=list)  # the profiles and instance ids

    def clear(self) -> None:
        self.thermal = False
        self.pinned_temp_c = None
        self.row_remap_failure = False
        self.row_remap_pending = False
        self.throttle = False
        self.frozen = False
        self.ecc_sbe_volatile = 0
        self.ecc_dbe_volatile = 0


class SimulatedCollector(GpuCollector):
    """Made-up telemetry for ``gpus`` H100-like GPUs, with fault injection.

    Args:
        node: Node name (seeds the GPU UUIDs).
        gpus: Number of GPUs (1-64).
        seed: Seed of the random generator; None draws a random seed.
        job: When set, :meth:`latency` yields one collective-latency sample per call for
            this job and ``rank`` (about 2 ms with jitter).
        rank: The rank of those latency samples.
        mig: MIG instances by GPU index: the profile of each (``"3g.40gb"``); their GPU
            instance ids are 1, 2, … in that order.

    Raises:
        ValueError: ``gpus`` is out of range, only one of ``job``/``rank`` is given, or
            ``mig`` names a GPU out of range or a profile that is not ``<n>g.<m>gb``.
    """

    name = "simulated"
    simulated = True

    def __init__(
        self,
        node: str,
        gpus: int = 8,
        seed: int | None = None,
        job: str | None = None,
        rank: int | None = None,
        mig: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= gpus <= 64:
            raise ValueError(f"gpus must be 1-64, got {gpus}")
        if (job is None) != (rank is None):
            raise ValueError("job and rank go together: give both or neither")
        self.node = node
        self.seed = seed if seed is not None else random.SystemRandom().randrange(2**32)
        self.job = job
        self.rank = rank
        self._rng = random.Random(self.seed)
        self._lock = threading.Lock()
        self._tick = 0
        self._straggle = False
        self._gpus = [
            _SimGpu(
                index=i,
                base_temp_c=self._rng.uniform(36.0, 42.0),
                phase=self._rng.uniform(0, 2 * math.pi),
            )
            for i in range(gpus)
        ]
        for gpu in self._gpus:
            gpu.temperature_c = gpu.base_temp_c
        # the extra readings draw from their own generator: the samples stay as they were
        self._xrng = random.Random(f"{self.seed}/extras")
        self._extras: dict[int, GpuExtras] = {}
        for gpu in self._gpus:
            gpu.energy_mj = int(self._xrng.uniform(1e9, 5e9))  # since the (simulated) boot
        for index, profiles in (mig or {}).items():
            if not 0 <= index < gpus:
                raise ValueError(f"mig: GPU {index} is out of range 0-{gpus - 1}")
            for gi, profile in enumerate(profiles, start=1):
                if not _MIG_PROFILE_RE.match(profile):
                    raise ValueError(f"mig: profile {profile!r} is not <n>g.<m>gb, e.g. 3g.40gb")
                self._gpus[index].mig.append(MigInstance(gpu_instance_id=gi, profile=profile))
        self._inventory = [
            GpuInfo(
                index=i,
                uuid=simulated_uuid(node, i),
                name=SIM_MODEL,
                memory_total_mib=SIM_MEMORY_MIB,
            )
            for i in range(gpus)
        ]

    @property
    def gpu_count(self) -> int:
        """Number of simulated GPUs."""
        return len(self._gpus)

    def is_available(self) -> bool:
        """Always True."""
        return True

    def inventory(self) -> list[GpuInfo]:
        """The simulated GPUs (deterministic UUIDs from node and index)."""
        return list(self._inventory)

    # -- readings ------------------------------------------------------------------------
    def collect(self) -> list[GpuSample]:
        """Advance the simulation one step and return one sample per GPU.

        A frozen GPU returns its previous sample unchanged (old ``ts``).
        """
        with self._lock:
            self._tick += 1
            now = utcnow()
            self._extras = {}
            return [self._step(gpu, now) for gpu in self._gpus]

    def extras(self) -> dict[int, GpuExtras]:
        """The extra readings of the last :meth:`collect` (none for a frozen GPU)."""
        with self._lock:
            return dict(self._extras)

    def _step(self, gpu: _SimGpu, now: datetime) -> GpuSample:
        rng = self._rng
        # Draw the same random numbers whatever the faults, so faults on one GPU do not
        # shift the values of the others (determinism per seed).
        load = 0.5 + 0.5 * math.sin(self._tick / 12.0 + gpu.phase)  # 0..1, slow wave
        util = min(100.0, max(0.0, 70.0 + 30.0 * load + rng.gauss(0, 3)))
        target = gpu.base_temp_c + 28.0 * (util / 100.0)  # ~36-70 °C
        noise_t = rng.gauss(0, 0.6)
        noise_p = rng.gauss(0, 8)
        mem_used = 60000.0 + 15000.0 * load + rng.uniform(-500, 500)
        sbe_draw = rng.random()
        pcie_draw = rng.random()
        noise = [self._xrng.gauss(0, 1) for _ in range(4)]  # drawn whatever the faults
        if gpu.frozen and gpu.last is not None:
            return gpu.last

        if gpu.pinned_temp_c is not None:
            gpu.temperature_c = gpu.pinned_temp_c
        elif gpu.thermal:
            gpu.temperature_c = min(105.0, max(gpu.temperature_c + 4.0, 80.0))
        else:
            gpu.temperature_c += 0.5 * (target - gpu.temperature_c) + noise_t
        if sbe_draw < 0.01:  # a rare corrected error, as healthy HBM shows
            gpu.ecc_sbe_volatile += 1
            gpu.ecc_sbe_aggregate += 1
        if pcie_draw < 0.02:
            gpu.pcie_replay += 1

        throttle = 0
        if gpu.throttle:
            throttle |= THROTTLE_HW_SLOWDOWN | THROTTLE_HW_THERMAL_SLOWDOWN
        if gpu.temperature_c >= SLOWDOWN_C:
            throttle |= THROTTLE_HW_THERMAL_SLOWDOWN | THROTTLE_SW_THERMAL_SLOWDOWN
        power = 120.0 + 520.0 * (util / 100.0) + noise_p
        if throttle:
            power *= 0.6
        sample = GpuSample(
            index=gpu.index,
            ts=now,
            temperature_c=round(gpu.temperature_c, 1),
            slowdown_temp_c=SLOWDOWN_C,
            shutdown_temp_c=SHUTDOWN_C,
            power_w=round(min(POWER_LIMIT_W, max(60.0, power)), 1),
            power_limit_w=POWER_LIMIT_W,
            utilization_pct=round(util, 1),
            memory_used_mib=round(mem_used, 1),
            memory_total_mib=SIM_MEMORY_MIB,
            ecc_sbe_volatile=gpu.ecc_sbe_volatile,
            ecc_dbe_volatile=gpu.ecc_dbe_volatile,
            ecc_sbe_aggregate=gpu.ecc_sbe_aggregate,
            ecc_dbe_aggregate=gpu.ecc_dbe_aggregate,
            remapped_rows_correctable=gpu.remapped_correctable,
            remapped_rows_uncorrectable=gpu.remapped_uncorrectable,
            row_remap_pending=gpu.row_remap_pending,
            row_remap_failure=gpu.row_remap_failure,
            pcie_replay_count=gpu.pcie_replay,
            throttle_reasons=throttle,
            nvlink_crc_errors=gpu.nvlink_crc,
            nvlink_replay_errors=gpu.nvlink_replay,
            nvlink_recovery_errors=gpu.nvlink_recovery,
        )
        gpu.last = sample
        self._extras[gpu.index] = self._extra(gpu, sample, load, noise)
        return sample

    def _extra(self, gpu: _SimGpu, sample: GpuSample, load: float, noise: list[float]) -> GpuExtras:
        """The extra readings that go with ``sample`` (see the module docs)."""
        throttled = bool(sample.throttle_reasons)
        power = sample.power_w or 0.0
        used = sample.memory_used_mib or 0.0
        gpu.energy_mj += int(power * 1000 * SIM_STEP_S)
        gpu.nvlink_bandwidth += int(2e8 * (0.5 + load))
        sm_clock = SIM_MAX_SM_CLOCK_MHZ * (0.88 + 0.12 * load) * (0.6 if throttled else 1.0)
        tensor = _clamp(0.25 + 0.45 * load + 0.02 * noise[2], 0.0, 1.0)
        return GpuExtras(
            index=gpu.index,
            pci_bus_id=simulated_pci_bus_id(gpu.index),
            driver_version=SIM_DRIVER_VERSION,
            sm_clock_mhz=round(sm_clock),
            mem_clock_mhz=SIM_MEM_CLOCK_MHZ,
            memory_temp_c=round(_clamp(gpu.temperature_c + 6 + noise[0], -50.0, 200.0), 1),
            total_energy_mj=gpu.energy_mj,
            enc_util_pct=0.0,
            dec_util_pct=0.0,
            mem_copy_util_pct=round(_clamp(25.0 + 40.0 * load + 2 * noise[1], 0.0, 100.0), 1),
            fb_used_mib=round(used - SIM_RESERVED_MIB, 1),
            fb_free_mib=round(SIM_MEMORY_MIB - used, 1),
            fb_reserved_mib=SIM_RESERVED_MIB,
            nvlink_bandwidth_total=gpu.nvlink_bandwidth,
            prof_gr_engine_active_ratio=round(
                _clamp((sample.utilization_pct or 0) / 100 * 0.97, 0.0, 1.0), 3
            ),
            prof_pipe_tensor_active_ratio=round(tensor, 3),
            prof_dram_active_ratio=round(_clamp(0.2 + 0.5 * load + 0.02 * noise[3], 0.0, 1.0), 3),
            prof_pcie_tx_bps=round(2e9 * (0.5 + load)),
            prof_pcie_rx_bps=round(3e9 * (0.5 + load)),
            mig=[_mig_reading(m, load) for m in gpu.mig],
        )

    def latency(self) -> list[LatencySample]:
        """One latency sample (ms) for the configured job and rank, or none.

        About 2 ms with jitter; ×10 while the ``straggle`` fault is active.
        """
        if self.job is None or self.rank is None:
            return []
        with self._lock:
            value = max(0.3, self._rng.gauss(BASE_LATENCY_MS, 0.15))
            if self._straggle:
                value *= 10.0
        return [
            LatencySample(job_id=self.job, rank=self.rank, ts=utcnow(), latency_ms=round(value, 3))
        ]

    # -- faults --------------------------------------------------------------------------
    def inject(self, fault: str, gpu: int | None = None, value: float | None = None) -> str:
        """Inject a fault (see the module docs for each fault's effect).

        Args:
            fault: One of :data:`FAULTS`.
            gpu: Target GPU index; None means GPU 0, except for ``clear`` (all GPUs) and
                node-wide faults (``straggle``).
            value: The XID code for ``xid`` (integer 0-100000), the temperature in °C for
                ``temp`` (-50-200); must be None for other faults.

        Returns:
            A one-line description of what was done.

        Raises:
            FaultError: unknown fault, GPU index out of range, missing/extra/invalid value.
        """
        if fault not in FAULTS:
            raise FaultError(f"unknown fault {fault!r}; choose one of: {', '.join(FAULTS)}")
        if gpu is not None and not 0 <= gpu < len(self._gpus):
            raise FaultError(
                f"gpu {gpu} is out of range: this node has GPUs 0-{len(self._gpus) - 1}"
            )
        if fault in FAULTS_WITH_VALUE and value is None:
            what = "an XID code, e.g. 79" if fault == "xid" else "a temperature in °C, e.g. 95"
            raise FaultError(f"fault {fault!r} needs a value: {what}")
        if fault not in FAULTS_WITH_VALUE and value is not None:
            raise FaultError(
                f"fault {fault!r} takes no value (got {value!r}); use --gpu to pick the GPU"
            )
        if (
            fault == "xid"
            and value is not None
            and (value != int(value) or not 0 <= value <= 100000)
        ):
            raise FaultError(f"XID code must be an integer 0-100000, got {value!r}")
        if fault == "temp" and value is not None and not -50 <= value <= 200:
            raise FaultError(f"temperature must be between -50 and 200 °C, got {value!r}")

        with self._lock:
            result, xid = self._EFFECTS[fault](self, gpu, value)
        if xid is not None:
            self.emit_xid(xid)
        return result

    # Each fault's effect, called with the lock held: (collector, gpu, value) -> (the
    # one-line description, the XID to emit once the lock is released or None). ``gpu`` is
    # already range-checked and ``value`` checked against the fault's needs.
    def _clear(self, gpu: int | None, _value: float | None) -> _Effect:
        targets = self._gpus if gpu is None else [self._gpus[gpu]]
        for target in targets:
            target.clear()
        if gpu is None:
            self._straggle = False
        return "cleared all faults" + ("" if gpu is None else f" on GPU {gpu}"), None

    def _straggler(self, _gpu: int | None, _value: float | None) -> _Effect:
        self._straggle = True
        result = "latency samples ×10 (straggler)"
        if self.job is None:
            result += "; note: no sim job/rank set, so no latency samples are made"
        return result, None

    def _thermal(self, gpu: int | None, _value: float | None) -> _Effect:
        target = self._gpus[gpu or 0]
        target.thermal = True
        target.pinned_temp_c = None
        return f"thermal runaway on GPU {target.index}", None

    def _temp(self, gpu: int | None, value: float | None) -> _Effect:
        target = self._gpus[gpu or 0]
        assert value is not None  # checked by inject()
        target.pinned_temp_c = float(value)
        target.thermal = False
        return f"temperature of GPU {target.index} set to {value:g} °C", None

    def _ecc_dbe(self, gpu: int | None, _value: float | None) -> _Effect:
        target = self._gpus[gpu or 0]
        target.ecc_dbe_volatile += 1
        target.ecc_dbe_aggregate += 1
        xid = XidEvent(
            gpu=target.index, xid=48, ts=utcnow(), message="simulated double bit ECC error"
        )
        return f"uncorrectable ECC error (and XID 48) on GPU {target.index}", xid

    def _row_remap_failure(self, gpu: int | None, _value: float | None) -> _Effect:
        target = self._gpus[gpu or 0]
        target.row_remap_failure = True
        target.row_remap_pending = True
        target.remapped_uncorrectable += 1
        return f"row remapping failure on GPU {target.index}", None

    def _xid(self, gpu: int | None, value: float | None) -> _Effect:
        target = self._gpus[gpu or 0]
        assert value is not None  # checked by inject()
        xid = XidEvent(gpu=target.index, xid=int(value), ts=utcnow(), message="simulated XID")
        return f"XID {int(value)} on GPU {target.index}", xid

    def _throttle(self, gpu: int | None, _value: float | None) -> _Effect:
        target = self._gpus[gpu or 0]
        target.throttle = True
        return f"HW slowdown throttling on GPU {target.index}", None

    def _freeze(self, gpu: int | None, _value: float | None) -> _Effect:
        target = self._gpus[gpu or 0]
        target.frozen = True
        return f"telemetry of GPU {target.index} frozen", None

    #: The dispatch table of :meth:`inject`: one effect per fault of :data:`FAULTS`.
    _EFFECTS: ClassVar[
        dict[str, Callable[[SimulatedCollector, int | None, float | None], _Effect]]
    ] = {
        "xid": _xid,
        "thermal": _thermal,
        "temp": _temp,
        "ecc-dbe": _ecc_dbe,
        "row-remap-failure": _row_remap_failure,
        "throttle": _throttle,
        "straggle": _straggler,
        "freeze": _freeze,
        "clear": _clear,
    }


def _clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


def _mig_reading(instance: MigInstance, load: float) -> MigInstance:
    """One reading of a simulated MIG instance: its memory slice (the profile's ``<m>gb``)
    used at 60-90 % with the load, and activity ratios that follow the load."""
    m = _MIG_PROFILE_RE.match(instance.profile)
    assert m is not None  # checked by the constructor
    total = int(m.group(2)) * 1024.0
    used = round(total * (0.6 + 0.3 * load), 1)
    return instance.model_copy(
        update={
            "fb_used_mib": used,
            "fb_free_mib": round(total - used, 1),
            "fb_reserved_mib": 0.0,
            "prof_gr_engine_active_ratio": round(0.5 + 0.45 * load, 3),
            "prof_pipe_tensor_active_ratio": round(0.2 + 0.4 * load, 3),
            "prof_dram_active_ratio": round(0.15 + 0.5 * load, 3),
        }
    )

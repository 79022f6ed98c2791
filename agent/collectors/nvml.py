"""GPU health from NVML through nvidia-ml-py (module ``pynvml``).

NVML is initialised once (:meth:`NvmlCollector.is_available` or :meth:`~NvmlCollector.start`)
and shut down once. Every NVML call is guarded on its own: a field the GPU or driver does not
support (``NVMLError_NotSupported``, ``NVMLError_FunctionNotFound``…) is sent as None and the
sample is still produced. Other per-field errors also give None, plus one ``nvml_field_error``
event per GPU, field and error.

Lost GPUs (decision): a GPU counts as *failed* for one collection when any call answers
``GPU is lost`` / ``GPU requires reset`` / ``driver not loaded`` / ``uninitialized``, or when
every field errors. Then the collector returns that GPU's **last good sample unchanged, with
its old ts** (nothing when it was never read), so the control plane's stale-telemetry rule
fires, and it queues one ``nvml_gpu_error`` event when the GPU goes bad (and again every
:data:`REPEAT_FAILURE_EVENT_S` seconds while it stays bad) and one ``nvml_gpu_recovered``
event when it reads again.

Extra readings (:class:`~tierwatch.agent.readings.GpuExtras`, for the agent's ``/metrics``):
``nvmlDeviceGetClockInfo`` (SM and memory clocks, MHz), ``nvmlDeviceGetTotalEnergyConsumption``
(mJ), ``nvmlDeviceGetEncoderUtilization`` / ``...DecoderUtilization`` (%), the ``memory``
rate of ``nvmlDeviceGetUtilizationRates`` (memory-copy %), ``nvmlDeviceGetMemoryInfo``
version 2 (used without reserved, free, reserved), ``nvmlDeviceGetFieldValues`` with
``NVML_FI_DEV_MEMORY_TEMP`` (HBM °C), and with MIG on (``nvmlDeviceGetMigMode``) each MIG
device's GPU instance id, profile (from its name) and memory. The PCI bus id
(``nvmlDeviceGetPciInfo``) and driver version (``nvmlSystemGetDriverVersion``) are read once at
start. Each call is guarded like the sample's (None when unsupported, or when this
nvidia-ml-py lacks the function); none of them decides whether a GPU counts as read.

XID errors: a daemon thread waits on an NVML event set (``nvmlEventSetCreate``,
``nvmlDeviceRegisterEvents(handle, nvmlEventTypeXidCriticalError, set)``,
``nvmlEventSetWait_v2(set, timeout_ms)`` in a loop); ``eventData`` is the XID code, and the
event's device handle is mapped back to the GPU index. Each XID is handed to the runtime at
once.

Sources: NVML API reference (nvml.h), nvidia-ml-py 12.x/13.x function names.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import re
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from tierwatch.agent.collectors.base import CollectorError, GpuCollector, XidCallback
from tierwatch.agent.protocol import GpuInfo, GpuSample, XidEvent, utcnow
from tierwatch.agent.readings import GpuExtras

log = logging.getLogger(__name__)

MIB = 1024 * 1024
#: Seconds between repeated ``nvml_gpu_error`` events for a GPU that stays unreadable.
REPEAT_FAILURE_EVENT_S = 300.0
#: Seconds one nvmlEventSetWait_v2 call blocks (also bounds how long shutdown waits).
EVENT_WAIT_MS = 500

# NVML return codes (nvml.h) that mean "this field is not available here" (-> None, quietly).
_UNSUPPORTED_NAMES = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_NOT_FOUND",
    "NVML_ERROR_INVALID_ARGUMENT",
)
# Return codes that mean "the GPU (or NVML) is gone" (-> stale sample + event).
_FATAL_NAMES = (
    "NVML_ERROR_GPU_IS_LOST",
    "NVML_ERROR_RESET_REQUIRED",
    "NVML_ERROR_DRIVER_NOT_LOADED",
    "NVML_ERROR_UNINITIALIZED",
)


def load_pynvml() -> ModuleType:
    """Import nvidia-ml-py's ``pynvml`` module.

    Raises:
        CollectorError: nvidia-ml-py is not installed.
    """
    try:
        return importlib.import_module("pynvml")
    except ImportError as exc:
        raise CollectorError("nvidia-ml-py (module pynvml) is not installed") from exc


def _handle_key(handle: Any) -> Any:
    """A hashable key for an NVML device handle (the pointer value for ctypes handles)."""
    if isinstance(handle, ctypes._Pointer | ctypes.c_void_p):
        return ("ptr", ctypes.cast(handle, ctypes.c_void_p).value)
    try:
        hash(handle)
    except TypeError:
        return ("id", id(handle))
    return ("obj", handle)


class _GpuFailed(Exception):
    """A fatal NVML error for one GPU during one collection."""


class NvmlCollector(GpuCollector):
    """Reads GPU health through NVML.

    Args:
        nvml: The ``pynvml`` module to use; None imports nvidia-ml-py's. Tests pass a
            stand-in module object with the same function names, constants and exceptions.
        event_wait_ms: Timeout of one ``nvmlEventSetWait_v2`` call, ms.
    """

    name = "nvml"
    simulated = False

    def __init__(self, nvml: ModuleType | None = None, event_wait_ms: int = EVENT_WAIT_MS):
        super().__init__()
        self._nvml_module = nvml
        self._event_wait_ms = event_wait_ms
        self._initialized = False
        self._init_error: str | None = None
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._index_by_key: dict[Any, int] = {}
        self._inventory: list[GpuInfo] = []
        self._last_good: dict[int, GpuSample] = {}
        self._extras: dict[int, GpuExtras] = {}  # of the last collect(), GPUs read live
        self._pci_bus_ids: dict[int, str] = {}
        self._driver_version: str | None = None
        self._failed_since: dict[int, float] = {}  # index -> monotonic time of last event
        self._reported_field_errors: set[tuple[int, str, int]] = set()
        self._nvlink_links: dict[int, list[int] | None] = {}  # index -> supported links
        self._event_set: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsupported: tuple[int, ...] = ()
        self._fatal: tuple[int, ...] = ()

    # -- NVML setup ----------------------------------------------------------------------
    @property
    def init_error(self) -> str | None:
        """Why NVML could not be initialised (None when it was, or was not tried)."""
        return self._init_error

    @property
    def nvml(self) -> ModuleType:
        """The pynvml module in use (imported on first use).

        Raises:
            CollectorError: nvidia-ml-py is not installed.
        """
        if self._nvml_module is None:
            self._nvml_module = load_pynvml()
        return self._nvml_module

    def _init(self) -> None:
        """Initialise NVML once.

        Raises:
            CollectorError: nvidia-ml-py is missing or ``nvmlInit`` failed.
        """
        with self._lock:
            if self._initialized:
                return
            nv = self.nvml
            try:
                nv.nvmlInit()
            except nv.NVMLError as exc:
                self._init_error = f"nvmlInit failed: {exc}"
                raise CollectorError(self._init_error) from exc
            except OSError as exc:  # library cannot be loaded on some platforms
                self._init_error = f"NVML library cannot be loaded: {exc}"
                raise CollectorError(self._init_error) from exc
            self._unsupported = tuple(getattr(nv, n) for n in _UNSUPPORTED_NAMES if hasattr(nv, n))
            self._fatal = tuple(getattr(nv, n) for n in _FATAL_NAMES if hasattr(nv, n))
            self._initialized = True

    def is_available(self) -> bool:
        """True when NVML loads and initialises (``nvmlInit`` succeeds)."""
        try:
            self._init()
        except CollectorError as exc:
            log.info("NVML not available: %s", exc)
            return False
        return True

    def start(self, on_xid: XidCallback) -> None:
        """Initialise NVML, enumerate GPUs and start the XID event thread.

        Raises:
            CollectorError: NVML cannot be initialised or GPUs cannot be enumerated.
        """
        super().start(on_xid)
        self._init()
        nv = self.nvml
        try:
            count = nv.nvmlDeviceGetCount()
        except nv.NVMLError as exc:
            raise CollectorError(f"nvmlDeviceGetCount failed: {exc}") from exc
        self._handles, self._inventory = [], []
        self._driver_version = self._read_driver_version()
        for index in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
            except nv.NVMLError as exc:
                self.add_event("nvml_gpu_error", f"cannot open GPU {index}: {exc}", gpu=index)
                handle = None
            self._handles.append(handle)
            if handle is None:
                continue
            self._index_by_key[_handle_key(handle)] = index
            uuid = self._field(index, "uuid", nv.nvmlDeviceGetUUID, handle)
            name = self._field(index, "name", nv.nvmlDeviceGetName, handle)
            mem = self._field(index, "memory_info", nv.nvmlDeviceGetMemoryInfo, handle)
            pci = self._call(index, "pci_info", "nvmlDeviceGetPciInfo", handle)
            bus_id = _text(getattr(pci, "busId", None)) if pci is not None else None
            if bus_id:
                self._pci_bus_ids[index] = bus_id
            self._inventory.append(
                GpuInfo(
                    index=index,
                    uuid=_text(uuid) or f"nvml-index-{index}",
                    name=(_text(name) or "")[:128],
                    memory_total_mib=round(mem.total / MIB, 1) if mem is not None else None,
                )
            )
        log.info("NVML: %d GPU(s): %s", count, ", ".join(g.name for g in self._inventory))
        self._start_xid_thread()

    def _read_driver_version(self) -> str | None:
        """``nvmlSystemGetDriverVersion`` (None when it fails; an event unless unsupported)."""
        nv = self.nvml
        fn = getattr(nv, "nvmlSystemGetDriverVersion", None)
        if fn is None:
            return None
        try:
            return _text(fn()) or None
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) not in self._unsupported:
                self.add_event("nvml_field_error", f"nvmlSystemGetDriverVersion failed: {exc}")
            return None

    def shutdown(self) -> None:
        """Stop the XID thread, free the event set and shut NVML down (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._event_wait_ms / 1000 + 2)
            self._thread = None
        if not self._initialized:
            return
        nv = self.nvml
        if self._event_set is not None:
            try:
                nv.nvmlEventSetFree(self._event_set)
            except nv.NVMLError as exc:
                log.warning("nvmlEventSetFree failed: %s", exc)
            self._event_set = None
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.warning("nvmlShutdown failed: %s", exc)
        self._initialized = False

    def inventory(self) -> list[GpuInfo]:
        """The GPUs found by :meth:`start`."""
        return list(self._inventory)

    # -- XID events ----------------------------------------------------------------------
    def _start_xid_thread(self) -> None:
        nv = self.nvml
        try:
            self._event_set = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            self.add_event(
                "xid_unavailable",
                f"nvmlEventSetCreate failed: {exc}; XID errors will not be reported",
            )
            return
        registered = 0
        for index, handle in enumerate(self._handles):
            if handle is None:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(
                    handle, nv.nvmlEventTypeXidCriticalError, self._event_set
                )
                registered += 1
            except nv.NVMLError as exc:
                self.add_event(
                    "xid_unavailable", f"cannot register for XID events: {exc}", gpu=index
                )
        if not registered:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._xid_loop, name="nvml-xid", daemon=True)
        self._thread.start()

    def _xid_loop(self) -> None:
        nv = self.nvml
        timeout_cls = getattr(nv, "NVMLError_Timeout", None)
        failing = False
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait_v2(self._event_set, self._event_wait_ms)
            except nv.NVMLError as exc:
                if timeout_cls is not None and isinstance(exc, timeout_cls):
                    continue
                if not failing:
                    self.add_event(
                        "xid_wait_error", f"nvmlEventSetWait_v2 failed: {exc}; retrying every 5 s"
                    )
                    failing = True
                self._stop.wait(5.0)
                continue
            failing = False
            if not int(data.eventType) & nv.nvmlEventTypeXidCriticalError:
                continue
            index = self._index_of(data.device)
            if index is None:
                self.add_event(
                    "xid_unmapped",
                    f"XID {int(data.eventData)} from a device handle that maps to no known GPU",
                )
                continue
            event = XidEvent(
                gpu=index,
                xid=int(data.eventData),
                ts=utcnow(),
                message="NVML XID critical error event",
            )
            try:
                self.emit_xid(event)
            except Exception as exc:  # noqa: BLE001 - keep the thread alive, say why
                log.exception("XID callback failed")
                self.add_event(
                    "xid_callback_error", f"XID {event.xid} not pushed: {exc}", gpu=index
                )

    def _index_of(self, handle: Any) -> int | None:
        index = self._index_by_key.get(_handle_key(handle))
        if index is not None:
            return index
        nv = self.nvml
        try:
            return int(nv.nvmlDeviceGetIndex(handle))
        except (nv.NVMLError, TypeError, ctypes.ArgumentError):
            return None

    # -- readings ------------------------------------------------------------------------
    def collect(self) -> list[GpuSample]:
        """One sample per GPU (see the module docs for unsupported fields and lost GPUs)."""
        samples = []
        self._extras = {}
        for index, handle in enumerate(self._handles):
            sample = self._read_gpu(index, handle) if handle is not None else None
            if sample is None:
                sample = self._last_good.get(index)  # stale: old ts on purpose
            if sample is not None:
                samples.append(sample)
        return samples

    def extras(self) -> dict[int, GpuExtras]:
        """The extra readings of the last :meth:`collect` (GPUs read live only)."""
        return dict(self._extras)

    def _call(self, index: int, field: str, fn_name: str, *args: Any) -> Any:
        """:meth:`_field` for a function this nvidia-ml-py may lack (None then)."""
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:
            return None
        return self._field(index, field, fn, *args)

    def _field(self, index: int, field: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call one NVML function; None when unsupported or failing (see module docs).

        Raises:
            _GpuFailed: the error says the GPU or NVML is gone.
        """
        nv = self.nvml
        try:
            return fn(*args)
        except nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code in self._fatal:
                raise _GpuFailed(f"{fn.__name__}: {exc}") from exc
            if code not in self._unsupported:
                key = (index, field, code if isinstance(code, int) else -1)
                if key not in self._reported_field_errors:
                    self._reported_field_errors.add(key)
                    self.add_event(
                        "nvml_field_error",
                        f"{fn.__name__} ({field}) failed: {exc}; sent as null",
                        gpu=index,
                    )
            return None

    def _read_gpu(self, index: int, handle: Any) -> GpuSample | None:
        nv = self.nvml
        try:
            fields, any_ok, raw = self._read_fields(index, handle)
            if not any_ok:
                raise _GpuFailed("every NVML query failed")
            extra_fields = self._read_extras(index, handle, raw)
        except _GpuFailed as exc:
            now = time.monotonic()
            last = self._failed_since.get(index)
            if last is None or now - last >= REPEAT_FAILURE_EVENT_S:
                self._failed_since[index] = now
                stale = (
                    "its last sample is repeated with its old timestamp"
                    if index in self._last_good
                    else "no sample is sent"
                )
                self.add_event(
                    "nvml_gpu_error", f"GPU {index} cannot be read ({exc}); {stale}", gpu=index
                )
            return None
        except nv.NVMLError as exc:  # pragma: no cover - _field catches these
            self.add_event("nvml_gpu_error", f"unexpected NVML error: {exc}", gpu=index)
            return None
        if self._failed_since.pop(index, None) is not None:
            self.add_event("nvml_gpu_recovered", f"GPU {index} reads again", gpu=index)
        sample = self.build_sample(fields)
        self._last_good[index] = sample
        self._extras[index] = self.build_extras(extra_fields)
        return sample

    def _read_fields(self, index: int, handle: Any) -> tuple[dict[str, Any], bool, dict[str, Any]]:
        """The sample's fields, whether any call answered, and the raw utilisation and
        memory answers (which :meth:`_read_extras` reuses)."""
        nv = self.nvml
        f = self._field
        ts = utcnow()
        out: dict[str, Any] = {"index": index, "ts": ts}
        ok: list[bool] = []

        def put(name: str, value: Any) -> None:
            out[name] = value
            ok.append(value is not None)

        put(
            "temperature_c",
            f(index, "temperature", nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU),
        )
        put(
            "slowdown_temp_c",
            f(
                index,
                "slowdown_temp",
                nv.nvmlDeviceGetTemperatureThreshold,
                handle,
                nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN,
            ),
        )
        put(
            "shutdown_temp_c",
            f(
                index,
                "shutdown_temp",
                nv.nvmlDeviceGetTemperatureThreshold,
                handle,
                nv.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
            ),
        )
        power_mw = f(index, "power", nv.nvmlDeviceGetPowerUsage, handle)
        put("power_w", power_mw / 1000.0 if power_mw is not None else None)
        limit_mw = f(index, "power_limit", nv.nvmlDeviceGetEnforcedPowerLimit, handle)
        put("power_limit_w", limit_mw / 1000.0 if limit_mw is not None else None)
        util = f(index, "utilization", nv.nvmlDeviceGetUtilizationRates, handle)
        put("utilization_pct", float(util.gpu) if util is not None else None)
        mem = f(index, "memory_info", nv.nvmlDeviceGetMemoryInfo, handle)
        put("memory_used_mib", round(mem.used / MIB, 1) if mem is not None else None)
        put("memory_total_mib", round(mem.total / MIB, 1) if mem is not None else None)

        for name, err_type, counter in (
            ("ecc_sbe_volatile", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_dbe_volatile", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            ("ecc_sbe_aggregate", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_AGGREGATE_ECC),
            ("ecc_dbe_aggregate", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC),
        ):
            put(name, f(index, name, nv.nvmlDeviceGetTotalEccErrors, handle, err_type, counter))

        rows = f(index, "remapped_rows", nv.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            corr, unc, pending, failure = rows
            put("remapped_rows_correctable", int(corr))
            put("remapped_rows_uncorrectable", int(unc))
            put("row_remap_pending", bool(pending))
            put("row_remap_failure", bool(failure))

        put("pcie_replay_count", f(index, "pcie_replay", nv.nvmlDeviceGetPcieReplayCounter, handle))
        put("throttle_reasons", self._throttle_reasons(index, handle))
        out.update(self._nvlink_errors(index, handle))
        return out, any(ok), {"util": util, "mem": mem}

    def _read_extras(self, index: int, handle: Any, raw: dict[str, Any]) -> dict[str, Any]:
        """:class:`GpuExtras` fields of one GPU (units: MHz, °C, mJ, %, MiB).

        Raises:
            _GpuFailed: a call says the GPU or NVML is gone.
        """
        nv = self.nvml
        call = self._call
        out: dict[str, Any] = {
            "index": index,
            "pci_bus_id": self._pci_bus_ids.get(index),
            "driver_version": self._driver_version,
        }
        for name, clock in (("sm_clock_mhz", "NVML_CLOCK_SM"), ("mem_clock_mhz", "NVML_CLOCK_MEM")):
            if hasattr(nv, clock):
                mhz = call(index, name, "nvmlDeviceGetClockInfo", handle, getattr(nv, clock))
                out[name] = float(mhz) if mhz is not None else None
        out["total_energy_mj"] = call(
            index, "total_energy", "nvmlDeviceGetTotalEnergyConsumption", handle
        )
        for name, fn_name in (
            ("enc_util_pct", "nvmlDeviceGetEncoderUtilization"),
            ("dec_util_pct", "nvmlDeviceGetDecoderUtilization"),
        ):
            answer = call(index, name, fn_name, handle)  # [utilisation %, sampling period µs]
            out[name] = float(answer[0]) if answer is not None else None
        util = raw["util"]
        out["mem_copy_util_pct"] = float(util.memory) if util is not None else None
        out.update(self._memory_v2(index, handle, raw["mem"]))
        if hasattr(nv, "NVML_FI_DEV_MEMORY_TEMP"):
            field_ids = [nv.NVML_FI_DEV_MEMORY_TEMP]
            values = call(index, "memory_temp", "nvmlDeviceGetFieldValues", handle, field_ids)
            out["memory_temp_c"] = _field_value(nv, values[0]) if values else None
        out["mig"] = self._mig_instances(index, handle)
        return out

    def _memory_v2(self, index: int, handle: Any, mem_v1: Any) -> dict[str, float | None]:
        """``fb_used_mib`` (without reserved), ``fb_free_mib`` and ``fb_reserved_mib`` from
        ``nvmlDeviceGetMemoryInfo`` version 2; only ``fb_free_mib`` (from version 1's
        answer) where version 2 is not available."""
        version = getattr(self.nvml, "nvmlMemory_v2", None)
        mem = None
        if version is not None:
            mem = self._call(index, "memory_info_v2", "nvmlDeviceGetMemoryInfo", handle, version)
        if mem is None:
            free = round(mem_v1.free / MIB, 1) if mem_v1 is not None else None
            return {"fb_used_mib": None, "fb_free_mib": free, "fb_reserved_mib": None}
        return {
            "fb_used_mib": round(mem.used / MIB, 1),
            "fb_free_mib": round(mem.free / MIB, 1),
            "fb_reserved_mib": round(mem.reserved / MIB, 1),
        }

    def _mig_instances(self, index: int, handle: Any) -> list[dict[str, Any]]:
        """The GPU's MIG instances (empty with MIG off or unsupported), one per GPU instance
        id (several compute instances of one GPU instance share its memory)."""
        nv = self.nvml
        call = self._call
        mode = call(index, "mig_mode", "nvmlDeviceGetMigMode", handle)  # [current, pending]
        if not mode or mode[0] != getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1):
            return []
        count = call(index, "mig_count", "nvmlDeviceGetMaxMigDeviceCount", handle) or 0
        instances: dict[int, dict[str, Any]] = {}
        for slot in range(int(count)):
            # an empty slot answers NVML_ERROR_NOT_FOUND: None, quietly
            mig = call(index, "mig_handle", "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            if mig is None:
                continue
            gi = call(index, "mig_gpu_instance", "nvmlDeviceGetGpuInstanceId", mig)
            if gi is None or int(gi) in instances:
                continue
            name = _text(call(index, "mig_name", "nvmlDeviceGetName", mig)) or ""
            mem = call(index, "mig_memory", "nvmlDeviceGetMemoryInfo", mig)
            instances[int(gi)] = {
                "gpu_instance_id": int(gi),
                "profile": mig_profile(name) or "unknown",
                "fb_used_mib": round(mem.used / MIB, 1) if mem is not None else None,
                "fb_free_mib": round(mem.free / MIB, 1) if mem is not None else None,
            }
        return [instances[gi] for gi in sorted(instances)]

    def _throttle_reasons(self, index: int, handle: Any) -> int | None:
        nv = self.nvml
        for fn_name in (
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
        ):
            fn = getattr(nv, fn_name, None)
            if fn is None:
                continue
            value = self._field(index, "throttle_reasons", fn, handle)
            if value is not None:
                return int(value)
        return None

    def _nvlink_errors(self, index: int, handle: Any) -> dict[str, int | None]:
        """NVLink CRC (flit + data), replay and recovery error counts summed over links.

        Links answering "not supported"/"invalid argument" are skipped, and remembered as
        such after the first collection.
        """
        nv = self.nvml
        counters = {
            "nvlink_crc_errors": (
                nv.NVML_NVLINK_ERROR_DL_CRC_FLIT,
                nv.NVML_NVLINK_ERROR_DL_CRC_DATA,
            ),
            "nvlink_replay_errors": (nv.NVML_NVLINK_ERROR_DL_REPLAY,),
            "nvlink_recovery_errors": (nv.NVML_NVLINK_ERROR_DL_RECOVERY,),
        }
        known = self._nvlink_links.get(index)
        probing = known is None
        links = list(range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))) if known is None else known
        totals: dict[str, int | None] = dict.fromkeys(counters)
        supported: list[int] = []
        for link in links:
            link_ok = False
            for name, ids in counters.items():
                for counter in ids:
                    try:
                        value = nv.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter)
                    except nv.NVMLError as exc:
                        if getattr(exc, "value", None) in self._fatal:
                            raise _GpuFailed(f"nvmlDeviceGetNvLinkErrorCounter: {exc}") from exc
                        continue
                    link_ok = True
                    totals[name] = (totals[name] or 0) + int(value)
            if link_ok:
                supported.append(link)
        if probing:
            self._nvlink_links[index] = supported
        return totals


_MIG_PROFILE_RE = re.compile(r"\bMIG\s+(\S+)\s*$")


def mig_profile(device_name: str) -> str | None:
    """The MIG profile in a MIG device's NVML name (``NVIDIA A100-SXM4-40GB MIG 1g.5gb`` →
    ``1g.5gb``), or None when the name has none."""
    m = _MIG_PROFILE_RE.search(device_name)
    return m.group(1) if m else None


def _field_value(nv: ModuleType, value: Any) -> float | None:
    """The number in one ``nvmlFieldValue_t`` (None when its ``nvmlReturn`` is an error)."""
    if getattr(value, "nvmlReturn", 1) != getattr(nv, "NVML_SUCCESS", 0):
        return None
    member = {
        getattr(nv, "NVML_VALUE_TYPE_DOUBLE", 0): "dVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_INT", 1): "uiVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG", 2): "ulVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", 3): "ullVal",
        getattr(nv, "NVML_VALUE_TYPE_SIGNED_LONG_LONG", 4): "sllVal",
        getattr(nv, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
        getattr(nv, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }.get(int(value.valueType))
    if member is None:
        return None
    return float(getattr(value.value, member))


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return str(value)

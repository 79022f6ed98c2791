"""Test helpers for the agent (imported as ``agent_helpers``): stand-in pynvml, receiver.

The stand-in ``pynvml`` is a module object with nvidia-ml-py's function names and signatures;
its constants and exception classes are nvidia-ml-py's own (importing pynvml needs no GPU),
so the collector under test sees the real interface. The report receiver is a real HTTP
endpoint on 127.0.0.1 (ephemeral port) that stands in for the control plane's ingest route in
these unit tests only.
"""

from __future__ import annotations

import importlib
import json
import queue
import re
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from procs import wait_for
from pydantic import ValidationError

from tierwatch.agent.credentials import LocalAuthority, b64url
from tierwatch.agent.protocol import ReportAck, ReportBatch

TOKEN = "test-agent-token"


class TestAuthority(LocalAuthority):
    """The server's credential signing key, for tests whose control plane is a
    :class:`Receiver`: it serves :meth:`jwks` as ``GET /api/v1/credentials/public-keys`` and
    :meth:`job_credential` signs what ``POST /api/v1/jobs/{job}/credential`` would return."""

    __test__ = False  # not a test class

    def job_auth(self, job_id: str) -> dict[str, str]:
        """``Authorization`` header of a rank of ``job_id``."""
        return {"Authorization": f"Bearer {self.job_credential(job_id)}"}


#: One authority per test process; every Receiver serves its keys.
AUTHORITY = TestAuthority(kid="test-key", seed=b"tierwatch test authority")
#: The ``Authorization`` header of the node's agent token (TOKEN).
NODE_AUTH = {"Authorization": f"Bearer {TOKEN}"}


def wait_until(condition: Callable[[], Any], timeout: float = 5.0, what: str = "condition"):
    """Poll ``condition`` until it is truthy; fail the test after ``timeout`` seconds."""
    try:
        return wait_for(condition, timeout=timeout, interval=0.01, what=what)
    except TimeoutError as exc:
        pytest.fail(str(exc))


# ---------------------------------------------------------------------------------------
# stand-in pynvml
# ---------------------------------------------------------------------------------------
@dataclass
class FakeGpu:
    """State of one stand-in GPU (units as NVML returns them: mW, bytes, °C)."""

    index: int
    uuid: str = ""
    name: str = "NVIDIA H100 80GB HBM3"
    temperature: int = 45
    slowdown: int = 90
    shutdown: int = 95
    power_mw: int = 250_000
    limit_mw: int = 700_000
    util: int = 80
    mem_total: int = 80 * 1024**3
    mem_used: int = 20 * 1024**3
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)  # (type, counter) -> n
    rows: tuple[int, int, int, int] = (0, 0, 0, 0)
    pcie_replay: int = 3
    reasons: int = 0
    nvlink: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, counter) -> n
    nvlink_links: int = 0  # links 0..n-1 are supported
    unsupported: set[str] = field(default_factory=set)  # function names -> NotSupported
    lost: bool = False
    # the extra readings (agent/readings.py), in NVML's units
    sm_clock: int = 1980  # MHz
    mem_clock: int = 2619  # MHz
    memory_temp: int | None = 52  # °C (field NVML_FI_DEV_MEMORY_TEMP); None: not supported
    energy_mj: int = 123_456_789
    enc_util: int = 0
    dec_util: int = 0
    mem_util: int = 10
    mem_reserved: int = 512 * 1024**2  # part of mem_used (version 1 of nvmlDeviceGetMemoryInfo)
    pci_bus_id: str = ""  # default 00000000:<0x18 + index>:00.0
    # MIG instances (gpu instance id, profile, used bytes, total bytes); any: MIG mode on
    mig: list[tuple[int, str, int, int]] = field(default_factory=list)


class FakeMigHandle:
    """A MIG device handle of one stand-in GPU (slot ``slot`` of its MIG devices)."""

    def __init__(self, gpu: FakeGpu, slot: int) -> None:
        self.gpu = gpu
        self.slot = slot


class FakeHandle:
    """An opaque device handle (like nvidia-ml-py's ctypes pointer)."""

    def __init__(self, index: int) -> None:
        self._index = index

    def __repr__(self) -> str:
        return f"<FakeHandle {self._index}>"


class FakeEventData:
    def __init__(self, device: FakeHandle, event_type: int, event_data: int) -> None:
        self.device = device
        self.eventType = event_type
        self.eventData = event_data
        self.gpuInstanceId = 0xFFFFFFFF
        self.computeInstanceId = 0xFFFFFFFF


def make_fake_pynvml(
    gpus: list[FakeGpu],
    *,
    init_error: str | None = None,
    clocks_event_reasons: bool = True,
    driver_version: str | None = "550.90.07",
) -> types.ModuleType:
    """Build a stand-in ``pynvml`` module over ``gpus``.

    Args:
        gpus: The GPUs it reports.
        init_error: Name of an NVMLError_* class that ``nvmlInit`` raises (no NVML).
        clocks_event_reasons: Whether ``nvmlDeviceGetCurrentClocksEventReasons`` exists
            (older nvidia-ml-py has only ...ThrottleReasons).
        driver_version: What ``nvmlSystemGetDriverVersion`` answers (None: not supported).
    """
    real = importlib.import_module("pynvml")
    mod = types.ModuleType("pynvml")
    for name in dir(real):
        if name.startswith(("NVML_", "NVMLError", "nvmlEventType", "nvmlClocks", "nvmlMemory_v")):
            setattr(mod, name, getattr(real, name))
    handles = [FakeHandle(g.index) for g in gpus]
    by_handle = {id(h): g for h, g in zip(handles, gpus, strict=True)}
    events: queue.Queue[FakeEventData] = queue.Queue()
    calls: dict[str, int] = {}
    state = {"initialized": False, "registered": [], "event_sets": 0, "freed": 0}
    mod.calls = calls
    mod.state = state
    mod.handles = handles

    def api(fn):
        def wrapper(*args):
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            if fn.__name__ not in {"nvmlInit", "nvmlShutdown"} and not state["initialized"]:
                raise real.NVMLError_Uninitialized()
            if args and isinstance(args[0], FakeHandle):
                gpu = by_handle[id(args[0])]
                if gpu.lost:
                    raise real.NVMLError_GpuIsLost()
                if fn.__name__ in gpu.unsupported:
                    raise real.NVMLError_NotSupported()
                return fn(gpu, *args[1:])
            return fn(*args)

        wrapper.__name__ = fn.__name__
        setattr(mod, fn.__name__, wrapper)
        return wrapper

    @api
    def nvmlInit():
        if init_error:
            raise getattr(real, init_error)()
        state["initialized"] = True

    @api
    def nvmlShutdown():
        state["initialized"] = False

    @api
    def nvmlDeviceGetCount():
        return len(gpus)

    @api
    def nvmlDeviceGetHandleByIndex(index):
        if not 0 <= index < len(handles):
            raise real.NVMLError_InvalidArgument()
        return handles[index]

    @api
    def nvmlDeviceGetIndex(gpu):
        return gpu.index

    @api
    def nvmlDeviceGetUUID(gpu):
        return gpu.uuid or f"GPU-fake-{gpu.index}"

    @api
    def nvmlDeviceGetName(gpu):
        if isinstance(gpu, FakeMigHandle):  # NVML names a MIG device "<model> MIG <profile>"
            return f"{gpu.gpu.name} MIG {gpu.gpu.mig[gpu.slot][1]}"
        return gpu.name

    @api
    def nvmlSystemGetDriverVersion():
        if driver_version is None:
            raise real.NVMLError_NotSupported()
        return driver_version

    @api
    def nvmlDeviceGetPciInfo(gpu):
        bus_id = gpu.pci_bus_id or f"00000000:{0x18 + gpu.index:02X}:00.0"
        return types.SimpleNamespace(busId=bus_id.encode(), busIdLegacy=bus_id[4:].encode())

    @api
    def nvmlDeviceGetClockInfo(gpu, clock_type):
        if clock_type == real.NVML_CLOCK_SM:
            return gpu.sm_clock
        if clock_type == real.NVML_CLOCK_MEM:
            return gpu.mem_clock
        raise real.NVMLError_InvalidArgument()

    @api
    def nvmlDeviceGetTotalEnergyConsumption(gpu):
        return gpu.energy_mj

    @api
    def nvmlDeviceGetEncoderUtilization(gpu):
        return [gpu.enc_util, 167_000]  # [%, sampling period in µs]

    @api
    def nvmlDeviceGetDecoderUtilization(gpu):
        return [gpu.dec_util, 167_000]

    @api
    def nvmlDeviceGetFieldValues(gpu, field_ids):
        out = []
        for field_id in field_ids:
            known = field_id == real.NVML_FI_DEV_MEMORY_TEMP and gpu.memory_temp is not None
            out.append(
                types.SimpleNamespace(
                    fieldId=field_id,
                    nvmlReturn=real.NVML_SUCCESS if known else real.NVML_ERROR_NOT_SUPPORTED,
                    valueType=real.NVML_VALUE_TYPE_UNSIGNED_INT,
                    value=types.SimpleNamespace(uiVal=gpu.memory_temp if known else 0),
                )
            )
        return out

    @api
    def nvmlDeviceGetMigMode(gpu):
        mode = real.NVML_DEVICE_MIG_ENABLE if gpu.mig else real.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    @api
    def nvmlDeviceGetMaxMigDeviceCount(gpu):
        return 7

    @api
    def nvmlDeviceGetMigDeviceHandleByIndex(gpu, slot):
        if slot >= len(gpu.mig):
            raise real.NVMLError_NotFound()
        return FakeMigHandle(gpu, slot)

    @api
    def nvmlDeviceGetGpuInstanceId(mig):
        return mig.gpu.mig[mig.slot][0]

    @api
    def nvmlDeviceGetTemperature(gpu, sensor):
        assert sensor == real.NVML_TEMPERATURE_GPU
        return gpu.temperature

    @api
    def nvmlDeviceGetTemperatureThreshold(gpu, threshold):
        if threshold == real.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return gpu.slowdown
        if threshold == real.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
            return gpu.shutdown
        raise real.NVMLError_InvalidArgument()

    @api
    def nvmlDeviceGetPowerUsage(gpu):
        return gpu.power_mw

    @api
    def nvmlDeviceGetEnforcedPowerLimit(gpu):
        return gpu.limit_mw

    @api
    def nvmlDeviceGetUtilizationRates(gpu):
        return types.SimpleNamespace(gpu=gpu.util, memory=gpu.mem_util)

    @api
    def nvmlDeviceGetMemoryInfo(gpu, version=None):
        if isinstance(gpu, FakeMigHandle):
            _, _, used, total = gpu.gpu.mig[gpu.slot]
            return types.SimpleNamespace(total=total, used=used, free=total - used)
        free = gpu.mem_total - gpu.mem_used
        if version:  # version 2: "used" without the reserved memory
            assert version == real.nvmlMemory_v2
            used = gpu.mem_used - gpu.mem_reserved
            return types.SimpleNamespace(
                version=version,
                total=gpu.mem_total,
                reserved=gpu.mem_reserved,
                free=free,
                used=used,
            )
        return types.SimpleNamespace(total=gpu.mem_total, used=gpu.mem_used, free=free)

    @api
    def nvmlDeviceGetTotalEccErrors(gpu, error_type, counter_type):
        return gpu.ecc.get((error_type, counter_type), 0)

    @api
    def nvmlDeviceGetRemappedRows(gpu):
        return gpu.rows

    @api
    def nvmlDeviceGetPcieReplayCounter(gpu):
        return gpu.pcie_replay

    if clocks_event_reasons:

        @api
        def nvmlDeviceGetCurrentClocksEventReasons(gpu):
            return gpu.reasons

    @api
    def nvmlDeviceGetCurrentClocksThrottleReasons(gpu):
        return gpu.reasons

    @api
    def nvmlDeviceGetNvLinkErrorCounter(gpu, link, counter):
        if link >= gpu.nvlink_links:
            raise real.NVMLError_NotSupported()
        return gpu.nvlink.get((link, counter), 0)

    @api
    def nvmlEventSetCreate():
        state["event_sets"] += 1
        return object()

    @api
    def nvmlDeviceRegisterEvents(gpu, event_types, event_set):
        state["registered"].append((gpu.index, event_types))

    @api
    def nvmlEventSetWait_v2(event_set, timeoutms):
        try:
            return events.get(timeout=timeoutms / 1000)
        except queue.Empty:
            raise real.NVMLError_Timeout() from None

    @api
    def nvmlEventSetFree(event_set):
        state["freed"] += 1

    def push_xid(index: int, xid: int) -> None:
        events.put(FakeEventData(handles[index], real.nvmlEventTypeXidCriticalError, xid))

    mod.push_xid = push_xid
    return mod


# ---------------------------------------------------------------------------------------
# report receiver
# ---------------------------------------------------------------------------------------
class Receiver:
    """A real HTTP endpoint for ``POST /api/v1/ingest/report`` (unit-test stand-in).

    ``fail_with`` makes it answer that status (e.g. 503, 429, 403) instead of storing.

    It also stands in for the server's credential endpoints, signing with ``authority``:
    ``GET /api/v1/credentials/public-keys``, ``POST /api/v1/agent/peer-certificate``
    (for the node of the token, see :meth:`token_for`), ``GET /api/v1/agent/peers`` and
    ``GET /api/v1/agent/jobs/{job}`` (the jobs of :meth:`register_job`; with ``open_jobs``,
    an unregistered job answers every certified node, no layout).
    """

    def __init__(
        self, port: int = 0, token: str = TOKEN, authority: TestAuthority = AUTHORITY
    ) -> None:
        self.token = token
        self.authority = authority
        self.lock = threading.Lock()
        self.batches: list[ReportBatch] = []  # stored, in arrival order
        self.keys: set[tuple[str, int]] = set()
        self.attempts = 0
        self.fail_with: int | None = None
        self.retry_after: str | None = None
        self.commands: list[dict[str, Any]] = []
        self.node_tokens: dict[str, str] = {}  # token -> node
        self.certificates: dict[str, dict[str, Any]] = {}  # node -> {url, certificate}
        self.jobs: dict[str, dict[str, Any]] = {}
        self.open_jobs = True
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, payload: Any, headers: dict | None = None) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _node(self) -> str | None:
                header = self.headers.get("Authorization", "")
                return receiver.node_tokens.get(header.removeprefix("Bearer "))

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                url = urlsplit(self.path)
                if url.path == "/api/v1/credentials/public-keys":
                    return self._answer(200, receiver.authority.jwks())
                node = self._node()
                if url.path == "/api/v1/agent/peers" and node:
                    wanted = parse_qs(url.query).get("node", [])
                    with receiver.lock:
                        peers = [
                            {"node": n, **receiver.certificates[n]}
                            for n in wanted
                            if n in receiver.certificates
                        ]
                    return self._answer(200, {"peers": peers})
                if url.path.startswith("/api/v1/agent/jobs/") and node:
                    job = url.path.rsplit("/", 1)[1]
                    with receiver.lock:
                        j = receiver.jobs.get(job)
                        if j is None and receiver.open_jobs:
                            j = {"nodes": sorted(receiver.certificates), "layout": None}
                    if j is None:
                        return self._answer(404, {"detail": f"job {job} is not registered"})
                    if node not in j["nodes"]:
                        return self._answer(403, {"detail": f"{node} is not a node of {job}"})
                    key = b64url(receiver.authority.manifest_key(job))
                    return self._answer(
                        200, {"job_id": job, "world_size": None, "manifest_key": key, **j}
                    )
                return self._answer(404, {"detail": "not found"})

            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/api/v1/agent/peer-certificate":
                    node = self._node()
                    if node is None:
                        return self._answer(401, {"detail": "not an agent token"})
                    got = json.loads(body)
                    cert = receiver.authority.node_certificate(node, got["url"], got["public_key"])
                    with receiver.lock:
                        receiver.certificates[node] = {"url": got["url"], "certificate": cert}
                    return self._answer(200, {"node": node, "url": got["url"], "certificate": cert})
                with receiver.lock:
                    receiver.attempts += 1
                    fail, retry_after = receiver.fail_with, receiver.retry_after
                if self.path != "/api/v1/ingest/report":
                    return self._answer(404, {"detail": "not found"})
                if (
                    self.headers.get("Authorization") != f"Bearer {receiver.token}"
                    and not self._node()
                ):
                    return self._answer(401, {"detail": "missing or invalid token"})
                if fail is not None:
                    headers = {"Retry-After": retry_after} if retry_after else None
                    return self._answer(fail, {"detail": f"stand-in says {fail}"}, headers)
                try:
                    batch = ReportBatch.model_validate_json(body)
                except ValidationError as exc:
                    return self._answer(422, {"detail": str(exc)})
                with receiver.lock:
                    key = (batch.epoch, batch.seq)
                    stored = key not in receiver.keys
                    if stored:
                        receiver.keys.add(key)
                        receiver.batches.append(batch)
                    acked = max(s for e, s in receiver.keys if e == batch.epoch)
                    commands, receiver.commands = receiver.commands, []
                ack = ReportAck(
                    epoch=batch.epoch, acked_seq=acked, stored=stored, commands=commands
                )
                return self._answer(200, ack.model_dump(mode="json"))

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()
        self._stopped = False

    def token_for(self, node: str) -> str:
        """An agent token bound to ``node`` (as ``tierwatch-server token create --role agent
        --node NODE`` makes one)."""
        token = f"{self.token}-{node}"
        self.node_tokens[token] = node
        return token

    def register_job(self, job_id: str, nodes: list[str], layout: list[str] | None = None) -> None:
        """What ``POST /api/v1/jobs/{job_id}/credential`` pins: the job's nodes (and layout)."""
        with self.lock:
            self.jobs[job_id] = {"nodes": sorted(set(nodes)), "layout": layout}

    def stored(self) -> list[ReportBatch]:
        with self.lock:
            return list(self.batches)

    def stop(self) -> None:
        """Stop serving (a second call does nothing)."""
        if self._stopped:
            return
        self._stopped = True
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


# ---------------------------------------------------------------------------------------
# Prometheus text
# ---------------------------------------------------------------------------------------
_SERIES_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_series(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The sample lines of a Prometheus text exposition as ``(name, labels, value)``, names
    exactly as written (prometheus_client's parser renames counter samples ``<name>_total``).
    """
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SERIES_RE.match(line)
        assert m, f"not a sample line: {line!r}"
        labels = {
            k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL_RE.findall(m[2] or "")
        }
        out.append((m[1], labels, float(m[3])))
    return out

"""Ingest benchmark: 2,500 simulated nodes x 8 GPUs (20,000 GPUs) reporting to a real
tierwatch-server running 2 worker processes (``serve --workers 2``).

Run ``.venv/bin/python bench/ingest.py`` (60 s of load) or ``BENCH_QUICK=1 ...`` (15 s).

What it does, in order:

1. Creates a fresh PostgreSQL database ``tierwatch_bench`` on 127.0.0.1:5432 (user postgres,
   trust auth; dropped first if it exists), or uses ``TIERWATCH_BENCH_DATABASE_URL``;
   migrates it and creates 2,500 agent tokens (``node-0000`` ... ``node-2499``) and one
   viewer token through ``tierwatch.server.tokens.create_token``.
2. Starts ``tierwatch-server serve --no-migrate --workers 2`` on an ephemeral loopback port
   (``BENCH_WORKERS`` changes the count; server CPU is summed over its processes).
3. In a separate load process (asyncio + one ``aiohttp.ClientSession`` connection pool; it
   shares the cores with the server, so it is kept cheap: aiohttp costs several times less
   CPU per request than httpx.AsyncClient, report bodies come from per-node JSON templates
   (checked byte for byte against json.dumps at start-up) and headers are built once):

   * warm-up: every node sends one batch (seq 1) so nodes and GPUs exist; not counted;
   * peer (a): the ingest load shape against ``GET /healthz`` (framework + network floor);
   * settle: 30 s of the ingest load, not measured (the latest-value tables past their
     first fill, so database growth is the steady state's);
   * ingest: every node reports every 10 s, phases spread evenly (250 reports/s, 2,000
     GPU samples/s), open loop: each request goes out at its scheduled time whatever the
     backlog, and latency is measured both from the scheduled time and from the moment the
     request headers hit the socket, so a saturated server shows up as a falling achieved
     rate and growing latency (no coordinated omission).

   Meanwhile reader threads in this process time the read endpoints at realistic rates: the
   cluster page as 5 open dashboards poll it (``GET /`` with ``HX-Request: true``, each every
   2 s, staggered), a full-page ``GET /`` every 15 s, and
   ``GET /api/v1/nodes`` every 10 s (automation polling at the report interval; its first
   page, 500 nodes, the API's default page size).
4. Measures server CPU (``/proc/<pid>/stat``), PostgreSQL CPU, database growth
   (``pg_database_size``, ``gpu_samples`` rows), the cost of pruning half of the run's
   samples (``fleet.service.prune``) and, as peer (b), a raw psycopg ``executemany`` of the
   same sample rows into ``gpu_samples`` (the database floor).
5. Prints a table and writes its block into the "Ingest (bench/ingest.py)" section of
   docs/benchmarks.md, dropping blocks that measured other server or bench code.

The server, PostgreSQL and the load process share the machine's cores; the table says how
many. ``BENCH_KEEP_DB=1`` keeps the database; ``BENCH_CONNECTIONS`` sets the client pool
size (default 128).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import hashlib
import json
import multiprocessing as mp
import os
import platform
import queue
import random
import re
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psycopg
from rich.console import Console
from rich.table import Table

from tierwatch.agent.netutil import free_port
from tierwatch.agent.protocol import GPU_METRICS, GpuSample, ReportBatch
from tierwatch.agent.sampling import SampleGate
from tierwatch.server.fleet.cluster_live import VERSION_HEADER as CLUSTER_VERSION_HEADER

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION_TITLE = "## Ingest (bench/ingest.py)"

QUICK = os.environ.get("BENCH_QUICK") == "1"
KEEP_DB = os.environ.get("BENCH_KEEP_DB") == "1"
DURATION_S = 15.0 if QUICK else 60.0  # ingest phase (s)
HEALTHZ_S = 5.0 if QUICK else 10.0  # peer (a) phase (s)
# The same load, not measured, right before the ingest phase: the latest-value rows (nodes,
# gpus) have each been rewritten a few times, so their growth is the steady state's, not the
# first fill of the free space that fillfactor 50 leaves in their pages.
SETTLE_S = 5.0 if QUICK else 30.0
NODES = int(os.environ.get("BENCH_NODES", "2500"))
WORKERS = int(os.environ.get("BENCH_WORKERS", "2"))
# as the agent's --full-sample-every: full samples every N reports, heartbeats between unless
# a health reading changed (agent.sampling.SampleGate decides, on the simulated readings)
FULL_SAMPLE_EVERY = int(os.environ.get("BENCH_FULL_SAMPLE_EVERY", "6"))
GPUS_PER_NODE = 8
INTERVAL_S = 10.0  # each node reports every 10 s
RATE = NODES / INTERVAL_S  # offered reports/s
CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "128"))
WARMUP_CONCURRENCY = 32
WARMUP_ATTEMPTS = 3  # a warm-up report that fails is resent (same batch) up to this many times
WARMUP_MAX_FAILURES = 64  # after this many failed warm-up attempts the run stops
MAX_IN_FLIGHT = 4096  # past this the load process drops (and counts) a scheduled request
REQUEST_TIMEOUT_S = 30.0
DRAIN_S = 30.0  # after the schedule ends, wait at most this long for answers
# Reader cadence under load: one person with the dashboard open (its cluster page polls the
# htmx fragment; a full page load now and then) and one automation polling the nodes API at
# the agents' report interval.
CLUSTER_POLL_S = 2.0
DASHBOARDS = 5  # people with the cluster page open, each polling every CLUSTER_POLL_S
FULL_PAGE_EVERY_S = 15.0
NODES_API_EVERY_S = 10.0
FLOOR_REPORTS = 1500  # DB floor: 8-row transactions per round (bounded by FLOOR_ROUND_S too)
FLOOR_ROUND_S = 10.0
FLOOR_ROUNDS = 3
FLOOR_BULK_ROWS = 2048  # DB floor, bulk variant: rows per commit
FLOOR_BULK_COMMITS = 8
MIN_REPORTS_FOR_CPU = 100  # below this many stored reports, CPU per report is not quoted
TARGET_P99_MS = 100.0  # from send (issue 14)
TARGET_CPU_MS_PER_REPORT = 1.0
TARGET_PAGE_P95_MS = 300.0
TARGET_SCRAPE_MS = 1000.0
TARGET_GROWTH_BYTES_PER_H = 300 * 1024**2

ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
DB_NAME = "tierwatch_bench"
DEFAULT_DB_URL = f"postgresql+psycopg://postgres@127.0.0.1:5432/{DB_NAME}"

# Non-fatal XIDs that show up on healthy training fleets (application faults, MMU faults,
# preemptive channel removal, DRAM page retirement, contained errors), with weights.
XID_CODES = (13, 31, 43, 45, 63, 94)
XID_WEIGHTS = (4, 4, 2, 2, 1, 1)
XID_PER_REPORT = 0.002  # about one report in 500 carries an XID
GPU_MODEL = "NVIDIA H100 80GB HBM3"
MEMORY_TOTAL_MIB = 81559.0
POWER_LIMIT_W = 700.0
THROTTLE_SW_POWER_CAP = 0x4


# --- simulated nodes ---------------------------------------------------------------------------


def _clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


@dataclass
class GpuState:
    """One simulated GPU: a random walk of plausible H100 telemetry and cumulative counters."""

    uuid: str
    temperature_c: float
    utilization_pct: float
    memory_used_mib: float
    ecc_sbe: int = 0
    ecc_sbe_aggregate: int = 0
    remapped_rows_correctable: int = 0
    pcie_replay_count: int = 0
    nvlink_crc_errors: int = 0
    nvlink_replay_errors: int = 0


# One GpuSample as JSON, in ``NodeSim.read``'s key order; ``%r`` of a float is what json.dumps
# writes. ``check_batch_shape`` checks that the template and json.dumps give the same bytes.
SAMPLE_JSON = (
    '{"index":%d,"ts":"%s","temperature_c":%r,"slowdown_temp_c":90.0,"shutdown_temp_c":95.0,'
    '"power_w":%r,"power_limit_w":' + repr(POWER_LIMIT_W) + ',"utilization_pct":%r,'
    '"memory_used_mib":%r,"memory_total_mib":' + repr(MEMORY_TOTAL_MIB) + ","
    '"ecc_sbe_volatile":%d,"ecc_dbe_volatile":0,"ecc_sbe_aggregate":%d,"ecc_dbe_aggregate":0,'
    '"remapped_rows_correctable":%d,"remapped_rows_uncorrectable":0,"row_remap_pending":false,'
    '"row_remap_failure":false,"pcie_replay_count":%d,"throttle_reasons":%d,'
    '"nvlink_crc_errors":%d,"nvlink_replay_errors":%d,"nvlink_recovery_errors":0}'
)


class NodeSim:
    """A simulated 8-GPU node: readings as wire-shaped dicts and as JSON report batches.

    Values evolve per reading from a per-node seeded RNG: utilization 60-100 %, temperature
    35-80 °C (slowdown at 90 °C), power 80-700 W following utilization, memory 20-80 GiB,
    rare single-bit ECC / PCIe replay / NVLink CRC increments, the SW power-cap clock reason
    near the power limit, and an XID in about one report in 500.

    ``batch`` writes the body from string templates (the parts that never change are JSON
    built once per node); ``batch_reference`` builds the same bytes with json.dumps of a dict,
    and serves as the check of the templates.
    """

    def __init__(self, index: int, epoch: str) -> None:
        self.name = f"node-{index:04d}"
        self.epoch = epoch
        self.gate = SampleGate(full_every=FULL_SAMPLE_EVERY)
        self.rng = random.Random(index)
        self.gpus = [
            GpuState(
                uuid="GPU-" + str(uuid.UUID(int=self.rng.getrandbits(128))),
                temperature_c=self.rng.uniform(45, 65),
                utilization_pct=self.rng.uniform(75, 100),
                memory_used_mib=self.rng.uniform(40000, 76000),
            )
            for _ in range(GPUS_PER_NODE)
        ]
        # The JSON of a placeholder body, cut around seq, sent_at and the samples list.
        text = self._envelope(0, "\x00", [], [])
        head, rest = text.split('"seq":0,"sent_at":"\\u0000"', 1)
        middle, tail = rest.split('"samples":[]', 1)
        self._head = head + '"seq":'
        self._middle = ',"sent_at":"'
        self._samples_open = '"' + middle + '"samples":['
        self._tail = "]" + tail

    def _envelope(
        self,
        seq: int,
        sent_at: str,
        samples: list[dict[str, Any]],
        xids: list[dict[str, Any]],
    ) -> str:
        body = {
            "protocol": 1,
            "node": self.name,
            "epoch": self.epoch,
            "seq": seq,
            "sent_at": sent_at,
            "agent_version": "0.1.0",
            "collector": "simulated",
            "simulated": True,
            "interval_s": INTERVAL_S,
            "sample_every": FULL_SAMPLE_EVERY,
            "gpus": [
                {
                    "index": i,
                    "uuid": g.uuid,
                    "name": GPU_MODEL,
                    "memory_total_mib": MEMORY_TOTAL_MIB,
                }
                for i, g in enumerate(self.gpus)
            ],
            "samples": samples,
            "xids": xids,
            "latency": [],
            "events": [],
            "dropped_batches": 0,
        }
        return json.dumps(body, separators=(",", ":"))

    def _advance(self) -> list[tuple[Any, ...]]:
        """Step every GPU's random walk once: the values that change, in SAMPLE_JSON order."""
        rng = self.rng
        out = []
        for i, g in enumerate(self.gpus):
            g.utilization_pct = _clamp(g.utilization_pct + rng.gauss(0, 3), 60, 100)
            g.temperature_c = _clamp(
                g.temperature_c + rng.gauss(0, 0.8) + (g.utilization_pct - 85) * 0.02, 35, 80
            )
            g.memory_used_mib = _clamp(g.memory_used_mib + rng.gauss(0, 300), 20000, 80000)
            power = _clamp(120 + g.utilization_pct * 5.6 + rng.gauss(0, 15), 80, POWER_LIMIT_W)
            if rng.random() < 0.002:
                g.ecc_sbe += 1
                g.ecc_sbe_aggregate += 1
            if rng.random() < 0.0002:
                g.remapped_rows_correctable += 1
            if rng.random() < 0.001:
                g.pcie_replay_count += 1
            if rng.random() < 0.0005:
                g.nvlink_crc_errors += 1
                g.nvlink_replay_errors += 1
            out.append(
                (
                    i,
                    round(g.temperature_c, 1),
                    round(power, 1),
                    round(g.utilization_pct, 1),
                    round(g.memory_used_mib, 1),
                    g.ecc_sbe,
                    g.ecc_sbe_aggregate,
                    g.remapped_rows_correctable,
                    g.pcie_replay_count,
                    THROTTLE_SW_POWER_CAP if power >= 690 else 0,
                    g.nvlink_crc_errors,
                    g.nvlink_replay_errors,
                )
            )
        return out

    def read(self, ts: datetime) -> list[dict[str, Any]]:
        """One sample per GPU at ``ts``: every ``GpuSample`` field set (ts as datetime)."""
        return [
            {
                "index": i,
                "ts": ts,
                "temperature_c": temp,
                "slowdown_temp_c": 90.0,
                "shutdown_temp_c": 95.0,
                "power_w": power,
                "power_limit_w": POWER_LIMIT_W,
                "utilization_pct": util,
                "memory_used_mib": mem,
                "memory_total_mib": MEMORY_TOTAL_MIB,
                "ecc_sbe_volatile": sbe,
                "ecc_dbe_volatile": 0,
                "ecc_sbe_aggregate": sbe_agg,
                "ecc_dbe_aggregate": 0,
                "remapped_rows_correctable": remapped,
                "remapped_rows_uncorrectable": 0,
                "row_remap_pending": False,
                "row_remap_failure": False,
                "pcie_replay_count": replay,
                "throttle_reasons": throttle,
                "nvlink_crc_errors": crc,
                "nvlink_replay_errors": nvl_replay,
                "nvlink_recovery_errors": 0,
            }
            for (i, temp, power, util, mem, sbe, sbe_agg, remapped, replay, throttle, crc,
                 nvl_replay) in self._advance()
        ]  # fmt: skip

    def _xids(self, read_at: str) -> list[dict[str, Any]]:
        if self.rng.random() >= XID_PER_REPORT:
            return []
        gpu = self.rng.randrange(GPUS_PER_NODE)
        code = self.rng.choices(XID_CODES, XID_WEIGHTS)[0]
        return [
            {
                "gpu": gpu,
                "xid": code,
                "ts": read_at,
                "message": f"NVRM: Xid (PCI:0000:{0x18 + gpu * 0x10:02x}:00): {code}, "
                f"pid={self.rng.randrange(1000, 99999)}, name=python3",
            }
        ]

    def batch(self, seq: int, sent_at: datetime) -> bytes:
        """The JSON body of one report (``ReportBatch`` shape) sent at ``sent_at``."""
        read_at = (sent_at - timedelta(milliseconds=150)).isoformat()
        values = self._advance()
        readings = [
            GpuSample.model_construct(
                index=v[0], temperature_c=v[1], slowdown_temp_c=90.0, shutdown_temp_c=95.0,
                ecc_sbe_volatile=v[5], ecc_dbe_volatile=0, ecc_sbe_aggregate=v[6],
                ecc_dbe_aggregate=0, remapped_rows_correctable=v[7],
                remapped_rows_uncorrectable=0, row_remap_pending=False, row_remap_failure=False,
                pcie_replay_count=v[8], throttle_reasons=v[9], nvlink_crc_errors=v[10],
                nvlink_replay_errors=v[11], nvlink_recovery_errors=0,
            )
            for v in values
        ]  # fmt: skip
        samples = (
            ",".join(SAMPLE_JSON % (v[0], read_at, *v[1:]) for v in values)
            if self.gate.admit(readings)
            else ""
        )
        xids = self._xids(read_at)
        tail = self._tail
        if xids:
            tail = tail.replace('"xids":[]', '"xids":' + json.dumps(xids, separators=(",", ":")))
        return (
            f"{self._head}{seq}{self._middle}{sent_at.isoformat()}"
            f"{self._samples_open}{samples}{tail}"
        ).encode()

    def batch_reference(self, seq: int, sent_at: datetime) -> bytes:
        """``batch`` built with json.dumps of the whole dict (the slow, obviously right way)."""
        read_at = sent_at - timedelta(milliseconds=150)
        samples = self.read(read_at)
        if not self.gate.admit([GpuSample(**s) for s in samples]):
            samples = []
        for s in samples:
            s["ts"] = read_at.isoformat()
        xids = self._xids(read_at.isoformat())
        return self._envelope(seq, sent_at.isoformat(), samples, xids).encode()


def check_batch_shape(epoch: str) -> int:
    """Validate generated bodies against ``ReportBatch``; returns the size of one in bytes.

    The template-built body must be byte for byte the json.dumps one (same RNG seed), over
    enough reports that XIDs and counter increments show up too.

    Raises:
        AssertionError: a sample field is missing or None (the bench promises all fields), or
            the templates drifted from json.dumps.
    """
    fast, ref = NodeSim(0, epoch), NodeSim(0, epoch)
    now = datetime.now(UTC)
    xids = 0
    for seq in range(1, 2001):
        sent_at = now + timedelta(seconds=INTERVAL_S * seq)
        body = fast.batch(seq, sent_at)
        assert body == ref.batch_reference(seq, sent_at), f"template drifted at seq {seq}"
        xids += b'"xids":[]' not in body
    assert xids, "no XID in 2,000 reports: the XID path of the template went unchecked"
    body = NodeSim(0, epoch).batch(1, now)
    batch = ReportBatch.model_validate_json(body)
    assert len(batch.samples) == GPUS_PER_NODE
    for s in batch.samples:
        missing = [k for k, v in s.model_dump().items() if v is None]
        assert not missing, f"sample fields left None: {missing}"
    return len(body)


# --- load process ------------------------------------------------------------------------------


@dataclass
class PhaseResult:
    """What one open-loop phase saw (times in seconds, monotonic clock of the load process)."""

    name: str
    offered: int = 0
    duration_s: float = 0.0
    dropped_backlog: int = 0  # not sent: MAX_IN_FLIGHT requests were already waiting
    unfinished: int = 0  # no answer within DRAIN_S after the schedule ended
    ok_in_window: int = 0  # 2xx answers that arrived before the schedule ended
    statuses: Counter[str] = field(default_factory=Counter)
    lat_sched_ms: list[float] = field(default_factory=list)  # 2xx: from scheduled time
    lat_send_ms: list[float] = field(default_factory=list)  # 2xx: from request headers sent
    sched_lag_ms: list[float] = field(default_factory=list)  # task start - scheduled time
    peak_in_flight: int = 0  # most requests scheduled but not yet answered at once
    not_stored: int = 0  # ingest acks with stored=false (would be a bench bug)
    error_samples: dict[str, str] = field(default_factory=dict)  # first detail per status
    load_cpu_s: float = 0.0  # CPU of the load process during the phase
    wall_s: float = 0.0  # schedule + drain


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an exception and of its causes (what the HTTP client wraps)."""
    parts = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 4:
        parts.append(f"{type(seen).__name__}: {seen}".strip())
        seen = seen.__cause__ or seen.__context__
    return " <- ".join(parts)[:400]


def _cpu_self_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# What a failed aiohttp request raises: its own errors, and TimeoutError (the socket read
# and connect timeouts are aiohttp.ServerTimeoutError, a subclass of both).
CLIENT_ERRORS = (aiohttp.ClientError, TimeoutError)


async def _note_headers_sent(
    _session: aiohttp.ClientSession, ctx: Any, _params: aiohttp.TraceRequestHeadersSentParams
) -> None:
    """aiohttp trace hook: the request's headers went to the socket; note when."""
    sent = ctx.trace_request_ctx
    if sent is not None:
        sent[0] = time.monotonic()


def _client_session(url: str) -> aiohttp.ClientSession:
    """The load process's one aiohttp session: ``CONNECTIONS`` keep-alive connections.

    Idle connections are closed after 4 s, before the server's 5 s keep-alive timeout
    (uvicorn's default) would close them under a request. Per request: 30 s to connect and
    30 s between reads, as with the httpx client before.
    """
    trace = aiohttp.TraceConfig()
    trace.on_request_headers_sent.append(_note_headers_sent)
    return aiohttp.ClientSession(
        base_url=url,
        connector=aiohttp.TCPConnector(limit=CONNECTIONS, keepalive_timeout=4.0),
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=REQUEST_TIMEOUT_S, sock_read=REQUEST_TIMEOUT_S
        ),
        trace_configs=[trace],
    )


async def _open_loop(
    name: str,
    duration_s: float,
    send: Any,
) -> PhaseResult:
    """Send ``duration_s * RATE`` requests at evenly spaced scheduled times (open loop).

    ``await send(j, sent)`` issues request number ``j`` and returns ``(status, body)`` once
    the whole answer is read; ``sent`` is a one-item list it sets to ``time.monotonic()``
    when the request headers are written (the aiohttp trace hook does that).
    """
    res = PhaseResult(name=name, offered=int(duration_s * RATE), duration_s=duration_s)
    dt = 1.0 / RATE
    tasks: set[asyncio.Task[None]] = set()
    slots = asyncio.Semaphore(CONNECTIONS)
    cpu0 = _cpu_self_s()
    t0 = time.monotonic() + 0.2
    window_end = t0 + res.offered * dt

    async def one(j: int, scheduled: float) -> None:
        start = time.monotonic()
        res.sched_lag_ms.append((start - scheduled) * 1000)
        sent = [start]
        try:
            # Wait for a connection here (a plain semaphore), not in the client's pool.
            async with slots:
                status, content = await send(j, sent)
        except CLIENT_ERRORS as exc:
            res.statuses[type(exc).__name__] += 1
            res.error_samples.setdefault(type(exc).__name__, describe_error(exc))
            return
        end = time.monotonic()
        res.statuses[str(status)] += 1
        if status >= 300:
            res.error_samples.setdefault(str(status), content[:400].decode(errors="replace"))
        if 200 <= status < 300:
            if end <= window_end:
                res.ok_in_window += 1
            res.lat_sched_ms.append((end - scheduled) * 1000)
            res.lat_send_ms.append((end - sent[0]) * 1000)
            if name == "ingest" and not json.loads(content).get("stored", False):
                res.not_stored += 1

    for j in range(res.offered):
        scheduled = t0 + j * dt
        delay = scheduled - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= MAX_IN_FLIGHT:
            res.dropped_backlog += 1
            continue
        task = asyncio.create_task(one(j, scheduled))
        tasks.add(task)
        res.peak_in_flight = max(res.peak_in_flight, len(tasks))
        task.add_done_callback(tasks.discard)
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=DRAIN_S)
        res.unfinished = len(pending)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    res.wall_s = time.monotonic() - t0
    res.load_cpu_s = _cpu_self_s() - cpu0
    return res


async def _load_main(spec: dict[str, Any], started: Any) -> dict[str, Any]:
    sims = [NodeSim(i, spec["epochs"][i]) for i in range(NODES)]
    # Built once per node; aiohttp only merges them with its defaults per request.
    headers = [
        {"Authorization": f"Bearer {t}", "Content-Type": "application/json"} for t in spec["tokens"]
    ]
    seqs = list(spec.get("seqs") or [spec["first_seq"]] * NODES)
    async with _client_session(spec["url"]) as client:
        if spec["phase"] == "warmup":
            sem = asyncio.Semaphore(WARMUP_CONCURRENCY)
            statuses: Counter[str] = Counter()  # final outcome per node
            retried: Counter[str] = Counter()  # failed attempts that were retried
            details: dict[str, str] = {}

            async def first(i: int) -> None:
                body = sims[i].batch(1, datetime.now(UTC))  # a retry resends the same batch
                async with sem:
                    for attempt in range(WARMUP_ATTEMPTS):
                        failed = sum(retried.values()) + sum(
                            v for k, v in statuses.items() if k != "200"
                        )
                        if failed > WARMUP_MAX_FAILURES:
                            statuses["skipped"] += 1  # the server is failing: stop early
                            return
                        try:
                            async with client.post(
                                "/api/v1/ingest/report", data=body, headers=headers[i]
                            ) as r:
                                text = await r.text()
                            outcome = str(r.status)
                            if r.status >= 300:
                                details.setdefault(outcome, text[:400])
                        except CLIENT_ERRORS as exc:
                            outcome = type(exc).__name__
                            details.setdefault(outcome, describe_error(exc))
                        if outcome == "200" or attempt == WARMUP_ATTEMPTS - 1:
                            statuses[outcome] += 1
                            return
                        retried[outcome] += 1

            t = time.monotonic()
            await asyncio.gather(*(first(i) for i in range(NODES)))
            return {
                "statuses": dict(statuses),
                "retried": dict(retried),
                "details": details,
                "wall_s": time.monotonic() - t,
            }

        if spec["phase"] == "healthz":

            async def send(j: int, sent: list[float]) -> tuple[int, bytes]:
                async with client.get(
                    "/healthz", headers=headers[j % NODES], trace_request_ctx=sent
                ) as r:
                    return r.status, await r.read()

        else:

            async def send(j: int, sent: list[float]) -> tuple[int, bytes]:
                i = j % NODES
                seq = seqs[i]
                seqs[i] += 1
                body = sims[i].batch(seq, datetime.now(UTC))
                async with client.post(
                    "/api/v1/ingest/report", data=body, headers=headers[i], trace_request_ctx=sent
                ) as r:
                    return r.status, await r.read()

        started.set()
        res = await _open_loop(spec["phase"], spec["duration_s"], send)
        out = dict(res.__dict__)
        out["statuses"] = dict(res.statuses)
        out["seqs"] = seqs  # each node's next seq (a later phase goes on from there)
        return out


def load_process(spec: dict[str, Any], results: Any, started: Any) -> None:
    """Entry point of the load process: run one phase, put its result dict on ``results``."""
    # If the phase overruns, dump every thread's stack to stderr to show where it is stuck.
    faulthandler.dump_traceback_later(spec.get("duration_s", 300) + DRAIN_S + 120, exit=False)
    try:
        results.put(asyncio.run(_load_main(spec, started)))
    except BaseException as exc:  # reported by the parent, which fails the run
        results.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def run_phase(ctx: Any, spec: dict[str, Any], on_start: Any = None) -> dict[str, Any]:
    """Run one load phase in a fresh process; ``on_start()`` is called when its clock starts.

    Raises:
        RuntimeError: the load process failed or did not answer in time.
    """
    results = ctx.Queue()
    started = ctx.Event()
    proc = ctx.Process(target=load_process, args=(spec, results, started), name="bench-load")
    proc.start()
    try:
        if on_start is not None:
            if not started.wait(120):
                raise RuntimeError("load process did not start its schedule within 120 s")
            on_start()
        limit = spec.get("duration_s", 300) + DRAIN_S + 240
        try:
            out = results.get(timeout=limit)
        except queue.Empty as exc:
            raise RuntimeError(f"load process gave no result within {limit:.0f} s") from exc
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    if "error" in out:
        raise RuntimeError(f"load process failed: {out['error']}")
    return out


# --- measurements in this process --------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int, children: bool = False) -> float:
    """utime+stime (and reaped children's, when asked) of a process from /proc, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is field 3 (state); utime/stime are fields 14/15, cutime/cstime 16/17.
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its live descendants (``serve --workers N``'s
    supervisor and workers), plus what each reaped."""
    total = proc_cpu_s(pid, children=True)
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return total
    for kid in kids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += tree_cpu_s(kid)
    return total


def postgres_cpu_s() -> float:
    """CPU seconds of all live ``postgres`` processes plus what the postmaster reaped."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if f.read().strip() != "postgres":
                    continue
            total += proc_cpu_s(int(entry), children=True)
        except (OSError, ValueError, IndexError):
            continue  # exited while we looked
    return total


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile ``q`` (0-100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, round(q / 100 * len(ordered) + 0.5 - 1e-9))
    return ordered[min(rank, len(ordered)) - 1]


@dataclass(frozen=True)
class ReadProbe:
    """One read endpoint the reader times under load, at its own fixed cadence."""

    key: str
    label: str  # as the table names it
    path: str
    every_s: float
    offset_s: float  # first GET this long after the ingest schedule starts (staggers probes)
    htmx: bool = False  # send HX-Request: true, as the dashboard's polling does


READ_PROBES = (
    ReadProbe(
        "cluster",
        f"GET / HX-Request (cluster page poll, {DASHBOARDS} dashboards)",
        "/",
        CLUSTER_POLL_S,
        0.0,
        htmx=True,
    ),
    # the other dashboards, their polls staggered over the period; their latencies are
    # merged into "cluster" for the table and the target
    *(
        ReadProbe(
            f"cluster_{d}",
            f"dashboard {d}",
            "/",
            CLUSTER_POLL_S,
            CLUSTER_POLL_S * d / DASHBOARDS,
            htmx=True,
        )
        for d in range(1, DASHBOARDS)
    ),
    ReadProbe("cluster_full", "GET / full page", "/", FULL_PAGE_EVERY_S, 0.7),
    ReadProbe(
        "nodes_api", "GET /api/v1/nodes (first page)", "/api/v1/nodes", NODES_API_EVERY_S, 1.3
    ),
    # Prometheus scraping the server's state series at its default 15 s interval
    ReadProbe("metrics", "GET /metrics (Prometheus scrape)", "/metrics", 15.0, 2.1),
)


#: The probes of the table and the idle measurements: the extra dashboards' polls are merged
#: into "cluster" (:func:`merge_dashboards`).
TABLE_PROBES = tuple(
    p for p in READ_PROBES if not p.key.startswith("cluster_") or p.key == "cluster_full"
)


def merge_dashboards(lat_ms: dict, statuses: dict, nbytes: dict, bytes_total: dict) -> None:
    """Fold the extra dashboards' cluster polls into the "cluster" probe (in place)."""
    for p in READ_PROBES:
        if p in TABLE_PROBES:
            continue
        lat_ms["cluster"] += lat_ms.pop(p.key)
        statuses["cluster"].update(statuses.pop(p.key))
        nbytes["cluster"] = max(nbytes["cluster"], nbytes.pop(p.key))
        bytes_total["cluster"] += bytes_total.pop(p.key)


def probe_headers(probe: ReadProbe, token: str) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {token}"}
    if probe.htmx:
        headers["HX-Request"] = "true"
    return headers


class Reader:
    """Times each of ``READ_PROBES`` at its own cadence, one thread per probe, until stopped.

    A probe's GETs follow a fixed schedule (every ``every_s`` from its start); one that takes
    longer than the period delays the next, it never overlaps it.
    """

    def __init__(self, url: str, token: str, max_s: float) -> None:
        self.url = url
        self.token = token
        self.max_s = max_s
        self.stop = threading.Event()
        self.lat_ms: dict[str, list[float]] = {p.key: [] for p in READ_PROBES}
        self.statuses: dict[str, Counter[str]] = {p.key: Counter() for p in READ_PROBES}
        self.nbytes: dict[str, int] = {p.key: 0 for p in READ_PROBES}  # largest answer
        self.bytes_total: dict[str, int] = {p.key: 0 for p in READ_PROBES}
        self.threads = [
            threading.Thread(target=self._run, args=(p,), name=f"bench-reader-{p.key}", daemon=True)
            for p in READ_PROBES
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self, timeout_s: float) -> None:
        self.stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))

    def _run(self, probe: ReadProbe) -> None:
        headers = probe_headers(probe, self.token)
        t0 = time.monotonic()
        deadline = t0 + self.max_s
        version: str | None = None  # the dashboard's #cluster-version, sent back as since=
        with httpx.Client(base_url=self.url, headers=headers, timeout=REQUEST_TIMEOUT_S) as c:
            next_t = t0 + probe.offset_s
            while not self.stop.wait(max(0.0, next_t - time.monotonic())):
                if time.monotonic() >= deadline:
                    break
                t = time.monotonic()
                params = {"since": version} if probe.htmx and version else None
                try:
                    r = c.get(probe.path, params=params)
                except httpx.HTTPError as exc:
                    self.statuses[probe.key][type(exc).__name__] += 1
                else:
                    ms = (time.monotonic() - t) * 1000
                    self.statuses[probe.key][str(r.status_code)] += 1
                    # a poll answered 204 (nothing changed) is a complete answer too
                    if r.status_code == 200 or (probe.htmx and r.status_code == 204):
                        self.lat_ms[probe.key].append(ms)
                        self.nbytes[probe.key] = max(self.nbytes[probe.key], len(r.content))
                        self.bytes_total[probe.key] += len(r.content)
                    if probe.htmx:
                        version = r.headers.get(CLUSTER_VERSION_HEADER, version)
                next_t += probe.every_s


def wait_quiet(pid: int, pg_url: str, max_s: float = 180.0) -> float:
    """Wait until the server is really idle; returns the seconds waited (at most ``max_s``).

    Requests the client gave up on may still be inside the server, some of them blocked
    (using no CPU) while holding a transaction open, so idle means both: under 5 % of a core
    over a second, and no other session of the database active or idle in a transaction.
    """
    t0 = time.monotonic()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        while time.monotonic() - t0 < max_s:
            c0 = tree_cpu_s(pid)
            time.sleep(1.0)
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state IN ('active', 'idle in transaction')"
            ).fetchone()
            busy_sessions = row[0] if row else 0
            if tree_cpu_s(pid) - c0 < 0.05 and busy_sessions == 0:
                break
    return time.monotonic() - t0


def measure_ingest_alone(
    url: str, tokens: list[str], epochs: list[str], pid: int, n: int = 200
) -> dict[str, Any]:
    """Reports sent one at a time to the quiet server: its CPU and latency per report.

    Uses nodes 0..n-1 with seq 1,000,000 (a forward jump in their epoch, as after agent-side
    spool drops), so nothing collides with the load phases.
    """
    lat: list[float] = []
    statuses: Counter[str] = Counter()
    cpu0 = tree_cpu_s(pid)
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as c:
        for i in range(n):
            body = NodeSim(i, epochs[i]).batch(1_000_000, datetime.now(UTC))
            headers = {"Authorization": f"Bearer {tokens[i]}", "Content-Type": "application/json"}
            t = time.monotonic()
            try:
                r = c.post("/api/v1/ingest/report", content=body, headers=headers)
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
                continue
            statuses[str(r.status_code)] += 1
            if r.status_code == 200:
                lat.append((time.monotonic() - t) * 1000)
    return {
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "cpu_ms": 1000 * (tree_cpu_s(pid) - cpu0) / n,
        "statuses": dict(statuses),
    }


def measure_reads_idle(url: str, token: str, pid: int, n: int = 5) -> dict[str, dict[str, Any]]:
    """Peer for the read endpoints: ``n`` sequential GETs of each probe on the idle server.

    Returns per probe key: median latency (ms), server CPU per request (ms), statuses.
    """
    out: dict[str, dict[str, Any]] = {}
    with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as c:
        for probe in TABLE_PROBES:
            headers = probe_headers(probe, token)
            lat: list[float] = []
            statuses: Counter[str] = Counter()
            cpu0 = tree_cpu_s(pid)
            for _ in range(n):
                t = time.monotonic()
                try:
                    r = c.get(probe.path, headers=headers)
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1
                    continue
                statuses[str(r.status_code)] += 1
                if r.status_code == 200:
                    lat.append((time.monotonic() - t) * 1000)
            out[probe.key] = {
                "p50_ms": pct(lat, 50),
                "cpu_ms": 1000 * (tree_cpu_s(pid) - cpu0) / n,
                "statuses": dict(statuses),
            }
    return out


# --- database ----------------------------------------------------------------------------------


def plain_pg_url(sqlalchemy_url: str) -> str:
    """A libpq URL (for psycopg) from a SQLAlchemy ``postgresql+psycopg://`` URL."""
    from sqlalchemy.engine import make_url

    return make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(False)


BENCH_LOCK_KEY = 0x7469_6572  # pg advisory lock: one bench run at a time on this PostgreSQL
LOCK_WAIT_S = 900.0


def acquire_bench_lock(console: Console) -> psycopg.Connection[Any] | None:
    """Hold a PostgreSQL advisory lock so two bench runs never overlap.

    Two runs would drop each other's ``tierwatch_bench`` and compete for the same cores. The
    lock lives as long as the returned connection. Waits at most ``LOCK_WAIT_S``.

    Raises:
        RuntimeError: another run held the lock for longer than ``LOCK_WAIT_S``.
    """
    conn = psycopg.connect(ADMIN_URL, autocommit=True)
    t0 = time.monotonic()
    next_note = t0
    while True:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (BENCH_LOCK_KEY,)).fetchone()
        if row and row[0]:
            return conn
        if time.monotonic() - t0 > LOCK_WAIT_S:
            conn.close()
            raise RuntimeError(f"another bench run held the lock for over {LOCK_WAIT_S:.0f} s")
        if time.monotonic() >= next_note:
            console.print("another bench run is in progress on this PostgreSQL; waiting ...")
            next_note += 30
        time.sleep(2)


def create_database() -> None:
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB_NAME}")


def drop_database() -> None:
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")


def create_tokens(db_url: str) -> tuple[list[str], str]:
    """NODES agent tokens (one per node, in node order) and one viewer token."""
    from tierwatch.server.db import make_engine, make_sessionmaker, session_scope
    from tierwatch.server.tokens import create_token

    engine = make_engine(db_url)
    try:
        with session_scope(make_sessionmaker(engine)) as session:
            agents = [
                create_token(session, role="agent", node=f"node-{i:04d}", label="bench")[0]
                for i in range(NODES)
            ]
            viewer, _ = create_token(session, role="viewer", label="bench reader")
    finally:
        engine.dispose()
    return agents, viewer


@dataclass
class DbSnapshot:
    size_bytes: int
    samples_bytes: int
    sample_rows: int
    taken_at: datetime
    receipts: int = 0  # stored reports (report_ranges' seqs), samples or not
    tables: dict[str, int] = field(default_factory=dict)  # bytes per table, indexes included


# Each top-level table's size, indexes and TOAST included; a partitioned table (gpu_samples
# on PostgreSQL) counts its partitions (pg_partition_tree), as the parent has no storage.
TABLE_SIZES_SQL = """
SELECT c.relname,
       CASE WHEN c.relkind = 'p'
            THEN (SELECT coalesce(sum(pg_total_relation_size(t.relid)), 0)
                  FROM pg_partition_tree(c.oid) t)
            ELSE pg_total_relation_size(c.oid) END
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = current_schema() AND c.relkind IN ('r', 'p') AND NOT c.relispartition
"""


def db_snapshot(pg_url: str) -> DbSnapshot:
    with psycopg.connect(pg_url) as conn:
        taken_at = datetime.now(UTC)
        tables = {name: int(size) for name, size in conn.execute(TABLE_SIZES_SQL).fetchall()}
        row = conn.execute(
            "SELECT pg_database_size(current_database()), count(*), "
            "(SELECT coalesce(sum(last_seq - first_seq + 1), 0)::bigint FROM report_ranges) "
            "FROM gpu_samples"
        ).fetchone()
    assert row is not None
    return DbSnapshot(
        size_bytes=row[0],
        samples_bytes=tables.get("gpu_samples", 0),
        sample_rows=row[1],
        taken_at=taken_at,
        receipts=row[2],
        tables=tables,
    )


def measure_prune(db_url: str, pg_url: str, run_started: datetime) -> dict[str, Any]:
    """Time ``fleet.service.prune`` with a cut that removes the run's samples.

    The samples are partitioned by hour (``fleet.partitions``) and retention drops whole
    hours, so the cut is the end of the hour holding the run's newest sample: the run's
    partition(s) are dropped, and everything older than the cut goes from receipts and events
    alike (now = cut + 1 h, both retention windows 1 h), warm-up rows included.
    """
    from tierwatch.server.db import make_engine, make_sessionmaker
    from tierwatch.server.fleet.partitions import WIDTH, partition_start
    from tierwatch.server.fleet.service import prune

    with psycopg.connect(pg_url) as conn:
        row = conn.execute(
            "SELECT max(ts) FROM gpu_samples WHERE ts >= %s", (run_started,)
        ).fetchone()
    newest = row[0] if row else None
    if newest is None:
        return {"error": "no samples from the run"}
    cut = partition_start(newest) + WIDTH
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as session:
            t = time.monotonic()
            deleted = prune(
                session,
                now=cut + timedelta(hours=1),
                sample_retention_s=3600,
                event_retention_s=3600,
            )
            seconds = time.monotonic() - t
    finally:
        engine.dispose()
    total = sum(deleted.values())
    return {"deleted": deleted, "total": total, "seconds": seconds, "rows_per_s": total / seconds}


GPU_SAMPLE_COLUMNS = ("node_id", "gpu_index", "ts", *GPU_METRICS)  # gpu_samples' columns


def measure_db_floor(pg_url: str) -> dict[str, Any]:
    """Peer (b): the same GPU sample rows inserted with raw psycopg ``executemany``.

    One connection. "per report": 8 rows and a commit per transaction, as ingest commits
    once per report (``FLOOR_ROUNDS`` rounds; the median round is quoted). "bulk": 2,048 rows
    per commit.
    """
    sql = (
        f"INSERT INTO gpu_samples ({', '.join(GPU_SAMPLE_COLUMNS)}) "
        f"VALUES ({', '.join(['%s'] * len(GPU_SAMPLE_COLUMNS))})"
    )
    with psycopg.connect(pg_url) as conn:
        node_ids = [r[0] for r in conn.execute("SELECT id FROM nodes ORDER BY name").fetchall()]
        conn.commit()
        sims = [NodeSim(i, "floor") for i in range(len(node_ids))]

        def rows_for(k: int) -> list[tuple[Any, ...]]:
            i = k % len(node_ids)
            return [
                (node_ids[i], s["index"], *(s[c] for c in GPU_SAMPLE_COLUMNS[2:]))
                for s in sims[i].read(datetime.now(UTC))
            ]

        rounds = []
        txn_ms: list[float] = []
        with conn.cursor() as cur:
            for _ in range(FLOOR_ROUNDS):
                n = 0
                t0 = time.monotonic()
                while n < FLOOR_REPORTS and time.monotonic() - t0 < FLOOR_ROUND_S:
                    t = time.monotonic()
                    cur.executemany(sql, rows_for(n))
                    conn.commit()
                    txn_ms.append((time.monotonic() - t) * 1000)
                    n += 1
                rounds.append(n * GPUS_PER_NODE / (time.monotonic() - t0))
            bulk = []
            for b in range(FLOOR_BULK_COMMITS):
                rows = [r for k in range(FLOOR_BULK_ROWS // GPUS_PER_NODE) for r in rows_for(k + b)]
                t = time.monotonic()
                cur.executemany(sql, rows)
                conn.commit()
                bulk.append(len(rows) / (time.monotonic() - t))
    return {
        "per_report_rows_s": statistics.median(rounds),
        "per_report_rounds": rounds,
        "txn_p50_ms": pct(txn_ms, 50),
        "txn_p99_ms": pct(txn_ms, 99),
        "bulk_rows_s": statistics.median(bulk),
    }


# --- server process ----------------------------------------------------------------------------


class ServerProc:
    """One ``tierwatch-server serve --no-migrate`` on an ephemeral loopback port."""

    def __init__(self, db_url: str, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
        self.env.update(
            TIERWATCH_DATABASE_URL=db_url,
            TIERWATCH_SECRET_KEY=secrets.token_urlsafe(48),
            TIERWATCH_PRUNE_INTERVAL_S="0",
        )
        self.popen: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [str(BIN / "tierwatch-server"), "serve", "--no-migrate",
             "--host", "127.0.0.1", "--port", str(self.port), "--workers", str(WORKERS)],
            env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"server exited at start:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"server not up on {self.url} within 60 s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def problem_lines(self, limit: int = 12) -> list[str]:
        """Distinct log lines that look like errors, with how often each occurred."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        pattern = re.compile(r"ERROR|Error|Exception|WARNING")
        counts = Counter(ln.strip() for ln in lines if pattern.search(ln))
        counts.pop("Traceback (most recent call last):", None)
        return [f"{n}× {line}" for line, n in counts.most_common(limit)]


# --- report ------------------------------------------------------------------------------------


def fmt_ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f} ms"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "n/a"
    return f"×{a / b:.2f}"


def fmt_statuses(statuses: dict[str, int]) -> str:
    bad = {k: v for k, v in sorted(statuses.items()) if not k.startswith("2")}
    return ", ".join(f"{k}: {v}" for k, v in bad.items()) if bad else "none"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def machine_line() -> str:
    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} CPUs (nproc), {mem_kib / 1024**2:.1f} GiB RAM, {cpu}"


def build_rows(m: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(measure, ingest, peer, ratio) rows of the results table."""
    ing, hz, fl, rd = m["ingest"], m["healthz"], m["floor"], m["reader"]
    rows: list[tuple[str, str, str, str]] = []
    rate_i = ing["ok_in_window"] / ing["duration_s"]
    rate_h = hz["ok_in_window"] / hz["duration_s"]
    # GPU sample rows stored per second: reports carry samples every FULL_SAMPLE_EVERY
    # reports, or when a health reading changed (agent.sampling), heartbeats otherwise
    samples_s = m["growth"]["rows_per_h"] / 3600
    rows.append(
        (
            "offered load (open loop)",
            f"{RATE:.1f} reports/s ({RATE * GPUS_PER_NODE:.0f} GPU readings/s; full samples "
            f"every {FULL_SAMPLE_EVERY} reports and on a health change), "
            f"{ing['duration_s']:.0f} s",
            f"GET /healthz, same schedule, {hz['duration_s']:.0f} s",
            "",
        )
    )
    rows.append(
        (
            "achieved (2xx answered in window)",
            f"{rate_i:.1f} reports/s ({100 * rate_i / RATE:.0f} % of offered)",
            f"{rate_h:.1f} req/s ({100 * rate_h / RATE:.0f} %)",
            ratio(rate_i, rate_h),
        )
    )
    rows.append(
        (
            "GPU sample rows stored/s",
            f"{samples_s:.0f} samples/s",
            f"DB floor: {fl['per_report_rows_s']:.0f} rows/s (psycopg, 8 rows/commit)",
            ratio(samples_s, fl["per_report_rows_s"]),
        )
    )
    rows.append(
        (
            "",
            "",
            f"DB floor bulk: {fl['bulk_rows_s']:.0f} rows/s (2,048 rows/commit)",
            ratio(samples_s, fl["bulk_rows_s"]),
        )
    )
    for label, key in (("from scheduled time", "lat_sched_ms"), ("from send", "lat_send_ms")):
        for q in (50, 99):
            a, b = pct(ing[key], q), pct(hz[key], q)
            rows.append((f"latency p{q} {label}", fmt_ms(a), fmt_ms(b), ratio(a, b)))
    rows.append(
        (
            "errors by status (not 2xx)",
            fmt_statuses(ing["statuses"])
            + (f"; backlog-dropped {ing['dropped_backlog']}" if ing["dropped_backlog"] else "")
            + (f"; unanswered {ing['unfinished']}" if ing["unfinished"] else ""),
            fmt_statuses(hz["statuses"]),
            "",
        )
    )
    rows.append(
        (
            "server CPU per request under load",
            (
                f"{m['ingest_cpu_ms_per_report']:.2f} ms per report (all server CPU incl. the "
                f"reader's GETs: {m['server_cpu_ms_per_report']:.2f} ms)"
                if m["ingest_cpu_ms_per_report"] is not None
                else f"n/a: only {m['stored_reports']} reports stored"
            ),
            f"{m['healthz_cpu_ms_per_req']:.2f} ms",
            ratio(m["ingest_cpu_ms_per_report"], m["healthz_cpu_ms_per_req"]),
        )
    )
    alone = m["alone"]
    rows.append(
        (
            "one report at a time, quiet server",
            f"p50 {fmt_ms(alone['p50_ms'])}, p99 {fmt_ms(alone['p99_ms'])}, server CPU "
            f"{alone['cpu_ms']:.2f} ms/report (n=200; errors: {fmt_statuses(alone['statuses'])})",
            f"psycopg 8-row txn p50 {fmt_ms(fl['txn_p50_ms'])}",
            ratio(alone["p50_ms"], fl["txn_p50_ms"]),
        )
    )
    rows.append(
        (
            "PostgreSQL CPU per report under load",
            f"{m['pg_cpu_ms_per_report']:.2f} ms"
            if m["ingest_cpu_ms_per_report"] is not None
            else "n/a",
            "",
            "",
        )
    )
    rows.append(
        (
            "server ceiling (1 core / CPU per report alone)",
            f"{1000 / alone['cpu_ms']:.0f} reports/s per core "
            f"({1000 / alone['cpu_ms'] * GPUS_PER_NODE:.0f} samples/s)",
            f"{1000 / m['healthz_cpu_ms_per_req']:.0f} req/s per core",
            "",
        )
    )
    rows.append(
        (
            "machine CPU busy during ingest",
            f"{m['machine_busy_pct']:.0f} % of {os.cpu_count()} cores "
            f"(server {m['server_cores']:.2f}, postgres {m['pg_cores']:.2f}, "
            f"load {m['load_cores']:.2f}, other processes {m['other_cores']:.2f} cores)",
            "",
            "",
        )
    )
    sent_i = max(1, ing["offered"] - ing["dropped_backlog"])
    sent_h = max(1, hz["offered"] - hz["dropped_backlog"])
    load_i = 1000 * ing["load_cpu_s"] / sent_i
    load_h = 1000 * hz["load_cpu_s"] / sent_h
    rows.append(
        (
            "load process CPU (aiohttp client)",
            f"{m['load_cpu_ms_per_report']:.2f} ms per report stored "
            f"({load_i:.2f} ms per request sent, body built from templates)",
            f"{load_h:.2f} ms per GET /healthz sent",
            ratio(load_i, load_h),
        )
    )
    for probe in TABLE_PROBES:
        lat = rd["lat_ms"][probe.key]
        if lat:
            sizes = human_bytes(rd["nbytes"][probe.key])
            if probe.htmx:
                unchanged = rd["statuses"][probe.key].get("204", 0)
                mean = rd.get("bytes_total", {}).get(probe.key, 0) / len(lat)
                sizes = (
                    f"{unchanged} answered 204 unchanged, mean {human_bytes(mean)}/poll, "
                    f"largest {sizes}"
                )
            value = (
                f"p50 {fmt_ms(pct(lat, 50))}, p95 {fmt_ms(pct(lat, 95))} (n={len(lat)}, {sizes})"
            )
        else:
            value = "missing: " + fmt_statuses(rd["statuses"][probe.key])
        idle = m["reads_idle"][probe.key]
        peer = (
            f"idle server: p50 {fmt_ms(idle['p50_ms'])}, server CPU {idle['cpu_ms']:.0f} ms/GET"
            if idle["p50_ms"] is not None
            else "idle server: " + fmt_statuses(idle["statuses"])
        )
        rows.append(
            (
                f"{probe.label}, every {probe.every_s:g} s, under load",
                value,
                peer,
                ratio(pct(lat, 50), idle["p50_ms"]),
            )
        )
    g = m["growth"]
    rows.append(
        (
            "database growth",
            f"{human_bytes(g['bytes_per_h'])}/h; gpu_samples {g['rows_per_h'] / 1e6:.2f} M rows/h "
            f"({g['table_bytes_per_row']:.0f} B/row incl. indexes); by table: "
            + ", ".join(
                f"{name} {human_bytes(b)}/h"
                for name, b in sorted(g.get("tables_per_h", {}).items(), key=lambda kv: -kv[1])
                if b >= 1 << 20
            ),
            "",
            "",
        )
    )
    p = m["prune"]
    if "error" in p:
        rows.append(("prune the run (drop its hour)", p["error"], "", ""))
    else:
        rows.append(
            (
                "prune the run (drop its hour)",
                f"{p['total']:,} rows in {p['seconds']:.2f} s = {p['rows_per_s']:,.0f} rows/s",
                "",
                "",
            )
        )
    return rows


def render_markdown(rows: list[tuple[str, str, str, str]]) -> str:
    out = ["| measure | ingest (POST /api/v1/ingest/report) | peer, same run | ratio |"]
    out.append("|---|---|---|---|")
    for r in rows:
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
    return "\n".join(out)


def _idle_bound(m: dict[str, Any], key: str) -> str:
    """What bounds a read under load: its own cost on the idle server against the wait for a
    core on the busy machine (the sentence's end, from ``; `` to the final period)."""
    idle = m["reads_idle"][key]
    if idle["p50_ms"] is None:
        return "."
    return (
        f"; the idle server answers it in {idle['p50_ms']:.0f} ms p50 ({idle['cpu_ms']:.0f} ms "
        f"of server CPU), so the rest is waiting for a core on a machine "
        f"{m['machine_busy_pct']:.0f} % busy with ingest."
    )


def verdict_lines(m: dict[str, Any]) -> list[str]:
    """Target checks and what bounds the result."""
    ing, rd = m["ingest"], m["reader"]
    rate_i = ing["ok_in_window"] / ing["duration_s"]
    p99 = pct(ing["lat_send_ms"], 99)
    p99_sched = pct(ing["lat_sched_ms"], 99)
    busy = m["machine_busy_pct"]
    errors = sum(v for k, v in ing["statuses"].items() if not k.startswith("2"))
    errors += ing["dropped_backlog"] + ing["unfinished"]
    sustained = rate_i >= 0.98 * RATE and errors == 0
    lines = []
    if sustained and p99 is not None and p99 < TARGET_P99_MS:
        lines.append(
            f"Ingest target met: {rate_i:.1f} of {RATE:.1f} reports/s with no errors, p99 "
            f"{p99:.1f} ms < {TARGET_P99_MS:.0f} ms (from send)."
        )
    else:
        what = []
        if rate_i < 0.98 * RATE:
            what.append(f"achieved {rate_i:.1f} of {RATE:.1f} reports/s ({rate_i / RATE:.0%})")
        if errors:
            what.append(f"{errors} failed/unsent reports")
        if p99 is not None and p99 >= TARGET_P99_MS:
            what.append(
                f"p99 from send {p99:.0f} ms is {p99 - TARGET_P99_MS:.0f} ms over the "
                f"{TARGET_P99_MS:.0f} ms target (×{p99 / TARGET_P99_MS:.1f}; from the scheduled "
                f"time {p99_sched:.0f} ms)"
            )
        lines.append(
            "Ingest target missed: "
            + "; ".join(what)
            + f". Bound by CPU: the machine was {busy:.0f} % busy, so a report waits for a core "
            "(queueing, not work: one report alone takes "
            f"{m['alone']['p50_ms']:.0f} ms p50 on the quiet server)."
        )
    per_report = m["ingest_cpu_ms_per_report"]
    if per_report is not None:
        lines.append(
            f"Server CPU target (≤ {TARGET_CPU_MS_PER_REPORT:g} ms per report): "
            + (
                "met"
                if per_report <= TARGET_CPU_MS_PER_REPORT
                else f"missed by {per_report - TARGET_CPU_MS_PER_REPORT:.2f} ms "
                f"(×{per_report / TARGET_CPU_MS_PER_REPORT:.2f})"
            )
            + f", {per_report:.2f} ms. Bound by the HTTP and ORM layers per request: a bare "
            f"GET /healthz costs {m['healthz_cpu_ms_per_req']:.2f} ms of server CPU on this "
            "machine under the same load (the peer row), before any JSON validation or SQL."
        )
    cpu = m["alone"]["cpu_ms"]
    pg = m["pg_cpu_ms_per_report"]
    load = m["load_cpu_ms_per_report"]
    if m["ingest_cpu_ms_per_report"] is None:
        lines.append(
            f"Bound in this run: not CPU. The server stored only {m['stored_reports']} reports "
            f"while the machine was {m['machine_busy_pct']:.0f} % busy: it stalled (see the "
            "pool timeouts below)."
        )
    lines.append(
        f"CPU bound: the server runs {WORKERS} worker process(es) (each one event loop plus a "
        f"thread pool under the GIL) on {os.cpu_count()} cores shared with PostgreSQL and the "
        f"load, so at {cpu:.2f} ms of server CPU per report (measured one at a time on the "
        f"quiet server) one worker tops out near {1000 / cpu:.0f} reports/s "
        f"({1000 / cpu * GPUS_PER_NODE:.0f} samples/s), "
        f"{RATE * cpu / 1000:.1f} cores' worth of work at the offered {RATE:.0f} reports/s"
        + (
            f"; under this run's concurrency it spent {m['ingest_cpu_ms_per_report']:.2f} ms "
            f"per report plus {pg:.2f} ms in PostgreSQL and {load:.2f} ms in the load process"
            if m["ingest_cpu_ms_per_report"] is not None
            else ""
        )
        + "."
    )
    page = rd["lat_ms"]["cluster"]
    if not page:
        lines.append(
            "Cluster page target (p95 < 300 ms): not measured, the cluster page poll is missing ("
            + fmt_statuses(rd["statuses"]["cluster"])
            + ")."
        )
    else:
        p95 = pct(page, 95)
        assert p95 is not None
        ok = p95 < TARGET_PAGE_P95_MS
        lines.append(
            f"Cluster page target (p95 < {TARGET_PAGE_P95_MS:.0f} ms, the htmx poll of "
            f"{DASHBOARDS} dashboards, each every {CLUSTER_POLL_S:g} s): "
            + ("met" if ok else f"missed by {p95 - TARGET_PAGE_P95_MS:.0f} ms")
            + f", p95 {p95:.0f} ms under ingest load (n={len(page)})"
            + _idle_bound(m, "cluster")
        )
    scrapes = rd["lat_ms"]["metrics"]
    if scrapes:
        p95 = pct(scrapes, 95)
        assert p95 is not None
        lines.append(
            f"/metrics target (a scrape < {TARGET_SCRAPE_MS:.0f} ms): "
            + ("met" if p95 < TARGET_SCRAPE_MS else f"missed by {p95 - TARGET_SCRAPE_MS:.0f} ms")
            + f", p95 {p95:.0f} ms under ingest load (n={len(scrapes)})"
            + _idle_bound(m, "metrics")
        )
    g = m["growth"]
    per_h = g["bytes_per_h"]
    samples_h = g.get("tables_per_h", {}).get("gpu_samples", 0.0)
    lines.append(
        f"Database growth target (≤ {human_bytes(TARGET_GROWTH_BYTES_PER_H)}/h): "
        + (
            "met"
            if per_h <= TARGET_GROWTH_BYTES_PER_H
            else f"missed by {human_bytes(per_h - TARGET_GROWTH_BYTES_PER_H)}/h "
            f"(×{per_h / TARGET_GROWTH_BYTES_PER_H:.2f})"
        )
        + f", {human_bytes(per_h)}/h; bound by the raw samples: gpu_samples "
        f"{human_bytes(samples_h)}/h = {g['rows_per_h'] / 1e6:.2f} M rows/h × "
        f"{g['table_bytes_per_row']:.0f} B/row (full samples every {FULL_SAMPLE_EVERY} reports "
        "and on a health change)."
    )
    return lines


SECTION_INTRO = (
    "One block per command line, for the current code only: a run replaces the block of its "
    "own command and drops every block that measured other server (app/) or bench code. "
    "Numbers are from real runs on the machine named in each block."
)
CODE_LINE_RE = re.compile(r"^- (server|bench) code: .*?sha256 ([0-9a-f]{12})", re.M)


def code_versions(block: str) -> dict[str, str]:
    """``{"server": sha, "bench": sha}`` from a block's header lines (empty if it has none)."""
    return dict(CODE_LINE_RE.findall(block))


def write_docs(block: str) -> None:
    """Put ``block`` (starting ``### `command` ``) into the ingest section of docs/benchmarks.md.

    The section holds one block per command line, all of the same code: the block with the
    same heading is replaced, and so is any block whose server or bench code hash differs
    from ``block``'s (or that has none); every other section of the file is kept.
    """
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    section_re = re.compile(rf"^{re.escape(SECTION_TITLE)}\n.*?(?=^## |\Z)", re.M | re.S)
    found = section_re.search(text)
    blocks: list[str] = []
    if found:
        blocks = re.split(r"^(?=### )", found.group(0), flags=re.M)[1:]
    heading = block.splitlines()[0]
    current = code_versions(block)
    blocks = [b for b in blocks if b.splitlines()[0] != heading and code_versions(b) == current]
    # Full runs first, then quick ones, each kept in the order they were first written.
    blocks.append(block)
    blocks.sort(key=lambda b: "BENCH_QUICK=1" in b.splitlines()[0])
    section = "\n\n".join([SECTION_TITLE, SECTION_INTRO, *(b.strip() for b in blocks)])
    if found:
        text = text[: found.start()] + section + "\n\n" + text[found.end() :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    DOCS.write_text(text.rstrip() + "\n")


# --- main --------------------------------------------------------------------------------------


def main() -> int:
    from tierwatch.server.migrate import upgrade

    console = Console()
    ctx = mp.get_context("spawn")
    db_url = os.environ.get("TIERWATCH_BENCH_DATABASE_URL") or DEFAULT_DB_URL
    own_db = "TIERWATCH_BENCH_DATABASE_URL" not in os.environ
    pg_url = plain_pg_url(db_url)
    run_id = uuid.uuid4().hex[:8]
    epochs = [f"bench-{run_id}-{i:04d}" for i in range(NODES)]
    body_bytes = check_batch_shape(epochs[0])
    mode = "quick (BENCH_QUICK=1)" if QUICK else "full"
    console.print(
        f"[bold]tierwatch ingest bench[/] {mode}: {NODES} nodes × {GPUS_PER_NODE} GPUs every "
        f"{INTERVAL_S:.0f} s, ~{body_bytes} B per report, {CONNECTIONS} client connections"
    )
    lock = acquire_bench_lock(console)
    workdir = Path(tempfile.mkdtemp(prefix="tierwatch-bench-"))
    server: ServerProc | None = None
    m: dict[str, Any] = {"app_sha": app_fingerprint(), "bench_sha": bench_fingerprint()}
    ok = False
    try:
        if own_db:
            create_database()
        t = time.monotonic()
        upgrade(db_url)
        tokens, viewer = create_tokens(db_url)
        console.print(f"database ready, {NODES + 1} tokens in {time.monotonic() - t:.1f} s")

        server = ServerProc(db_url, workdir)
        server.start()
        console.print(f"server pid {server.pid} on {server.url}")
        spec = {"url": server.url, "tokens": tokens, "epochs": epochs}

        warm = run_phase(ctx, {**spec, "phase": "warmup", "first_seq": 1})
        console.print(
            f"warm-up: {NODES} first reports in {warm['wall_s']:.1f} s "
            f"({NODES / warm['wall_s']:.0f}/s closed loop, {WARMUP_CONCURRENCY} concurrent); "
            f"statuses {warm['statuses']}, retried {warm['retried']}"
        )
        for key, detail in warm["details"].items():
            console.print(f"  warm-up {key}: {detail}")
        m["warmup"] = warm
        if warm["statuses"].get("200", 0) != NODES:
            raise RuntimeError(f"warm-up failed: {warm['statuses']}\n{server.log_tail()}")

        # Peer (a): the same schedule against GET /healthz.
        hz_cpu: dict[str, float] = {}
        hz = run_phase(
            ctx,
            {**spec, "phase": "healthz", "first_seq": 2, "duration_s": HEALTHZ_S},
            on_start=lambda: hz_cpu.setdefault("before", tree_cpu_s(server.pid)),
        )
        hz_answered = sum(v for k, v in hz["statuses"].items() if k.isdigit())
        m["healthz"] = hz
        m["healthz_cpu_ms_per_req"] = (
            1000 * (tree_cpu_s(server.pid) - hz_cpu["before"]) / max(1, hz_answered)
        )
        console.print(f"healthz peer done: {hz['statuses']}")

        # The ingest phase, with the reader and CPU/database snapshots around it.
        before: dict[str, Any] = {}
        reader = Reader(server.url, viewer, DURATION_S + DRAIN_S + 60)

        def on_start() -> None:
            before["db"] = db_snapshot(pg_url)
            before["server"] = tree_cpu_s(server.pid)
            before["pg"] = postgres_cpu_s()
            before["machine"] = machine_cpu()
            before["t"] = time.monotonic()
            reader.start()

        console.print(f"settle: {SETTLE_S:.0f} s of the same load, not measured ...")
        settle = run_phase(ctx, {**spec, "phase": "settle", "first_seq": 2, "duration_s": SETTLE_S})
        m["settle"] = {k: v for k, v in settle.items() if k != "seqs"}
        console.print(f"ingest phase: {DURATION_S:.0f} s open loop ...")
        try:
            ing = run_phase(
                ctx,
                {**spec, "phase": "ingest", "seqs": settle["seqs"], "duration_s": DURATION_S},
                on_start=on_start,
            )
        finally:
            reader.finish(REQUEST_TIMEOUT_S + 5)
        wall = time.monotonic() - before["t"]
        server_cpu = tree_cpu_s(server.pid) - before["server"]
        pg_cpu = postgres_cpu_s() - before["pg"]
        busy1, total1 = machine_cpu()
        busy0, total0 = before["machine"]
        after_db = db_snapshot(pg_url)
        # Reports the server really stored (a client timeout may still have been stored).
        # Counted from report_ranges' seqs: a heartbeat stores a report without sample rows.
        stored_reports = max(1, after_db.receipts - before["db"].receipts)
        m["ingest"] = ing
        merge_dashboards(reader.lat_ms, reader.statuses, reader.nbytes, reader.bytes_total)
        m["reader"] = {
            "lat_ms": reader.lat_ms,
            "statuses": reader.statuses,
            "nbytes": reader.nbytes,
            "bytes_total": reader.bytes_total,
        }
        m["stored_reports"] = stored_reports
        m["server_cpu_ms_per_report"] = 1000 * server_cpu / stored_reports
        m["pg_cpu_ms_per_report"] = 1000 * pg_cpu / stored_reports
        m["load_cpu_ms_per_report"] = 1000 * ing["load_cpu_s"] / stored_reports
        m["server_cores"] = server_cpu / wall
        m["pg_cores"] = pg_cpu / wall
        m["load_cores"] = ing["load_cpu_s"] / wall
        m["machine_busy_pct"] = 100 * (busy1 - busy0) / max(1, total1 - total0)
        machine_cores = (busy1 - busy0) / CLK_TCK / wall
        m["other_cores"] = max(
            0.0, machine_cores - m["server_cores"] - m["pg_cores"] - m["load_cores"]
        )
        b0: DbSnapshot = before["db"]
        run_s = ing["duration_s"]
        rows = after_db.sample_rows - b0.sample_rows
        m["growth"] = {
            "db_bytes": after_db.size_bytes - b0.size_bytes,
            "rows": rows,
            "bytes_per_h": (after_db.size_bytes - b0.size_bytes) / run_s * 3600,
            "rows_per_h": rows / run_s * 3600,
            "table_bytes_per_row": (after_db.samples_bytes - b0.samples_bytes) / max(1, rows),
            "tables_per_h": {
                name: (size - b0.tables.get(name, 0)) / run_s * 3600
                for name, size in after_db.tables.items()
            },
        }
        console.print(f"ingest done: {ing['statuses']}; measuring prune and DB floor ...")

        # On the quiet server: ingest one report at a time, and each read endpoint alone (the
        # reader's share of the server CPU above is costed with the latter).
        m["quiet_wait_s"] = wait_quiet(server.pid, pg_url)
        m["alone"] = measure_ingest_alone(server.url, tokens, epochs, server.pid)
        m["reads_idle"] = measure_reads_idle(server.url, viewer, server.pid)
        reader_cpu_s = sum(
            reader.statuses[p.key].get("200", 0) * m["reads_idle"][p.key]["cpu_ms"] / 1000
            for p in TABLE_PROBES
        )
        m["reader_cpu_s"] = reader_cpu_s
        m["ingest_cpu_ms_per_report"] = (
            1000 * max(0.0, server_cpu - reader_cpu_s) / stored_reports
            if stored_reports >= MIN_REPORTS_FOR_CPU
            else None
        )
        m["prune"] = measure_prune(db_url, pg_url, b0.taken_at)
        m["floor"] = measure_db_floor(pg_url)
        m["server_problems"] = server.problem_lines()
        ok = True
    finally:
        if server is not None:
            server.stop()
        if own_db and not KEEP_DB:
            with contextlib.suppress(psycopg.Error):
                drop_database()
        if lock is not None:
            lock.close()
        if ok and os.environ.get("BENCH_KEEP_LOG") != "1":
            shutil.rmtree(workdir, ignore_errors=True)
        elif ok:
            console.print(f"server log kept in {workdir / 'server.log'}")
        else:
            console.print(f"[red]run failed[/]; server log kept in {workdir / 'server.log'}")
            if server is not None:
                for line in server.problem_lines():
                    console.print(f"  {line}")

    rows_out = build_rows(m)
    table = Table(title=f"tierwatch ingest, {mode}")
    for col in ("measure", "ingest (POST /api/v1/ingest/report)", "peer, same run", "ratio"):
        table.add_column(col, overflow="fold")
    for r in rows_out:
        table.add_row(*r)
    console.print(table)
    shared = (
        f"The load process, PostgreSQL and the server share {os.cpu_count()} cores on this "
        "machine; every figure above is measured with all three competing for them."
    )
    verdict = verdict_lines(m)
    console.print(shared)
    for line in verdict:
        console.print(line)
    ing = m["ingest"]
    notes = [
        shared,
        *verdict,
        f'Latency "from scheduled time" counts from when the open-loop schedule said the '
        f'report was due (what an agent sees, including any client-side queueing); "from '
        f'send" counts from when the request headers were written to the socket. Load '
        f"generator lag (task start - scheduled) p99 {fmt_ms(pct(ing['sched_lag_ms'], 99))}.",
        f"Warm-up (not counted): {NODES} first reports, closed loop with "
        f"{WARMUP_CONCURRENCY} in flight, took {m['warmup']['wall_s']:.1f} s "
        f"({NODES / m['warmup']['wall_s']:.0f} reports/s; first reports also create nodes "
        "and GPUs). Then "
        f"{SETTLE_S:.0f} s of the same open-loop load, not measured (statuses "
        f"{m['settle']['statuses']}), so the tables rewritten by every report are past their "
        "first fill when growth is measured.",
        f"Each report: {GPUS_PER_NODE} GpuSample with every field set, the GPU inventory, about "
        f"1 in {round(1 / XID_PER_REPORT)} with a non-fatal XID; ~{body_bytes} B of JSON; "
        f"{CONNECTIONS} pooled keep-alive connections from one aiohttp.ClientSession "
        "(the load process; bodies from per-node JSON templates, headers built once per node).",
        "Readers during the ingest phase (httpx, one thread each, viewer token): the cluster "
        f"page as {DASHBOARDS} open dashboards poll it (GET / with HX-Request: true, each every "
        f"{CLUSTER_POLL_S:g} s, staggered), a full-page GET / every {FULL_PAGE_EVERY_S:g} s, "
        f"GET /api/v1/nodes every {NODES_API_EVERY_S:g} s (automation polling at the report "
        "interval, its first page) and GET /metrics every 15 s (a Prometheus scrape).",
        f"CPU per report divides by the reports the server stored during the phase "
        f"({m['stored_reports']:,}, from the seqs report_ranges holds), not by the answers "
        "the client got in time. "
        f"The quiet-server measurements started after waiting {m['quiet_wait_s']:.0f} s for "
        "the server to finish what the load left behind. "
        "The ingest-only figure subtracts the reader's GETs "
        f"({m['reader_cpu_s']:.1f} s of server CPU, costed at the idle-server CPU per GET). "
        f"Database growth counts pg_database_size before/after the ingest phase (WAL not "
        f"included) over {ing['duration_s']:.0f} s, extrapolated to an hour; prune uses "
        f"fleet.service.prune with the cut at the end of the hour of the run's newest sample "
        f"(samples are partitioned by hour; the run's partition is dropped), on an idle "
        f"server ({m['prune'].get('deleted', {})}).",
        "DB floor rounds (rows/s, 8 rows per commit, one connection): "
        + ", ".join(f"{r:.0f}" for r in m["floor"]["per_report_rounds"])
        + " (median quoted).",
    ]
    if m["warmup"]["retried"]:
        notes.append(
            f"Warm-up attempts that failed and were resent: {m['warmup']['retried']} ("
            + "; ".join(f"{k}: {v}" for k, v in m["warmup"]["details"].items())
            + ")."
        )
    for phase in ("ingest", "healthz"):
        for key, detail in m[phase]["error_samples"].items():
            notes.append(f"{phase} {key}, first seen: `{detail}`")
            console.print(f"[red]{phase} {key}[/]: {detail}")
    if ing["not_stored"]:
        notes.append(f"{ing['not_stored']} ingest acks said stored=false (replays): a bench bug.")
    if any("QueuePool limit" in line for line in m["server_problems"]):
        notes.append(
            "Server-side 500s (the client usually gave up first, at its 30 s read timeout) are "
            "SQLAlchemy pool timeouts (pool 10 + overflow 10, 30 s). A py-spy dump "
            "of the server in that state shows all 40 AnyIO worker threads blocked in "
            "`optional_principal -> lookup_token -> QueuePool._do_get`, while the 20 pooled "
            "connections belong to requests that already authenticated (their session opened a "
            "transaction in the auth dependency) and now wait for a worker thread to run the "
            "route: a pool/thread-pool deadlock that only the 30 s pool timeout breaks. It starts "
            "once about 60 requests are inside the server at once (20 holding connections + 40 "
            "threads waiting), i.e. as soon as ingest falls behind its offered rate."
        )
    if m["server_problems"]:
        notes.append("Server log lines that look like problems (count × line):")
        console.print("[red]server log problems:[/]\n" + "\n".join(m["server_problems"]))
    section = "\n".join(
        [
            f"### `{command_line()}`",
            "",
            f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            f"- machine: {machine_line()}; PostgreSQL " + _pg_version() + " on the same machine",
            f"- command: `{command_line()}` ({mode}, {CONNECTIONS} client connections)",
            f"- server code: app/**/*.py sha256 {m['app_sha']} (taken at the start of the run)",
            f"- bench code: bench/**/*.py sha256 {m['bench_sha']}",
            "",
            render_markdown(rows_out),
            "",
            "Notes:",
            "",
            *[f"- {n}" for n in notes],
            *(["", "```", *m["server_problems"], "```"] if m["server_problems"] else []),
        ]
    )
    write_docs(section)
    console.print(f"wrote {DOCS.relative_to(ROOT)}")
    return 0


def _tree_fingerprint(folder: str) -> str:
    digest = hashlib.sha256()
    for path in sorted((ROOT / folder).rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def app_fingerprint() -> str:
    """sha256 (12 hex) of the server's Python sources, to tell which code a block measured."""
    return _tree_fingerprint("app")


def bench_fingerprint() -> str:
    """sha256 (12 hex) of the bench's own Python sources (the load generator is part of it)."""
    return _tree_fingerprint("bench")


def command_line() -> str:
    """The command that reproduces this run (the env settings that change it, then the script)."""
    env = [f"{k}={os.environ[k]}" for k in ("BENCH_QUICK", "BENCH_CONNECTIONS") if k in os.environ]
    return " ".join([*env, ".venv/bin/python bench/ingest.py"])


def _pg_version() -> str:
    try:
        with psycopg.connect(ADMIN_URL) as conn:
            row = conn.execute("SHOW server_version").fetchone()
        return str(row[0]).split()[0] if row else "?"
    except psycopg.Error:
        return "?"


if __name__ == "__main__":
    sys.exit(main())

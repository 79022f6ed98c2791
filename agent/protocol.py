"""Wire models shared by the node agent and the control plane (pydantic only).

The agent sends :class:`ReportBatch` to ``POST /api/v1/ingest/report`` and gets a
:class:`ReportAck` back. Batches carry an agent *epoch* (a boot id, new on every agent start)
and a per-epoch sequence number starting at 1, so the server stores each batch once
(idempotent on node + epoch + seq) and a restarted agent that counts from 1 again is not
mistaken for a replay.

Every metric field of :class:`GpuSample` is optional: ``None`` means the collector could not
read it (unsupported on this GPU or driver), never zero.

Units are in the field names: ``_c`` degrees Celsius, ``_w`` watts, ``_pct`` percent,
``_mib`` mebibytes, ``_ms`` milliseconds, ``_s`` seconds. Times are timezone-aware UTC.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal, get_args, get_origin

from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, model_validator

PROTOCOL_VERSION: Final = 1

NODE_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_NODE_NAME_RE = re.compile(NODE_NAME_PATTERN)

# Clock-event ("throttle") reason bits, as defined by NVML's nvmlClocksEventReasons*
# constants (nvml.h; formerly nvmlClocksThrottleReasons*).
THROTTLE_GPU_IDLE = 0x1
THROTTLE_APPLICATIONS_CLOCKS_SETTING = 0x2
THROTTLE_SW_POWER_CAP = 0x4
THROTTLE_HW_SLOWDOWN = 0x8
THROTTLE_SYNC_BOOST = 0x10
THROTTLE_SW_THERMAL_SLOWDOWN = 0x20
THROTTLE_HW_THERMAL_SLOWDOWN = 0x40
THROTTLE_HW_POWER_BRAKE_SLOWDOWN = 0x80
THROTTLE_DISPLAY_CLOCK_SETTING = 0x100

#: The hardware slowdown reasons: the ones the health rules act on (a power cap or idle clocks
#: are how a healthy GPU runs).
HW_THROTTLE_MASK = (
    THROTTLE_HW_SLOWDOWN | THROTTLE_HW_THERMAL_SLOWDOWN | THROTTLE_HW_POWER_BRAKE_SLOWDOWN
)

THROTTLE_REASON_NAMES: dict[int, str] = {
    THROTTLE_GPU_IDLE: "gpu_idle",
    THROTTLE_APPLICATIONS_CLOCKS_SETTING: "applications_clocks_setting",
    THROTTLE_SW_POWER_CAP: "sw_power_cap",
    THROTTLE_HW_SLOWDOWN: "hw_slowdown",
    THROTTLE_SYNC_BOOST: "sync_boost",
    THROTTLE_SW_THERMAL_SLOWDOWN: "sw_thermal_slowdown",
    THROTTLE_HW_THERMAL_SLOWDOWN: "hw_thermal_slowdown",
    THROTTLE_HW_POWER_BRAKE_SLOWDOWN: "hw_power_brake_slowdown",
    THROTTLE_DISPLAY_CLOCK_SETTING: "display_clock_setting",
}


def throttle_reason_names(mask: int | None) -> list[str]:
    """Names of the clock-event reason bits set in ``mask`` (empty for None or 0)."""
    if not mask:
        return []
    return [name for bit, name in THROTTLE_REASON_NAMES.items() if mask & bit]


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(UTC)


def _check_node_name(value: str) -> str:
    if not _NODE_NAME_RE.fullmatch(value):
        raise ValueError(
            "node name must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("text must not contain NUL (\\x00) characters")
    return value


NodeName = Annotated[str, AfterValidator(_check_node_name)]
# Counters are stored as 64-bit signed integers (BIGINT).
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
Text = Annotated[str, AfterValidator(_no_nul)]


class _Model(BaseModel):
    # Unknown fields are an error (422 at the API), so a typo never silently drops data.
    # NaN/Infinity are refused too: they are not JSON and would poison charts and sums.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GpuInfo(_Model):
    """Static identity of one GPU on a node."""

    index: Annotated[int, Field(ge=0, le=255)]
    uuid: Annotated[Text, Field(min_length=1, max_length=96)]
    name: Annotated[Text, Field(max_length=128)] = ""  # model, e.g. "NVIDIA H100 80GB HBM3"
    memory_total_mib: Annotated[float, Field(ge=0)] | None = None


class GpuSample(_Model):
    """One reading of one GPU's health metrics.

    ``ts`` is when the collector actually read the values; a collector that keeps returning
    a cached reading keeps the old ``ts``, which is how the server detects stale telemetry.
    ECC and PCIe/NVLink counters are cumulative counts as NVML reports them (NVLink counters
    summed over links); the server derives increases and rates.
    """

    index: Annotated[int, Field(ge=0, le=255)]
    ts: AwareDatetime
    temperature_c: Annotated[float, Field(ge=-50, le=200)] | None = None
    slowdown_temp_c: Annotated[float, Field(ge=0, le=200)] | None = None
    shutdown_temp_c: Annotated[float, Field(ge=0, le=200)] | None = None
    power_w: Annotated[float, Field(ge=0, le=10000)] | None = None
    power_limit_w: Annotated[float, Field(ge=0, le=10000)] | None = None
    utilization_pct: Annotated[float, Field(ge=0, le=100)] | None = None
    memory_used_mib: Annotated[float, Field(ge=0)] | None = None
    memory_total_mib: Annotated[float, Field(ge=0)] | None = None
    ecc_sbe_volatile: Count | None = None
    ecc_dbe_volatile: Count | None = None
    ecc_sbe_aggregate: Count | None = None
    ecc_dbe_aggregate: Count | None = None
    remapped_rows_correctable: Count | None = None
    remapped_rows_uncorrectable: Count | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    pcie_replay_count: Count | None = None
    throttle_reasons: Count | None = None  # bitmask of THROTTLE_* above
    nvlink_crc_errors: Count | None = None
    nvlink_replay_errors: Count | None = None
    nvlink_recovery_errors: Count | None = None


def _value_type(annotation: Any) -> type:
    """``float``, ``int`` or ``bool``: the value type of an optional metric field of
    :class:`GpuSample` (``Annotated[float, Field(...)] | None`` → ``float``)."""
    (inner,) = [a for a in get_args(annotation) if a is not type(None)]
    return get_args(inner)[0] if get_origin(inner) is Annotated else inner


#: Each metric field of :class:`GpuSample` (every field but ``index`` and ``ts``), in wire
#: order, with its value type. The server's columns and API shapes are tested against it.
GPU_METRIC_TYPES: dict[str, type] = {
    name: _value_type(info.annotation)
    for name, info in GpuSample.model_fields.items()
    if name not in ("index", "ts")
}
#: The metric names of :class:`GpuSample`, in wire order.
GPU_METRICS: tuple[str, ...] = tuple(GPU_METRIC_TYPES)


class XidEvent(_Model):
    """One XID error reported by the driver for one GPU. Every occurrence is its own event.

    ``before_start`` marks a value that was already there when the agent started, not an
    occurrence seen live: dcgm-exporter's ``DCGM_FI_DEV_XID_ERRORS`` gauge holds the last
    XID of each GPU, so the collector's first scrape may find one from before the agent ran
    (a restart on a node whose GPU already failed). ``ts`` is then when the agent read it;
    when it occurred is unknown, and the same old value is reported again at every agent
    start (the server tells it from a new occurrence, see ``fleet.rules.rule_xid_before_start``).
    Optional, default False: batches of older agents are read as before.
    """

    gpu: Annotated[int, Field(ge=0, le=255)]
    xid: Annotated[int, Field(ge=0, le=100000)]
    ts: AwareDatetime
    message: Annotated[Text, Field(max_length=2000)] = ""
    before_start: bool = False


class LatencySample(_Model):
    """Time of one small all_reduce on a job's process group, measured by a rank (ms)."""

    job_id: Annotated[Text, Field(min_length=1, max_length=128)]
    rank: Annotated[int, Field(ge=0, le=2**31 - 1)]
    world_size: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    ts: AwareDatetime
    latency_ms: Annotated[float, Field(ge=0, le=3_600_000)]


class AgentEvent(_Model):
    """Something the agent wants an operator to see (a collector error, dropped batches…)."""

    kind: Annotated[Text, Field(min_length=1, max_length=64)]
    ts: AwareDatetime
    message: Annotated[Text, Field(max_length=2000)] = ""
    gpu: Annotated[int, Field(ge=0, le=255)] | None = None


TierName = Literal["memory", "peer", "persistent"]
JobId = Annotated[
    Text, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
]


class CheckpointEvent(_Model):
    """Something that happened to one step of a job's checkpoint in one tier.

    ``kind``: ``staged`` (a rank's state is captured; ``blocking_s`` is the training thread's
    time in ``save()`` plus any optimizer pre-hook wait), ``committed`` (the tier holds this
    rank's files, or with ``rank`` None the whole step), ``failed`` (``message`` says what and
    names the file), ``evicted`` (retention removed the step from the tier).

    Units: ``bytes`` bytes, ``seconds`` wall time of the tier's work for this step (staging,
    write, replication or upload), ``blocking_s`` seconds the training thread was blocked.
    """

    job_id: JobId
    step: Annotated[int, Field(ge=0, le=2**62)]
    tier: TierName
    kind: Literal["staged", "committed", "failed", "evicted"]
    rank: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    world_size: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    ts: AwareDatetime
    bytes: Count | None = None
    seconds: Annotated[float, Field(ge=0, le=10**7)] | None = None
    blocking_s: Annotated[float, Field(ge=0, le=10**7)] | None = None
    message: Annotated[Text, Field(max_length=2000)] = ""


class JobProgress(_Model):
    """A training rank's progress: the step it completed and how long steps take.

    ``layout`` (node of every rank, index = rank) is sent by rank 0 when it starts and now and
    then, so the server knows the job's world_size and rank→node placement.

    ``starting`` marks the report rank 0 sends when it starts, before its restore or first
    save accepted the start (a start at another world size, or of another model, is refused
    then): it gives a job the server does not know yet its world_size and layout, and changes
    neither for a known job (the server waits for a report of a trained step).
    """

    job_id: JobId
    rank: Annotated[int, Field(ge=0, le=2**31 - 1)]
    world_size: Annotated[int, Field(ge=1, le=2**31 - 1)]
    step: Annotated[int, Field(ge=0, le=2**62)]
    step_time_s: Annotated[float, Field(ge=0, le=10**6)] | None = None
    ts: AwareDatetime
    layout: Annotated[list[NodeName], Field(max_length=65536)] | None = None
    starting: bool = False


class RestoreReport(_Model):
    """The outcome of one rank's restore.

    Attributes:
        step: the step loaded (None: nothing to restore, or the restore failed).
        seconds: wall time of the restore (agreement, staging, load).
        steps_lost: ``last_step - step``: completed steps that were not recovered (the newest
            step this rank had reported done before the failure, when known).
        files_by_tier: how many files came from each tier (memory | peer | persistent).
        sources: per file name, ``"<tier>:<node>"`` it came from.
        ok: False when the restore failed (``message`` says why).
        request_id: the operator's restore request this rank carried out (None: a restore
            at start with no request).
        phase: ``staging`` (the rank started on ``request_id``; ``step`` is the target,
            ``seconds`` 0), ``loaded`` or ``failed`` (the outcome); None means the outcome
            (``ok`` tells which).
    """

    job_id: JobId
    rank: Annotated[int, Field(ge=0, le=2**31 - 1)]
    world_size: Annotated[int, Field(ge=1, le=2**31 - 1)]
    step: Annotated[int, Field(ge=0, le=2**62)] | None = None
    ts: AwareDatetime
    seconds: Annotated[float, Field(ge=0, le=10**7)]
    steps_lost: Annotated[int, Field(ge=0)] | None = None
    files_by_tier: dict[TierName, Annotated[int, Field(ge=0)]] = {}
    sources: Annotated[
        dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=300)]],
        Field(max_length=4096),
    ] = {}
    ok: bool = True
    message: Annotated[Text, Field(max_length=2000)] = ""
    # restore_requests.id is a 32-bit integer column: a larger id names no request (and on
    # PostgreSQL would fail the whole report, which the agent then retries for ever).
    request_id: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    phase: Literal["staging", "loaded", "failed"] | None = None


class ReportBatch(_Model):
    """One agent report: what the collectors read since the previous batch.

    ``gpus`` is the node's GPU inventory (sent in every batch; it is small). ``dropped_batches``
    counts batches the agent's spool discarded (oldest first) because it was full.
    ``samples`` holds every GPU's reading, or none (a heartbeat): an agent sends them at least
    every ``sample_every`` reports and in any report whose health readings changed
    (:mod:`tierwatch.agent.sampling`), so a GPU's newest sample may be up to
    ``sample_every × interval_s`` old while it is read fine.
    """

    protocol: Literal[1] = PROTOCOL_VERSION
    node: NodeName
    epoch: Annotated[Text, Field(min_length=1, max_length=64)]
    seq: Annotated[int, Field(ge=1, le=2**63 - 1)]
    sent_at: AwareDatetime
    agent_version: Annotated[Text, Field(max_length=32)] = ""
    collector: Annotated[Text, Field(max_length=32)] = ""
    simulated: bool = False
    interval_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    # full samples at least every this many reports (agent.sampling); 1 for older agents
    sample_every: Annotated[int, Field(ge=1, le=720)] = 1
    gpus: Annotated[list[GpuInfo], Field(max_length=64)] = []
    samples: Annotated[list[GpuSample], Field(max_length=4096)] = []
    xids: Annotated[list[XidEvent], Field(max_length=4096)] = []
    latency: Annotated[list[LatencySample], Field(max_length=4096)] = []
    events: Annotated[list[AgentEvent], Field(max_length=1024)] = []
    checkpoint_events: Annotated[list[CheckpointEvent], Field(max_length=4096)] = []
    progress: Annotated[list[JobProgress], Field(max_length=4096)] = []
    restores: Annotated[list[RestoreReport], Field(max_length=1024)] = []
    command_results: Annotated[list[CommandResult], Field(max_length=1024)] = []
    dropped_batches: Count = 0

    @model_validator(mode="after")
    def _consistent_gpus(self) -> ReportBatch:
        """GPU indices are unique in the inventory, and samples and XIDs name a GPU of it."""
        indices = [g.index for g in self.gpus]
        if len(set(indices)) != len(indices):
            raise ValueError("gpus: each GPU index may appear once in the inventory")
        if self.gpus:
            known = set(indices)
            named = (
                ("samples", [s.index for s in self.samples]),
                ("xids", [x.gpu for x in self.xids]),
            )
            for field, gpus in named:
                for i, gpu in enumerate(gpus):
                    if gpu not in known:
                        raise ValueError(
                            f"{field}[{i}] names GPU {gpu}, which is not in this batch's "
                            f"inventory (GPUs {sorted(known)})"
                        )
        return self


CommandId = Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class Command(_Model):
    """A command for the agent, delivered in the answer to a report.

    ``kind`` and ``args``:

    - ``isolate`` / ``release``: ``{"reason": str, "actor": str}``; the agent runs its
      node-local isolation driver (``--isolation-command``) with them.
    - ``restore``: ``{"request_id": int, "job_id": str, "step": int, "tier": str | None,
      "reason": str, "actor": str, "not_after": ISO time}``; the agent hands the request to
      the job's ranks on this node, which roll back in-process at an agreed step boundary
      (or restore that step at their next start, unless ``not_after`` has passed).

    A command is executed at most once per ``id`` (re-deliveries are answered with the
    recorded result). ``expires_at``: the agent refuses to start it after this time.
    """

    id: CommandId
    kind: Annotated[Text, Field(min_length=1, max_length=32)]
    args: dict[str, Any] = {}
    expires_at: AwareDatetime | None = None


class CommandResult(_Model):
    """What became of a command on the agent (reported in the next batch).

    ``state``: ``running`` (accepted and started; a restore waits for its ranks), then
    ``succeeded`` or ``failed``. ``exit_code`` and ``output`` (the last 4,000 characters of
    stdout+stderr) come from a driver executable when one ran.
    """

    id: CommandId
    state: Literal["running", "succeeded", "failed"]
    ts: AwareDatetime
    # Stored in a 32-bit integer column (an exit status or an HTTP status fits).
    exit_code: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None
    output: Annotated[Text, Field(max_length=4000)] = ""


class ReportAck(_Model):
    """The server's answer to a report.

    ``stored`` is False when this (epoch, seq) was already held (a replay); the agent drops
    the batch from its spool either way. ``acked_seq`` is the highest seq the server holds
    for this epoch.
    """

    epoch: str
    acked_seq: int
    stored: bool
    commands: list[Command] = []

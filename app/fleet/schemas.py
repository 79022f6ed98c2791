"""API shapes of the fleet (pydantic v2). Units are in field names (see agent.protocol)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from tierwatch.agent.protocol import Text
from tierwatch.server.fleet.rules import RULES
from tierwatch.server.fleet.service import NodeView, node_view_fields


class ReasonOut(BaseModel):
    """Why a node is not healthy, and what to do about it."""

    rule: str
    severity: str
    gpu: int | None
    key: str
    message: str
    action: str
    evidence: dict[str, Any]
    first_seen: datetime
    last_seen: datetime


class GpuOut(BaseModel):
    """A GPU with its latest values (None = not supported/read)."""

    index: int
    uuid: str
    name: str
    ts: datetime | None
    temperature_c: float | None = None
    slowdown_temp_c: float | None = None
    shutdown_temp_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    utilization_pct: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    row_remap_pending: bool | None = None
    row_remap_failure: bool | None = None
    pcie_replay_count: int | None = None
    throttle_reasons: int | None = None
    throttle_reason_names: list[str] = []
    nvlink_crc_errors: int | None = None
    nvlink_replay_errors: int | None = None
    nvlink_recovery_errors: int | None = None
    xid_count: int = 0


class IsolationOut(BaseModel):
    """Who isolated a node, when and why (the overlay; the driver run is a command)."""

    at: datetime | None
    by: str
    reason: str


class NodeOut(BaseModel):
    """A node: effective state (unreachable overrides health), reasons and GPUs.

    ``isolated`` is the operator's overlay (it holds whatever the health state until the
    node is released); ``isolation`` says who/when/why while it is set.
    """

    name: str
    state: str
    health_state: str
    reasons: list[ReasonOut]
    isolated: bool
    isolation: IsolationOut | None = None
    released_at: datetime | None = None
    simulated: bool
    collector: str
    agent_version: str
    interval_s: float
    first_seen: datetime | None
    last_seen: datetime | None
    state_since: datetime | None
    gpus: list[GpuOut]


class ReportStats(BaseModel):
    """What the server holds of the node's current agent epoch."""

    epoch: str
    first_seq: int | None
    last_seq: int | None
    batches: int
    missing: int
    dropped_by_agent: int


class NodeDetailOut(NodeOut):
    """A node with its report bookkeeping."""

    reports: ReportStats


class NodeList(BaseModel):
    """One page of nodes plus the number per state.

    Attributes:
        counts: nodes per effective state (name filter applied; state filter and paging not).
        nodes: this page, in name order.
        next_cursor: pass as ``cursor`` for the next page; None on the last one.
    """

    counts: dict[str, int]
    nodes: list[NodeOut]
    next_cursor: str | None = None


class EventOut(BaseModel):
    """One event (XID, state change, agent event, acknowledgement)."""

    id: int
    node: str | None
    kind: str
    gpu: int | None
    code: int | None
    ts: datetime
    severity: str
    message: str
    data: dict[str, Any]


def _known_rule(value: str) -> str:
    if value not in RULES:
        raise ValueError(f"unknown rule {value!r}; rules: {', '.join(RULES)}")
    return value


RuleId = Annotated[str, AfterValidator(_known_rule)]


class AckIn(BaseModel):
    """Acknowledge a node's reasons: all of them, or one rule and/or one GPU."""

    model_config = ConfigDict(extra="forbid")

    rule: RuleId | None = None
    gpu: Annotated[int, Field(ge=0, le=255)] | None = None
    note: Annotated[Text, Field(max_length=2000)] = ""


class AckOut(BaseModel):
    """Result of an acknowledgement."""

    cleared: int
    node: NodeOut


def node_out(view: NodeView, *, detail: dict[str, Any] | None = None) -> NodeOut:
    """Build the API shape of a node view (a NodeDetailOut when ``detail`` is given).

    The fields come from :func:`fleet.service.node_view_fields`, as ``GET /api/v1/nodes``'s
    rows do (``node_list_payload``) and the node page's.
    """
    fields = node_view_fields(view)
    if detail is not None:
        return NodeDetailOut(**fields, reports=ReportStats(**detail))
    return NodeOut(**fields)

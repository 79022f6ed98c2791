"""Request and response models of the actions API (``/api/v1``)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from tierwatch.agent.protocol import _no_nul
from tierwatch.server.actions.settings import PolicySettings
from tierwatch.server.fleet.schemas import NodeOut

Reason = Annotated[
    str,
    StringConstraints(strip_whitespace=True, min_length=1, max_length=1000),
    AfterValidator(_no_nul),
    Field(description="why (required; shown in the audit log and to other operators)"),
]


class ReasonIn(BaseModel):
    """Body of isolate / release."""

    model_config = ConfigDict(extra="forbid")

    reason: Reason


class RestoreIn(BaseModel):
    """Body of a restore request.

    ``step``: the step to roll back to (default: the newest step some tier holds
    completely, or that ``tier`` holds). ``tier``: restore from this tier only.
    """

    model_config = ConfigDict(extra="forbid")

    step: Annotated[int, Field(ge=0, le=2**62)] | None = None
    tier: Literal["memory", "peer", "persistent"] | None = None
    reason: Reason


class CommandOut(BaseModel):
    """A queued command and what became of it."""

    id: str
    kind: str
    node: str | None
    executor: Literal["agent", "server"]
    driver: str
    state: Literal["pending", "delivered", "running", "succeeded", "failed", "expired"]
    actor: str
    reason: str
    args: dict[str, Any]
    created_at: datetime
    expires_at: datetime
    delivered_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    attempts: int
    exit_code: int | None
    output: str
    restore_id: int | None


class IsolationOut(BaseModel):
    """The answer to isolate / release: the node as it now is, and the driver run."""

    changed: bool = Field(description="False when the node already was in that state")
    node: NodeOut
    command: CommandOut | None = Field(description="the driver run queued (None: driver none)")


class RankProgressOut(BaseModel):
    """One rank's progress on a restore request."""

    rank: int
    node: str
    phase: Literal["pending", "staging", "loaded", "failed"]
    step: int | None
    tier: str | None = Field(description="tier most of the rank's files came from")
    files_by_tier: dict[str, int]
    seconds: float | None
    steps_lost: int | None
    message: str
    updated_at: datetime | None


class RestoreRequestOut(BaseModel):
    """A restore request with each rank's progress."""

    id: int
    job_id: str
    step: int
    tier: str | None
    reason: str
    actor: str
    state: Literal["running", "succeeded", "failed", "expired"]
    created_at: datetime
    finished_at: datetime | None
    seconds: float | None = Field(description="slowest rank's restore time (s)")
    steps_lost: int | None = Field(description="most steps a rank lost")
    message: str
    ranks: list[RankProgressOut]


class AuditOut(BaseModel):
    """One audit-log entry."""

    id: int
    ts: datetime
    actor: str
    role: str
    action: str
    target_kind: str
    target: str
    reason: str
    outcome: str
    detail: dict[str, Any]


class BreakerOut(BaseModel):
    """The auto-isolation circuit breaker."""

    tripped: bool
    tripped_at: datetime | None
    message: str
    allowed_per_window: int
    isolated_in_window: int
    nodes: int


class PolicyOut(BaseModel):
    """The auto-isolation policy: settings in force (and where each comes from), the
    breaker, and the policy's recent actions."""

    settings: PolicySettings
    source: dict[str, Literal["env", "admin"]]
    breaker: BreakerOut
    updated_at: datetime | None
    updated_by: str
    recent: list[AuditOut]


class MaintenanceOut(BaseModel):
    """A maintenance window (``actions.models.MaintenanceWindow``); ``state`` is
    ``scheduled`` (not open yet), ``active`` or ``over`` at the time of the answer."""

    id: int
    scope: Literal["node", "cluster"]
    node: str | None
    starts_at: datetime
    ends_at: datetime
    ended_at: datetime | None
    ended_by: str
    reason: str
    created_by: str
    created_at: datetime
    state: Literal["scheduled", "active", "over"]


class MaintenanceList(BaseModel):
    """Maintenance windows, newest first."""

    windows: list[MaintenanceOut]

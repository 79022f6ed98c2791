"""Settings of the action machinery (nested in the server settings; no server imports here,
so ``config`` can import them)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

WORKFLOW_PREFIX = "WORKFLOW_"


class QueueSettings(BaseModel):
    """Command-queue settings (``TIERWATCH_COMMANDS__*``).

    Attributes:
        ttl_s: a command nobody started within this many seconds expires (default 15 min).
        redeliver_s: a delivered command the agent has not reported on is sent again after
            this many seconds (the answer may have been lost; the agent runs it once).
        restore_ttl_s: a restore request whose ranks have not all answered within this many
            seconds expires (its ranks may be down for good; default 1 h).
        max_per_ack: at most this many commands ride on one report answer.
    """

    ttl_s: Annotated[float, Field(gt=0)] = 900.0
    redeliver_s: Annotated[float, Field(gt=0)] = 10.0
    restore_ttl_s: Annotated[float, Field(gt=0)] = 3600.0
    max_per_ack: Annotated[int, Field(ge=1, le=1000)] = 50


class PolicySettings(BaseModel):
    """Auto-isolation settings (``TIERWATCH_POLICY__*``; an admin can override the first five
    through ``PUT /api/v1/policy``).

    Attributes:
        enabled: act at all (default off).
        unreachable_s: isolate a node unreachable for longer than this (seconds).
        breaker_pct: at most this percentage of nodes auto-isolated per window (at least 1).
        breaker_window_s: the breaker's window (seconds).
        restore_jobs: also request a restore (newest committed step) of the jobs that ran on
            an auto-isolated node.
        actions: recommended-action codes that make an unhealthy node a candidate (any
            ``WORKFLOW_*`` code always does).
        control_plane_window_s: after this replica started, became leader or resumed from a
            stall, unreachability is not acted on for this long; also the window of the
            "many nodes at once" rule (seconds; :mod:`~tierwatch.server.actions.control_plane`).
        suspect_ingest_lag_s: reports waiting longer than this to be stored make the control
            plane suspect (seconds).
        suspect_unreachable_pct: more than this percentage of nodes (and at least 2) going
            unreachable within one window makes the control plane suspect.
        maintenance_max_s: the longest maintenance window an operator may open (seconds;
            default 7 days), so a forgotten window cannot silence a node for good.
    """

    enabled: bool = False
    unreachable_s: Annotated[float, Field(gt=0, le=30 * 86400)] = 30.0
    breaker_pct: Annotated[float, Field(gt=0, le=100)] = 10.0
    breaker_window_s: Annotated[float, Field(gt=0, le=30 * 86400)] = 600.0
    restore_jobs: bool = False
    actions: list[str] = ["RESET_GPU", "RESTART_BM", "REPLACE_GPU"]
    control_plane_window_s: Annotated[float, Field(gt=0, le=86400)] = 300.0
    suspect_ingest_lag_s: Annotated[float, Field(gt=0)] = 10.0
    suspect_unreachable_pct: Annotated[float, Field(gt=0, le=100)] = 5.0
    maintenance_max_s: Annotated[float, Field(gt=0, le=366 * 86400)] = 7 * 86400.0


class PolicyUpdate(BaseModel):
    """An admin's change to the policy: fields left out keep their value; ``null`` returns a
    field to its ``TIERWATCH_POLICY__*`` setting."""

    model_config = {"extra": "forbid"}

    enabled: bool | None = None
    unreachable_s: Annotated[float, Field(gt=0, le=30 * 86400)] | None = None
    breaker_pct: Annotated[float, Field(gt=0, le=100)] | None = None
    breaker_window_s: Annotated[float, Field(gt=0, le=30 * 86400)] | None = None
    restore_jobs: bool | None = None

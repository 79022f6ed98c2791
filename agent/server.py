"""The agent's local HTTP API (FastAPI, served by uvicorn inside the agent process).

Endpoints:

- ``GET /v1/status``: node, collector, simulated flag, epoch, last seq built/sent/acked, spool
  depth, dropped and rejected batch counts (read-only, open to any client that can connect).
- ``POST /v1/inject``: inject a fault into the simulated collector
  (body ``{"fault": ..., "gpu": int|null, "value": number|null}``); 409 on a real collector,
  422 on an unknown fault, a GPU index out of range or a missing/extra value.
- ``POST /v1/trainer/latency``: a list of
  :class:`~tierwatch.agent.protocol.LatencySample` from local training ranks, queued into the
  next report.

- Checkpoint endpoints ``/v1/ckpt/*`` (control) and peer endpoints ``/v1/peer/*`` (peer
  token): see :mod:`tierwatch.agent.checkpoint.tierstore.api` and docs/checkpointing.md.

Control endpoints (``/v1/inject``, ``/v1/trainer/*``, ``/v1/ckpt/*``) answer 403 to clients
whose address is not loopback unless the request carries ``Authorization: Bearer <the
agent's token>``. The server binds to loopback by default (``--listen``).
"""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from tierwatch import __version__
from tierwatch.agent.collectors.simulated import Fault, FaultError
from tierwatch.agent.config import is_loopback_host
from tierwatch.agent.protocol import LatencySample

if TYPE_CHECKING:
    from tierwatch.agent.runtime import AgentRuntime


class InjectRequest(BaseModel):
    """Body of ``POST /v1/inject``.

    Attributes:
        fault: What to inject (see :mod:`tierwatch.agent.collectors.simulated`).
        gpu: Target GPU index (None: GPU 0, or all GPUs for ``clear``).
        value: XID code for ``xid``, temperature (°C) for ``temp``; None otherwise.
    """

    model_config = ConfigDict(extra="forbid")

    fault: Fault
    gpu: Annotated[int, Field(ge=0, le=255)] | None = None
    value: float | None = None


class InjectResponse(BaseModel):
    """Answer of ``POST /v1/inject``."""

    ok: bool = True
    fault: str
    gpu: int | None
    message: str


class QueuedResponse(BaseModel):
    """Answer of ``POST /v1/trainer/latency``."""

    queued: int


def create_app(runtime: AgentRuntime) -> FastAPI:
    """Build the local API app for one agent runtime.

    Args:
        runtime: The running agent (collector, reporter, settings, latency queue).

    Returns:
        The FastAPI application.
    """
    app = FastAPI(title="tierwatch agent", version=__version__, docs_url=None, redoc_url=None)

    def control_access(request: Request) -> None:
        """Allow loopback clients, or others with the agent's bearer token.

        Raises:
            HTTPException: 403 with the reason when neither holds.
        """
        host = request.client.host if request.client else ""
        if is_loopback_host(host):
            return
        token = runtime.settings.token_value
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if (
            token
            and scheme.lower() == "bearer"
            and hmac.compare_digest(given.strip().encode(), token.encode())
        ):
            return
        raise HTTPException(
            status_code=403,
            detail=f"control endpoints accept loopback clients only; from {host or 'unknown'} "
            "send 'Authorization: Bearer <agent token>'",
        )

    control = [Depends(control_access)]

    @app.get("/v1/status")
    def status() -> dict[str, Any]:
        """The agent's identity, collector and reporting state."""
        return runtime.status()

    @app.post("/v1/inject", dependencies=control)
    def inject(body: InjectRequest) -> InjectResponse:
        """Inject a fault into the simulated collector (409 on a real collector)."""
        collector = runtime.collector
        inject_fn = getattr(collector, "inject", None)
        if not collector.simulated or inject_fn is None:
            raise HTTPException(
                status_code=409,
                detail=f"this agent reads real GPUs through the '{collector.name}' collector; "
                "faults can only be injected into an agent started with --collector simulated",
            )
        try:
            message = inject_fn(body.fault, body.gpu, body.value)
        except FaultError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        return InjectResponse(fault=body.fault, gpu=body.gpu, message=message)

    @app.post("/v1/trainer/latency", dependencies=control)
    def trainer_latency(
        samples: Annotated[list[LatencySample], Field(max_length=4096)],
    ) -> QueuedResponse:
        """Queue collective-latency samples (ms) from local ranks into the next report."""
        runtime.add_latency(samples)
        return QueuedResponse(queued=len(samples))

    from tierwatch.agent.checkpoint.tierstore.api import ckpt_router

    # the store counts once it has started (agent.json written, peer URL known)
    app.include_router(
        ckpt_router(
            lambda: runtime.ckpt if runtime.ckpt is not None and runtime.ckpt.started else None,
            control=control,
            queue_events=runtime.add_checkpoint_reports,
        )
    )
    return app

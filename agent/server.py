"""The agent's local HTTP API (FastAPI, served by uvicorn inside the agent process).

Endpoints:

- ``GET /v1/status``: node, collector, simulated flag, epoch, last seq built/sent/acked, spool
  depth, dropped and rejected batch counts (read-only, open to any client that can connect).
- ``GET /metrics``: this node's GPUs in dcgm-exporter's Prometheus format
  (:mod:`tierwatch.agent.exporter`), read-only and open like ``/v1/status``: it holds the
  telemetry a node's dcgm-exporter serves to anyone on port 9400 (no token, job data or
  paths), and Prometheus scrapes exporters without credentials. The same endpoint, alone, is
  served by the separate metrics listener (``--metrics-listen``, :func:`create_metrics_app`),
  so Prometheus can reach it while the control API stays on loopback.
- ``POST /v1/inject``: inject a fault into the simulated collector
  (body ``{"fault": ..., "gpu": int|null, "value": number|null}``); 409 on a real collector,
  422 on an unknown fault, a GPU index out of range or a missing/extra value.
- ``POST /v1/trainer/latency``: a list of
  :class:`~tierwatch.agent.protocol.LatencySample` from local training ranks, queued into the
  next report.

- Checkpoint endpoints ``/v1/ckpt/*`` (control) and peer endpoints ``/v1/peer/*`` (signed
  by the calling node, :mod:`tierwatch.agent.peer_identity`): see
  :mod:`tierwatch.agent.checkpoint.tierstore.api` and docs/checkpointing.md.

Control endpoints need a bearer credential whatever the client's address
(:mod:`tierwatch.agent.access`): ``/v1/inject`` the agent token; ``/v1/trainer/latency`` and
``/v1/ckpt/*`` the agent token or a job credential, which acts for its own job only. Loopback
grants nothing. The server binds to loopback by default (``--listen``).
"""

from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Response
from pydantic import BaseModel, ConfigDict, Field

from tierwatch import __version__
from tierwatch.agent.access import Caller, LocalAccess, require_jobs
from tierwatch.agent.bodylimit import BodyLimit
from tierwatch.agent.collectors.simulated import Fault, FaultError
from tierwatch.agent.exporter import CONTENT_TYPE
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


def create_app(runtime: "AgentRuntime") -> FastAPI:
    """Build the local API app for one agent runtime.

    Args:
        runtime: The running agent (collector, reporter, settings, latency queue).

    Returns:
        The FastAPI application.
    """
    app = FastAPI(title="tierwatch agent", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit)  # every endpoint's body limit: agent/bodylimit.py

    access = LocalAccess(runtime.settings.token_value, runtime.keys)
    NodeCaller = Annotated[Caller, Depends(access.node())]
    AnyCaller = Annotated[Caller, Depends(access.any())]

    @app.get("/v1/status")
    def status() -> dict[str, Any]:
        """The agent's identity, collector and reporting state."""
        return runtime.status()

    _add_metrics_route(app, runtime)

    @app.post("/v1/inject")
    def inject(body: InjectRequest, _: NodeCaller) -> InjectResponse:
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

    @app.post("/v1/trainer/latency")
    def trainer_latency(
        samples: Annotated[list[LatencySample], Field(max_length=4096)], who: AnyCaller
    ) -> QueuedResponse:
        """Queue collective-latency samples (ms) from local ranks into the next report
        (a job credential: samples of its own job only)."""
        require_jobs(who, {s.job_id for s in samples})
        runtime.add_latency(samples)
        return QueuedResponse(queued=len(samples))

    from tierwatch.agent.checkpoint.tierstore.api import ckpt_router

    # the store counts once it has started (agent.json written, peer URL known)
    app.include_router(
        ckpt_router(
            lambda: runtime.ckpt if runtime.ckpt is not None and runtime.ckpt.started else None,
            access=access,
            queue_events=runtime.add_checkpoint_reports,
        )
    )
    return app


def _add_metrics_route(app: FastAPI, runtime: "AgentRuntime") -> None:
    @app.get("/metrics", response_class=Response)
    def metrics() -> Response:
        """This node's GPUs in dcgm-exporter's Prometheus text format.

        No credential (principal: anyone who can connect), as ``/v1/status``: read-only GPU
        telemetry that dcgm-exporter itself serves without one, rendered from the runtime's
        latest readings (a scrape never calls the collector).
        """
        return Response(runtime.render_metrics(), media_type=CONTENT_TYPE)


def create_metrics_app(runtime: "AgentRuntime") -> FastAPI:
    """The separate metrics listener's app: ``GET /metrics`` and nothing else.

    Args:
        runtime: The running agent.

    Returns:
        A FastAPI application without docs or OpenAPI routes.
    """
    app = FastAPI(
        title="tierwatch agent metrics",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(BodyLimit)
    _add_metrics_route(app, runtime)
    return app

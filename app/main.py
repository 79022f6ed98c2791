"""The control-plane application: ``create_app()`` wires routers, middleware and lifespan."""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.gzip import GZipMiddleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierwatch import __version__
from tierwatch.server.actions import api as actions_api
from tierwatch.server.actions import maintenance_api
from tierwatch.server.actions import views as actions_views
from tierwatch.server.alerts import api as alerts_api
from tierwatch.server.alerts import views as alerts_views
from tierwatch.server.background import BackgroundWork
from tierwatch.server.checkpoints import api as checkpoints_api
from tierwatch.server.checkpoints import views as checkpoints_views
from tierwatch.server.config import Settings, get_settings
from tierwatch.server.credentials import api as credentials_api
from tierwatch.server.db import make_engine, make_sessionmaker, pool_capacity
from tierwatch.server.demo import api as demo_api
from tierwatch.server.demo import views as demo_views
from tierwatch.server.fleet import api as fleet_api
from tierwatch.server.fleet import prom_history
from tierwatch.server.fleet import views as fleet_views
from tierwatch.server.ingest import api as ingest_api
from tierwatch.server.ingest.writer import IngestWriter, WriterMetrics
from tierwatch.server.metrics import ScrapeCache, make_registry
from tierwatch.server.resources import resource_dir
from tierwatch.server.security import (
    LoginLimiter,
    TokenResolver,
    principal_from_request,
    role_refusal,
)
from tierwatch.server.web import signin
from tierwatch.server.web.csrf import SESSION_COOKIE

log = logging.getLogger("tierwatch.server")


class BodySizeLimit:
    """Refuse request bodies over ``limit`` bytes with 413, before the route reads them.

    Checks ``Content-Length`` up front and counts streamed (chunked) bodies as they arrive.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._too_large(scope, receive, send)
            return
        seen = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    # Answer 413 now; the route then sees a disconnect and its own reply
                    # (whatever it is) is dropped by guarded_send.
                    refused = True
                    await self._too_large(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not refused:
                raise
            # The route failed on the disconnect we fed it after answering 413: expected.

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = JSONResponse(
            {
                "detail": f"request body is larger than the {self.limit}-byte limit; send smaller "
                "batches (or raise TIERWATCH_MAX_BODY_BYTES)"
            },
            status_code=413,
        )
        await response(scope, receive, send)


def _field_path(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = [
        {"field": _field_path(e.get("loc", ())), "message": e.get("msg", ""), "type": e.get("type")}
        for e in exc.errors()
    ]
    summary = "; ".join(f"{e['field']}: {e['message']}" for e in errors[:5])
    return JSONResponse(
        status_code=422,
        content=jsonable_encoder({"detail": f"invalid request: {summary}", "errors": errors}),
    )


def _register_wire_schemas(app: FastAPI) -> None:
    """Add the agent wire models to the OpenAPI components (the ingest route parses its
    body itself, so FastAPI would not list ``ReportBatch`` on its own)."""
    from fastapi.openapi.utils import get_openapi

    from tierwatch.agent.protocol import ReportBatch

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            defs = ReportBatch.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(defs.pop("$defs", {}))
            components["ReportBatch"] = defs
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def connection_budget(app: FastAPI) -> dict[str, int]:
    """The most PostgreSQL connections each engine of ``app`` can hold open at once.

    Keys: ``requests`` (the request pool: requests, background work, the token cache;
    ``TIERWATCH_DB_POOL_SIZE + TIERWATCH_DB_MAX_OVERFLOW``), ``ingest writer`` (2) and
    ``leader lock`` (2: its lock, and a second connection while it takes the lock). Their
    sum is one replica's most. ``tierwatch-server serve`` migrates on one more connection,
    closed before these open. All 0 on SQLite. (docs/operations.md, "Running several
    replicas".)
    """
    return {
        "requests": pool_capacity(app.state.engine),
        "ingest writer": pool_capacity(app.state.writer_engine),
        "leader lock": pool_capacity(app.state.background.lock.engine),
    }


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the control-plane app.

    Raises:
        ConfigError: unsafe settings outside dev mode (e.g. no secret key).
    """
    settings = settings or get_settings()
    settings.check_serving()
    # Every PostgreSQL connection this replica can open comes from three engines (see
    # connection_budget): this request pool, the ingest writer's and the leader lock's.
    engine = make_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await app.state.ingest_writer.start()
        app.state.background.start()
        yield
        await app.state.background.stop()
        await app.state.ingest_writer.stop()
        writer_engine.dispose()
        engine.dispose()
        if app.state.prom_history is not None:
            app.state.prom_history.close()

    app = FastAPI(
        title="tierwatch",
        version=__version__,
        description="GPU-cluster health and tiered checkpointing control plane.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = make_sessionmaker(engine)
    app.state.metrics_registry = make_registry(
        app.state.sessionmaker, settings.health, gpu_series=settings.metrics_gpu_series
    )
    # The writer stores one group at a time: one connection of its own, no pre-ping round
    # trip per group (a connection that broke fails that group, is discarded, and the
    # group's reports are retried one by one on a fresh one).
    writer_engine = make_engine(settings.database_url, pool_size=1, max_overflow=1, pre_ping=False)
    app.state.writer_engine = writer_engine
    app.state.ingest_writer = IngestWriter(make_sessionmaker(writer_engine), settings)
    # tierwatch_ingest_refused_total: report items refused for their job (checkpoints.scoping)
    app.state.metrics_registry.register(app.state.ingest_writer.refusals)
    app.state.metrics_registry.register(WriterMetrics(app.state.ingest_writer))
    app.state.metrics_cache = ScrapeCache(app.state.metrics_registry, settings.metrics_cache_s)
    app.state.token_resolver = TokenResolver(engine, settings.token_cache_s)
    # the node charts' history: Prometheus' query_range when TIERWATCH_PROMETHEUS_URL is set
    app.state.prom_history = prom_history.from_settings(settings)
    app.state.background = BackgroundWork(
        app.state.sessionmaker,
        engine,
        settings,
        tick_s=settings.background_tick_s,
        ingest_lag=app.state.ingest_writer.lag,
    )
    # Counted in the database: every replica shares one budget per client address.
    app.state.login_limiter = LoginLimiter(
        app.state.sessionmaker, settings.login_attempts, settings.login_window_s
    )

    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    # The cookie holds the CSRF token, flash messages and, once signed in, an opaque session
    # id (web/sessions.py), never a token. Secure outside dev mode (settings.cookie_secure).
    app.add_middleware(
        SessionMiddleware,
        secret_key=settings.session_secret,
        session_cookie=SESSION_COOKIE,
        same_site="lax",
        max_age=max(1, math.ceil(settings.session_ttl_s)),
        https_only=settings.cookie_secure,
    )
    # Level 5: most of level 9's ratio on JSON/HTML at a fraction of its CPU (the node list
    # of a 2,048-node cluster is ~11 MB before compression).
    app.add_middleware(GZipMiddleware, minimum_size=1024, compresslevel=5)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)

    app.include_router(ingest_api.router)
    app.include_router(fleet_api.router)
    app.include_router(checkpoints_api.router)
    app.include_router(credentials_api.router)
    app.include_router(actions_api.router)
    app.include_router(maintenance_api.router)
    app.include_router(alerts_api.router)
    app.include_router(demo_api.router)
    # Dashboard pages: the sign-in, then each domain's views (one URL each, order-free).
    app.include_router(signin.router)
    app.include_router(fleet_views.router)
    app.include_router(checkpoints_views.router)
    app.include_router(alerts_views.router)
    app.include_router(actions_views.router)
    app.include_router(demo_views.router)
    app.mount("/static", StaticFiles(directory=resource_dir("static")), name="static")

    _register_wire_schemas(app)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/healthz", include_in_schema=False)
    def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.get("/metrics", include_in_schema=False)
    def metrics(request: Request) -> Response:
        if settings.metrics_require_token:
            principal = principal_from_request(request)
            if principal is None:
                return PlainTextResponse("authentication required", status_code=401)
            if not principal.has_role("viewer"):
                return PlainTextResponse(role_refusal(principal.role, "viewer"), status_code=403)
        return Response(app.state.metrics_cache.get(), media_type=CONTENT_TYPE_LATEST)

    return app

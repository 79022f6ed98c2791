"""Server settings, read from ``TIERWATCH_*`` environment variables (pydantic-settings).

Nested health thresholds use a double underscore, e.g. ``TIERWATCH_HEALTH__STRAGGLER_FACTOR=4``.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tierwatch.agent.exporter import DEFAULT_HOST_LABEL, check_label_name
from tierwatch.server.actions.drivers import IsolationSettings
from tierwatch.server.actions.settings import PolicySettings, QueueSettings
from tierwatch.server.alerts.service import AlertSettings
from tierwatch.server.credentials.peer_schemas import (
    MAX_NODE_CERTIFICATE_TTL_S,
    MIN_NODE_CERTIFICATE_TTL_S,
)
from tierwatch.server.credentials.schemas import MAX_TTL_S, MIN_TTL_S
from tierwatch.server.db import DEFAULT_MAX_OVERFLOW, DEFAULT_POOL_SIZE
from tierwatch.server.fleet.prom_history import redact
from tierwatch.server.fleet.rules import HealthThresholds

DEFAULT_DATABASE_URL = "sqlite:///var/tierwatch.db"
_PLACEHOLDER_SECRETS = {"changeme", "change-me", "secret", "dev", "test", "password"}
MIN_SECRET_LENGTH = 32


class ConfigError(RuntimeError):
    """Settings that the server cannot start with; the message says what to set."""


class Settings(BaseSettings):
    """Control-plane settings.

    Attributes:
        database_url: SQLAlchemy URL, ``sqlite:///path/to/file.db`` (default, relative to the
            working directory) or ``postgresql+psycopg://user@host:5432/db``.
        db_pool_size: PostgreSQL connections the request pool keeps open (requests,
            background work, the token cache). With ``db_max_overflow`` it bounds what one
            replica opens: ``db_pool_size + db_max_overflow + 4`` (the ingest writer's 2, the
            leader lock's 2); docs/operations.md, "Running several replicas".
        db_max_overflow: more connections the request pool opens under load, closed again
            when returned.
        secret_key: signs dashboard session cookies; required unless ``dev`` is set.
        dev: development mode (allows running without a secret key; the session cookie
            is not marked ``Secure`` unless ``session_cookie_secure`` says so).
        sample_retention_s: raw GPU samples, latency samples and report seq ranges older than
            this are pruned (seconds; default 24 h).
        event_retention_s: events (XIDs, state changes) older than this are pruned (seconds).
        prune_interval_s: how often the pruner runs (seconds; 0 disables it).
        rollup_retention_s: 5-minute GPU sample rollups (the long-range node charts) older
            than this are pruned (seconds; default 30 days).
        max_body_bytes: request bodies larger than this are refused with 413 (bytes).
        log_level: the server's log level (``debug``, ``info``, ``warning``, ``error``);
            ``serve --log-level`` overrides it, for its worker processes too.
        ingest_max_queue: agent reports one replica holds (queued or being stored) before it
            sheds more with 503 and a ``Retry-After`` sized to the backlog (docs/operations.md,
            "Ingest back-pressure"); the agents keep shed reports in their spools and retry.
        metrics_require_token: require a bearer token for ``GET /metrics``.
        metrics_cache_s: a ``/metrics`` rendering is served this long to every scraper
            (seconds; 0: render each scrape).
        metrics_gpu_series: also re-export every live GPU's dcgm-exporter gauges on the
            server's ``/metrics`` (off: the agents' own ``/metrics`` serve them per node).
        max_clock_skew_s: reports with a time further than this ahead of the server's
            clock are refused (seconds): a future reading would pin a GPU's latest value.
        token_cache_s: how long a process remembers a valid token (seconds); a revoked
            token stops working within this time (0: checked on every request).
        dashboard_refresh_s: how often dashboard pages poll for fresh data (seconds).
        background_tick_s: seconds between two passes of the leader's background work
            (policy, cluster drivers, expiry, alerts); 0: this process never does background
            work (an API-only replica, or tests that drive it themselves).
        login_attempts: failed dashboard sign-ins allowed per client address within
            ``login_window_s`` before further attempts are refused with 429.
        login_window_s: the sign-in rate limit's window (seconds).
        session_ttl_s: how long a dashboard sign-in lasts (seconds; default 12 h). Absolute,
            counted from the sign-in (an open dashboard polls, so an idle timeout would never
            end it); signing out, revoking the token or its expiry end it sooner.
        session_cookie_secure: mark the session cookie ``Secure`` (sent over HTTPS only).
            None (default): on outside dev mode, off in dev mode. Set it off only for a
            dashboard served over plain HTTP on a network you trust.
        prometheus_url: base URL of the Prometheus that scrapes the agents' ``/metrics``
            (``http://prometheus:9090``, a path prefix allowed; ``user:password@`` is sent
            as basic auth). Set: the node charts read from its ``query_range``
            (``tierwatch.server.fleet.prom_history``), falling back to the database while it
            fails; empty (default): the charts read from the database.
        prometheus_host_label: the label of the ``DCGM_FI_*`` series that holds the node's
            name (the agents' ``--metrics-host-label``; dcgm-exporter's ``Hostname``, or
            ``hostname`` since 2026).
        prometheus_timeout_s: how long a chart request waits for Prometheus (seconds).
        prometheus_retry_s: after Prometheus was unreachable, slow or answered 5xx, the
            charts read from the database this long before it is tried again (seconds; 0:
            try every request).
        health: health-rule thresholds (see ``tierwatch.server.fleet.rules``).
        isolation: the isolation driver (``TIERWATCH_ISOLATION__DRIVER=none|command|slurm|
            kubernetes``; see ``tierwatch.server.actions.drivers``).
        commands: the command queue (``TIERWATCH_COMMANDS__TTL_S`` …).
        policy: the auto-isolation policy (``TIERWATCH_POLICY__ENABLED`` …).
        job_credential_ttl_s: lifetime of a job credential when its registration gives none
            (seconds; default 30 days, 60 s to 366 days; see docs/security.md).
        node_certificate_ttl_s: lifetime of a node certificate (``POST
            /api/v1/agent/peer-certificate``; seconds; default 24 h, 300 s to 30 days).
        alerts: webhooks (``TIERWATCH_ALERTS__WEBHOOKS='["https://…"]'`` …).
        demo_report: the JSON report ``make demo`` writes (``TIERWATCH_DEMO_REPORT=
            var/demo-report.json``, relative to the working directory), shown at ``/demo``
            and ``/api/v1/demo/report`` and linked from the dashboard's navigation; read
            again at every request. Unset (or empty): no demo report, both answer 404.
    """

    # hide_input_in_errors: a refused value can hold a secret (a password in a URL, a key)
    model_config = SettingsConfigDict(
        env_prefix="TIERWATCH_",
        env_nested_delimiter="__",
        extra="ignore",
        hide_input_in_errors=True,
    )

    database_url: str = DEFAULT_DATABASE_URL
    db_pool_size: Annotated[int, Field(ge=1)] = DEFAULT_POOL_SIZE
    db_max_overflow: Annotated[int, Field(ge=0)] = DEFAULT_MAX_OVERFLOW
    secret_key: str | None = None
    dev: bool = False
    sample_retention_s: Annotated[float, Field(gt=0)] = 24 * 3600.0
    event_retention_s: Annotated[float, Field(gt=0)] = 30 * 24 * 3600.0
    prune_interval_s: Annotated[float, Field(ge=0)] = 300.0
    rollup_retention_s: Annotated[float, Field(gt=0)] = 30 * 24 * 3600.0
    max_body_bytes: Annotated[int, Field(gt=0)] = 1024 * 1024
    ingest_max_queue: Annotated[int, Field(ge=1)] = 2000
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    metrics_require_token: bool = False
    metrics_gpu_series: bool = False
    metrics_cache_s: Annotated[float, Field(ge=0, le=300)] = 5.0
    token_cache_s: Annotated[float, Field(ge=0)] = 30.0
    max_clock_skew_s: Annotated[float, Field(gt=0)] = 300.0
    dashboard_refresh_s: Annotated[float, Field(gt=0)] = 1.5
    background_tick_s: Annotated[float, Field(ge=0)] = 1.0
    login_attempts: Annotated[int, Field(ge=1)] = 10
    login_window_s: Annotated[float, Field(gt=0)] = 60.0
    session_ttl_s: Annotated[float, Field(gt=0, le=366 * 24 * 3600)] = 12 * 3600.0
    session_cookie_secure: bool | None = None
    prometheus_url: str = ""
    prometheus_host_label: str = DEFAULT_HOST_LABEL
    prometheus_timeout_s: Annotated[float, Field(gt=0, le=120)] = 5.0
    prometheus_retry_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    health: HealthThresholds = HealthThresholds()
    isolation: IsolationSettings = IsolationSettings()
    commands: QueueSettings = QueueSettings()
    policy: PolicySettings = PolicySettings()
    job_credential_ttl_s: Annotated[float, Field(ge=MIN_TTL_S, le=MAX_TTL_S)] = 30 * 24 * 3600.0
    node_certificate_ttl_s: Annotated[
        float, Field(ge=MIN_NODE_CERTIFICATE_TTL_S, le=MAX_NODE_CERTIFICATE_TTL_S)
    ] = 24 * 3600.0
    alerts: AlertSettings = AlertSettings()
    demo_report: Path | None = None

    @field_validator("demo_report", mode="before")
    @classmethod
    def _blank_demo_report_is_unset(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("prometheus_url")
    @classmethod
    def _prometheus_url_is_http(cls, value: str) -> str:
        value = value.strip()
        if not value:
            return ""
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"TIERWATCH_PROMETHEUS_URL {redact(value)!r} is not an http(s) URL: set it to "
                "Prometheus' base URL, e.g. http://prometheus:9090 (empty: charts from the "
                "database)"
            )
        if parts.query or parts.fragment:
            raise ValueError(
                f"TIERWATCH_PROMETHEUS_URL {redact(value)!r} has a query or fragment: give "
                "the base URL only (the server adds /api/v1/query_range)"
            )
        try:
            parts.port  # noqa: B018 - urllib checks the port only when asked
        except ValueError:
            raise ValueError(
                f"TIERWATCH_PROMETHEUS_URL {redact(value)!r} has no valid port: give a number "
                "from 1 to 65535, e.g. http://prometheus:9090"
            ) from None
        return value.rstrip("/")

    @field_validator("prometheus_host_label")
    @classmethod
    def _prometheus_host_label_is_a_label(cls, value: str) -> str:
        return check_label_name(value, "TIERWATCH_PROMETHEUS_HOST_LABEL")

    def check_serving(self) -> None:
        """Refuse settings that are unsafe for serving.

        Raises:
            ConfigError: outside dev mode when ``TIERWATCH_SECRET_KEY`` is unset, shorter than
                32 characters or an obvious placeholder.
        """
        if self.dev:
            return
        key = self.secret_key or ""
        if not key:
            raise ConfigError(
                "TIERWATCH_SECRET_KEY is not set: set it to a random string of at least "
                f"{MIN_SECRET_LENGTH} characters (e.g. `python -c 'import secrets; "
                "print(secrets.token_urlsafe(48))'`), or set TIERWATCH_DEV=1 for local development"
            )
        if key.lower() in _PLACEHOLDER_SECRETS or len(key) < MIN_SECRET_LENGTH:
            raise ConfigError(
                f"TIERWATCH_SECRET_KEY is a placeholder or shorter than {MIN_SECRET_LENGTH} "
                "characters: set a random secret"
            )

    @property
    def cookie_secure(self) -> bool:
        """Whether the session cookie is marked ``Secure``: ``session_cookie_secure``, or,
        when that is unset, outside dev mode."""
        if self.session_cookie_secure is None:
            return not self.dev
        return self.session_cookie_secure

    @property
    def session_secret(self) -> str:
        """The key that signs session cookies (a fixed dev key in dev mode without one)."""
        return self.secret_key or "tierwatch-dev-mode-insecure-session-key"


@lru_cache
def get_settings() -> Settings:
    """Settings from the environment, read once per process."""
    return Settings()

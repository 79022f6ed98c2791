"""Agent settings, read from ``TIERWATCH_*`` environment variables and CLI options.

Every field can be set as ``TIERWATCH_<FIELD>`` (e.g. ``TIERWATCH_NODE=gpu-017``,
``TIERWATCH_SIM_GPUS=4``); options given on the command line take precedence.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tierwatch.agent.protocol import NODE_NAME_PATTERN

CollectorName = Literal["auto", "nvml", "dcgm-exporter", "simulated"]
COLLECTOR_NAMES: tuple[str, ...] = ("auto", "nvml", "dcgm-exporter", "simulated")
DEFAULT_PORT = 9470

_NODE_RE = re.compile(NODE_NAME_PATTERN)


class SettingsError(ValueError):
    """Settings are incomplete or inconsistent for what was asked (the message says what to set)."""


def parse_listen(listen: str) -> tuple[str, int]:
    """Split a listen address into host and port.

    Args:
        listen: ``HOST:PORT``, ``[IPV6]:PORT``, ``HOST`` (port 9470) or ``:PORT`` (loopback).
            Port 0 picks a free ephemeral port.

    Returns:
        ``(host, port)``.

    Raises:
        ValueError: the port is not a number in 0-65535 or the address is empty.
    """
    text = listen.strip()
    if not text:
        raise ValueError("listen address is empty; use HOST:PORT, e.g. 127.0.0.1:9470")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"listen address {listen!r}: missing ']' after the IPv6 address")
        port_text = rest.removeprefix(":") or str(DEFAULT_PORT)
    elif text.count(":") > 1:  # a bare IPv6 address without a port
        host, port_text = text, str(DEFAULT_PORT)
    else:
        host, _, port_text = text.partition(":")
        port_text = port_text or str(DEFAULT_PORT)
    host = host or "127.0.0.1"
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"listen address {listen!r}: port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"listen address {listen!r}: port {port} is outside 0-65535")
    return host, port


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` is a loopback IP address or ``localhost`` (names other than that: no)."""
    if host == "localhost":
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


class AgentSettings(BaseSettings):
    """Configuration of one node agent (env prefix ``TIERWATCH_``).

    Attributes:
        node: This node's name as the control plane knows it (required to run).
        server: Base URL of the control plane, e.g. ``https://tierwatch.example:8000``.
        token: The agent's bearer token (scoped to ``node`` on the server). Also accepted by
            the agent's local API from non-loopback clients.
        collector: ``auto`` (NVML when it loads, else simulated), ``nvml``, ``dcgm-exporter``
            or ``simulated``.
        interval: Seconds between two reports.
        listen: Address of the agent's local HTTP API (loopback by default).
        spool_dir: Folder of the on-disk spool of unsent batches (default
            ``var/spool/<node>`` under the working directory).
        spool_max_batches: Most batches the spool holds; beyond, the oldest are dropped.
        dcgm_exporter_url: The ``/metrics`` URL of a dcgm-exporter on this node.
        sim_gpus: Number of simulated GPUs.
        sim_seed: Seed of the simulator's random generator (None: random).
        sim_job: Job id for which the simulator produces collective-latency samples.
        sim_rank: Rank of those latency samples (with ``sim_job``).
        log_level: Python logging level name.
    """

    model_config = SettingsConfigDict(env_prefix="TIERWATCH_", extra="ignore")

    node: str | None = None
    server: str | None = None
    token: SecretStr | None = None
    collector: CollectorName = "auto"
    interval: float = Field(5.0, gt=0, le=3600)
    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    spool_dir: Path | None = None
    spool_max_batches: int = Field(10000, ge=1)
    dcgm_exporter_url: str = "http://127.0.0.1:9400/metrics"
    sim_gpus: int = Field(8, ge=1, le=64)
    sim_seed: int | None = None
    sim_job: str | None = Field(None, min_length=1, max_length=128)
    sim_rank: int | None = Field(None, ge=0)
    log_level: str = "INFO"

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str | None) -> str | None:
        if value is not None and not _NODE_RE.match(value):
            raise ValueError(
                "node name must be 1-128 characters of letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("server")
    @classmethod
    def _server_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")):
            raise ValueError("server must be an http:// or https:// URL, e.g. http://cp:8000")
        return value

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        parse_listen(value)
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        value = value.upper()
        if value not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError("log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
        return value

    @model_validator(mode="after")
    def _sim_job_and_rank(self) -> AgentSettings:
        if (self.sim_job is None) != (self.sim_rank is None):
            raise ValueError("sim_job and sim_rank go together: set both or neither")
        return self

    @property
    def listen_host(self) -> str:
        """Host part of :attr:`listen`."""
        return parse_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        """Port part of :attr:`listen` (0: ephemeral)."""
        return parse_listen(self.listen)[1]

    @property
    def token_value(self) -> str | None:
        """The token as plain text (None when unset or empty)."""
        return self.token.get_secret_value() if self.token else None

    def resolved_spool_dir(self) -> Path:
        """The spool folder: :attr:`spool_dir`, else ``var/spool/<node>`` under the cwd.

        Raises:
            SettingsError: neither ``spool_dir`` nor ``node`` is set.
        """
        if self.spool_dir is not None:
            return self.spool_dir
        if not self.node:
            raise SettingsError("set spool_dir or node (TIERWATCH_SPOOL_DIR / TIERWATCH_NODE)")
        return Path.cwd() / "var" / "spool" / self.node

    def check_runnable(self) -> None:
        """Check that everything ``tierwatch-agent run`` needs is set.

        Raises:
            SettingsError: node, server or token is missing (names the option and env var).
        """
        missing = [
            f"--{name} (TIERWATCH_{name.upper()})"
            for name, value in (("node", self.node), ("server", self.server),
                                ("token", self.token_value))
            if not value
        ]
        if missing:
            raise SettingsError("missing required setting(s): " + ", ".join(missing))

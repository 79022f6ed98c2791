"""Agent settings, read from ``TIERWATCH_*`` environment variables and CLI options.

Every field can be set as ``TIERWATCH_<FIELD>`` (e.g. ``TIERWATCH_NODE=gpu-017``,
``TIERWATCH_SIM_GPUS=4``); options given on the command line take precedence.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from tierwatch.agent.protocol import NODE_NAME_PATTERN

CollectorName = Literal["auto", "nvml", "dcgm-exporter", "simulated"]
DEFAULT_PORT = 9470
#: Port of ``--metrics-listen HOST`` without one (next to the local API's).
DEFAULT_METRICS_PORT = 9471

_NODE_RE = re.compile(NODE_NAME_PATTERN)


_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?i?B?)?\s*$", re.IGNORECASE)
_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "M": 1000**2,
    "MB": 1000**2,
    "G": 1000**3,
    "GB": 1000**3,
    "T": 1000**4,
    "TB": 1000**4,
    "P": 1000**5,
    "PB": 1000**5,
    "KI": 1024,
    "KIB": 1024,
    "MI": 1024**2,
    "MIB": 1024**2,
    "GI": 1024**3,
    "GIB": 1024**3,
    "TI": 1024**4,
    "TIB": 1024**4,
    "PI": 1024**5,
    "PIB": 1024**5,
}


def parse_bytes(text: str | int) -> int:
    """Parse a size in bytes, with an optional unit suffix.

    Args:
        text: ``123``, ``64KiB``, ``8GiB``, ``1.5G`` (decimal units: kB, MB, GB, TB, PB; binary
            units: KiB, MiB, GiB, TiB, PiB; a bare K/M/G/T/P is decimal). An int is taken as
            bytes.

    Returns:
        The size in bytes (>= 0).

    Raises:
        ValueError: not a number with a known unit, or negative.
    """
    if isinstance(text, bool):
        raise ValueError(f"size {text!r} is not a number of bytes")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size {text} is negative")
        return text
    m = _BYTES_RE.match(str(text))
    unit = (m.group(2) or "").upper() if m else ""
    if not m or unit not in _BYTE_UNITS:
        raise ValueError(
            f"size {text!r}: use bytes or a number with a unit such as 512MiB, 8GiB, 2GB"
        )
    number = float(m.group(1)) * _BYTE_UNITS[unit]
    if number == float("inf"):
        raise ValueError(f"size {text!r} is too large")
    return int(number)


MAX_MEMORY_BUDGET = 2**62


def parse_memory_budget(value: object) -> int:
    """Parse ``--memory-budget``: a positive size in bytes, at most 2**62.

    Raises:
        PydanticCustomError: (a ValueError for pydantic) a one-line message naming
            ``--memory-budget`` (not a size, zero, negative or absurdly large).
    """
    from pydantic_core import PydanticCustomError

    def bad(why: str) -> PydanticCustomError:
        return PydanticCustomError(
            "memory_budget",
            "--memory-budget (TIERWATCH_MEMORY_BUDGET) {value}: {why}",
            {"value": repr(value) if not isinstance(value, int) else str(value), "why": why},
        )

    positive = "must be a positive size such as 8GiB"
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise bad(positive)
    if isinstance(value, str) and value.strip().startswith("-"):
        raise bad(positive)
    try:
        size = parse_bytes(value)
    except (ValueError, OverflowError):
        raise bad(positive) from None
    if size <= 0:
        raise bad(positive)
    if size > MAX_MEMORY_BUDGET:
        raise bad(
            f"{size} bytes is more than any machine has (at most 2**62 bytes); "
            "use a size such as 8GiB"
        )
    return size


S3_DEFAULT_PART_SIZE = 16 * 1024**2
S3_MIN_PART_SIZE = 5 * 1024**2
S3_MAX_PART_SIZE = 5 * 1024**3
_REGION_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_PROFILE_RE = re.compile(r"^[\w.@+=,-]{1,128}$")


def parse_persistent_options(value: object) -> dict[str, Any] | None:
    """Parse ``--persistent-options`` / ``TIERWATCH_PERSISTENT_OPTIONS``: a JSON object of
    fsspec storage options for the persistent URL's filesystem.

    Args:
        value: A JSON text (``'{"endpoint_url": "http://minio:9000"}'``), a dict, or
            None/empty (no options).

    Returns:
        The options (None when empty).

    Raises:
        ValueError: not JSON, or not a JSON object (the message shows an example).
    """
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(
                f"--persistent-options (TIERWATCH_PERSISTENT_OPTIONS) is not valid JSON ({exc}); "
                """use a JSON object such as '{"endpoint_url": "http://minio:9000"}'"""
            ) from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(
            "--persistent-options (TIERWATCH_PERSISTENT_OPTIONS) must be a JSON object of "
            """fsspec storage options, such as '{"endpoint_url": "http://minio:9000"}'"""
        )
    return value or None


class SettingsError(ValueError):
    """Settings are incomplete or inconsistent for what was asked (the message says what to set)."""


def parse_listen(listen: str, default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """Split a listen address into host and port.

    Args:
        listen: ``HOST:PORT``, ``[IPV6]:PORT``, ``HOST`` (port ``default_port``) or ``:PORT``
            (loopback). Port 0 picks a free ephemeral port.
        default_port: The port of an address without one (9470, the local API's).

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
        port_text = rest.removeprefix(":") or str(default_port)
    elif text.count(":") > 1:  # a bare IPv6 address without a port
        host, port_text = text, str(default_port)
    else:
        host, _, port_text = text.partition(":")
        port_text = port_text or str(default_port)
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


def read_secret_file(path: Path, *, option: str) -> str:
    """The secret held in ``path`` (a token file), less one trailing newline.

    The file must be a regular file that only its owner can read (mode 0600 or 0400). As
    PostgreSQL allows for its ``ssl_key_file``, a file owned by root may also be readable by
    its group (0640 / 0440) when this process is not root and reads it through that group:
    that is how a Kubernetes Secret volume with ``fsGroup`` mounts a secret for a non-root
    container. Symlinks are followed (Secret volumes are links).

    Args:
        path: The file.
        option: How the setting is named in messages, e.g. ``--token-file
            (TIERWATCH_TOKEN_FILE)``.

    Returns:
        The file's content without one trailing ``\n`` (or ``\r\n``).

    Raises:
        SettingsError: the file is missing, not a regular file, unreadable, not UTF-8,
            empty, or readable by group (but for the root-owned case above) or by others;
            the message names the option, the path and what to fix.
    """
    where = f"{option} {path}"
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SettingsError(
            f"{where}: no such file (point it at the file that holds the token)"
        ) from None
    except OSError as exc:
        raise SettingsError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise SettingsError(f"{where}: is not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    # group read only where that is how this (non-root) process reads a root-owned file
    via_group = (
        st.st_uid == 0 and os.geteuid() != 0 and st.st_gid in {os.getegid(), *os.getgroups()}
    )
    allowed = 0o740 if via_group else 0o700
    if mode & 0o077 & ~allowed:
        who = "others" if mode & 0o007 else "its group"
        raise SettingsError(
            f"{where}: is readable by {who} (mode {mode:04o}); chmod 600 it"
            + (
                " (or chown root and chmod 640 for a group-readable secret)"
                if who != "others"
                else ""
            )
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise SettingsError(f"{where}: is not UTF-8 text") from None
    except OSError as exc:
        raise SettingsError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    if not text:
        raise SettingsError(f"{where}: is empty (write the token into it)")
    return text


class AgentSettings(BaseSettings):
    """Configuration of one node agent (env prefix ``TIERWATCH_``).

    Attributes:
        node: This node's name as the control plane knows it (required to run).
        server: Base URL of the control plane, e.g. ``https://tierwatch.example:8000``.
        token: The agent's bearer token (scoped to ``node`` on the server). Also accepted by
            the agent's local API from non-loopback clients.
        token_file: A file that holds ``token`` (read by :meth:`check_runnable`, see
            :func:`read_secret_file`); keeps the token out of argv. Not with ``token``.
        collector: ``auto`` (NVML when it loads, else simulated), ``nvml``, ``dcgm-exporter``
            or ``simulated``.
        interval: Seconds between two reports.
        full_sample_every: Every GPU's sample goes out at least every this many reports; the
            reports between carry samples only when a health reading changed
            (:mod:`tierwatch.agent.sampling`; 1: every report).
        listen: Address of the agent's local HTTP API (loopback by default).
        metrics_listen: Address of a second listener that serves only ``GET /metrics``
            (``HOST:PORT``; a bare host listens on port 9471), so Prometheus can scrape the
            node while the control API stays on loopback; None: ``/metrics`` is served on
            the local API only.
        metrics_host_label: Name of the label of ``/metrics`` that holds the node's name
            (dcgm-exporter: ``Hostname``, ``hostname`` since 2026).
        metrics_model_label: Name of the label that holds the GPU model (default
            ``model_name``; dcgm-exporter's ``modelName`` is camelCase, which promtool's
            linter rejects).
        metrics_dcgm_names: Serve dcgm-exporter's exact names and counter types on
            ``/metrics`` (``DCGM_FI_DEV_PCIE_REPLAY_COUNTER``; counters without ``_total``
            as ``counter``), which promtool's linter rejects; default False
            (``tierwatch_gpu_pcie_replays``, ``untyped``; see agent/exporter.py).
        spool_dir: Folder of the on-disk spool of unsent batches (default
            ``var/spool/<node>`` under the working directory).
        spool_max_batches: Most batches the spool holds; beyond, the oldest are dropped.
        shutdown_flush_s: Seconds a stopping agent keeps trying to deliver its spool before
            it exits; what is left is sent on the next start (keep it below the pod's or
            unit's stop timeout).
        dcgm_exporter_url: The ``/metrics`` URL of a dcgm-exporter on this node.
        sim_gpus: Number of simulated GPUs.
        sim_seed: Seed of the simulator's random generator (None: random).
        sim_job: Job id for which the simulator produces collective-latency samples.
        sim_rank: Rank of those latency samples (with ``sim_job``).
        log_level: Python logging level name.
        memory_dir: The node's memory-tier folder, shared with its training ranks (default
            ``/dev/shm/tierwatch/<node>``).
        peer_token, peer_token_file: Retired (a shared secret opened every job's checkpoints):
            set, they stop the agent with a message (:meth:`check_runnable`).
        advertise_url: URL other agents use to reach this agent (default
            ``http://<listen host>:<actual port>``).
        persistent_url: fsspec URL of the persistent tier (default
            ``file://<cwd>/var/checkpoints``; ``s3://bucket/prefix`` for S3 and S3-compatible
            stores).
        persistent_options: fsspec storage options for the persistent URL's filesystem, a
            JSON object (for s3fs: ``endpoint_url``, ``profile``, ``client_kwargs``,
            ``config_kwargs``, …). Unknown s3fs options are refused.
        s3_endpoint_url: S3 only: the endpoint of an S3-compatible store, e.g.
            ``http://minio:9000`` (None: AWS, or ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``
            as botocore reads them).
        s3_region: S3 only: the bucket's region, e.g. ``eu-west-1`` (None: ``AWS_REGION`` /
            ``AWS_DEFAULT_REGION`` or the profile's, as botocore resolves it).
        s3_profile: S3 only: the profile in ``~/.aws/config`` / ``~/.aws/credentials`` whose
            credentials to use (None: botocore's chain: ``AWS_ACCESS_KEY_ID`` +
            ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, then a container or instance role).
            Credentials themselves are never agent settings.
        s3_part_size: S3 only: bytes per part of a multipart upload (5 MiB … 5 GiB); a file
            up to this size is one ``PutObject``.
        s3_upload_concurrency: S3 only: parts of one file uploaded at once (1 … 64); the
            upload holds at most ``(concurrency + 1) * part_size`` bytes.
        replication: Number of peer nodes that hold a replica of each rank's files.
        memory_budget: Most bytes the memory folder may hold before peer uploads are refused
            (507): an int or a size such as ``8GiB``; default 50 % of the size of the
            filesystem that holds ``memory_dir``.
        ckpt_scan_interval: Seconds between two scans of the memory folder for committed steps.
        ckpt_nice: Nice value (0-19) of the threads that replicate and upload checkpoints, so
            they yield the node's cores to training (0: the agent's own priority).
        isolation_command: Executable the ``command`` isolation driver runs on this node for
            ``isolate`` / ``release`` (node name, action and reason in its environment, see
            ``tierwatch.agent.commands``); None: such commands fail with a message saying
            to set it.
        isolation_timeout: Seconds the isolation command may run before it is killed.
        state_dir: Folder of the agent's own state (the ids of commands it ran, so a
            re-delivered command runs once across restarts); default ``var/agent/<node>``.
        credential_keys_file: A JWK set of the server's public keys (the answer of ``GET
            /api/v1/credentials/public-keys``) to check job credentials with; None: fetched
            from the server (see :mod:`tierwatch.agent.credential_keys`).
    """

    model_config = SettingsConfigDict(env_prefix="TIERWATCH_", extra="ignore")

    node: str | None = None
    server: str | None = None
    token: SecretStr | None = None
    token_file: Path | None = None
    collector: CollectorName = "auto"
    interval: float = Field(5.0, gt=0, le=3600)
    full_sample_every: int = Field(6, ge=1, le=720)
    listen: str = f"127.0.0.1:{DEFAULT_PORT}"
    metrics_listen: str | None = None
    # exporter.DEFAULT_HOST_LABEL / DEFAULT_MODEL_LABEL (tested); not imported, so that
    # loading the settings does not load prometheus-client
    metrics_host_label: str = "Hostname"
    metrics_model_label: str = "model_name"
    metrics_dcgm_names: bool = False
    spool_dir: Path | None = None
    spool_max_batches: int = Field(10000, ge=1)
    shutdown_flush_s: float = Field(5.0, ge=0, le=600)
    dcgm_exporter_url: str = "http://127.0.0.1:9400/metrics"
    sim_gpus: int = Field(8, ge=1, le=64)
    sim_seed: int | None = None
    sim_job: str | None = Field(None, min_length=1, max_length=128)
    sim_rank: int | None = Field(None, ge=0)
    log_level: str = "INFO"
    memory_dir: Path | None = None
    peer_token: SecretStr | None = None
    peer_token_file: Path | None = None
    advertise_url: str | None = None
    persistent_url: str | None = None
    persistent_options: Annotated[dict[str, Any] | None, NoDecode] = None
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_profile: str | None = None
    s3_part_size: int = S3_DEFAULT_PART_SIZE
    s3_upload_concurrency: int = Field(8, ge=1, le=64)
    replication: int = Field(1, ge=0, le=64)
    memory_budget: int | None = None
    ckpt_scan_interval: float = Field(2.0, gt=0, le=3600)
    ckpt_nice: int = Field(10, ge=0, le=19)
    isolation_command: Path | None = None
    isolation_timeout: float = Field(60.0, gt=0, le=3600)
    state_dir: Path | None = None
    credential_keys_file: Path | None = None

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _memory_budget(cls, value: object) -> int | None:
        if value is None or value == "":
            return None
        return parse_memory_budget(value)

    @field_validator("advertise_url")
    @classmethod
    def _advertise_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                "advertise_url must be an http:// or https:// URL that other "
                "agents can reach, e.g. http://gpu-017:9470"
            )
        return value

    @field_validator("persistent_url")
    @classmethod
    def _persistent_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        value = value.strip()
        if "://" not in value:  # a plain path: make it a file:// URL
            value = "file://" + str(Path(value).expanduser().absolute())
        return value.rstrip("/")

    @field_validator("persistent_options", mode="before")
    @classmethod
    def _persistent_options(cls, value: object) -> dict[str, Any] | None:
        return parse_persistent_options(value)

    @field_validator("s3_endpoint_url")
    @classmethod
    def _s3_endpoint_url(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        value = value.strip().rstrip("/")
        if not re.match(r"^https?://[^/\s]+$", value):
            raise ValueError(
                f"s3_endpoint_url {value!r}: use the store's http:// or https:// base URL "
                "without a path, e.g. http://minio.example:9000"
            )
        return value

    @field_validator("s3_region")
    @classmethod
    def _s3_region(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not _REGION_RE.match(value.strip()):
            raise ValueError(
                f"s3_region {value!r}: use a region name such as us-east-1 or eu-west-1"
            )
        return value.strip()

    @field_validator("s3_profile")
    @classmethod
    def _s3_profile(cls, value: str | None) -> str | None:
        if value is None or value == "":
            return None
        if not _PROFILE_RE.match(value.strip()):
            raise ValueError(f"s3_profile {value!r}: not a profile name of ~/.aws/config")
        return value.strip()

    @field_validator("s3_part_size", mode="before")
    @classmethod
    def _s3_part_size(cls, value: object) -> int:
        if value is None or value == "":
            return S3_DEFAULT_PART_SIZE
        try:
            size = parse_bytes(value)  # type: ignore[arg-type]
        except (ValueError, OverflowError):
            size = -1
        if not S3_MIN_PART_SIZE <= size <= S3_MAX_PART_SIZE:
            raise ValueError(
                f"s3_part_size {value!r}: must be a size between 5MiB and 5GiB "
                "(S3's part limits), e.g. 16MiB"
            )
        return size

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

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_listen(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        try:
            parse_listen(value, DEFAULT_METRICS_PORT)
        except ValueError as exc:
            raise ValueError(f"--metrics-listen (TIERWATCH_METRICS_LISTEN): {exc}") from None
        return value.strip()

    @field_validator("metrics_host_label")
    @classmethod
    def _metrics_host_label(cls, value: str) -> str:
        from tierwatch.agent.exporter import check_label_name

        return check_label_name(value, "--metrics-host-label (TIERWATCH_METRICS_HOST_LABEL)")

    @field_validator("metrics_model_label")
    @classmethod
    def _metrics_model_label(cls, value: str) -> str:
        from tierwatch.agent.exporter import check_label_name

        return check_label_name(value, "--metrics-model-label (TIERWATCH_METRICS_MODEL_LABEL)")

    @model_validator(mode="after")
    def _metrics_labels_differ(self) -> AgentSettings:
        if self.metrics_host_label == self.metrics_model_label:
            raise ValueError(
                "--metrics-host-label and --metrics-model-label are both "
                f"{self.metrics_host_label!r}: give them two names"
            )
        return self

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

    @model_validator(mode="after")
    def _storage_options(self) -> AgentSettings:
        self.persistent_storage_options()  # a conflict or a misplaced S3 setting fails here
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
    def metrics_address(self) -> tuple[str, int] | None:
        """``(host, port)`` of :attr:`metrics_listen` (None: no separate listener)."""
        if self.metrics_listen is None:
            return None
        return parse_listen(self.metrics_listen, DEFAULT_METRICS_PORT)

    @property
    def token_value(self) -> str | None:
        """The token as plain text (None when unset or empty)."""
        return self.token.get_secret_value() if self.token else None

    def resolved_memory_dir(self) -> Path:
        """The memory folder: :attr:`memory_dir`, else ``/dev/shm/tierwatch/<node>``.

        Raises:
            SettingsError: neither ``memory_dir`` nor ``node`` is set.
        """
        if self.memory_dir is not None:
            return self.memory_dir
        if not self.node:
            raise SettingsError(
                "set memory_dir or node (--memory-dir / TIERWATCH_MEMORY_DIR, "
                "--node / TIERWATCH_NODE)"
            )
        return Path("/dev/shm/tierwatch") / self.node

    def resolved_persistent_url(self) -> str:
        """The persistent tier's fsspec URL (default ``file://<cwd>/var/checkpoints``)."""
        return self.persistent_url or "file://" + str(Path.cwd() / "var" / "checkpoints")

    def persistent_storage_options(self) -> dict[str, Any]:
        """The fsspec storage options for :meth:`resolved_persistent_url`:
        :attr:`persistent_options`, plus (``s3://`` URLs) ``endpoint_url`` from
        :attr:`s3_endpoint_url`, ``profile`` from :attr:`s3_profile` and
        ``client_kwargs.region_name`` from :attr:`s3_region`. Credentials are left to
        botocore's chain unless ``persistent_options`` names them.

        Raises:
            ValueError: an ``s3_*`` setting contradicts the same option in
                ``persistent_options``, or is set for a URL that is not ``s3://`` (the
                message names both settings); an option s3fs does not know (listing the
                known ones).
        """
        options = json.loads(json.dumps(self.persistent_options or {}))  # a deep copy
        given = {
            "s3_endpoint_url": self.s3_endpoint_url,
            "s3_region": self.s3_region,
            "s3_profile": self.s3_profile,
        }
        url = self.resolved_persistent_url()
        if url.partition("://")[0].lower() not in {"s3", "s3a"}:
            misplaced = [f"{k} (TIERWATCH_{k.upper()})" for k, v in given.items() if v]
            if misplaced:
                raise ValueError(
                    f"{', '.join(misplaced)}: S3 settings only work with an s3:// "
                    f"persistent URL, and persistent_url is {url}: unset them or use an s3:// URL"
                )
            return options

        def put(where: dict[str, Any], key: str, value: str | None, setting: str) -> None:
            if value is None:
                return
            if key in where and where[key] != value:
                raise ValueError(
                    f"{setting} (TIERWATCH_{setting.upper()}) is {value!r} but "
                    f"persistent_options sets {key} to {where[key]!r}: set one of them"
                )
            where[key] = value

        put(options, "endpoint_url", self.s3_endpoint_url, "s3_endpoint_url")
        put(options, "profile", self.s3_profile, "s3_profile")
        if self.s3_region is not None:
            client = options.get("client_kwargs")
            if client is None:
                client = options["client_kwargs"] = {}
            if not isinstance(client, dict):
                raise ValueError("persistent_options.client_kwargs must be a JSON object")
            put(client, "region_name", self.s3_region, "s3_region")
        from tierwatch.agent.checkpoint.tierstore.s3 import check_s3_options

        try:
            check_s3_options(options)
        except ImportError:
            raise ValueError(f"{url} needs s3fs: pip install s3fs") from None
        except ValueError as exc:
            raise ValueError(f"persistent_options: {exc}") from None
        return options

    def resolved_memory_budget(self) -> int:
        """The memory budget in bytes: :attr:`memory_budget`, else 50 % of the size of the
        filesystem holding the memory folder (its nearest existing parent).

        Raises:
            SettingsError: as :meth:`resolved_memory_dir`.
        """
        if self.memory_budget is not None:
            return self.memory_budget
        path = self.resolved_memory_dir()
        while not path.exists() and path != path.parent:
            path = path.parent
        st = os.statvfs(path)
        return st.f_frsize * st.f_blocks // 2

    def resolved_state_dir(self) -> Path:
        """The agent's state folder: :attr:`state_dir`, else ``var/agent/<node>`` under the cwd.

        Raises:
            SettingsError: neither ``state_dir`` nor ``node`` is set.
        """
        if self.state_dir is not None:
            return self.state_dir
        if not self.node:
            raise SettingsError(
                "set --state-dir or --node so the agent knows where to keep its state"
            )
        return Path.cwd() / "var" / "agent" / self.node

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

    def load_token_files(self) -> None:
        """Set ``token`` from ``token_file``.

        Raises:
            SettingsError: a token and its file are both given (``--token`` or
                ``TIERWATCH_TOKEN`` with ``--token-file`` or ``TIERWATCH_TOKEN_FILE``, the
                same for the peer token), or the file is unusable (:func:`read_secret_file`).
        """
        for name in ("token",):
            path: Path | None = getattr(self, f"{name}_file")
            if path is None:
                continue
            flag, env = name.replace("_", "-"), f"TIERWATCH_{name.upper()}"
            value = read_secret_file(path, option=f"--{flag}-file ({env}_FILE)")
            given: SecretStr | None = getattr(self, name)
            # a second check (the CLI's, then the runtime's) finds the file's own value
            if given is not None and given.get_secret_value() != value:
                raise SettingsError(
                    f"--{flag} ({env}) and --{flag}-file ({env}_FILE) are both set; "
                    "keep only the file"
                )
            setattr(self, name, SecretStr(value))

    def check_runnable(self) -> None:
        """Check that everything ``tierwatch-agent run`` needs is set.

        Refuses the retired peer token. Reads ``token_file`` into ``token`` first
        (:meth:`load_token_files`).

        Raises:
            SettingsError: node, server or token is missing (names the option and env var),
                a token file is unusable or given beside its token, or the isolation command
                is not an executable file.
        """
        if self.peer_token is not None or self.peer_token_file is not None:
            raise SettingsError(
                "--peer-token / --peer-token-file (TIERWATCH_PEER_TOKEN[_FILE]) are no longer "
                "used: agents authenticate to each other as nodes, with keys the server "
                'certifies (docs/security.md, "Peers"); remove the setting and its Secret'
            )
        self.load_token_files()
        missing = [
            f"--{name} (TIERWATCH_{name.upper()})"
            for name, value in (
                ("node", self.node),
                ("server", self.server),
                ("token", self.token_value),
            )
            if not value
        ]
        if not self.token_value:
            missing[-1] += " or --token-file (TIERWATCH_TOKEN_FILE)"
        if missing:
            raise SettingsError("missing required setting(s): " + ", ".join(missing))
        exe = self.isolation_command
        if exe is not None and not (exe.is_file() and os.access(exe, os.X_OK)):
            raise SettingsError(
                f"--isolation-command (TIERWATCH_ISOLATION_COMMAND) {exe}: "
                + ("is not executable (chmod +x it)" if exe.is_file() else "no such file")
            )

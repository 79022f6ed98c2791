"""``tierwatch-agent``: run the node agent, or inject a fault into a simulated one.

Examples::

    tierwatch-agent run --node gpu-017 --server http://cp:8000 --token-file /etc/tierwatch/token
    tierwatch-agent run ... --metrics-listen 0.0.0.0:9471   # Prometheus scrapes :9471/metrics
    TIERWATCH_COLLECTOR=simulated TIERWATCH_SIM_GPUS=4 tierwatch-agent run --node sim-1 ...
    tierwatch-agent inject xid 79 --gpu 3
    tierwatch-agent inject temp 95 --gpu 1
    tierwatch-agent inject clear
    tierwatch-agent ckpt ls --job llama-7b --memory-dir /dev/shm/tierwatch/gpu-017
    tierwatch-agent ckpt export --job llama-7b --to /data/llama-7b-step-1200

Every ``run`` option can also be set as a ``TIERWATCH_*`` environment variable (e.g.
``TIERWATCH_SERVER``); a command-line option wins. Messages go to stderr.

Exit codes of ``inject``: 0 done; 1 refused by the agent (409 real collector, 403, 422 bad
fault/GPU/value, other HTTP errors); 3 agent unreachable. ``run`` exits 0 after a graceful
shutdown and 2 on bad settings or a collector that cannot start.

Keep this module's imports light (no FastAPI/uvicorn at import time, never torch or
``tierwatch.server``): ``inject`` must start fast.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(
    name="tierwatch-agent",
    help="tierwatch node agent: reports GPU health to the tierwatch control plane.",
    no_args_is_help=True,
    add_completion=False,
)

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


def _err(message: str) -> None:
    typer.echo(message, err=True)


@app.command()
def run(
    node: Annotated[str | None, typer.Option(help="This node's name [TIERWATCH_NODE].")] = None,
    server: Annotated[
        str | None, typer.Option(help="Control-plane URL, e.g. http://cp:8000 [TIERWATCH_SERVER].")
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            help="Agent bearer token; prefer --token-file (argv is public) [TIERWATCH_TOKEN]."
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the agent token, mode 0600 (one trailing newline is dropped) "
            "[TIERWATCH_TOKEN_FILE]."
        ),
    ] = None,
    collector: Annotated[
        str | None,
        typer.Option(help="auto | nvml | dcgm-exporter | simulated [TIERWATCH_COLLECTOR]."),
    ] = None,
    interval: Annotated[
        float | None, typer.Option(help="Seconds between reports (default 5) [TIERWATCH_INTERVAL].")
    ] = None,
    full_sample_every: Annotated[
        int | None,
        typer.Option(
            help="Send every GPU's sample at least every N reports; the reports between carry "
            "samples only when a health reading changed (default 6; 1: every report) "
            "[TIERWATCH_FULL_SAMPLE_EVERY].",
        ),
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option(help="Local API address (default 127.0.0.1:9470) [TIERWATCH_LISTEN]."),
    ] = None,
    metrics_listen: Annotated[
        str | None,
        typer.Option(
            help="Also serve GET /metrics (dcgm-exporter format, nothing else) on HOST:PORT, "
            "for Prometheus (default: only on the local API) [TIERWATCH_METRICS_LISTEN]."
        ),
    ] = None,
    metrics_host_label: Annotated[
        str | None,
        typer.Option(
            help="Name of the /metrics label holding the node name (default Hostname; "
            "dcgm-exporter >= 2026: hostname) [TIERWATCH_METRICS_HOST_LABEL]."
        ),
    ] = None,
    metrics_model_label: Annotated[
        str | None,
        typer.Option(
            help="Name of the /metrics label holding the GPU model (default model_name; "
            "dcgm-exporter: modelName) "
            "[TIERWATCH_METRICS_MODEL_LABEL]."
        ),
    ] = None,
    metrics_dcgm_names: Annotated[
        bool | None,
        typer.Option(
            "--metrics-dcgm-names/--no-metrics-dcgm-names",
            help="Serve DCGM_FI_DEV_PCIE_REPLAY_COUNTER and dcgm-exporter's counter types "
            "exactly, which promtool rejects (default: tierwatch_gpu_pcie_replays, untyped) "
            "[TIERWATCH_METRICS_DCGM_NAMES].",
        ),
    ] = None,
    spool_dir: Annotated[
        Path | None,
        typer.Option(help="Spool folder (default var/spool/<node>) [TIERWATCH_SPOOL_DIR]."),
    ] = None,
    spool_max_batches: Annotated[
        int | None,
        typer.Option(help="Spool bound, batches (default 10000) [TIERWATCH_SPOOL_MAX_BATCHES]."),
    ] = None,
    dcgm_exporter_url: Annotated[
        str | None, typer.Option(help="dcgm-exporter metrics URL [TIERWATCH_DCGM_EXPORTER_URL].")
    ] = None,
    sim_gpus: Annotated[
        int | None, typer.Option(help="Simulated GPUs (default 8) [TIERWATCH_SIM_GPUS].")
    ] = None,
    sim_seed: Annotated[
        int | None, typer.Option(help="Simulator seed (default random) [TIERWATCH_SIM_SEED].")
    ] = None,
    sim_job: Annotated[
        str | None, typer.Option(help="Job id for simulated latency samples [TIERWATCH_SIM_JOB].")
    ] = None,
    sim_rank: Annotated[
        int | None, typer.Option(help="Rank for simulated latency samples [TIERWATCH_SIM_RANK].")
    ] = None,
    log_level: Annotated[
        str | None, typer.Option(help="DEBUG | INFO | WARNING | ERROR [TIERWATCH_LOG_LEVEL].")
    ] = None,
    memory_dir: Annotated[
        Path | None,
        typer.Option(
            help="Memory-tier folder shared with local ranks (default /dev/shm/tierwatch/<node>) "
            "[TIERWATCH_MEMORY_DIR]."
        ),
    ] = None,
    peer_token: Annotated[
        str | None,
        typer.Option(
            hidden=True,
            help="Retired: agents authenticate to each other as nodes [TIERWATCH_PEER_TOKEN].",
        ),
    ] = None,
    peer_token_file: Annotated[
        Path | None,
        typer.Option(hidden=True, help="Retired, as --peer-token [TIERWATCH_PEER_TOKEN_FILE]."),
    ] = None,
    credential_keys_file: Annotated[
        Path | None,
        typer.Option(
            help="JWK set of the server's public keys, to check job credentials with "
            "(default: fetched from the server) [TIERWATCH_CREDENTIAL_KEYS_FILE]."
        ),
    ] = None,
    advertise_url: Annotated[
        str | None,
        typer.Option(
            help="URL peers use to reach this agent (default http://<listen host>:<port>) "
            "[TIERWATCH_ADVERTISE_URL]."
        ),
    ] = None,
    persistent_url: Annotated[
        str | None,
        typer.Option(
            help="fsspec URL of the persistent tier (default file://<cwd>/var/checkpoints; "
            "s3:// needs s3fs) [TIERWATCH_PERSISTENT_URL]."
        ),
    ] = None,
    persistent_options: Annotated[
        str | None,
        typer.Option(
            help="fsspec storage options of the persistent URL, a JSON object, e.g. "
            """'{"config_kwargs": {"retries": {"max_attempts": 10}}}' """
            "[TIERWATCH_PERSISTENT_OPTIONS]."
        ),
    ] = None,
    s3_endpoint_url: Annotated[
        str | None,
        typer.Option(
            help="S3-compatible endpoint, e.g. http://minio:9000 (default AWS) "
            "[TIERWATCH_S3_ENDPOINT_URL]."
        ),
    ] = None,
    s3_region: Annotated[
        str | None,
        typer.Option(help="The bucket's region, e.g. eu-west-1 [TIERWATCH_S3_REGION]."),
    ] = None,
    s3_profile: Annotated[
        str | None,
        typer.Option(
            help="AWS profile for the credentials (default: env, AWS_PROFILE, instance role) "
            "[TIERWATCH_S3_PROFILE]."
        ),
    ] = None,
    s3_part_size: Annotated[
        str | None,
        typer.Option(
            help="Multipart upload part size, 5MiB-5GiB (default 16MiB) [TIERWATCH_S3_PART_SIZE]."
        ),
    ] = None,
    s3_upload_concurrency: Annotated[
        int | None,
        typer.Option(
            help="Parts of one file uploaded at once (default 8) [TIERWATCH_S3_UPLOAD_CONCURRENCY]."
        ),
    ] = None,
    replication: Annotated[
        int | None,
        typer.Option(
            help="Peer nodes holding a replica of each rank (default 1) [TIERWATCH_REPLICATION]."
        ),
    ] = None,
    memory_budget: Annotated[
        str | None,
        typer.Option(
            help="Most bytes the memory folder may hold, e.g. 8GiB (default 50% of its "
            "filesystem) [TIERWATCH_MEMORY_BUDGET]."
        ),
    ] = None,
    ckpt_scan_interval: Annotated[
        float | None,
        typer.Option(
            help="Seconds between scans for committed steps (default 2) "
            "[TIERWATCH_CKPT_SCAN_INTERVAL]."
        ),
    ] = None,
    isolation_command: Annotated[
        Path | None,
        typer.Option(
            help="Executable the 'command' isolation driver runs on isolate/release "
            "[TIERWATCH_ISOLATION_COMMAND]."
        ),
    ] = None,
    isolation_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds the isolation command may run (default 60) [TIERWATCH_ISOLATION_TIMEOUT]."
        ),
    ] = None,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Agent state folder (default var/agent/<node>) [TIERWATCH_STATE_DIR]."),
    ] = None,
) -> None:
    """Run the agent until SIGTERM/SIGINT."""
    from pydantic import ValidationError

    from tierwatch.agent.collectors.base import CollectorError
    from tierwatch.agent.config import AgentSettings, SettingsError

    overrides = {
        key: value
        for key, value in {
            "node": node,
            "server": server,
            "token": token,
            "token_file": token_file,
            "collector": collector,
            "interval": interval,
            "full_sample_every": full_sample_every,
            "listen": listen,
            "metrics_listen": metrics_listen,
            "metrics_host_label": metrics_host_label,
            "metrics_model_label": metrics_model_label,
            "metrics_dcgm_names": metrics_dcgm_names,
            "spool_dir": spool_dir,
            "spool_max_batches": spool_max_batches,
            "dcgm_exporter_url": dcgm_exporter_url,
            "sim_gpus": sim_gpus,
            "sim_seed": sim_seed,
            "sim_job": sim_job,
            "sim_rank": sim_rank,
            "log_level": log_level,
            "memory_dir": memory_dir,
            "peer_token": peer_token,
            "peer_token_file": peer_token_file,
            "credential_keys_file": credential_keys_file,
            "advertise_url": advertise_url,
            "persistent_url": persistent_url,
            "persistent_options": persistent_options,
            "s3_endpoint_url": s3_endpoint_url,
            "s3_region": s3_region,
            "s3_profile": s3_profile,
            "s3_part_size": s3_part_size,
            "s3_upload_concurrency": s3_upload_concurrency,
            "replication": replication,
            "memory_budget": memory_budget,
            "ckpt_scan_interval": ckpt_scan_interval,
            "isolation_command": isolation_command,
            "isolation_timeout": isolation_timeout,
            "state_dir": state_dir,
        }.items()
        if value is not None
    }
    try:
        settings = AgentSettings(**overrides)
        settings.check_runnable()
    except ValidationError as exc:
        for error in exc.errors():
            where = ".".join(str(p) for p in error["loc"]) or "settings"
            _err(f"error: {where}: {error['msg']}")
        raise typer.Exit(EXIT_USAGE) from None
    except SettingsError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(EXIT_USAGE) from None

    logging.basicConfig(
        level=settings.log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if settings.log_level != "DEBUG":  # one line per report is noise; failures are logged
        logging.getLogger("httpx").setLevel(logging.WARNING)
    from tierwatch.agent.runtime import AgentRuntime

    try:
        runtime = AgentRuntime(settings)
        runtime.install_signal_handlers()
        runtime.start()
    except (CollectorError, SettingsError, RuntimeError, OSError) as exc:
        _err(f"error: cannot start the agent: {exc}")
        raise typer.Exit(EXIT_USAGE) from None
    raise typer.Exit(runtime.run())


@app.command()
def inject(
    fault: Annotated[
        str,
        typer.Argument(
            help="xid | thermal | temp | ecc-dbe | row-remap-failure | throttle | straggle | "
            "freeze | clear"
        ),
    ],
    value: Annotated[
        float | None, typer.Argument(help="XID code (xid) or temperature in °C (temp).")
    ] = None,
    gpu: Annotated[
        int | None, typer.Option(help="Target GPU index (default 0; clear: all).")
    ] = None,
    agent: Annotated[
        str, typer.Option(help="The agent's local API URL [TIERWATCH_AGENT_URL].")
    ] = "",
    token: Annotated[
        str | None,
        typer.Option(help="The node's agent token; prefer --token-file [TIERWATCH_TOKEN]."),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(help="File holding the agent token [TIERWATCH_TOKEN_FILE]."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="HTTP timeout, seconds.", min=0.1)] = 5.0,
) -> None:
    """Inject a fault into a running agent with the simulated collector."""
    import math

    import httpx

    from tierwatch.agent.httputil import error_detail

    if value is not None and not math.isfinite(value):
        _err(f"error: VALUE must be a finite number, not {value}")
        raise typer.Exit(EXIT_USAGE)

    url = agent or os.environ.get("TIERWATCH_AGENT_URL") or "http://127.0.0.1:9470"
    url = url.rstrip("/") + "/v1/inject"
    token = token or os.environ.get("TIERWATCH_TOKEN")
    token_path = token_file or (
        Path(os.environ["TIERWATCH_TOKEN_FILE"]) if os.environ.get("TIERWATCH_TOKEN_FILE") else None
    )
    if token is None and token_path is not None:
        from tierwatch.agent.config import SettingsError, read_secret_file

        try:
            token = read_secret_file(token_path, option="--token-file (TIERWATCH_TOKEN_FILE)")
        except SettingsError as exc:
            _err(f"error: {exc}")
            raise typer.Exit(EXIT_USAGE) from None
    if not token:
        _err(
            "error: the agent accepts faults only with its agent token: give --token-file "
            "(TIERWATCH_TOKEN_FILE) or --token (TIERWATCH_TOKEN)"
        )
        raise typer.Exit(EXIT_USAGE)
    headers = {"Authorization": f"Bearer {token}"}
    body = {"fault": fault, "gpu": gpu, "value": value}
    try:
        resp = httpx.post(url, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        _err(f"error: cannot reach the agent at {url}: {exc} (is it running? --agent URL)")
        raise typer.Exit(EXIT_UNREACHABLE) from None
    if resp.status_code == 200:
        _err(f"injected: {resp.json().get('message', fault)}")
        return
    _err(f"refused (HTTP {resp.status_code}): {error_detail(resp)}")
    raise typer.Exit(EXIT_REFUSED)


def _add_ckpt() -> None:
    from tierwatch.agent.checkpoint.tierstore.cli import app as ckpt_app

    app.add_typer(ckpt_app, name="ckpt")


_add_ckpt()


def main() -> None:
    """Console-script entry point (``tierwatch-agent``)."""
    app()


if __name__ == "__main__":
    main()

"""``tierwatch-server``: serve, migrate, manage tokens, register jobs, prune.

Tokens and job credentials print alone on stdout (messages go to stderr), so ``T=$(tierwatch-server
token create --role viewer)`` works.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from tierwatch.server.config import ConfigError, get_settings

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False
)
token_app = typer.Typer(no_args_is_help=True, help="Create, list and revoke API tokens.")
app.add_typer(token_app, name="token")


def _err(message: str) -> None:
    typer.echo(message, err=True)


def _sessionmaker():  # type: ignore[no-untyped-def]
    from tierwatch.server.db import make_engine, make_sessionmaker

    return make_sessionmaker(make_engine(get_settings().database_url))


_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _configure_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=_LOG_FORMAT)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def worker_app():  # type: ignore[no-untyped-def]
    """The app factory each ``serve --workers N`` process calls (uvicorn ``factory=True``).

    Settings come from the environment, as in the parent, which sets ``TIERWATCH_LOG_LEVEL``
    to its ``--log-level``.
    """
    from tierwatch.server.main import create_app

    settings = get_settings()
    _configure_logging(settings.log_level)
    return create_app(settings)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port", min=1, max=65535)] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            help="server processes sharing the port (PostgreSQL only); each has its own "
            "request pool and ingest writer, one of them (the leader) runs background work",
            min=1,
            max=64,
        ),
    ] = 1,
    migrate_first: Annotated[bool, typer.Option("--migrate/--no-migrate")] = True,
    log_level: Annotated[
        str | None,
        typer.Option(help="debug, info, warning or error (default: TIERWATCH_LOG_LEVEL, info)"),
    ] = None,
    forwarded_allow_ips: Annotated[
        str,
        typer.Option(
            help="comma-separated addresses of reverse proxies whose X-Forwarded-For is "
            "trusted (default: none; the client address is the TCP peer)"
        ),
    ] = "",
) -> None:
    """Run the control plane (migrates the database first unless --no-migrate)."""
    import os

    import uvicorn

    from tierwatch.server.main import create_app

    settings = get_settings()
    log_level = (log_level or settings.log_level).lower()
    if log_level not in ("debug", "info", "warning", "error", "critical"):
        _err(f"error: --log-level {log_level!r}: use debug, info, warning, error or critical")
        raise typer.Exit(2)
    _configure_logging(log_level)
    try:
        settings.check_serving()
        if workers > 1 and settings.database_url.startswith("sqlite"):
            raise ConfigError(
                f"--workers {workers} needs PostgreSQL: SQLite takes one writer at a time, so "
                "more processes only wait on its lock. Set TIERWATCH_DATABASE_URL to a "
                "PostgreSQL database, or serve with --workers 1"
            )
        if migrate_first:
            from tierwatch.server.migrate import upgrade

            upgrade(settings.database_url)
        # One process: the app is built here, so a bad setting fails before the port opens.
        # Several: each worker builds its own from the same environment (uvicorn's factory).
        app_ = create_app(settings) if workers == 1 else "tierwatch.server.cli:worker_app"
    except ConfigError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(2) from exc
    os.environ["TIERWATCH_LOG_LEVEL"] = log_level  # the workers read their settings anew
    _err(f"tierwatch-server listening on http://{host}:{port} ({workers} worker(s))")
    # Proxy headers only from named proxies: otherwise any local client could claim any
    # address (and get round the sign-in rate limit).
    uvicorn.run(
        app_,
        host=host,
        port=port,
        workers=workers if workers > 1 else None,
        factory=workers > 1,
        log_level=log_level,
        access_log=False,
        proxy_headers=bool(forwarded_allow_ips),
        forwarded_allow_ips=forwarded_allow_ips or None,
    )


@app.command()
def migrate() -> None:
    """Upgrade the database schema to the newest revision."""
    from tierwatch.server.migrate import upgrade

    upgrade(get_settings().database_url)
    _err("database is at the newest schema revision")


@app.command()
def prune() -> None:
    """Delete samples and events older than the retention windows, once."""
    from tierwatch.agent.protocol import utcnow
    from tierwatch.server.fleet.service import prune as prune_rows

    settings = get_settings()
    with _sessionmaker()() as session:
        deleted = prune_rows(
            session,
            now=utcnow(),
            sample_retention_s=settings.sample_retention_s,
            event_retention_s=settings.event_retention_s,
        )
    _err(f"deleted {deleted}")


def _audit_cli(session: Any, action: str, target: str, detail: dict[str, Any]) -> None:
    """Record a CLI action in the audit log (actor ``cli@<user>``)."""
    import getpass

    from tierwatch.agent.protocol import utcnow
    from tierwatch.server.actions import audit

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    audit.record(
        session,
        actor=f"cli@{user}",
        role="admin",
        action=action,
        target_kind="token",
        target=target,
        outcome="ok",
        now=utcnow(),
        detail=detail,
    )


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="viewer | operator | admin | agent")],
    node: Annotated[str | None, typer.Option(help="node an agent token reports for")] = None,
    label: Annotated[str, typer.Option(help="free text to recognise the token by")] = "",
    expires_in: Annotated[
        str | None,
        typer.Option(
            help="the token stops working after this long: seconds, or a number with a unit "
            "(90m, 12h, 30d, 2w); default: never"
        ),
    ] = None,
) -> None:
    """Create a token and print it (only its hash is stored: it cannot be shown again)."""
    from tierwatch.server.db import session_scope
    from tierwatch.server.tokens import TokenError, create_token, parse_duration

    try:
        expires_in_s = None if expires_in is None else parse_duration(expires_in)
        with session_scope(_sessionmaker()) as session:
            plaintext, row = create_token(
                session, role=role, node=node, label=label, expires_in_s=expires_in_s
            )
            token_id = row.id
            expires_at = row.expires_at
            _audit_cli(
                session,
                "token_create",
                str(token_id),
                {
                    "role": role,
                    "node": node,
                    "label": label,
                    "expires_at": expires_at.isoformat() if expires_at else None,
                },
            )
    except TokenError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(2) from exc
    _err(
        f"created {role} token id {token_id}"
        + (f" for node {node}" if node else "")
        + (f", expires {expires_at.isoformat()}" if expires_at else "")
    )
    typer.echo(plaintext)


@token_app.command("list")
def token_list() -> None:
    """List tokens, tab-separated: id, role, node, status (active | revoked | expired),
    created, expires (- for never), label; never the tokens themselves."""
    from tierwatch.agent.protocol import utcnow
    from tierwatch.server.tokens import list_tokens

    now = utcnow()
    with _sessionmaker()() as session:
        for t in list_tokens(session):
            expires = t.expires_at.isoformat() if t.expires_at else "-"
            typer.echo(
                f"{t.id}\t{t.role}\t{t.node_name or '-'}\t{t.status(now)}\t"
                f"{t.created_at.isoformat()}\t{expires}\t{t.label}"
            )


@token_app.command("revoke")
def token_revoke(token_id: Annotated[int, typer.Argument(help="id from `token list`")]) -> None:
    """Revoke a token: its dashboard sessions end and state-changing requests refuse it at
    once; reads (and agent reports) within TIERWATCH_TOKEN_CACHE_S."""
    from tierwatch.server.db import session_scope
    from tierwatch.server.tokens import TokenError, revoke_token

    try:
        with session_scope(_sessionmaker()) as session:
            revoke_token(session, token_id)
            _audit_cli(session, "token_revoke", str(token_id), {})
    except TokenError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(2) from exc
    _err(f"revoked token {token_id}")


job_app = typer.Typer(no_args_is_help=True, help="Register jobs and issue job credentials.")
app.add_typer(job_app, name="job")


def _cli_actor() -> str:
    import getpass

    try:
        return f"cli@{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli@unknown"


def _write_private(path: Any, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600, atomically (a temporary file in the same
    folder, then renamed over it: never readable by others, never half written)."""
    import os
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@job_app.command("credential")
def job_credential(
    job_id: Annotated[str, typer.Argument(help="the job's id, as the training library names it")],
    node: Annotated[
        list[str],
        typer.Option("--node", help="a node the job runs on (repeat the option for each node)"),
    ],
    world_size: Annotated[
        int | None, typer.Option(help="number of ranks, when known (pins it)")
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(help="node of every rank, comma-separated (rank 0 first), when known"),
    ] = None,
    ttl_s: Annotated[
        float | None,
        typer.Option(
            "--ttl-s",
            help="credential lifetime in seconds (60 to 31622400; default "
            "TIERWATCH_JOB_CREDENTIAL_TTL_S, 30 days)",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="write the credential to this file (mode 0600) instead of stdout"),
    ] = None,
) -> None:
    """Register a job before its ranks start (e.g. from a Slurm PrologSlurmctld) and issue
    its credential: only the agents of the given nodes may then report for it. Registering
    again (the job's restart) replaces its nodes and layout; the credential keeps its
    secret. The credential prints alone on stdout (or goes to --out)."""
    from pydantic import ValidationError

    from tierwatch.server.credentials.service import RegistrationError, register_job
    from tierwatch.server.db import session_scope

    settings = get_settings()
    ranks = [n.strip() for n in layout.split(",")] if layout is not None else None
    try:
        with session_scope(_sessionmaker()) as session:
            result = register_job(
                session,
                job_id=job_id,
                nodes=node,
                world_size=world_size,
                layout=ranks,
                ttl_s=ttl_s if ttl_s is not None else settings.job_credential_ttl_s,
                actor=_cli_actor(),
                role="admin",
            )
    except RegistrationError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(2) from exc
    except ValidationError as exc:
        for e in exc.errors(include_url=False):
            where = ".".join(str(p) for p in e["loc"]) or "request"
            _err(f"error: {where}: {e['msg']}")
        raise typer.Exit(2) from exc
    if out is not None:
        try:
            _write_private(out, result["credential"])
        except OSError as exc:
            _err(f"error: cannot write {out}: {exc.strerror or exc}")
            raise typer.Exit(2) from exc
    _err(
        f"registered job {job_id} on {len(result['nodes'])} node(s)"
        + (f", world_size {result['world_size']}" if result["world_size"] else "")
        + f"; credential expires {result['expires_at'].isoformat()}"
        + (f", written to {out}" if out is not None else "")
    )
    if out is None:
        typer.echo(result["credential"])


def main() -> None:
    """Console-script entry point: configuration and database mistakes print one line
    saying what to fix (exit 2) instead of a traceback."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError
    from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

    try:
        app(prog_name="tierwatch-server", standalone_mode=True)
    except SettingsError as exc:  # e.g. a list setting that is not JSON
        _err(
            f"error: invalid setting: {exc}; list settings take JSON, e.g. "
            """TIERWATCH_POLICY__ACTIONS='["RESET_GPU","RESTART_BM"]'"""
        )
        raise SystemExit(2) from None
    except ValidationError as exc:
        problems = "; ".join(
            f"TIERWATCH_{'__'.join(str(p) for p in e['loc']).upper()}: {e['msg']}"
            for e in exc.errors()
        )
        _err(f"error: invalid setting: {problems}")
        raise SystemExit(2) from None
    except (ArgumentError, NoSuchModuleError) as exc:
        _err(
            f"error: TIERWATCH_DATABASE_URL is not usable ({exc}); use sqlite:///path/to/file.db "
            "or postgresql+psycopg://user@host:5432/db"
        )
        raise SystemExit(2) from None
    except DBAPIError as exc:
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
        hint = (
            "run `tierwatch-server migrate` first"
            if "no such table" in first or "does not exist" in first and "relation" in first
            else "check TIERWATCH_DATABASE_URL and that the database is reachable"
        )
        _err(f"error: database: {first}; {hint}")
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()

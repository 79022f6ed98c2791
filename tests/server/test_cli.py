"""tierwatch-server CLI: tokens on stdout alone, clear errors, refusal without a secret."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent / "tierwatch-server"

# The CLI's own behaviour (output, errors, exit codes) runs on one backend: the SQL behind its
# token and audit commands is tested on both in-process; migrations keep both backends here.
one_backend = pytest.mark.one_backend


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def cli_env(db_url, monkeypatch) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
    env["TIERWATCH_DATABASE_URL"] = db_url
    return env


@one_backend
def test_token_create_prints_only_the_token(cli_env, session):
    from tierwatch.server.tokens import lookup_token

    out = run("token", "create", "--role", "viewer", env=cli_env)
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    assert out.stdout == token + "\n"
    assert token.startswith("tw_")
    assert "created viewer token" in out.stderr
    row = lookup_token(session, token)
    assert row is not None
    assert row.role == "viewer"
    assert token not in row.token_hash  # only the hash is stored


@one_backend
def test_agent_token_for_node_not_yet_seen(cli_env, session):
    from tierwatch.server.tokens import lookup_token

    out = run("token", "create", "--role", "agent", "--node", "gpu-node-17", env=cli_env)
    assert out.returncode == 0, out.stderr
    assert lookup_token(session, out.stdout.strip()).node_name == "gpu-node-17"


@one_backend
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--role", "root"], "unknown role"),
        (["--role", "agent"], "--node NAME"),
        (["--role", "agent", "--node", "bad name"], "invalid node name"),
        (["--role", "viewer", "--node", "n1"], "only applies to agent tokens"),
    ],
)
def test_token_create_refuses_bad_input(cli_env, args, message):
    out = run("token", "create", *args, env=cli_env)
    assert out.returncode == 2
    assert out.stdout == ""
    assert message in out.stderr


@one_backend
def test_token_list_and_revoke(cli_env):
    run("token", "create", "--role", "admin", "--label", "ops", env=cli_env)
    listing = run("token", "list", env=cli_env).stdout.splitlines()
    token_id = listing[0].split("\t")[0]
    assert "admin" in listing[0]
    assert "active" in listing[0]
    assert run("token", "revoke", token_id, env=cli_env).returncode == 0
    assert "revoked" in run("token", "list", env=cli_env).stdout
    missing = run("token", "revoke", "99999", env=cli_env)
    assert missing.returncode == 2
    assert "no token with id 99999" in missing.stderr


@one_backend
def test_serve_refuses_to_start_without_secret_outside_dev(cli_env):
    out = run("serve", "--port", "1", env=cli_env)
    assert out.returncode == 2
    assert "TIERWATCH_SECRET_KEY is not set" in out.stderr
    weak = run("serve", "--port", "1", env={**cli_env, "TIERWATCH_SECRET_KEY": "changeme"})
    assert weak.returncode == 2
    assert "placeholder" in weak.stderr


def test_migrate_is_idempotent(cli_env):
    assert run("migrate", env=cli_env).returncode == 0
    assert run("migrate", env=cli_env).returncode == 0


@one_backend
@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (
            {"TIERWATCH_DATABASE_URL": "notaurl"},
            ["migrate"],
            "TIERWATCH_DATABASE_URL is not usable",
        ),
        ({"TIERWATCH_DATABASE_URL": "mysql://x/y"}, ["migrate"], "unsupported database 'mysql'"),
        ({"TIERWATCH_MAX_BODY_BYTES": "-1"}, ["token", "list"], "TIERWATCH_MAX_BODY_BYTES"),
        (
            {"TIERWATCH_HEALTH__STRAGGLER_FACTOR": "abc", "TIERWATCH_DEV": "1"},
            ["serve"],
            "TIERWATCH_HEALTH__STRAGGLER_FACTOR",
        ),
        ({}, ["serve", "--port", "99999"], "65535"),
    ],
)
def test_configuration_mistakes_are_one_clear_line(cli_env, env, args, message):
    out = run(*args, env={**cli_env, **env})
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


@one_backend
def test_unmigrated_database_says_to_migrate(cli_env, tmp_path):
    out = run(
        "token", "list", env={**cli_env, "TIERWATCH_DATABASE_URL": f"sqlite:///{tmp_path}/new.db"}
    )
    assert out.returncode == 2
    assert "run `tierwatch-server migrate` first" in out.stderr


@one_backend
def test_token_create_and_revoke_are_audited(cli_env, session):
    from tierwatch.server.actions.audit import query

    out = run("token", "create", "--role", "operator", "--label", "oncall", env=cli_env)
    assert out.returncode == 0, out.stderr
    token_id = out.stderr.split("token id ")[1].split()[0]
    assert run("token", "revoke", token_id, env=cli_env).returncode == 0
    entries = query(session, target_kind="token")
    assert [(e.action, e.target) for e in entries] == [
        ("token_revoke", token_id),
        ("token_create", token_id),
    ]
    assert entries[1].detail["role"] == "operator"
    assert entries[0].actor.startswith("cli@")


@one_backend
def test_unusable_isolation_settings_are_one_line_errors(cli_env):
    env = {**cli_env, "TIERWATCH_DEV": "1"}
    out = run(
        "serve",
        "--port",
        "1",
        env={
            **env,
            "TIERWATCH_ISOLATION__DRIVER": "slurm",
            "TIERWATCH_ISOLATION__SCONTROL": "/nope/scontrol",
        },
    )
    assert out.returncode == 2
    assert "TIERWATCH_ISOLATION__SCONTROL" in out.stderr
    assert "Traceback" not in out.stderr
    out = run("serve", "--port", "1", env={**env, "TIERWATCH_POLICY__ACTIONS": "RESET_GPU"})
    assert out.returncode == 2
    assert """TIERWATCH_POLICY__ACTIONS='["RESET_GPU","RESTART_BM"]'""" in out.stderr
    assert "Traceback" not in out.stderr


@one_backend
def test_token_create_with_an_expiry(cli_env, session):
    from tierwatch.server.tokens import lookup_token

    out = run("token", "create", "--role", "viewer", "--expires-in", "2h", env=cli_env)
    assert out.returncode == 0, out.stderr
    row = lookup_token(session, out.stdout.strip())
    assert row is not None
    assert row.expires_at - row.created_at == timedelta(hours=2)
    assert f"expires {row.expires_at.isoformat()}" in out.stderr
    [line] = run("token", "list", env=cli_env).stdout.splitlines()
    fields = line.split("\t")
    assert fields[3:6] == ["active", row.created_at.isoformat(), row.expires_at.isoformat()]


@one_backend
def test_token_create_refuses_a_bad_expiry(cli_env):
    out = run("token", "create", "--role", "viewer", "--expires-in", "soon", env=cli_env)
    assert out.returncode == 2
    assert out.stdout == ""
    assert "invalid duration 'soon'" in out.stderr
    assert run("token", "list", env=cli_env).stdout == ""


@one_backend
def test_token_list_shows_expired_tokens_and_tokens_without_expiry(cli_env, session):
    from sqlalchemy import update

    from tierwatch.agent.protocol import utcnow
    from tierwatch.server.tokens import ApiToken, create_token

    _, forever = create_token(session, role="viewer", label="forever")
    _, short = create_token(session, role="viewer", label="short", expires_in_s=60)
    session.execute(
        update(ApiToken)
        .where(ApiToken.id == short.id)
        .values(expires_at=utcnow() - timedelta(seconds=1))
    )
    session.commit()
    rows = {
        line.split("\t")[-1]: line.split("\t")
        for line in run("token", "list", env=cli_env).stdout.splitlines()
    }
    assert rows["forever"][3] == "active"
    assert rows["forever"][5] == "-"
    assert rows["short"][3] == "expired"

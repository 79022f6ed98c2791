"""The isolation commands run without tierwatch's secrets in their environment.

A table of :func:`scrubbed_env`, then the real thing twice: the agent's ``command`` driver
(:func:`run_isolation_command`) and the server's ``slurm`` driver each run a small script
that prints its environment, with tokens and storage credentials set in the parent's.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tierwatch.agent.commands import run_isolation_command
from tierwatch.agent.envsafe import scrubbed_env
from tierwatch.server.actions.drivers import IsolationSettings, SlurmDriver

SECRETS = {
    "TIERWATCH_TOKEN": "agent-token-value",
    "TIERWATCH_PEER_TOKEN": "peer-token-value",
    "TIERWATCH_SECRET_KEY": "session-secret-value",
    "TIERWATCH_TOKEN_FILE": "/run/secrets/token",
    "TIERWATCH_PEER_TOKEN_FILE": "/run/secrets/peer-token",
    "TIERWATCH_ALERTS__SLACK_TOKEN": "slack-token-value",
    "tierwatch_token": "lower-case-token-value",
    "TIERWATCH_PERSISTENT_URL": "s3://KEY:SECRET@bucket/prefix",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-value",
    "AWS_SESSION_TOKEN": "aws-session-value",
}
KEPT = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/root",
    "SLURM_CONF": "/etc/slurm/slurm.conf",
    "KUBECONFIG": "/etc/kube/config",
    "AWS_REGION": "eu-west-1",
    "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
    "TIERWATCH_NODE": "gpu-017",
    "TIERWATCH_SERVER": "http://cp:8000",
    "MY_TOKEN": "not-ours",
}


@pytest.mark.parametrize(("name", "value"), sorted({**SECRETS, **KEPT}.items()))
def test_scrubbed_env_drops_exactly_the_secrets(name: str, value: str) -> None:
    env = scrubbed_env({name: value})
    if name in SECRETS:
        assert env == {}
    else:
        assert env == {name: value}


def test_scrubbed_env_leaves_its_argument_alone() -> None:
    environ = {**SECRETS, **KEPT}
    assert scrubbed_env(environ) == KEPT
    assert environ == {**SECRETS, **KEPT}


def env_printer(path: Path) -> Path:
    """An executable that prints the part of its environment under test as one JSON object
    (not all of it: the drivers keep only the last 4,000 characters of the output)."""
    path.write_text(
        f"#!{sys.executable}\n"
        + textwrap.dedent(
            """
            import json, os
            prefixes = ("TIERWATCH_", "AWS_", "SLURM_")
            env = os.environ.items()
            print("NodeName=gpu-017 State=IDLE")  # what scontrol -o show node reads
            print(json.dumps({k: v for k, v in env if k.upper().startswith(prefixes)}))
            """
        )
    )
    path.chmod(0o755)
    return path


def printed_env(output: str) -> dict[str, str]:
    line = next(line for line in output.splitlines() if line.startswith("{"))
    return json.loads(line)


def assert_no_secrets(env: dict[str, str]) -> None:
    for name, value in SECRETS.items():
        assert name not in env
        assert value not in json.dumps(env)
    assert env["SLURM_CONF"] == KEPT["SLURM_CONF"]


def test_agent_isolation_command_sees_no_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {**SECRETS, "SLURM_CONF": KEPT["SLURM_CONF"]}.items():
        monkeypatch.setenv(name, value)
    ok, code, output = run_isolation_command(
        env_printer(tmp_path / "isolate.py"),
        action="isolate",
        node="gpu-017",
        reason="xid 79",
        actor="policy",
        command_id="c-1",
        timeout_s=30,
    )
    assert (ok, code) == (True, 0), output
    env = printed_env(output)
    assert_no_secrets(env)
    assert env["TIERWATCH_NODE"] == "gpu-017"
    assert env["TIERWATCH_ACTION"] == "isolate"


def test_server_slurm_driver_runs_scontrol_without_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    env_printer(bindir / "scontrol")
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    for name, value in {**SECRETS, "SLURM_CONF": KEPT["SLURM_CONF"]}.items():
        monkeypatch.setenv(name, value)
    result = SlurmDriver(IsolationSettings(driver="slurm")).isolate("gpu-017", "xid 79")
    assert result.ok, result.output
    assert_no_secrets(printed_env(result.output))

"""``tierwatch-server job credential``: registers the job, writes the credential to a 0600
file (or alone on stdout), and says what is wrong in one line per field."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from tierwatch.agent.credentials import CredentialVerifier
from tierwatch.server.checkpoints.models import Job
from tierwatch.server.credentials import service

BIN = Path(sys.executable).parent / "tierwatch-server"
pytestmark = pytest.mark.one_backend  # the CLI's own behaviour; the SQL is tested in-process


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN), *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture
def cli_env(db_url) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERWATCH_")}
    env["TIERWATCH_DATABASE_URL"] = db_url
    return env


def verify(session, credential: str):
    keys = service.public_key_set(session)
    session.commit()
    return CredentialVerifier.from_jwks(keys).verify_job(credential)


def test_writes_the_credential_to_a_private_file(cli_env, session, tmp_path):
    out_file = tmp_path / "job.cred"
    out_file.write_text("old")
    out_file.chmod(0o644)
    out = run(
        "job", "credential", "train-1", "--node", "gpu-1", "--node", "gpu-2",
        "--world-size", "16", "--ttl-s", "7200", "--out", str(out_file),
        env=cli_env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    assert "registered job train-1 on 2 node(s), world_size 16" in out.stderr
    assert stat.S_IMODE(out_file.stat().st_mode) == 0o600
    credential = out_file.read_text().strip()
    checked = verify(session, credential)
    assert checked.job_id == "train-1"
    assert abs(checked.expires_at - checked.issued_at - 7200) <= 1
    assert credential not in out.stderr
    job = session.scalar(select(Job).where(Job.job_id == "train-1"))
    assert job.registered_nodes == ["gpu-1", "gpu-2"]
    assert job.registered_world_size == 16
    assert job.registered_by.startswith("cli@")
    assert [p.name for p in tmp_path.iterdir()] == ["job.cred"]  # no temporary file left


def test_prints_the_credential_alone_without_out(cli_env, session):
    out = run("job", "credential", "train-2", "--node", "gpu-1", "--layout", "gpu-1,gpu-1",
              env=cli_env)  # fmt: skip
    assert out.returncode == 0, out.stderr
    credential = out.stdout.strip()
    assert out.stdout == credential + "\n"
    assert verify(session, credential).job_id == "train-2"
    assert session.scalar(select(Job.layout).where(Job.job_id == "train-2")) == ["gpu-1", "gpu-1"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["job-3", "--node", "bad node"], "error: nodes.0: Value error, node name must be"),
        (["job-3", "--node", "a", "--ttl-s", "5"], "error: ttl_s: Input should be greater"),
        (["job-3", "--node", "a", "--layout", "a,b"], "which are not in nodes"),
        (["bad/id", "--node", "a"], "error: job id 'bad/id' is not valid"),
    ],
)
def test_mistakes_are_one_line_errors(cli_env, args, message):
    out = run("job", "credential", *args, env=cli_env)
    assert out.returncode == 2, out.stdout
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""

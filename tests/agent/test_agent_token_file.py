"""``--token-file`` (``TIERWATCH_TOKEN_FILE``), the retired peer token (``TIERWATCH_PEER_TOKEN`` /
``TIERWATCH_PEER_TOKEN_FILE``): tokens out of argv, read from files only their owner can read.

A table of :func:`read_secret_file`, the settings that load the files, then
``tierwatch-agent run`` itself: every refusal is one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tierwatch.agent.cli import EXIT_USAGE, app
from tierwatch.agent.config import AgentSettings, SettingsError, read_secret_file

OPTION = "--token-file (TIERWATCH_TOKEN_FILE)"
ENV = ("TOKEN", "TOKEN_FILE", "PEER_TOKEN", "PEER_TOKEN_FILE", "NODE", "SERVER")


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(f"TIERWATCH_{name}", raising=False)


def secret(tmp_path: Path, content: bytes, mode: int = 0o600, name: str = "token") -> Path:
    path = tmp_path / name
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(
    ("content", "mode", "value"),
    [
        (b"tok-123\n", 0o600, "tok-123"),
        (b"tok-123", 0o400, "tok-123"),
        (b"tok-123\r\n", 0o600, "tok-123"),
        (b"tok-123\n\n", 0o600, "tok-123\n"),  # one newline only
        (b" tok 123 \n", 0o600, " tok 123 "),
    ],
)
def test_read_secret_file_reads_the_token(
    tmp_path: Path, content: bytes, mode: int, value: str
) -> None:
    assert read_secret_file(secret(tmp_path, content, mode), option=OPTION) == value


@pytest.mark.parametrize(
    ("content", "mode", "needle"),
    [
        (b"", 0o600, "is empty (write the token into it)"),
        (b"\n", 0o600, "is empty (write the token into it)"),
        (b"tok\n", 0o644, "is readable by others (mode 0644); chmod 600 it"),
        (b"tok\n", 0o604, "is readable by others (mode 0604); chmod 600 it"),
        (b"tok\n", 0o640, "is readable by its group (mode 0640); chmod 600 it"),
        (b"tok\n", 0o620, "is readable by its group (mode 0620); chmod 600 it"),
        (b"\xff\xfe", 0o600, "is not UTF-8 text"),
    ],
)
def test_read_secret_file_refuses(tmp_path: Path, content: bytes, mode: int, needle: str) -> None:
    path = secret(tmp_path, content, mode)
    with pytest.raises(SettingsError) as err:
        read_secret_file(path, option=OPTION)
    assert str(err.value).startswith(f"{OPTION} {path}: ")
    assert needle in str(err.value)


def test_read_secret_file_refuses_a_missing_file_and_a_folder(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no such file"):
        read_secret_file(tmp_path / "nope", option=OPTION)
    with pytest.raises(SettingsError, match="is not a regular file"):
        read_secret_file(tmp_path, option=OPTION)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a root-owned file")
def test_a_root_owned_secret_may_be_group_readable_for_a_non_root_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a Kubernetes Secret volume with ``fsGroup`` mounts it: root:<fsGroup> 0440."""
    path = secret(tmp_path, b"tok\n", 0o440)
    monkeypatch.setattr(os, "geteuid", lambda: 10001)
    monkeypatch.setattr(os, "getgroups", lambda: [path.stat().st_gid])
    assert read_secret_file(path, option=OPTION) == "tok"
    path.chmod(0o444)
    with pytest.raises(SettingsError, match="readable by others"):
        read_secret_file(path, option=OPTION)


def test_the_retired_peer_token_is_refused_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One shared peer token opened every job's checkpoints on every node: it is gone, and
    a deployment that still sets it is told so instead of running without a peer tier."""
    monkeypatch.setenv("TIERWATCH_PEER_TOKEN_FILE", str(secret(tmp_path, b"peer\n", name="p")))
    settings = AgentSettings(
        node="n1", server="http://cp:8000", token_file=secret(tmp_path, b"agent\n")
    )
    with pytest.raises(SettingsError, match="no longer used: agents authenticate"):
        settings.check_runnable()


runner = CliRunner()


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    result = runner.invoke(app, ["run", "--node", "n1", *args], env=env)
    return result.exit_code, result.output.strip().splitlines()


def test_run_reads_the_token_from_the_file(tmp_path: Path) -> None:
    """The token counts as given: only the missing server is reported."""
    code, lines = run("--token-file", str(secret(tmp_path, b"agent\n")))
    assert code == EXIT_USAGE
    assert lines == ["error: missing required setting(s): --server (TIERWATCH_SERVER)"]


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--token", "t"], {"TIERWATCH_TOKEN_FILE": "{ok}"}, "are both set; keep only the file"),
        (["--token-file", "{ok}"], {"TIERWATCH_TOKEN": "t"}, "are both set; keep only the file"),
        (["--token-file", "{missing}"], {}, f"{OPTION} {{missing}}: no such file"),
        (["--token-file", "{empty}"], {}, f"{OPTION} {{empty}}: is empty"),
        ([], {"TIERWATCH_TOKEN_FILE": "{open}"}, f"{OPTION} {{open}}: is readable by others"),
        (["--token", "t", "--peer-token", "p"], {}, "are no longer used: agents authenticate"),
        (["--token", "t"], {"TIERWATCH_PEER_TOKEN": "p"}, "are no longer used"),
    ],
)
def test_run_refuses_bad_token_files_in_one_line(
    tmp_path: Path, args: list[str], env: dict[str, str], needle: str
) -> None:
    paths = {
        "ok": str(secret(tmp_path, b"tok\n", name="ok")),
        "missing": str(tmp_path / "missing"),
        "empty": str(secret(tmp_path, b"", name="empty")),
        "open": str(secret(tmp_path, b"tok\n", 0o644, name="open")),
    }
    code, lines = run(
        "--server",
        "http://cp:8000",
        *(a.format(**paths) for a in args),
        env={k: v.format(**paths) for k, v in env.items()},
    )
    assert code == EXIT_USAGE
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    assert needle.format(**paths) in lines[0]

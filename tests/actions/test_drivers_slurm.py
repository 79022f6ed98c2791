"""SlurmDriver's process handling against a recording stand-in ``scontrol`` (a real
executable on PATH): argv, hostile reasons, exit codes, timeouts, a missing executable.

What Slurm itself does with the drains (marks, an admin's drain, a pending reboot) is tested
against a real slurmctld in ``test_slurm_real.py``."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tierwatch.server.actions.drivers import (
    OUTPUT_LIMIT,
    IsolationSettings,
    SlurmDriver,
)

Recorder = Callable[..., Path]
IDLE = "NodeName=gpu-07 Arch=x86_64 CPUTot=64 State=IDLE ThreadsPerCore=2 Partitions=main\n"
DRAINED = (
    "NodeName=gpu-07 CPUTot=64 State=IDLE+DRAIN Partitions=main "
    "Reason=tierwatch: XID 79 [root@2026-12-02T10:00:00]\n"
)
SHOW = ["-o", "show", "node", "gpu-07"]


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Writes ``bin/scontrol`` (first on PATH) that appends its argv to ``calls.jsonl``, prints
    ``output`` and exits with ``exit_code``; returns the calls file."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")

    def make(*, exit_code: int = 0, output: str = "", show: str = IDLE) -> Path:
        script = bindir / "scontrol"
        script.write_text(
            f"#!{sys.executable}\n"
            + textwrap.dedent(
                f"""
                import json, sys
                with open({str(calls)!r}, "a") as f:
                    f.write(json.dumps(sys.argv[1:]) + "\\n")
                if sys.argv[1:3] == ["-o", "show"]:
                    sys.stdout.write({show!r})
                    sys.exit(0)
                sys.stdout.write({output!r})
                sys.exit({exit_code})
                """
            )
        )
        script.chmod(0o755)
        return calls

    return make


def recorded(calls: Path) -> list[list[str]]:
    return [json.loads(line) for line in calls.read_text().splitlines()]


def driver(**settings: object) -> SlurmDriver:
    return SlurmDriver(IsolationSettings(driver="slurm", **settings))  # type: ignore[arg-type]


def test_isolate_runs_drain_with_reason(fake_scontrol: Recorder) -> None:
    calls = fake_scontrol(output="updated\n")
    result = driver().isolate("gpu-07", "XID 79 on GPU 3")
    assert recorded(calls) == [
        SHOW,
        ["update", "nodename=gpu-07", "state=drain", "reason=tierwatch: XID 79 on GPU 3"],
    ]
    assert result.ok
    assert result.exit_code == 0
    assert result.output.splitlines() == [
        "$ scontrol -o show node gpu-07",
        "slurm: was IDLE",
        "$ scontrol update nodename=gpu-07 state=drain 'reason=tierwatch: XID 79 on GPU 3'",
        "exit 0",
        "updated",
    ]
    assert result.detail["scheduler"]["before"]["state"] == "IDLE"
    assert result.detail["scheduler"]["action"] == "drain"


def test_release_runs_resume(fake_scontrol: Recorder) -> None:
    calls = fake_scontrol(show=DRAINED)
    result = driver().release("gpu-07", "fixed")
    assert recorded(calls) == [SHOW, ["update", "nodename=gpu-07", "state=resume"]]
    assert result.ok
    assert result.output.splitlines() == [
        "$ scontrol -o show node gpu-07",
        "slurm: was IDLE+DRAIN, reason 'tierwatch: XID 79' (root, 2026-12-02T10:00:00)",
        "$ scontrol update nodename=gpu-07 state=resume",
        "exit 0",
    ]


@pytest.mark.parametrize("reason", ["", "   "])
def test_empty_reason_still_carries_the_mark(fake_scontrol: Recorder, reason: str) -> None:
    calls = fake_scontrol()
    assert driver().isolate("gpu-07", reason).ok
    assert recorded(calls)[-1] == [
        "update",
        "nodename=gpu-07",
        "state=drain",
        "reason=tierwatch: isolated",
    ]


def test_hostile_reason_is_one_literal_argument(fake_scontrol: Recorder, tmp_path: Path) -> None:
    calls = fake_scontrol()
    canary = tmp_path / "canary"
    reason = f'it\'s "bad"; touch {canary} $(touch {canary}) `touch {canary}`\nline two'
    result = driver().isolate("gpu-07", reason)
    assert result.ok
    one_line = " ".join(reason.split())  # Slurm shows a reason on one line
    assert recorded(calls)[-1] == [
        "update",
        "nodename=gpu-07",
        "state=drain",
        f"reason=tierwatch: {one_line}",
    ]
    assert not canary.exists()


def test_nonzero_exit_is_a_failure_with_output(fake_scontrol: Recorder) -> None:
    fake_scontrol(exit_code=1, output="slurm_update error: Invalid node name specified\n")
    result = driver().isolate("gpu-07", "sick")
    assert not result.ok
    assert result.exit_code == 1
    assert result.output.splitlines() == [
        "$ scontrol -o show node gpu-07",
        "slurm: was IDLE",
        "$ scontrol update nodename=gpu-07 state=drain 'reason=tierwatch: sick'",
        "exit 1",
        "Slurm has no node named 'gpu-07': tierwatch's node name must be the Slurm NodeName "
        "(the agent's --node)",
        "slurm_update error: Invalid node name specified",
    ]


def test_long_output_keeps_command_and_tail(fake_scontrol: Recorder) -> None:
    fake_scontrol(exit_code=2, output="x" * 10_000 + "THE END\n")
    result = driver().isolate("gpu-07", "sick")
    assert not result.ok
    assert len(result.output) <= OUTPUT_LIMIT
    assert result.output.startswith("$ scontrol -o show node gpu-07\nslurm: was IDLE\n$ scontrol")
    assert result.output.endswith("THE END")


def test_timeout_kills_the_process_group(tmp_path: Path) -> None:
    # A shell script whose `sleep` child would keep the output pipe open if only the shell died.
    script = tmp_path / "slow-scontrol"
    script.write_text("#!/bin/sh\necho waiting for slurmctld\nsleep 60\n")
    script.chmod(0o755)
    result = driver(scontrol=str(script), timeout_s=0.5).isolate("gpu-07", "sick")
    assert not result.ok
    assert result.exit_code is None
    assert result.output.splitlines() == [
        f"$ {script} -o show node gpu-07",
        "timed out after 0.5 s (killed)",
        "waiting for slurmctld",
    ]


def test_missing_executable_names_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    result = driver().release("gpu-07", "")
    assert not result.ok
    assert result.exit_code is None
    assert "executable not found: 'scontrol'" in result.output
    assert "TIERWATCH_ISOLATION__SCONTROL" in result.output

    missing = tmp_path / "opt" / "slurm" / "bin" / "scontrol"
    result = driver(scontrol=str(missing)).isolate("gpu-07", "sick")
    assert not result.ok
    assert f"executable not found: '{missing}'" in result.output


def test_non_executable_file_is_a_failure(tmp_path: Path) -> None:
    script = tmp_path / "scontrol"
    script.write_text("not a program\n")
    result = driver(scontrol=str(script)).isolate("gpu-07", "sick")
    assert not result.ok
    assert "cannot run" in result.output
    assert "TIERWATCH_ISOLATION__SCONTROL" in result.output

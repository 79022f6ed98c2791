"""The agent's command executor: the node-local isolation command runs once per command id
(across re-deliveries and restarts), with the node, action and reason in its environment;
failures, timeouts, expiry and refusals are reported with what to fix."""

from __future__ import annotations

import json
import stat
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from tierwatch.agent.commands import CommandExecutor
from tierwatch.agent.protocol import Command, CommandResult, utcnow


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "isolate.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


RECORDING = (
    'printf \'%s|%s|%s|%s|%s\\n\' "$1" "$2" "$TIERWATCH_NODE" "$TIERWATCH_ACTION" '
    '"$TIERWATCH_REASON" >> "$(dirname "$0")/calls.txt"\necho "drained $TIERWATCH_NODE"\n'
)


class Results:
    def __init__(self) -> None:
        self.items: list[CommandResult] = []
        self.cond = threading.Condition()

    def __call__(self, results: list[CommandResult]) -> None:
        with self.cond:
            self.items.extend(results)
            self.cond.notify_all()

    def wait_count(self, n: int, timeout: float = 10.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.items) >= n, timeout), self.items

    def wait_final(self, command_id: str, timeout: float = 10.0) -> CommandResult:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                done = [
                    r
                    for r in self.items
                    if r.id == command_id and r.state in ("succeeded", "failed")
                ]
                if done:
                    return done[-1]
                left = deadline - time.monotonic()
                assert left > 0, f"no final result for {command_id}: {self.items}"
                self.cond.wait(left)


def make(tmp_path: Path, exe: Path | None, *, sink=None, timeout_s: float = 10.0):
    results = Results()
    ex = CommandExecutor(
        node="gpu-node-07",
        state_dir=tmp_path / "state",
        isolation_command=exe,
        isolation_timeout_s=timeout_s,
        restore_sink=sink,
        report=results,
    )
    ex.start()
    return ex, results


def cmd(cid: str, kind: str = "isolate", **kw) -> Command:
    return Command(
        id=cid, kind=kind, args={"reason": kw.pop("reason", "XID 79"), "actor": "token:3"}, **kw
    )


def test_isolation_command_gets_node_action_and_reason(tmp_path):
    exe = script(tmp_path, RECORDING)
    ex, results = make(tmp_path, exe)
    reason = 'fell off the bus; $(touch pwned) `id` "quoted"'
    ex.submit([cmd("c1", reason=reason)])
    res = results.wait_final("c1")
    ex.stop()
    assert res.state == "succeeded"
    assert res.exit_code == 0
    assert res.output.strip() == "drained gpu-node-07"
    assert (tmp_path / "calls.txt").read_text() == (
        f"isolate|gpu-node-07|gpu-node-07|isolate|{reason}\n"
    )
    assert not (tmp_path / "pwned").exists()
    assert [r.state for r in results.items] == ["running", "succeeded"]


def test_a_command_runs_once_across_redelivery_and_restart(tmp_path):
    exe = script(tmp_path, RECORDING)
    ex, results = make(tmp_path, exe)
    ex.submit([cmd("c1"), cmd("c1")])  # twice in one answer
    results.wait_final("c1")
    ex.submit([cmd("c1")])  # re-delivered: the recorded result is sent again at once
    ex.stop()
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 1
    assert [r.state for r in results.items].count("succeeded") == 2  # recorded result resent
    # A restarted agent remembers it too.
    ex2, results2 = make(tmp_path, exe)
    ex2.submit([cmd("c1")])  # answered from the state file, at once
    ex2.stop()
    assert results2.items[0].state == "succeeded"
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 1


def test_a_command_cut_short_by_a_restart_is_reported_failed_not_rerun(tmp_path):
    exe = script(tmp_path, RECORDING)
    state = tmp_path / "state"
    state.mkdir()
    (state / "commands.json").write_text(
        json.dumps({"commands": {"c9": {"state": "started", "exit_code": None, "output": ""}}})
    )
    ex, results = make(tmp_path, exe)
    ex.submit([cmd("c9")])
    res = results.wait_final("c9")
    ex.stop()
    assert res.state == "failed"
    assert "not run again" in res.output
    assert not (tmp_path / "calls.txt").exists()


def test_failing_command_reports_exit_code_and_output(tmp_path):
    exe = script(tmp_path, 'echo "scontrol: error: Invalid node name" >&2\nexit 3\n')
    ex, results = make(tmp_path, exe)
    ex.submit([cmd("c1", kind="release")])
    res = results.wait_final("c1")
    ex.stop()
    assert res.state == "failed"
    assert res.exit_code == 3
    assert "Invalid node name" in res.output


def test_hung_command_is_killed_after_the_timeout(tmp_path):
    exe = script(tmp_path, "echo started\nsleep 30\n")
    ex, results = make(tmp_path, exe, timeout_s=0.5)
    t0 = time.monotonic()
    ex.submit([cmd("c1")])
    res = results.wait_final("c1")
    ex.stop()
    assert time.monotonic() - t0 < 10
    assert res.state == "failed"
    assert res.exit_code is None
    assert "killed" in res.output
    assert "started" in res.output


def test_without_an_isolation_command_the_message_says_what_to_set(tmp_path):
    ex, results = make(tmp_path, None)
    ex.submit([cmd("c1")])
    res = results.wait_final("c1")
    ex.stop()
    assert res.state == "failed"
    assert "--isolation-command" in res.output


def test_missing_executable_is_a_clear_failure(tmp_path):
    ex, results = make(tmp_path, tmp_path / "nope.sh")
    ex.submit([cmd("c1")])
    res = results.wait_final("c1")
    ex.stop()
    assert res.state == "failed"
    assert "nope.sh" in res.output
    assert "TIERWATCH_ISOLATION_COMMAND" in res.output


def test_expired_and_unknown_commands_are_not_run(tmp_path):
    exe = script(tmp_path, RECORDING)
    ex, results = make(tmp_path, exe)
    ex.submit(
        [
            cmd("old", expires_at=utcnow() - timedelta(seconds=1)),
            Command(id="weird", kind="reboot", args={}),
        ]
    )
    old, weird = results.wait_final("old"), results.wait_final("weird")
    ex.stop()
    assert old.state == "failed"
    assert "expired" in old.output
    assert weird.state == "failed"
    assert "unknown command kind 'reboot'" in weird.output
    assert not (tmp_path / "calls.txt").exists()


@pytest.mark.parametrize(
    ("error", "expect"),
    [
        (None, "running"),
        (ValueError("args.step is missing"), "failed"),
        (RuntimeError("no store"), "failed"),
    ],
)
def test_restore_is_handed_to_the_checkpoint_store(tmp_path, error, expect):
    got: list[Command] = []

    def sink(c: Command) -> None:
        got.append(c)
        if error is not None:
            raise error

    ex, results = make(tmp_path, None, sink=sink)
    ex.submit([Command(id="r1", kind="restore", args={"request_id": 1, "job_id": "j", "step": 20})])
    results.wait_count(1)
    ex.stop()
    assert [c.id for c in got] == ["r1"]
    assert results.items[-1].state == expect
    if error is not None:
        assert str(error) in results.items[-1].output


def test_agent_refuses_to_start_with_an_unusable_isolation_command(tmp_path):
    import subprocess
    import sys

    agent = Path(sys.executable).parent / "tierwatch-agent"
    not_exec = tmp_path / "isolate.sh"
    not_exec.write_text("#!/bin/sh\n")
    not_exec.chmod(0o644)
    for exe, message in (
        (tmp_path / "missing.sh", "no such file"),
        (not_exec, "is not executable"),
    ):
        out = subprocess.run(
            [
                str(agent),
                "run",
                "--node",
                "n1",
                "--server",
                "http://127.0.0.1:9",
                "--token",
                "t",
                "--isolation-command",
                str(exe),
                "--state-dir",
                str(tmp_path / "state"),
                "--spool-dir",
                str(tmp_path / "spool"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2
        assert message in out.stderr
        assert "TIERWATCH_ISOLATION_COMMAND" in out.stderr

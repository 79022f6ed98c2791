"""Carry out the server's commands on this node, each at most once.

Commands arrive in the answers to the agent's reports (``ReportAck.commands``). The
executor runs them one at a time on its own thread and reports what became of each
(``CommandResult``: running, then succeeded or failed) in the next batches.

- ``isolate`` / ``release`` (the node-local ``command`` isolation driver): runs the
  configured executable as ``<exe> <action> <node>`` with ``TIERWATCH_ACTION``,
  ``TIERWATCH_NODE``, ``TIERWATCH_REASON``, ``TIERWATCH_ACTOR`` and
  ``TIERWATCH_COMMAND_ID`` in its environment, and without the agent's secrets
  (:func:`tierwatch.agent.envsafe.scrubbed_env`: tokens, persistent-tier credentials); exit
  code 0 is success; its combined stdout and stderr (last 4,000 characters) are reported;
  it is killed (with its process group) after the timeout.
- ``restore``: handed to the checkpoint store (``CheckpointService.add_restore_request``),
  which serves it to the job's ranks; reported ``running`` — the server finishes it when the
  ranks report their restore.

At most once: a command id is written to the state file (``commands.json`` in the state
folder) before the command starts, so a re-delivered command — the answer carrying the
result was lost, or the agent restarted — is not run again: its recorded result is sent
again instead (one that was cut short by a restart is reported failed, not re-run).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierwatch.agent.envsafe import scrubbed_env
from tierwatch.agent.fsutil import atomic_write_json
from tierwatch.agent.protocol import Command, CommandResult, utcnow

log = logging.getLogger(__name__)

OUTPUT_MAX = 4000
REMEMBER = 2000  # command ids kept in the state file
STATE_FILE = "commands.json"

RestoreSink = Callable[[Command], None]
ResultSink = Callable[[list[CommandResult]], None]


def _tail(text: str) -> str:
    return text[-OUTPUT_MAX:]


def run_isolation_command(
    executable: Path,
    *,
    action: str,
    node: str,
    reason: str,
    actor: str,
    command_id: str,
    timeout_s: float,
) -> tuple[bool, int | None, str]:
    """Run the node-local isolation executable once.

    Returns:
        ``(ok, exit_code, output)``: ``ok`` when it exited 0; ``exit_code`` None when it
        could not start or timed out; ``output`` its stdout+stderr tail, or what went wrong.
    """
    env = {
        **scrubbed_env(os.environ),  # the script never sees the agent's tokens
        "TIERWATCH_ACTION": action,
        "TIERWATCH_NODE": node,
        "TIERWATCH_REASON": reason,
        "TIERWATCH_ACTOR": actor,
        "TIERWATCH_COMMAND_ID": command_id,
    }
    try:
        proc = subprocess.Popen(
            [str(executable), action, node],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        return (
            False,
            None,
            (
                f"cannot run the isolation command {executable}: "
                f"{exc.strerror or exc}; set --isolation-command "
                "(TIERWATCH_ISOLATION_COMMAND) to an executable file"
            ),
        )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        text = out.decode(errors="replace")
        return False, None, _tail(f"{text}\n[killed: still running after {timeout_s:g} s]")
    return proc.returncode == 0, proc.returncode, _tail(out.decode(errors="replace"))


class CommandExecutor:
    """Runs commands from the server once each, in order, on a thread of its own.

    Args:
        node: this node's name.
        state_dir: where ``commands.json`` (ids already run, and their results) lives.
        isolation_command: the ``command`` driver's executable (None: such commands fail
            with a message saying how to set it).
        isolation_timeout_s: seconds before that executable is killed.
        restore_sink: hands a ``restore`` command to the checkpoint store; raises
            ``ValueError`` (bad arguments) or ``RuntimeError`` (no store) to refuse it.
        report: called with results to send to the server (from the executor's thread).
    """

    def __init__(
        self,
        *,
        node: str,
        state_dir: Path,
        isolation_command: Path | None,
        isolation_timeout_s: float,
        restore_sink: RestoreSink | None,
        report: ResultSink,
    ) -> None:
        self.node = node
        self._path = state_dir / STATE_FILE
        self._isolation_command = isolation_command
        self._timeout_s = isolation_timeout_s
        self._restore_sink = restore_sink
        self._report = report
        self._lock = threading.Lock()
        self._done: dict[str, dict[str, Any]] = self._load()
        self._queued: set[str] = set()
        self._queue: queue.Queue[Command | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    # -- state file --------------------------------------------------------------------
    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self._path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.error("command state %s unreadable (%s); starting with none", self._path, exc)
            return {}
        done = data.get("commands", {}) if isinstance(data, dict) else {}
        for entry in done.values():
            if entry.get("state") == "started":  # cut short by a restart: never re-run
                entry.update(
                    state="failed",
                    output="the agent stopped while this command ran; it is not run again",
                )
        return done

    def _save(self) -> None:
        if len(self._done) > REMEMBER:
            for key in list(self._done)[: len(self._done) - REMEMBER]:
                del self._done[key]
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self._path, {"commands": self._done})
        except OSError as exc:
            log.error("cannot write command state %s: %s", self._path, exc)

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the executor thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="tierwatch-commands", daemon=True
            )
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop after the command in progress (waits up to ``timeout_s``)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    def busy(self) -> int:
        """Commands queued or running."""
        with self._lock:
            return len(self._queued)

    def known(self, command_id: str) -> dict[str, Any] | None:
        """The recorded state of a command id, or None."""
        with self._lock:
            entry = self._done.get(command_id)
            return dict(entry) if entry else None

    # -- intake ------------------------------------------------------------------------
    def submit(self, commands: list[Command]) -> None:
        """Take commands from a report answer (any thread). New ones are queued; ones already
        run are answered with their recorded result; ones queued or running are ignored."""
        again: list[CommandResult] = []
        for command in commands:
            with self._lock:
                entry = self._done.get(command.id)
                if command.id in self._queued:
                    continue
                if entry is None:
                    self._queued.add(command.id)
                    self._queue.put(command)
                    continue
            if entry["state"] in ("running", "succeeded", "failed"):
                again.append(self._result(command.id, entry))
        if again:
            self._report(again)

    @staticmethod
    def _result(command_id: str, entry: dict[str, Any]) -> CommandResult:
        state = entry["state"] if entry["state"] != "started" else "running"
        return CommandResult(
            id=command_id,
            state=state,
            ts=utcnow(),
            exit_code=entry.get("exit_code"),
            output=entry.get("output", ""),
        )

    def _record(
        self, command_id: str, state: str, *, exit_code: int | None = None, output: str = ""
    ) -> None:
        with self._lock:
            self._done[command_id] = {
                "state": state,
                "exit_code": exit_code,
                "output": _tail(output),
                "ts": utcnow().isoformat(),
            }
            self._save()

    # -- execution ---------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            command = self._queue.get()
            if command is None:
                return
            try:
                self._execute(command)
            except Exception as exc:  # noqa: BLE001 - a bug fails this command only
                log.exception("command %s (%s) failed", command.id, command.kind)
                self._finish(command, False, None, f"agent error: {exc!r}")
            finally:
                with self._lock:
                    self._queued.discard(command.id)

    def _finish(self, command: Command, ok: bool, exit_code: int | None, output: str) -> None:
        state = "succeeded" if ok else "failed"
        self._record(command.id, state, exit_code=exit_code, output=output)
        log.log(
            logging.INFO if ok else logging.ERROR,
            "command %s (%s) %s%s",
            command.id,
            command.kind,
            state,
            f": {output[-300:]}" if output and not ok else "",
        )
        self._report(
            [
                CommandResult(
                    id=command.id,
                    state=state,
                    ts=utcnow(),
                    exit_code=exit_code,
                    output=_tail(output),
                )
            ]
        )

    def _execute(self, command: Command) -> None:
        if command.expires_at is not None and utcnow() >= command.expires_at:
            self._finish(command, False, None, "expired before the agent could start it")
            return
        self._record(command.id, "started")
        if command.kind in ("isolate", "release"):
            self._report([CommandResult(id=command.id, state="running", ts=utcnow())])
            if self._isolation_command is None:
                self._finish(
                    command,
                    False,
                    None,
                    (
                        "no isolation command is configured on this agent: set "
                        "--isolation-command (TIERWATCH_ISOLATION_COMMAND) to the executable "
                        "that isolates/releases this node"
                    ),
                )
                return
            ok, code, out = run_isolation_command(
                self._isolation_command,
                action=command.kind,
                node=self.node,
                reason=str(command.args.get("reason", "")),
                actor=str(command.args.get("actor", "")),
                command_id=command.id,
                timeout_s=self._timeout_s,
            )
            self._finish(command, ok, code, out)
        elif command.kind == "restore":
            if self._restore_sink is None:
                self._finish(
                    command,
                    False,
                    None,
                    "the checkpoint store is not running on "
                    "this agent (start it with --memory-dir)",
                )
                return
            try:
                self._restore_sink(command)
            except (ValueError, RuntimeError) as exc:
                self._finish(command, False, None, f"restore refused: {exc}")
                return
            self._record(command.id, "running", output="handed to the job's ranks on this node")
            self._report(
                [
                    CommandResult(
                        id=command.id,
                        state="running",
                        ts=utcnow(),
                        output="handed to the job's ranks on this node",
                    )
                ]
            )
        else:
            self._finish(
                command,
                False,
                None,
                f"unknown command kind {command.kind!r} (this agent knows isolate, "
                "release, restore): upgrade the agent",
            )

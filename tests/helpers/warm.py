"""Rank processes forked from a pre-imported parent, so no rank pays torch's start-up.

A cold rank spends about 2 s of CPU importing torch before it trains, and the checkpoint
tests start well over a hundred ranks. :func:`start_rank` forks each rank from
multiprocessing's fork server, which has imported torch and tierwatch's training library
once (``warm_rank``, preloaded). The child is still a process of its own that runs the
script as ``__main__`` (:func:`warm_rank.run_script`): the test can SIGKILL it, poll it and
wait for its exit code through :class:`ForkedRank`, which has the ``subprocess.Popen``
methods ``Proc`` uses.

The fork server is started once per test process (one per xdist worker) with the
environment a cold rank would see at interpreter start-up (``STARTUP_ENV``); a launch whose
environment differs there starts cold instead.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

from procs import REPO_ROOT, Proc, base_env

# Read by the interpreter or by torch at import, so they must match for a forked start.
STARTUP_ENV = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}

_lock = threading.Lock()
_ctx: Any = None


def _context() -> Any:
    """The forkserver context, its server started with the ranks' start-up environment."""
    global _ctx
    with _lock:
        if _ctx is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["warm_rank"])
            saved = dict(os.environ)
            # Python 3.11's fork server ignores the sys.path it is handed and preloads with
            # its own, from PYTHONPATH: without this folder on it, importing warm_rank fails,
            # the failure is swallowed, and every child imports torch again (about 2 s each).
            server_path = os.pathsep.join([STARTUP_ENV["PYTHONPATH"], str(Path(__file__).parent)])
            try:  # the server inherits the environment it is started with
                os.environ.clear()
                os.environ.update(base_env(**{**STARTUP_ENV, "PYTHONPATH": server_path}))
                forkserver.ensure_running()
            finally:
                os.environ.clear()
                os.environ.update(saved)
            _ctx = ctx
        return _ctx


class ForkedRank:
    """A forked rank, seen through the ``subprocess.Popen`` methods ``Proc`` calls."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_rank(
    name: str, script: Path, args: list[str], env: dict[str, str], log_path: Path
) -> Proc:
    """Run ``python script args`` with ``env`` as a rank process; forked when ``env`` agrees
    with the fork server's start-up environment, else started cold."""
    argv = [sys.executable, str(script), *args]
    if any(env.get(k) != v for k, v in STARTUP_ENV.items()):
        return Proc(name, argv, env, log_path).start()
    import warm_rank

    # daemon: a rank a test left running is ended when the test process exits
    process = _context().Process(
        target=warm_rank.run_script,
        name=name,
        daemon=True,
        args=(str(script), args, env, str(log_path)),
    )
    process.start()
    return Proc(name, argv, env, log_path, popen=ForkedRank(process))  # type: ignore[arg-type]

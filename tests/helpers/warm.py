"""Warm rank processes: start-up paid ahead of time, off the test's critical path.

A cold rank spends about 2 s of CPU importing torch before it trains; the checkpoint tests
start a few hundred ranks. ``WarmPool`` keeps a few ``warm_rank.py`` processes that have
done those imports (niced, so they soak up idle CPU) and hands one out per rank: the test
gets a real child process (``Proc``) running the script as ``__main__``, which it can
SIGKILL, poll and wait for as before. A launch whose start-up environment differs from the
pool's (``PYTHONPATH``, ``OMP_NUM_THREADS``) starts cold instead, so nothing a rank reads
at interpreter start-up can differ from a cold start.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from procs import REPO_ROOT, Proc, base_env

WARM_RANK = Path(__file__).with_name("warm_rank.py")
# Read by the interpreter or by torch at import, so they must match for a warm start.
STARTUP_ENV = {"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
IMPORT_NICE = 5


class WarmPool:
    """Up to ``size`` idle warm ranks, refilled after each take."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._idle: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(WARM_RANK)], env=base_env(**STARTUP_ENV),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: os.nice(IMPORT_NICE))

    def fill(self) -> None:
        with self._lock:
            self._idle = [p for p in self._idle if p.poll() is None]
            while len(self._idle) < self.size:
                self._idle.append(self._spawn())

    def start(self, name: str, script: Path, args: list[str], env: dict[str, str],
              log_path: Path) -> Proc:
        """Run ``python script args`` with ``env`` as a rank; warm when the env allows."""
        if any(env.get(k) != v for k, v in STARTUP_ENV.items()):
            return Proc(name, [sys.executable, str(script), *args], env, log_path).start()
        with self._lock:
            self._idle = [p for p in self._idle if p.poll() is None]
            popen = self._idle.pop(0) if self._idle else self._spawn()
        assert popen.stdin is not None
        spec = {"script": str(script), "args": args, "env": env, "log": str(log_path)}
        popen.stdin.write((json.dumps(spec) + "\n").encode())
        popen.stdin.close()
        return Proc(name, [sys.executable, str(script), *args], env, log_path, popen=popen)

    def close(self) -> None:
        with self._lock:
            for p in self._idle:
                p.kill()
                p.wait(10)
            self._idle = []


_POOL: WarmPool | None = None


def pool() -> WarmPool:
    """This test process's pool (one per xdist worker), emptied at exit."""
    global _POOL
    if _POOL is None:
        _POOL = WarmPool()
        atexit.register(_POOL.close)
    return _POOL

"""The test ranks really start warm: forked from a fork server that has imported torch."""

from __future__ import annotations

import sys
from pathlib import Path

import warm
from procs import base_env, wait_for

PROBE = """
import os, sys
import warm_rank
print(f"imported_in={warm_rank.IMPORTED_IN} pid={os.getpid()} torch={'torch' in sys.modules}")
sys.exit(3)
"""


def test_a_forked_rank_inherits_the_preloaded_torch(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    log = tmp_path / "probe.out"
    proc = warm.start_rank("probe", script, [], base_env(**warm.STARTUP_ENV), log)
    assert type(proc.popen).__name__ == "ForkedRank"  # the environment allowed a fork
    wait_for(lambda: not proc.running, timeout=60, what="the probe rank to exit")
    assert proc.stop() == 3  # the script's exit code comes back
    fields = dict(kv.split("=") for kv in log.read_text().split())
    assert fields["torch"] == "True"
    # warm_rank was imported before the fork (in the server), not by the rank itself
    assert fields["imported_in"] != fields["pid"], log.read_text()


def test_a_rank_with_another_startup_environment_starts_cold(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text("import sys; sys.exit(0)\n")
    env = base_env(**{**warm.STARTUP_ENV, "OMP_NUM_THREADS": "2"})
    proc = warm.start_rank("cold", script, [], env, tmp_path / "cold.out")
    assert type(proc.popen).__name__ != "ForkedRank"
    assert proc.popen is not None
    assert proc.popen.wait(timeout=60) == 0
    assert proc.args[0] == sys.executable

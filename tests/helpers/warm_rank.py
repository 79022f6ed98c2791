"""What a forked rank runs (see warm.py): imported once by the fork server, so each rank
starts with torch and tierwatch's training library already loaded.

:func:`run_script` turns the forked child into ``python SCRIPT ARGS``: it appends stdout and
stderr to the rank's log, takes the rank's environment as its whole environment, and runs the
script as ``__main__``. The script's ``sys.exit(code)`` is the process's exit code.
"""

from __future__ import annotations

import os
import runpy
import sys

# What every rank of the checkpoint tests imports first; a cold start spends ~2 s of CPU here.
import numpy  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401

import tierwatch

tierwatch.TieredCheckpointer  # noqa: B018 - imports the training library (a lazy attribute)

# The process that imported this module: the fork server's pid in a forked rank (a rank that
# imported it itself paid torch's start-up; tests/test_warm_ranks.py checks it does not).
IMPORTED_IN = os.getpid()


def run_script(script: str, args: list[str], env: dict[str, str], log_path: str) -> None:
    """Run ``script`` with ``args`` as ``__main__`` in this process.

    Raises:
        SystemExit: as the script does (its exit code).
    """
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` does
    runpy.run_path(script, run_name="__main__")

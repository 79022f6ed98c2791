"""A warm rank: a Python process that has imported torch and tierwatch's training library,
then waits on stdin for what to run (see warm.py).

The spec is one JSON line: ``{"script": PATH, "args": [...], "env": {...}, "log": PATH}``.
The process then appends its stdout and stderr to ``log``, takes ``env`` as its whole
environment, and runs ``script`` as ``__main__`` with ``args``, exactly as
``python SCRIPT ARGS`` would after start-up. It stays the same process: the test that
launched it can SIGKILL it, and its exit code is the script's.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

# What every rank of the e2e tests imports first; a cold start spends ~2 s of CPU here.
import numpy  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401

import tierwatch

tierwatch.TieredCheckpointer  # noqa: B018 - imports the training library (lazy attribute)


def main() -> None:
    line = sys.stdin.readline()
    if not line:  # the pool closed us without work: exit quietly
        raise SystemExit(0)
    spec = json.loads(line)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 0)  # imports ran niced; the rank runs as usual
    except OSError:
        pass
    os.environ.clear()
    os.environ.update(spec["env"])
    script = spec["script"]
    sys.argv = [script, *spec["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

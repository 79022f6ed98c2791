"""Run checkpoint background work at a lower CPU priority than training (no torch).

A save's background work (copying, writing, checksumming, replicating, uploading) competes
with the training step for the node's cores. On Linux every thread is a schedulable task
with its own nice value, so the background threads lower their own priority with
``setpriority(PRIO_PROCESS, <thread id>, nice)``: when training and checkpointing both want a
core, training gets it, and the background work uses the cycles training leaves idle.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

DEFAULT_NICE = 10


def lower_this_thread(nice: int = DEFAULT_NICE) -> bool:
    """Raise the calling thread's nice value to at least ``nice`` (0-19; 0: leave it).

    Returns:
        True when the priority was changed; False when ``nice`` is 0, the platform has no
        per-thread priorities, or the call was refused (it is then logged, never raised).
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        if current >= nice:
            return False
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice))
    except OSError as exc:
        log.debug("cannot lower the priority of thread %d: %s", tid, exc)
        return False
    return True

"""Make a drawn failure real on the cluster (see :class:`demo.faults.Effect`).

Each function does what the failure does to a node and returns what it did, in words;
recovery is not its business (the supervisor and tierwatch do that).
"""

from __future__ import annotations

import os
import random
import signal

from demo.cluster import Node
from demo.faults import Effect


def kill(pid: int) -> None:
    """SIGKILL a rank (as a crashed process or a lost host would end it)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def strike(effect: Effect, node: Node, rank_pid: int, rng: random.Random, gpus: int) -> str:
    """Apply ``effect`` to ``node``, whose rank runs as ``rank_pid``.

    ``gpu``: the fault goes into a random GPU of the node's simulated collector, then the
    rank is killed. ``host``: the rank and the agent are killed and the memory tier (with
    the replicas the node held) is wiped. ``process``: the rank is killed. ``network``: the
    rank is killed and the replicas the node holds for its peers are dropped. ``sdc``: rank
    0's process gets SIGUSR1 and corrupts a weight after its current step (the caller
    passes rank 0's pid).

    Returns:
        What was done, for the report's ``injected`` field.

    Raises:
        RuntimeError: the agent refused the injection.
    """
    if effect.action == "gpu":
        gpu = rng.randrange(gpus)
        what = node.inject(effect.fault or "xid", gpu=gpu, value=effect.value)
        kill(rank_pid)
        return f"{what}; rank killed"
    if effect.action == "host":
        kill(rank_pid)
        node.stop(signal.SIGKILL)
        node.wipe_memory()
        return "host lost: rank and agent killed, memory tier wiped"
    if effect.action == "process":
        kill(rank_pid)
        return "rank killed"
    if effect.action == "network":
        kill(rank_pid)
        dropped = node.drop_replicas()
        return f"rank killed; {dropped} peer replica step(s) held by the node dropped"
    if effect.action == "sdc":
        os.kill(rank_pid, signal.SIGUSR1)
        return "a weight of rank 0 corrupted (exponent bit flip in the final norm)"
    raise ValueError(f"unknown effect {effect.action!r}")

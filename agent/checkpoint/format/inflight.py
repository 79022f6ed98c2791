"""Memory steps the node's agent is reading (replication, upload): pinned against eviction.

The ranks write the memory tier and evict its old steps themselves; the agent reads committed
steps from it to replicate and upload them. So that retention never deletes files under a
transfer, the agent *pins* each step while it reads it:

``<memory-dir>/jobs/<job_id>/.agent-pins.json``::

    {"node": "node-a", "pid": 4242, "lease_s": 60.0,
     "expires_at": "2026-12-02T01:50:00+00:00",
     "steps": {"7": ["peer"], "10": ["persistent"]}}

written atomically by the agent whenever its pins change and again every third of the lease
while any pin is held (removed when none is). A file whose ``expires_at`` (UTC) has passed
pins nothing: an agent killed mid-transfer holds memory for at most one lease.

``<memory-dir>/jobs/<job_id>/.agent-pins.lock`` serialises the two sides (``fcntl.flock``,
exclusive): the agent holds it while it adds a pin and checks that the step is still
committed (every local rank's commit marker is there), a rank while it reads the pins and
removes the steps it evicts. So either the rank evicted the step first (the agent sees the
marker gone and skips the step), or the agent pinned it first (the rank keeps it).

Shared by the agent (:class:`~tierwatch.agent.checkpoint.tierstore.store.MemoryStore`) and
the ranks (``TieredCheckpointer``); no torch, no network. docs/checkpointing.md,
"Backpressure".
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path

from tierwatch.agent.fsutil import atomic_write_json
from tierwatch.agent.protocol import utcnow

log = logging.getLogger(__name__)

PINS_FILE = ".agent-pins.json"
PINS_LOCK = ".agent-pins.lock"
DEFAULT_LEASE_S = 60.0


@contextlib.contextmanager
def pins_lock(job_dir: Path) -> Iterator[None]:
    """Hold ``<job_dir>/.agent-pins.lock`` (exclusive ``flock``; blocks until free).

    A job folder that does not exist (nothing to pin or evict) is not created: the block runs
    without the lock. So does a folder where the lock cannot be taken (a file system without
    ``flock``, a read-only folder): logged, since a rank's eviction and the agent's pin are
    then ordered only by the commit-marker check. Raises nothing itself.
    """
    try:
        fd = os.open(job_dir / PINS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except FileNotFoundError:
        yield
        return
    except OSError as exc:
        log.warning("cannot open %s (%s): pins and evictions unlocked", job_dir / PINS_LOCK, exc)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            log.warning(
                "cannot lock %s (%s): pins and evictions unlocked", job_dir / PINS_LOCK, exc
            )
        yield
    finally:
        os.close(fd)  # releases the lock


def read_agent_pins(job_dir: Path, *, now: datetime | None = None) -> dict[int, list[str]]:
    """The steps the agent pins now: step → tiers (``peer``, ``persistent``) reading it.

    Args:
        job_dir: ``<memory-dir>/jobs/<job_id>``.
        now: The time to check the lease against (UTC; default: now).

    Returns:
        ``{}`` when there is no pin file, its lease ran out, or it cannot be read (logged: a
        step then is not protected, and a transfer that loses its files reports a ``failed``
        event).
    """
    path = job_dir / PINS_FILE
    try:
        data = json.loads(path.read_text())
        expires = datetime.fromisoformat(data["expires_at"])
        steps = {int(s): [str(t) for t in tiers] for s, tiers in dict(data["steps"]).items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("%s unreadable (%s): no step pinned by the agent", path, exc)
        return {}
    if expires <= (now or utcnow()):
        return {}
    return dict(sorted(steps.items()))


def write_agent_pins(
    job_dir: Path,
    *,
    node: str,
    steps: Mapping[int, Sequence[str]],
    lease_s: float = DEFAULT_LEASE_S,
    now: datetime | None = None,
) -> None:
    """Write (or, with no ``steps``, remove) the agent's pin file of one job.

    Args:
        job_dir: ``<memory-dir>/jobs/<job_id>``.
        node: This agent's node.
        steps: step → tiers reading it.
        lease_s: Seconds the pins hold unless written again.
        now: The time the lease starts (UTC; default: now).

    Raises:
        OSError: the file cannot be written or removed.
    """
    path = job_dir / PINS_FILE
    if not steps:
        path.unlink(missing_ok=True)
        return
    expires = (now or utcnow()) + timedelta(seconds=lease_s)
    atomic_write_json(
        path,
        {
            "node": node,
            "pid": os.getpid(),
            "lease_s": lease_s,
            "expires_at": expires.isoformat(),
            "steps": {str(s): sorted(set(t)) for s, t in sorted(steps.items())},
        },
        fsync=False,
    )


@contextlib.contextmanager
def held_steps(job_dir: Path) -> Iterator[set[int]]:
    """The ranks' side: hold the pin lock and yield the steps the agent pins now.

    Evict inside the block, so the agent cannot pin a step between the read and the removal::

        with held_steps(job_dir) as held:
            for step in memory_evictions(..., pinned=held):
                files.remove(step)

    Raises nothing: an unreadable pin file pins nothing, a lock that cannot be taken is
    skipped (both logged).
    """
    with pins_lock(job_dir):
        yield set(read_agent_pins(job_dir))

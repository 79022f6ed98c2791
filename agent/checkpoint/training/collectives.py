"""The checkpointer's collectives, on process groups of its own (torch).

A :class:`TieredCheckpointer <.checkpointer.TieredCheckpointer>` talks to the other ranks in
three places, each on its own group so none waits behind another:

- the **save group** (gloo): the background writer's all-gathers and broadcasts (write
  verdicts, outcomes, rank 0's decision), ``dcp.save`` and restore's ``dcp.load``. On the
  training group these would interleave with the training loop's own collectives from
  another thread and deadlock; gloo also serves NCCL jobs.
- the **control group** (gloo): :meth:`TieredCheckpointer.maybe_rollback`'s agreement runs
  on the training thread while the background writer may be inside a collective on the save
  group.
- the job's **training group** (default WORLD): only the latency probe, timed there
  because that is the group whose latency training feels. On an NCCL group it runs on the
  GPU the group is bound to (see :func:`probe_device`) and is timed with CUDA events, so
  the host never waits for the whole device.

Every collective of the save group is entered by every rank, also by a rank that failed
before it: a rank-local failure is an *outcome* (:class:`RankOutcome`) that the others
receive in the collective, so all ranks give up together with the cause, instead of waiting
for ``timeout_s``. A phase that may take one rank much longer than ``timeout_s`` (a restore
fetching its files from the persistent tier) runs under :meth:`CheckpointCollectives.
gather_outcomes`: the waiting ranks exchange a heartbeat every ``heartbeat_s`` (at most
``timeout_s`` / 4), so no single collective waits longer than that, however long the fetch
(docs/checkpointing.md "Collective failures").

Without ``torch.distributed`` initialised, every collective is the identity of one rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tierwatch.agent.checkpoint.training.errors import CheckpointError

log = logging.getLogger(__name__)

HEARTBEAT_MAX_S = 5.0  # the longest pause between two heartbeats of a slow phase (seconds)
PROGRESS_LOG_S = 30.0  # how often a waiting rank logs whom it waits for (seconds)


@dataclass(frozen=True)
class RankOutcome:
    """What one rank's part of a phase gave, as exchanged with the other ranks.

    Attributes:
        rank: The rank it comes from.
        value: The phase's result on that rank (None when it failed).
        error: Why it failed on that rank (``"ExcType: first line"``), else None.
    """

    rank: int
    value: Any = None
    error: str | None = None


def failure_text(exc: BaseException) -> str:
    """``"ExcType: first line of the message"`` (at most 1500 characters), for an outcome."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:1500]


def values_or_raise(
    outcomes: Sequence[RankOutcome], *, what: str, nodes: Sequence[str] | None = None
) -> list[Any]:
    """Every rank's value, or the failure of every rank that failed, raised the same way on
    every rank (all ranks hold the same ``outcomes``, so all give up together).

    Args:
        outcomes: One per rank, index = rank (:meth:`CheckpointCollectives.gather_outcomes`).
        what: The phase, for the message (e.g. ``"restore of job x: staging step 4"``).
        nodes: Node name per rank, to name where each failure happened.

    Returns:
        ``[outcome.value for outcome in outcomes]``.

    Raises:
        CheckpointError: some rank failed; the message names each such rank (and its node)
            with its cause, e.g. ``… failed on rank 1 (node-b): RuntimeError: …``.
    """
    failed = [o for o in outcomes if o.error is not None]
    if failed:
        where = [
            f"rank {o.rank}"
            + (f" ({nodes[o.rank]})" if nodes and o.rank < len(nodes) else "")
            + f": {o.error}"
            for o in failed[:4]
        ]
        more = f" and {len(failed) - 4} more" if len(failed) > 4 else ""
        raise CheckpointError(
            f"{what} failed on {'; '.join(where)}{more}; every rank gave up"[:2000]
        )
    return [o.value for o in outcomes]


def probe_device(
    *,
    backend: str,
    bound_device: torch.device | None,
    current_device: int | None,
    device_count: int,
    env: Mapping[str, str],
) -> torch.device:
    """The device the latency probe all-reduces on, for a group with ``backend``.

    A group whose backend is not NCCL (gloo, or anything without ``nccl`` in its name) is
    timed with a CPU tensor. For NCCL the rules, first match wins:

    1. ``bound_device``: the device the group was initialised with
       (``init_process_group(device_id=...)``, exposed as ``ProcessGroup.bound_device_id``;
       torch 2.13 ``distributed_c10d.py`` sets it and ``barrier()`` uses it the same way).
    2. ``current_device`` when it is not 0: the process called ``torch.cuda.set_device``.
    3. ``LOCAL_RANK`` from ``env`` (torchrun's), modulo ``device_count`` (a launcher that
       gives each process one visible GPU keeps LOCAL_RANK but shows only ``cuda:0``).
    4. ``cuda:0``.

    Rule 2 before 3: a process that chose its GPU itself runs its collectives there. Using
    ``current_device`` alone (the old rule) put every rank of a node that never called
    ``set_device`` on ``cuda:0``, which NCCL refuses ("Duplicate GPU detected").

    Args:
        backend: ``torch.distributed.get_backend(group)``, e.g. ``"nccl"``, ``"gloo"`` or
            ``"cpu:gloo,cuda:nccl"``.
        bound_device: The group's (or WORLD's) ``bound_device_id``, or None.
        current_device: ``torch.cuda.current_device()``, or None without CUDA.
        device_count: ``torch.cuda.device_count()`` (0 without CUDA).
        env: The process environment (``LOCAL_RANK``).

    Returns:
        ``torch.device("cpu")`` or ``torch.device("cuda", index)``.

    Raises:
        RuntimeError: the backend is NCCL but this process sees no CUDA device.
    """
    if "nccl" not in backend.lower():
        return torch.device("cpu")
    if device_count < 1:
        raise RuntimeError(f"the training group's backend is {backend!r} but no CUDA device")
    if bound_device is not None and bound_device.type == "cuda":
        return torch.device("cuda", bound_device.index or 0)
    if current_device:
        return torch.device("cuda", current_device)
    local_rank = env.get("LOCAL_RANK", "")
    if local_rank.isdigit():
        return torch.device("cuda", int(local_rank) % device_count)
    return torch.device("cuda", 0)


def _bound_device(group: Any) -> torch.device | None:
    """``bound_device_id`` of ``group``, else of WORLD (a new group inherits WORLD's)."""
    for pg in (group, dist.group.WORLD):
        bound = getattr(pg, "bound_device_id", None) if pg is not None else None
        if bound is not None:
            return torch.device(bound)
    return None


class CheckpointCollectives:
    """Rank, world size and the collectives of one checkpointer.

    Args:
        timeout_s: Timeout of the save and control groups' collectives (seconds): the
            longest one collective waits for a rank that does not enter it (a dead or hung
            rank). A rank that is merely slow in a phase run by :meth:`gather_outcomes`
            keeps the others' collectives short with its heartbeats.
        train_group: The job's training group, for :meth:`latency_ms` (None: WORLD).

    Attributes:
        distributed: Whether ``torch.distributed`` is initialised (else one process).
        rank, world_size: This process's rank and the job's world size.
        group: The save group (None when not distributed), for DCP's ``process_group``.
        timeout_s: As given.
        heartbeat_s: Seconds between two heartbeats of :meth:`gather_outcomes`:
            ``timeout_s`` / 4, at most :data:`HEARTBEAT_MAX_S`, at least 0.05.
    """

    def __init__(self, *, timeout_s: float, train_group: Any = None) -> None:
        self.timeout_s = float(timeout_s)
        self.heartbeat_s = max(0.05, min(HEARTBEAT_MAX_S, self.timeout_s / 4))
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.train_group = train_group
        self._probe_device: torch.device | None = None
        timeout = timedelta(seconds=timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        self._ctrl_group = (
            dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        )

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), index = rank, on the save group."""
        return self._all_gather(obj, self.group)

    def broadcast_from_0(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (other ranks' argument is ignored), save group."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (an 8-byte all_reduce MIN, control group)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._ctrl_group)
        return int(t.item())

    def all_gather_control(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, index = rank, on the control group."""
        return self._all_gather(obj, self._ctrl_group)

    def gather_outcomes(
        self, fn: Callable[[], Any], *, what: str, limit_s: float | None = None
    ) -> list[RankOutcome]:
        """Run ``fn()`` on this rank, however long it takes, and return every rank's outcome.

        Every rank calls this at the same point. ``fn`` runs on a helper thread; meanwhile
        the calling thread all-gathers on the save group, every :attr:`heartbeat_s` seconds,
        either "still running" or this rank's outcome (an exception from ``fn`` is an
        outcome, ``error`` set: it never skips the collective). The rounds end when every
        rank sent its outcome. So a rank whose ``fn`` takes minutes (a restore's fetch from
        the persistent tier) makes no collective of the others wait longer than about
        :attr:`heartbeat_s`, which is below ``timeout_s``; a rank that dies or hangs outside
        ``fn`` still ends the others' wait after ``timeout_s`` (gloo's error).

        ``fn`` must not use the save group itself (the heartbeats run on it meanwhile).

        Args:
            fn: This rank's part of the phase (no arguments), e.g. staging its files.
            what: The phase, for the helper thread's name and the progress log.
            limit_s: The longest this rank's ``fn`` may take (seconds; None: unbounded):
                past it the rank's outcome is an error (``fn`` is left running, detached).

        Returns:
            One :class:`RankOutcome` per rank, index = rank, the same on every rank.

        Raises:
            RuntimeError: a heartbeat collective failed (gloo: a rank is gone, or did not
                enter it within ``timeout_s``).
        """
        done = threading.Event()
        box: list[RankOutcome] = []

        def run() -> None:
            try:
                box.append(RankOutcome(self.rank, value=fn()))
            except BaseException as exc:  # noqa: BLE001 - becomes this rank's outcome
                box.append(RankOutcome(self.rank, error=failure_text(exc)))
            finally:
                done.set()

        if not self.distributed:
            run()
            return box
        threading.Thread(target=run, name=f"tierwatch-ckpt-{what[:40]}", daemon=True).start()
        t0 = last_log = time.monotonic()
        mine: RankOutcome | None = None
        while True:
            done.wait(self.heartbeat_s)
            elapsed = time.monotonic() - t0
            if mine is None and done.is_set():
                mine = box[0]
            elif mine is None and limit_s is not None and elapsed > limit_s:
                mine = RankOutcome(self.rank, error=f"{what} did not finish within {limit_s:.0f} s")
            # a float (seconds so far) while running, the outcome once done
            sent: RankOutcome | float = mine if mine is not None else round(elapsed, 1)
            got = self._all_gather(sent, self.group)
            if all(isinstance(g, RankOutcome) for g in got):
                return got
            now = time.monotonic()
            if now - last_log >= PROGRESS_LOG_S:
                last_log = now
                slow = [f"rank {r} ({g:.0f} s)" for r, g in enumerate(got) if isinstance(g, float)]
                log.info("rank %d: %s: waiting for %s", self.rank, what, ", ".join(slow))

    def latency_device(self) -> torch.device:
        """The device :meth:`latency_ms` all-reduces on (:func:`probe_device`'s rules).

        Raises:
            RuntimeError: not distributed, or an NCCL group without a CUDA device.
        """
        if not self.distributed:
            raise RuntimeError("no collective latency without torch.distributed")
        if self._probe_device is None:
            backend = str(dist.get_backend(self.train_group))
            cuda = "nccl" in backend.lower() and torch.cuda.is_available()
            self._probe_device = probe_device(
                backend=backend,
                bound_device=_bound_device(self.train_group),
                current_device=torch.cuda.current_device() if cuda else None,
                device_count=torch.cuda.device_count() if cuda else 0,
                env=os.environ,
            )
        return self._probe_device

    def latency_ms(self) -> float:
        """Time one 1-element all_reduce on the training group (ms).

        On a CUDA device (NCCL) the time is GPU time between two CUDA events on the current
        stream of :meth:`latency_device`, around ``all_reduce(async_op=True)`` and
        ``work.wait()`` (which makes that stream wait for NCCL's); the host then waits for the
        end event only (the work queued on that stream before it, and the collective), not
        for the whole device (no ``torch.cuda.synchronize``: the checkpointer's copy streams
        are not waited for). The device is chosen once and kept. On the CPU
        (gloo) it is the wall time of ``all_reduce(async_op=True)`` + ``work.wait()``.

        Raises:
            RuntimeError: not distributed (there is no collective to time), or an NCCL group
                without a CUDA device.
        """
        device = self.latency_device()
        group = self.train_group
        if device.type != "cuda":
            x = torch.zeros(1, device=device)
            t0 = time.perf_counter()
            work = dist.all_reduce(x, group=group, async_op=True)
            if work is not None:
                work.wait()
            return (time.perf_counter() - t0) * 1000.0
        stream = torch.cuda.current_stream(device)
        with torch.cuda.device(device):
            x = torch.zeros(1, device=device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            work = dist.all_reduce(x, group=group, async_op=True)
            if work is not None:
                work.wait()
            end.record(stream)
        end.synchronize()
        return float(start.elapsed_time(end))

    def _all_gather(self, obj: Any, group: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

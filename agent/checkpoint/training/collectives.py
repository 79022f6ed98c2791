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

Without ``torch.distributed`` initialised, every collective is the identity of one rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


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
        timeout_s: Timeout of the save and control groups' collectives (seconds).
        train_group: The job's training group, for :meth:`latency_ms` (None: WORLD).

    Attributes:
        distributed: Whether ``torch.distributed`` is initialised (else one process).
        rank, world_size: This process's rank and the job's world size.
        group: The save group (None when not distributed), for DCP's ``process_group``.
    """

    def __init__(self, *, timeout_s: float, train_group: Any = None) -> None:
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

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
  because that is the group whose latency training feels.

Without ``torch.distributed`` initialised, every collective is the identity of one rank.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


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

    def latency_ms(self) -> float:
        """Time one 1-element all_reduce on the training group (ms; on the GPU for NCCL).

        Raises:
            RuntimeError: not distributed (there is no collective to time).
        """
        if not self.distributed:
            raise RuntimeError("no collective latency without torch.distributed")
        group = self.train_group
        backend = dist.get_backend(group)
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl" and torch.cuda.is_available()
            else torch.device("cpu")
        )
        x = torch.zeros(1, device=device)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) * 1000.0

    def _all_gather(self, obj: Any, group: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

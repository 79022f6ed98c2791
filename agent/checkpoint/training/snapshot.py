"""Staging a state dict into reused CPU buffers (torch).

:class:`SnapshotStager` walks a (nested) state dict and gives back a copy whose tensors live in CPU
buffers that are allocated once and reused by every later save with the same shapes. Each
tensor is either copied at once (``stage``'s synchronous part) or left as a pending copy for a
background thread (``lazy``): parameters and optimizer state only change in
``optimizer.step()``, which waits for the pending copies through a step pre-hook, so copying
them while the next forward/backward runs never tears a snapshot.

CUDA tensors are copied into pinned buffers with ``non_blocking=True`` on a side stream and
synchronised before the buffers are read; CPU tensors go into plain (unpinned) buffers.
DTensors are staged shard by shard (their local tensor), keeping mesh and placements.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

try:  # DTensor is public from torch 2.4
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    DTensor = None  # type: ignore[assignment,misc]

LazyPredicate = Callable[[tuple[Any, ...], torch.Tensor], bool]


@dataclass
class PendingCopies:
    """Copies left for the background thread.

    Attributes:
        pairs: (destination CPU buffer, source tensor).
        nbytes: bytes to copy.
    """

    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0

    def run(self) -> None:
        """Do the copies (and wait for CUDA ones to land)."""
        cuda = any(src.is_cuda for _, src in self.pairs)
        stream = torch.cuda.Stream() if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for dst, src in self.pairs:
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()
        else:
            for dst, src in self.pairs:
                dst.copy_(src)
        self.pairs.clear()


class SnapshotStager:
    """Copies state dicts into CPU buffers that are reused across saves.

    Attributes:
        allocations: how many buffers were allocated so far (a save with unchanged shapes
            allocates none).
        staged_bytes: bytes of tensor data in the last staged state dict.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.allocations = 0
        self.staged_bytes = 0

    def stage(
        self, state: dict[str, Any], lazy: LazyPredicate
    ) -> tuple[dict[str, Any], PendingCopies]:
        """Stage ``state``.

        Args:
            state: A nested dict/list of tensors and plain values.
            lazy: ``lazy(path, tensor)`` True leaves the tensor's copy pending.

        Returns:
            The staged state dict (same structure; tensors replaced by CPU buffers, other
            values deep-copied) and the pending copies.
        """
        pending = PendingCopies()
        self.staged_bytes = 0
        seen: set[tuple[Any, ...]] = set()
        staged = self._walk(state, (), lazy, pending, seen)
        for path in [p for p in self._buffers if p not in seen]:  # keys that went away
            del self._buffers[path]
        return staged, pending

    def _walk(
        self,
        value: Any,
        path: tuple[Any, ...],
        lazy: LazyPredicate,
        pending: PendingCopies,
        seen: set[tuple[Any, ...]],
    ) -> Any:
        if isinstance(value, dict):
            return {k: self._walk(v, (*path, k), lazy, pending, seen) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v, (*path, i), lazy, pending, seen) for i, v in enumerate(value)]
        if DTensor is not None and isinstance(value, DTensor):
            local = self._tensor(value._local_tensor, path, lazy, pending, seen)
            return DTensor.from_local(
                local,
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, lazy, pending, seen)
        return copy.deepcopy(value)

    def _tensor(
        self,
        t: torch.Tensor,
        path: tuple[Any, ...],
        lazy: LazyPredicate,
        pending: PendingCopies,
        seen: set[tuple[Any, ...]],
    ) -> torch.Tensor:
        seen.add(path)
        src = t.detach()
        buf = self._buffers.get(path)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(
                src.shape,
                dtype=src.dtype,
                device="cpu",
                pin_memory=src.is_cuda and torch.cuda.is_available(),
            )
            self._buffers[path] = buf
            self.allocations += 1
        self.staged_bytes += buf.numel() * buf.element_size()
        if lazy(path, t):
            pending.pairs.append((buf, src))
            pending.nbytes += buf.numel() * buf.element_size()
        else:
            buf.copy_(src)
        return buf

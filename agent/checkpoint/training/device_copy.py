"""The GPU → host copy protocol of a snapshot, on CUDA events (torch).

Four calls, on two threads, order a snapshot copy against training without the training
thread ever waiting on the GPU:

1. :meth:`DeviceCopier.mark_ready` (training thread, in ``save()``): an event recorded on the
   training thread's *current* stream of the source device, after every kernel that produced
   the state (and after the clones ``save()`` makes of non-lazy tensors).
2. :meth:`DeviceCopier.issue` (writer thread): sets the writer thread's CUDA device to the
   sources' device (the current device is per host thread: without it every rank's writer
   works on cuda:0), makes the copy stream of that device wait on the ready event, enqueues
   the copies with ``non_blocking=True`` into pinned host buffers on it and records a *done*
   event there. It returns as soon as the copies are enqueued.
3. :meth:`DeviceCopier.order_after` (training thread, in the optimizer step pre-hook): the
   training thread's current stream waits on the done event, so the optimizer's kernels that
   change parameters and optimizer state run only after the copy has read them. A GPU-side
   wait: the host goes straight on.
4. :meth:`DeviceCopier.wait` (writer thread): the host waits on the done event before DCP or
   the checksums read the host buffers.

The source tensors and the clones stay referenced by the batch until step 4, so the caching
allocator cannot hand their memory to another tensor while the copy stream still reads it.

torch sources relied on: ``torch/cuda/streams.py`` (``Stream.wait_event``, ``Event.record``,
``Event.synchronize``), ``torch/cuda/__init__.py`` (``set_device``, ``current_stream``,
``stream``). What only a GPU shows (bench/gpu_check.py runs it): that copies into the slab are
really asynchronous (pinned), that they land on the sources' device for LOCAL_RANK ≠ 0, and
that the committed step is bit-equal to a synchronous ``.cpu()`` copy.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class CudaOps(Protocol):
    """The CUDA calls the protocol makes (:class:`TorchCuda`; a fake in tests)."""

    def current_stream(self, device: torch.device) -> Any:
        """The calling thread's current stream on ``device``."""

    def new_stream(self, device: torch.device) -> Any:
        """A new stream on ``device``."""

    def new_event(self) -> Any:
        """A new event (``record(stream)``, ``synchronize()``)."""

    def set_device(self, device: torch.device) -> None:
        """Make ``device`` the calling thread's current device."""

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        """Make ``stream`` current on the calling thread for a block."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` without waiting for it (on the current stream)."""


class TorchCuda:
    """:class:`CudaOps` with ``torch.cuda``."""

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device=device)

    def new_event(self) -> Any:
        # blocking: the writer's synchronize() sleeps instead of spinning a core training
        # (its data loader) may need (cudaEventBlockingSync; torch/cuda/streams.py)
        return torch.cuda.Event(blocking=True)

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)


@dataclass
class DeviceBatch:
    """The copies from one CUDA device in one snapshot.

    Attributes:
        device: The sources' device (e.g. ``cuda:3``).
        ready: Event recorded on the training thread's current stream in ``save()``.
        pairs: (pinned host buffer, source tensor on ``device``); cleared once copied.
        nbytes: Bytes to copy.
        done: Event recorded on the copy stream after the copies (set by ``issue``).
    """

    device: torch.device
    ready: Any
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0
    done: Any = None


class DeviceCopier:
    """Runs the protocol (module docstring) with one copy stream per device, reused by
    every save.

    Args:
        ops: The CUDA calls (default: ``torch.cuda``).
    """

    def __init__(self, ops: CudaOps | None = None) -> None:
        self.ops: CudaOps = ops if ops is not None else TorchCuda()
        self._streams: dict[torch.device, Any] = {}

    def mark_ready(self, device: torch.device) -> DeviceBatch:
        """Training thread, in ``save()``: a batch whose copies run after everything enqueued
        so far on the training thread's current stream of ``device``."""
        ready = self.ops.new_event()
        ready.record(self.ops.current_stream(device))
        return DeviceBatch(device=device, ready=ready)

    def issue(self, batch: DeviceBatch) -> None:
        """Writer thread: enqueue the batch's copies on the device's copy stream after its
        ready event, and record its done event. Does not wait for the copies."""
        self.ops.set_device(batch.device)
        stream = self._streams.get(batch.device)
        if stream is None:
            stream = self._streams[batch.device] = self.ops.new_stream(batch.device)
        stream.wait_event(batch.ready)
        with self.ops.use_stream(stream):
            for dst, src in batch.pairs:
                self.ops.copy(dst, src)
        done = self.ops.new_event()
        done.record(stream)
        batch.done = done

    def order_after(self, batch: DeviceBatch) -> None:
        """Training thread, before the optimizer step: its current stream of the batch's
        device waits (on the GPU) for the batch's copies. A batch not issued (its copy failed)
        orders nothing."""
        if batch.done is not None:
            self.ops.current_stream(batch.device).wait_event(batch.done)

    def wait(self, batch: DeviceBatch) -> None:
        """Writer thread: block until the batch's copies have landed, then drop the
        references to its sources."""
        if batch.done is not None:
            batch.done.synchronize()
        batch.pairs.clear()

"""Staging a state dict into reused host buffers (torch).

:class:`SnapshotStager` walks a (nested) state dict and gives back a copy whose tensors live in
host buffers that are allocated once and reused by every later save with the same shapes. Each
tensor is either copied at once (``stage``'s synchronous part) or left as a pending copy for the
background writer thread (``lazy``): parameters and optimizer state only change in
``optimizer.step()``, whose step pre-hook orders it after the pending copies
(:meth:`PendingCopies.before_optimizer_step`), so copying them while the next forward/backward
runs never tears a snapshot. A lazily copied tensor that changes anyway (outside the hooked
step) is caught by its version counter (:mod:`.tensor_versions`) and the step is refused.

Host buffers:

- CPU-only states: one plain buffer per tensor.
- States with CUDA tensors: views into one :class:`~.host_slab.HostSlab` sized to the state and
  page-locked once with ``cudaHostRegister`` (never per-tensor ``pin_memory()``, whose caching
  allocator rounds each block up to a power of two). Its bytes count in the node's memory
  budget (:attr:`SnapshotStager.pinned_bytes`).

CUDA tensors are copied with the event protocol of :mod:`.device_copy`: an event recorded on
the training thread's current stream in ``save()``, copies on a per-device copy stream of the
writer thread, the optimizer's stream waiting on the copies' done event (no host sync on the
training thread). Non-lazy CUDA tensors (module buffers, and everything when ``state`` has no
optimizer) are cloned on the GPU in ``save()``, in stream order, and copied asynchronously from
the clone; the clones cost their bytes of GPU memory until the copy has landed.

DTensors (FSDP2, tensor parallel) are staged shard by shard: the staged value is a DTensor whose
local tensor *is* the host buffer, with the original's spec (mesh, placements, global shape and
stride), built with the ``DTensor(local, spec, requires_grad=False)`` constructor.
``DTensor.from_local`` cannot be used: it moves a local tensor to the mesh's device type
(``torch/distributed/tensor/_api.py``, ``local_tensor.to(device_type)``), which on a CUDA mesh
makes a new GPU copy of the buffer before the lazy copy has filled it. A CPU local tensor on a
CUDA mesh is what DCP's own CPU state dicts hold (``_create_cpu_state_dict`` in
``torch/distributed/_state_dict_utils.py`` keeps the spec and swaps in a CPU local tensor).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tierwatch.agent.checkpoint.training.device_copy import DeviceBatch, DeviceCopier
from tierwatch.agent.checkpoint.training.host_slab import HostSlab, TensorSpec
from tierwatch.agent.checkpoint.training.tensor_versions import VersionGuard

try:  # DTensor is public from torch 2.4
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - older torch
    DTensor = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

Path = tuple[Any, ...]
LazyPredicate = Callable[[Path, torch.Tensor], bool]


@dataclass
class PendingCopies:
    """Copies left for the background writer thread, and how the training thread waits for
    them.

    Attributes:
        pairs: Every pending (host buffer, source tensor); empty once :meth:`run` is done.
        nbytes: Bytes to copy.
        host_pairs: The pairs whose source is not a CUDA tensor (plain ``copy_``).
        batches: The CUDA pairs, one batch per device (:class:`~.device_copy.DeviceBatch`).
        versions: Version counters of the lazily copied sources.
        copier: Runs the CUDA event protocol (None without CUDA sources).
    """

    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    nbytes: int = 0
    host_pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    batches: list[DeviceBatch] = field(default_factory=list)
    versions: VersionGuard = field(default_factory=VersionGuard)
    copier: DeviceCopier | None = None

    def run(self, issued: Callable[[], None] | None = None) -> str | None:
        """Writer thread: do the copies and check the sources' versions.

        Order: CUDA copies are enqueued (not waited for), host copies are made; with no CUDA
        copies the versions are compared now; ``issued()`` tells the training thread that its
        optimizer step may go on (after :meth:`before_optimizer_step`); then the CUDA copies
        are waited for and the versions compared (unless the optimizer step pre-hook did it
        first). On return the host buffers hold the snapshot and no source is referenced.

        Args:
            issued: Called once the training thread may run its optimizer step.

        Returns:
            Why the snapshot must not be committed (a lazily copied tensor changed in place
            outside the hooked optimizer step; names it by its state-dict path), or None.
        """
        copier = self.copier
        ok = False
        try:
            if copier is not None:
                for batch in self.batches:
                    copier.issue(batch)
            for dst, src in self.host_pairs:
                dst.copy_(src)
            if not self.batches:
                self.versions.close()
            if issued is not None:
                issued()
            ok = True
        finally:
            # the sources and clones stay referenced until every enqueued copy has landed,
            # also when a copy failed (that first error is the one raised)
            if copier is not None:
                for batch in self.batches:
                    if ok:
                        copier.wait(batch)
                    else:
                        with contextlib.suppress(Exception):
                            copier.wait(batch)
        self.versions.close()
        self.host_pairs.clear()
        self.pairs.clear()
        return self.versions.problem

    def before_optimizer_step(self) -> None:
        """Training thread, in the optimizer step pre-hook, after ``issued()``: close the
        version window (the step is about to change the sources) and make the training
        thread's current stream wait, on the GPU, for the CUDA copies."""
        self.versions.close()
        if self.copier is not None:
            for batch in list(self.batches):
                self.copier.order_after(batch)


class SnapshotStager:
    """Copies state dicts into host buffers that are reused across saves.

    Args:
        slab: True: buffers are views into one :class:`~.host_slab.HostSlab` (pinned when the
            state has CUDA tensors and CUDA is available); False: one plain buffer per tensor;
            None (default): a slab exactly when the state has CUDA tensors.
        copier: The CUDA copy protocol (default: one on ``torch.cuda``, made when first
            needed).

    Attributes:
        allocations: How many buffers (or slabs) were allocated so far (a save with unchanged
            paths, shapes and dtypes allocates none).
        staged_bytes: Bytes of tensor data in the last staged state dict.
        pin_error: Why ``cudaHostRegister`` refused the slab (then staged unpinned: the copies
            are right but not asynchronous), or None.
    """

    def __init__(self, *, slab: bool | None = None, copier: DeviceCopier | None = None) -> None:
        self.slab = slab
        self._copier = copier
        self._buffers: dict[Any, torch.Tensor] = {}
        self._slab: HostSlab | None = None
        self.allocations = 0
        self.staged_bytes = 0
        self.pin_error: str | None = None

    @property
    def pinned_bytes(self) -> int:
        """Bytes of page-locked host memory the stager holds (its slab, when pinned)."""
        return self._slab.nbytes if self._slab is not None and self._slab.pinned else 0

    def buffer(self, path: Path) -> torch.Tensor:
        """The host buffer of the tensor at ``path`` (a DTensor's: of its local shard).

        Raises:
            KeyError: no tensor at ``path`` in the last staged state dict.
        """
        return self._buffers[path]

    def stage(
        self, state: dict[str, Any], lazy: LazyPredicate
    ) -> tuple[dict[str, Any], PendingCopies]:
        """Stage ``state``.

        Args:
            state: A nested dict/list of tensors, DTensors and plain values.
            lazy: ``lazy(path, tensor)`` True leaves the tensor's copy pending (its version is
                watched); ``path`` is the tuple of keys/indices down to it.

        Returns:
            The staged state dict (same structure; tensors replaced by host buffers, DTensors
            by DTensors over host buffers, other values deep-copied) and the pending copies.

        """
        leaves: list[tuple[Path, torch.Tensor]] = []
        _collect(state, (), leaves)
        has_cuda = any(t.is_cuda for _, t in leaves)
        use_slab = self.slab if self.slab is not None else has_cuda
        if use_slab:
            self._prepare_slab(leaves, pin=has_cuda and torch.cuda.is_available())
        else:
            self._prepare_buffers(leaves)

        pending = PendingCopies()
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.staged_bytes = 0
        staged = self._build(state, (), lazy, pending, by_device)
        if by_device:
            if self._copier is None:
                self._copier = DeviceCopier()
            pending.copier = self._copier
            for device, pairs in by_device.items():
                # recorded after the clones above: the copies see the state as of save()
                batch = self._copier.mark_ready(device)
                batch.pairs = pairs
                batch.nbytes = sum(dst.nbytes for dst, _ in pairs)
                pending.batches.append(batch)
        return staged, pending

    # -- buffers ------------------------------------------------------------------------------
    def _prepare_buffers(self, leaves: list[tuple[Path, torch.Tensor]]) -> None:
        if self._slab is not None:
            self._slab.release()
            self._slab = None
            self._buffers = {}
        wanted = {path for path, _ in leaves}
        for path in [p for p in self._buffers if p not in wanted]:  # keys that went away
            del self._buffers[path]
        for path, t in leaves:
            buf = self._buffers.get(path)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                self._buffers[path] = torch.empty(t.shape, dtype=t.dtype, device="cpu")
                self.allocations += 1

    def _prepare_slab(self, leaves: list[tuple[Path, torch.Tensor]], *, pin: bool) -> None:
        specs = [TensorSpec.of(path, t) for path, t in leaves]
        pin = pin and self.pin_error is None  # a refused pin is not retried every save
        if self._slab is not None and self._slab.fits(specs, pin=pin):
            return
        if self._slab is not None:
            self._slab.release()  # no copy into it is in flight: save() waited for the last
            self._slab = None
        try:
            self._slab = HostSlab(specs, pin=pin)
        except RuntimeError as exc:  # cudaHostRegister refused: copies still right, not async
            if not pin:
                raise
            log.warning("cannot pin the staging slab (%s); staging unpinned", exc)
            self.pin_error = str(exc)
            self._slab = HostSlab(specs, pin=False)
        self._buffers = dict(self._slab.views)
        self.allocations += 1

    # -- the staged state dict ----------------------------------------------------------------
    def _build(
        self,
        value: Any,
        path: Path,
        lazy: LazyPredicate,
        pending: PendingCopies,
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]],
    ) -> Any:
        if isinstance(value, dict):
            return {
                k: self._build(v, (*path, k), lazy, pending, by_device) for k, v in value.items()
            }
        if isinstance(value, list):
            return [
                self._build(v, (*path, i), lazy, pending, by_device) for i, v in enumerate(value)
            ]
        if DTensor is not None and isinstance(value, DTensor):
            # watch the DTensor itself: an in-place op on it bumps its version counter (shared
            # with the parameter it was detached from), not its local tensor's
            local = self._tensor(value._local_tensor, path, lazy, pending, by_device, watch=value)
            return host_dtensor(value, local)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path, lazy, pending, by_device)
        return copy.deepcopy(value)

    def _tensor(
        self,
        t: torch.Tensor,
        path: Path,
        lazy: LazyPredicate,
        pending: PendingCopies,
        by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]],
        *,
        watch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        src = t.detach()
        watched = src if watch is None else watch
        buf = self._buffers[path]
        self.staged_bytes += buf.nbytes
        is_lazy = lazy(path, t)
        if src.is_cuda:
            if is_lazy:
                pending.versions.watch(path, watched)
            else:
                src = src.clone()  # in stream order on the training thread's current stream
            by_device.setdefault(src.device, []).append((buf, src))
        elif is_lazy:
            pending.versions.watch(path, watched)
            pending.host_pairs.append((buf, src))
        else:
            buf.copy_(src)
            return buf
        pending.pairs.append((buf, src))
        pending.nbytes += buf.nbytes
        return buf


def _collect(value: Any, path: Path, out: list[tuple[Path, torch.Tensor]]) -> None:
    """The tensors of a state dict (a DTensor's local shard), in :meth:`_build`'s order."""
    if isinstance(value, dict):
        for k, v in value.items():
            _collect(v, (*path, k), out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _collect(v, (*path, i), out)
    elif DTensor is not None and isinstance(value, DTensor):
        out.append((path, value._local_tensor))
    elif isinstance(value, torch.Tensor):
        out.append((path, value))


def host_dtensor(original: Any, local: torch.Tensor) -> Any:
    """A DTensor with ``original``'s spec (the same mesh object, placements, global shape and
    stride) whose local tensor is ``local`` itself, on whatever device ``local`` is.

    Args:
        original: A DTensor.
        local: Its local shard's host buffer (the shape and dtype of
            ``original._local_tensor``).

    Returns:
        The DTensor, with ``requires_grad=False``; ``result._local_tensor is local``.

    Source: ``DTensor.__new__(local_tensor, spec, *, requires_grad)`` in
    ``torch/distributed/tensor/_api.py`` (torch 2.13); the spec is copied (shallow), so the
    mesh is the original's.
    """
    assert DTensor is not None
    spec = copy.copy(original._spec)
    return DTensor(local, spec, requires_grad=False)

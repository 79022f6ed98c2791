"""One host slab for a snapshot's staging buffers, pinned once for CUDA states (torch).

A GPU → CPU copy is asynchronous only into page-locked (pinned) host memory. Pinning each
staging buffer with ``tensor.pin_memory()`` or ``torch.empty(..., pin_memory=True)`` goes
through PyTorch's caching host allocator, which rounds every block up to a power of two
(``CachingHostAllocator``), so a 5 GiB shard can hold 8 GiB of RAM that cannot be swapped.
Instead :class:`HostSlab` allocates one plain CPU block sized to the whole state (each
tensor's bytes rounded up to :data:`ALIGN`) and page-locks exactly that range with
``cudaHostRegister``, as DCP's own stager does (``torch/cuda/_pin_memory_utils.py``, used by
``torch/distributed/checkpoint/_state_dict_stager.py``). It is allocated once and reused by
every save whose tensors have the same paths, shapes and dtypes; a change allocates a new
slab and unpins the old one.

Each staging buffer is a tensor with a storage of its own that points into the slab
(``torch.frombuffer`` on a slice of the slab), so ``storage().nbytes() == tensor.nbytes``:
DCP's ``FileSystemWriter`` writes a tensor as is only then, and clones a view of a larger
storage before ``torch.save`` (``torch/distributed/checkpoint/filesystem.py``,
``_OverlappingCpuLoader`` / ``_SerialCpuLoader``), which would copy the state once more.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

ALIGN = 256
"""Bytes each buffer's start is aligned to (cudaMalloc's own alignment, so a device shard
and its host buffer line up for the DMA engine)."""


@dataclass(frozen=True)
class TensorSpec:
    """What a staging buffer must hold.

    Attributes:
        path: The tensor's path in the state dict (a key of the slab's views).
        shape: Its shape.
        dtype: Its dtype.
    """

    path: Hashable
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize

    @classmethod
    def of(cls, path: Hashable, t: torch.Tensor) -> TensorSpec:
        """The spec of tensor ``t`` at ``path``."""
        return cls(path, tuple(t.shape), t.dtype)


def align_up(n: int, align: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``align`` (bytes)."""
    return -(-n // align) * align


def plan_slab(specs: Sequence[TensorSpec], align: int = ALIGN) -> tuple[list[int], int]:
    """Place tensors one after the other in a slab.

    Args:
        specs: The tensors, in the order they are placed.
        align: Alignment of every start offset (bytes, a power of two).

    Returns:
        (start offset of each spec in bytes, the slab's size in bytes). A spec of 0 bytes gets
        the current offset and takes no room.
    """
    offsets: list[int] = []
    end = 0
    for spec in specs:
        start = align_up(end, align)
        offsets.append(start)
        end = start + spec.nbytes
    return offsets, align_up(end, align) if end else 0


def _unpin(base: torch.Tensor) -> None:
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.unpin_memory(base.data_ptr())


class HostSlab:
    """One CPU block holding every staging buffer of a state, optionally pinned.

    Args:
        specs: The tensors to hold (paths must be distinct).
        pin: Page-lock the block with ``cudaHostRegister`` (needs CUDA).

    Attributes:
        specs: The tensors it was sized for, in placement order.
        nbytes: The block's size in bytes (what it costs in host RAM).
        pinned: Whether the block is page-locked.
        views: path → the buffer for that tensor (shape and dtype of its spec).

    Raises:
        RuntimeError: ``pin`` and ``cudaHostRegister`` fails (``torch/cuda/_pin_memory_utils.py``
            raises with the CUDA error code).
        ValueError: two specs share a path.
    """

    def __init__(self, specs: Sequence[TensorSpec], *, pin: bool) -> None:
        self.specs = tuple(specs)
        offsets, self.nbytes = plan_slab(self.specs)
        if len({s.path for s in self.specs}) != len(self.specs):
            raise ValueError("two tensors share a path in the slab")
        self._base = torch.empty(self.nbytes, dtype=torch.uint8)
        self.pinned = False
        self._finalizer: weakref.finalize | None = None
        if pin and self.nbytes:
            from torch.cuda import _pin_memory_utils

            _pin_memory_utils.pin_memory(self._base.data_ptr(), self.nbytes)
            self.pinned = True
            # the finalizer holds the base tensor, so the block is unpinned before it is freed
            self._finalizer = weakref.finalize(self, _unpin, self._base)
            self._finalizer.atexit = False  # the CUDA context may be gone at exit
        self.views: dict[Hashable, torch.Tensor] = {}
        memory = self._base.numpy().data if self.nbytes else None  # a memoryview
        for spec, start in zip(self.specs, offsets, strict=True):
            size = spec.nbytes
            if size == 0 or memory is None:
                self.views[spec.path] = torch.empty(spec.shape, dtype=spec.dtype)
                continue
            # a storage of exactly `size` bytes inside the slab (it keeps the slab alive)
            raw = torch.frombuffer(memory[start : start + size], dtype=torch.uint8)
            self.views[spec.path] = raw.view(spec.dtype).view(spec.shape)

    def fits(self, specs: Sequence[TensorSpec], *, pin: bool) -> bool:
        """Whether this slab holds exactly ``specs`` (same order), pinned as asked."""
        return self.specs == tuple(specs) and self.pinned == (pin and self.nbytes > 0)

    def release(self) -> None:
        """Unpin the block now (its memory is freed once no buffer refers to it).

        Call it only when no copy into the slab is in flight.
        """
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.pinned = False

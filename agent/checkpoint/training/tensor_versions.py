"""Detect tensors changed in place while their snapshot copy was pending (torch).

Parameters and optimizer state are copied lazily, after ``save()`` returns, because they
change only in the hooked ``optimizer.step()``. Some jobs change them elsewhere: an optimizer
left out of ``state`` (Muon next to AdamW), optimizer-in-backward, an EMA update, an eval
weight swap. Such a change between ``save()`` and the copy tears the snapshot.

Every in-place op on a tensor bumps its version counter (``Tensor._version``; ``detach()``
shares the counter with the tensor it came from, see ``torch/_tensor.py`` and the autograd
notes on in-place correctness checks). :class:`VersionGuard` records each lazily copied
tensor's version in ``save()`` and compares once the copy window closes: after the copy, or
at the hooked optimizer step, whichever comes first (after that point the optimizer itself
changes them, legitimately). A change means the snapshot may be torn, and the step is refused.

Not seen: writes through ``tensor.data`` (a separate version counter) and writes by kernels
outside PyTorch's dispatcher (custom CUDA code writing through a raw pointer).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import torch

MAX_NAMED = 5


def path_name(path: Sequence[Hashable]) -> str:
    """A state-dict path as one dotted name (``("model", "lin.weight")`` →
    ``model.lin.weight``)."""
    return ".".join(str(p) for p in path)


class VersionGuard:
    """Version counters of the tensors of one snapshot whose copy is pending.

    Attributes:
        changed: State-dict paths of the tensors whose version changed (set by :meth:`close`).
    """

    def __init__(self) -> None:
        self._watched: list[tuple[str, torch.Tensor, int]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.changed: list[str] = []

    def watch(self, path: Sequence[Hashable], t: torch.Tensor) -> None:
        """Record ``t``'s version now (training thread, in ``save()``)."""
        self._watched.append((path_name(path), t, t._version))

    def close(self) -> None:
        """Compare the versions once; later calls do nothing (either thread may call it).

        The first caller closes the copy window: the writer after its copies, or the
        optimizer step pre-hook, whichever comes first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.changed = [name for name, t, v in self._watched if t._version != v]
            self._watched.clear()

    @property
    def problem(self) -> str | None:
        """Why the snapshot must not be committed (names the changed tensors), or None."""
        if not self.changed:
            return None
        names = ", ".join(self.changed[:MAX_NAMED])
        more = f" and {len(self.changed) - MAX_NAMED} more" if len(self.changed) > MAX_NAMED else ""
        return (
            f"{names}{more} changed in place between save() and its snapshot copy, outside "
            "the hooked optimizer step (an EMA update, an optimizer not in state, a weight "
            "swap?); the snapshot may be torn. Change them only inside a hooked "
            "optimizer.step(), or put the optimizer that changes them in state"
        )

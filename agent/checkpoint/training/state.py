"""Per-rank training state that a checkpoint must keep per rank: RNG streams and the data order.

DCP writes a value that every rank saves under the same key only once (it deduplicates
replicated items), so a per-rank value saved under a shared key would silently come back as
one rank's value on every rank. Both helpers here key their state by rank
(``{"rank_<r>": ...}``), which keeps every rank's value apart; at load, each rank reads its
own key (loading at a different world size therefore needs these keys left out).

Both follow ``torch.distributed.checkpoint.stateful.Stateful`` (``state_dict`` /
``load_state_dict``), so
:class:`~tierwatch.agent.checkpoint.training.checkpointer.TieredCheckpointer` and plain DCP
handle them alike.

Both store plain tensors only, never pickled objects (docs/security.md "Integrity of restored
steps"): DCP saves a tensor's bytes as they are, whereas a Python object would go through
``torch.save`` and come back through ``torch.load``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


PYTHON_STATE_LEN = 625  # Mersenne Twister: 624 words and the position
NUMPY_KEY_LEN = 624


def _old_format(name: str) -> ValueError:
    return ValueError(
        f"RNG state {name!r} is in the old pickled format, which is no longer loaded (it "
        "would run whatever code the bytes name): restore a step saved by this version, or "
        "leave 'rng' out of the state to load that step"
    )


class RNGState:
    """This rank's random-number generators: Python ``random``, NumPy's global generator, the
    torch CPU generator and every CUDA device's generator.

    ``state_dict()`` → ``{"rank_<r>": {...}}`` of tensors only (no pickle):

    - ``python``: int64 ``[version, *internal_state]`` (1 + 625) of ``random.getstate()``;
      ``python_gauss``: float64 ``[has_gauss, gauss_next]``;
    - ``numpy`` (omitted when NumPy is not installed): int64 ``[*keys, pos, has_gauss]``
      (624 + 2) of ``np.random.get_state()`` (always ``'MT19937'``); ``numpy_gauss``: float64
      ``[cached_gaussian]``;
    - ``torch``: the uint8 CPU generator state; ``cuda``: a uint8 tensor per device.

    A state saved by an older version (``python``/``numpy`` as pickled bytes) is refused
    with a ``ValueError`` that says so.

    Args:
        rank: The rank to key by (default: torch.distributed's rank, else 0).
    """

    def __init__(self, rank: int | None = None) -> None:
        self.rank = _rank() if rank is None else rank

    @property
    def key(self) -> str:
        return f"rank_{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        """Capture the generators now (copies, so later draws do not change the snapshot)."""
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "python": torch.tensor([version, *internal], dtype=torch.int64),
            "python_gauss": torch.tensor(
                [0.0 if gauss is None else 1.0, 0.0 if gauss is None else gauss],
                dtype=torch.float64,
            ),
            "torch": torch.get_rng_state(),
        }
        try:
            import numpy as np

            name, keys, pos, has_gauss, cached = np.random.get_state()
            if name != "MT19937":  # np.random's global generator is always MT19937
                raise ValueError(f"NumPy's global generator is {name!r}, not 'MT19937'")
            state["numpy"] = torch.tensor(
                [*np.asarray(keys, dtype=np.int64).tolist(), int(pos), int(has_gauss)],
                dtype=torch.int64,
            )
            state["numpy_gauss"] = torch.tensor([float(cached)], dtype=torch.float64)
        except ImportError:  # numpy is optional
            pass
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return {self.key: state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set the generators from a state saved by the same rank.

        Raises:
            KeyError: ``state_dict`` holds no entry for this rank (saved at another world
                size); names the rank and the keys present.
            ValueError: a state in the old pickled format, or of the wrong shape.
        """
        if self.key not in state_dict:
            raise KeyError(
                f"RNG state has no entry for rank {self.rank} (keys: "
                f"{sorted(state_dict)[:8]}); it was saved at another world size"
            )
        state = state_dict[self.key]
        py = state["python"]
        if not isinstance(py, torch.Tensor) or "python_gauss" not in state:
            raise _old_format("python")
        words = py.to(torch.int64).cpu().tolist()
        if len(words) != 1 + PYTHON_STATE_LEN:
            raise ValueError(f"RNG state 'python' has {len(words)} values, not 626")
        has_gauss, gauss = state["python_gauss"].to(torch.float64).cpu().tolist()
        if "numpy" in state:
            numpy_state = state["numpy"]
            if not isinstance(numpy_state, torch.Tensor) or "numpy_gauss" not in state:
                raise _old_format("numpy")
            if numpy_state.numel() != NUMPY_KEY_LEN + 2:
                raise ValueError(
                    f"RNG state 'numpy' has {numpy_state.numel()} values, not {NUMPY_KEY_LEN + 2}"
                )
        random.setstate((words[0], tuple(words[1:]), gauss if has_gauss else None))
        torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
        if "numpy" in state:
            import numpy as np

            values = state["numpy"].to(torch.int64).cpu().tolist()
            np.random.set_state(
                (
                    "MT19937",
                    np.asarray(values[:NUMPY_KEY_LEN], dtype=np.uint32),
                    int(values[NUMPY_KEY_LEN]),
                    int(values[NUMPY_KEY_LEN + 1]),
                    float(state["numpy_gauss"].to(torch.float64).cpu().item()),
                )
            )
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that resumes mid-epoch at the sample where it stopped.

    The position counts the indices this rank's iterator has handed out in the current epoch;
    ``state_dict()`` records it with the epoch, so a restored sampler continues with the next
    index, in the same shuffled order. With a ``DataLoader`` that prefetches (``num_workers``
    > 0), the sampler runs ahead of training by the prefetched batches; either use
    ``num_workers=0`` or call :meth:`set_position` with the samples actually consumed.

    ``state_dict()`` → ``{"rank_<r>": {"epoch", "position", "seed", "num_replicas",
    "shuffle"}}``, each a 0-d int64 tensor (no pickle; ``shuffle`` 0 or 1). Loading also
    accepts plain ints and bools.

    Args:
        dataset: Anything with ``__len__`` (a ``Dataset``), or an int dataset size.
        num_replicas, rank: default to torch.distributed's world size and rank.
        shuffle, seed, drop_last: as for ``DistributedSampler``.
    """

    def __init__(
        self,
        dataset: Dataset[Any] | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if isinstance(dataset, int):
            dataset = _SizedRange(dataset)
        super().__init__(
            dataset,
            num_replicas=_world_size() if num_replicas is None else num_replicas,
            rank=_rank() if rank is None else rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.position = 0

    @property
    def key(self) -> str:
        return f"rank_{self.rank}"

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its first sample."""
        if epoch != self.epoch:
            self.position = 0
        super().set_epoch(epoch)

    def set_position(self, position: int) -> None:
        """Set how many samples of the current epoch were consumed."""
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"position must be in 0..{self.num_samples}, not {position}")
        self.position = position

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start = self.position
        for i in range(start, len(indices)):
            self.position = i + 1
            yield indices[i]
        # An exhausted epoch moves to the next one's start.
        self.epoch += 1
        self.position = 0

    def __len__(self) -> int:
        return self.num_samples - self.position

    def state_dict(self) -> dict[str, Any]:
        """The epoch and position of this rank (keyed by rank)."""
        values = {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "shuffle": int(self.shuffle),
        }
        return {self.key: {k: torch.tensor(v, dtype=torch.int64) for k, v in values.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume from a state saved by the same rank at the same world size.

        Raises:
            KeyError: no entry for this rank.
            ValueError: saved with another number of replicas, seed or shuffle setting (the
                order would differ).
        """
        if self.key not in state_dict:
            raise KeyError(
                f"sampler state has no entry for rank {self.rank} (keys: "
                f"{sorted(state_dict)[:8]}); it was saved at another world size"
            )
        state = {k: int(v) for k, v in state_dict[self.key].items()}
        for name in ("num_replicas", "seed", "shuffle"):
            if state[name] != int(getattr(self, name)):
                raise ValueError(
                    f"sampler was saved with {name}={state[name]!r}, this one has "
                    f"{int(getattr(self, name))!r}: the sample order would differ"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


class _SizedRange(Dataset[int]):
    def __init__(self, n: int) -> None:
        if n < 0 or not math.isfinite(n):
            raise ValueError(f"dataset size must be ≥ 0, not {n}")
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

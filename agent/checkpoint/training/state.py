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
"""

from __future__ import annotations

import math
import pickle
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


class RNGState:
    """This rank's random-number generators: Python ``random``, NumPy's global generator, the
    torch CPU generator and every CUDA device's generator.

    ``state_dict()`` → ``{"rank_<r>": {"python": bytes, "numpy": bytes, "torch": uint8 tensor,
    "cuda": [uint8 tensor per device]}}`` (NumPy omitted when it is not installed).

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
        state: dict[str, Any] = {
            "python": pickle.dumps(random.getstate()),
            "torch": torch.get_rng_state(),
        }
        try:
            import numpy as np

            state["numpy"] = pickle.dumps(np.random.get_state())
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
        """
        if self.key not in state_dict:
            raise KeyError(
                f"RNG state has no entry for rank {self.rank} (keys: "
                f"{sorted(state_dict)[:8]}); it was saved at another world size"
            )
        state = state_dict[self.key]
        random.setstate(pickle.loads(state["python"]))  # noqa: S301 - our own checkpoint
        torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
        if "numpy" in state:
            import numpy as np

            np.random.set_state(pickle.loads(state["numpy"]))  # noqa: S301
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([t.cpu() for t in state["cuda"]])


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` that resumes mid-epoch at the sample where it stopped.

    The position counts the indices this rank's iterator has handed out in the current epoch;
    ``state_dict()`` records it with the epoch, so a restored sampler continues with the next
    index, in the same shuffled order. With a ``DataLoader`` that prefetches (``num_workers``
    > 0), the sampler runs ahead of training by the prefetched batches; either use
    ``num_workers=0`` or call :meth:`set_position` with the samples actually consumed.

    ``state_dict()`` → ``{"rank_<r>": {"epoch": int, "position": int, "seed": int,
    "num_replicas": int, "shuffle": bool}}``.

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
        return {
            self.key: {
                "epoch": self.epoch,
                "position": self.position,
                "seed": self.seed,
                "num_replicas": self.num_replicas,
                "shuffle": self.shuffle,
            }
        }

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
        state = state_dict[self.key]
        for name in ("num_replicas", "seed", "shuffle"):
            if state[name] != getattr(self, name):
                raise ValueError(
                    f"sampler was saved with {name}={state[name]!r}, this one has "
                    f"{getattr(self, name)!r}: the sample order would differ"
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

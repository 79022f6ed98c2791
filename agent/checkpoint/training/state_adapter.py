"""The user's ``state`` dict as DCP state dicts, and back (torch).

``state`` maps a name (a non-empty string without ``.``) to what the job checkpoints:

- an ``nn.Module``: saved through ``get_model_state_dict`` (FQNs without DDP's ``module.``
  prefix, so ``{"model": model.state_dict()}`` loads the step with plain DCP);
- a ``torch.optim.Optimizer``: through ``get_optimizer_state_dict`` with the module in
  ``state`` whose parameters it updates (so a fresh optimizer restores fully);
- an object with ``state_dict``/``load_state_dict`` (schedulers, ``RNGState``,
  ``ResumableDistributedSampler``): through those;
- anything else: as is (and replaced in ``state`` on load).

Both the save path (:mod:`.checkpointer`) and restore (:mod:`.restore`) go through
:class:`StateAdapter`, so what is saved is exactly what is loaded.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tierwatch.agent.checkpoint.training.errors import CheckpointError


def data_ptr(t: torch.Tensor) -> int:
    """Data pointer of a tensor, or of a DTensor's local shard."""
    local = getattr(t, "_local_tensor", None)
    return (local if local is not None else t).data_ptr()


@dataclass
class LiveState:
    """A state dict ready for DCP, with what staging needs to know about it.

    Attributes:
        state_dict: name → DCP state dict (modules, optimizers, Statefuls) or value.
        param_ptrs: Data pointers of every module parameter (they change only in
            ``optimizer.step()``).
        optim_keys: Names of the optimizers.
    """

    state_dict: dict[str, Any]
    param_ptrs: set[int]
    optim_keys: set[str]


class StateAdapter:
    """Reads and writes the user's ``state`` dict as DCP state dicts.

    Args:
        state: name → model / optimizer / scheduler / Stateful / value.

    Raises:
        CheckpointError: ``state`` is not a non-empty dict.
    """

    def __init__(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not state:
            raise CheckpointError(
                "state must be a non-empty dict of name → model, optimizer, "
                "scheduler, Stateful or value"
            )
        self.state = state

    @property
    def modules(self) -> dict[str, nn.Module]:
        """The ``nn.Module`` entries of ``state``."""
        return {k: v for k, v in self.state.items() if isinstance(v, nn.Module)}

    @property
    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """The optimizer entries of ``state``."""
        return {k: v for k, v in self.state.items() if isinstance(v, torch.optim.Optimizer)}

    def owner(self, optim: torch.optim.Optimizer, key: str) -> nn.Module:
        """The module in ``state`` whose parameters ``optim`` (``state[key]``) updates.

        Raises:
            CheckpointError: no module in ``state`` shares a parameter with ``optim``.
        """
        ptrs = {data_ptr(p) for g in optim.param_groups for p in g["params"]}
        for module in self.modules.values():
            if ptrs & {data_ptr(p) for p in module.parameters()}:
                return module
        raise CheckpointError(
            f"state[{key!r}] is an optimizer whose parameters belong to no nn.Module in state; "
            "put the model it trains in the same state dict"
        )

    def live(self) -> LiveState:
        """The state dict to save (or to load into: optimizer state is initialised).

        Raises:
            CheckpointError: a bad key, or an optimizer without its module in ``state``.
        """
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        live: dict[str, Any] = {}
        param_ptrs: set[int] = set()
        optim_keys: set[str] = set()
        for key, value in self.state.items():
            if not isinstance(key, str) or not key or "." in key:
                raise CheckpointError(f"state key {key!r}: use a non-empty string without '.'")
            if isinstance(value, nn.Module):
                live[key] = get_model_state_dict(value)
                param_ptrs |= {data_ptr(p) for p in value.parameters()}
            elif isinstance(value, torch.optim.Optimizer):
                live[key] = get_optimizer_state_dict(self.owner(value, key), value)
                optim_keys.add(key)
            elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
                live[key] = value.state_dict()
            else:
                live[key] = value
        return LiveState(live, param_ptrs, optim_keys)

    def signature(self, live: dict[str, Any]) -> str:
        """Digest of every module's FQNs, shapes and dtypes in ``live`` (32 hex characters;
        a different model differs)."""
        h = hashlib.sha256()
        for key in sorted(self.modules):
            for fqn, t in sorted(live[key].items()):
                if isinstance(t, torch.Tensor):
                    h.update(f"{key}.{fqn}:{tuple(t.shape)}:{t.dtype}\n".encode())
        return h.hexdigest()[:32]

    def load(self, loaded: dict[str, Any]) -> None:
        """Put a loaded state dict (the structure :meth:`live` gives) back into ``state``."""
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        for key, value in self.state.items():
            if isinstance(value, nn.Module):
                set_model_state_dict(value, loaded[key])
            elif isinstance(value, torch.optim.Optimizer):
                set_optimizer_state_dict(self.owner(value, key), value, loaded[key])
            elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
                value.load_state_dict(loaded[key])
            else:
                self.state[key] = loaded[key]

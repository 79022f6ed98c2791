"""tierwatch: find sick GPU nodes fast, and lose little training when a job comes back.

Installed layout: ``tierwatch.server`` (the control plane, source folder ``app/``) and
``tierwatch.agent`` (the node agent, source folder ``agent/``). Importing this package
imports neither torch nor the server.

The training-side API is re-exported lazily (importing it is what imports torch)::

    from tierwatch import TieredCheckpointer, RNGState, ResumableDistributedSampler
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "TieredCheckpointer": "tierwatch.agent.checkpoint.training.checkpointer",
    "CheckpointError": "tierwatch.agent.checkpoint.training.errors",
    "ModelMismatchError": "tierwatch.agent.checkpoint.training.errors",
    "RNGState": "tierwatch.agent.checkpoint.training.state",
    "ResumableDistributedSampler": "tierwatch.agent.checkpoint.training.state",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierwatch' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

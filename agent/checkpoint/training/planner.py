"""The DCP save planner of the memory-tier writes: torch's ``DefaultSavePlanner`` with plan
caching, under a cache key of the checkpointer's own.

With ``enable_plan_caching=True`` (torch.distributed.checkpoint, ``default_planner.py``) a
rank whose local save plan equals the previous save's sends an empty plan to the
coordinator, and the coordinator reuses the cached global plan and metadata when no rank's
plan changed: the plan exchange of every save after the first shrinks from every rank's full
plan to a flag. A training job saves the same state structure every time, so after the first
save that is the common case. A changed shape or a new key sends the full plans again.

torch keys the cache by the planner's class name in class-level dictionaries of
``SavePlanner``. Each checkpointer uses a key of its own (:func:`cache_key`), so a user's own
cached DCP saves in the same process never share its plans, and :func:`forget` drops the
key's entries when the checkpointer closes.
"""

from __future__ import annotations

import uuid

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

#: The class-level caches of ``SavePlanner`` that hold a key's plans (torch 2.13).
_CACHES = (
    "_cached_save_plan",
    "_cached_final_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_metadata",
)


def cache_key(job_id: str) -> str:
    """A plan-cache key unique to one checkpointer of ``job_id``."""
    return f"tierwatch:{job_id}:{uuid.uuid4().hex[:12]}"


class CachedSavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner(enable_plan_caching=True)`` whose plans are cached under ``key``.

    Args:
        key: The cache key (:func:`cache_key`); every rank of a job must use a planner at
            every save (the coordinator's cache is its own process's).
    """

    def __init__(self, key: str) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key


def forget(key: str) -> None:
    """Drop ``key``'s cached plans (no error when there are none)."""
    for name in _CACHES:
        cache = getattr(SavePlanner, name, None)
        if isinstance(cache, dict):
            cache.pop(key, None)


def cached(key: str) -> bool:
    """Whether a global plan is cached under ``key`` (the coordinator's, after a save)."""
    return key in getattr(SavePlanner, "_cached_global_plan", {}) or key in getattr(
        SavePlanner, "_cached_save_plan", {}
    )

"""Which step to commit, persist and keep in each tier (pure logic, no I/O, no torch).

After every rank wrote step ``N`` (or failed to), rank 0 decides for all ranks
(:func:`decide_commit`), and every rank records the decision in its commit marker:

- **commit**: only when every rank wrote its files; otherwise nothing of the step counts
  (each rank removes what it wrote), and the reason names the failed ranks.
- **persist**: the first committed step at or after each multiple of ``persist_every``
  (step ``N`` persists when ``N // persist_every`` is above that of the last persisted step),
  the first committed step ever, or a step the caller forced (``save(..., persist=True)``).
- **retain**: per tier, the newest ``keep[tier]`` committed (memory, peer) or persisted
  (persistent) steps, plus every step older than ``N`` that a pending restore request pins
  (docs/checkpointing.md, "Pinned steps"). The agents evict the rest of the replicas and of
  the persistent tier from this; each rank evicts its own memory files
  (:func:`memory_evictions`).

Rank 0 carries :class:`History` from one decision to the next (seeded by a restore, cut
back by a rollback).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TIER_KEYS = ("memory", "peer", "persistent")


@dataclass(frozen=True)
class History:
    """Rank 0's view of what the tiers hold.

    Attributes:
        committed: Committed steps still held in memory or by peers, ascending (at most
            ``max(keep["memory"], keep["peer"])`` after a decision).
        persisted: Steps sent to the persistent tier, ascending.
    """

    committed: tuple[int, ...] = ()
    persisted: tuple[int, ...] = ()

    @classmethod
    def seeded(cls, committed: Iterable[int], persisted: Iterable[int]) -> History:
        """The history a restore found: the complete steps, and those persisted."""
        return cls(tuple(sorted(set(committed))), tuple(sorted(set(persisted))))

    def up_to(self, step: int) -> History:
        """This history without the steps above ``step`` (a rollback to ``step``)."""
        return History(
            tuple(s for s in self.committed if s <= step),
            tuple(s for s in self.persisted if s <= step),
        )


@dataclass(frozen=True)
class CommitDecision:
    """Rank 0's decision for one step, broadcast to every rank.

    Attributes:
        committed: Whether the step counts.
        persist: Whether it goes to the persistent tier.
        retain: Steps each tier keeps (``{"memory": [...], "peer": [...], "persistent":
            [...]}``, ascending); empty when not committed.
        why: Why it was not committed ("" when it was).
    """

    committed: bool
    persist: bool = False
    retain: dict[str, list[int]] = field(default_factory=dict)
    why: str = ""


def decide_commit(
    step: int,
    outcomes: list[str | None],
    history: History,
    *,
    persist_every: int,
    keep: Mapping[str, int],
    force_persist: bool = False,
    pinned: Iterable[int] = (),
) -> tuple[CommitDecision, History]:
    """Decide commit, persistence and retention of ``step`` (see the module notes).

    Args:
        step: The step every rank tried to write.
        outcomes: Every rank's write error, index = rank (None: written).
        history: Rank 0's history before this step.
        persist_every: The persistence cadence (steps, ≥ 1).
        keep: Newest steps each tier keeps (``memory``, ``peer``, ``persistent``; each ≥ 1).
        force_persist: Persist this step whatever the cadence.
        pinned: Steps pending restore requests name (any rank's agent).

    Returns:
        The decision and the history after it (unchanged when not committed).
    """
    failed = [f"rank {r}: {e}" for r, e in enumerate(outcomes) if e]
    if failed:
        return CommitDecision(committed=False, why="; ".join(failed)[:1800]), history
    last_persisted = history.persisted[-1] if history.persisted else None
    persist = (
        force_persist
        or last_persisted is None
        or step // persist_every > last_persisted // persist_every
    )
    committed = [s for s in history.committed if s < step] + [step]
    persisted = list(history.persisted)
    if persist:
        persisted = [s for s in persisted if s < step] + [step]
    old_pins = {s for s in pinned if s < step}
    retain = {
        "memory": sorted(set(committed[-keep["memory"] :]) | old_pins),
        "peer": sorted(set(committed[-keep["peer"] :]) | old_pins),
        "persistent": sorted(set(persisted[-keep["persistent"] :]) | old_pins),
    }
    committed = committed[-max(keep["memory"], keep["peer"]) :]
    return (
        CommitDecision(committed=True, persist=persist, retain=retain),
        History(tuple(committed), tuple(persisted)),
    )


def memory_evictions(
    steps: Iterable[int],
    *,
    retained: Iterable[int],
    newest: int,
    pinned: Iterable[int] = (),
    uploading: int | None = None,
) -> list[int]:
    """The memory steps a rank removes its files of after committing ``newest``.

    Args:
        steps: Steps with a folder in the node's memory tier for the job.
        retained: Rank 0's ``retain["memory"]`` (pinned steps included).
        newest: The step just committed (it and newer steps always stay).
        pinned: Steps this rank's agent pins now (a request that arrived since rank 0
            decided).
        uploading: The newest step marked persist whose upload this rank's agent has not
            finished (the agent reads it from memory), or None.

    Returns:
        The steps to evict, ascending.
    """
    keep = set(retained) | {newest} | set(pinned)
    return sorted(s for s in steps if s not in keep and s < newest and s != uploading)

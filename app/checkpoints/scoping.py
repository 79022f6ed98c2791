"""Which node's agent may report what for a job: the ingest scoping rules (pure).

An agent token is bound to one node, and the ingest API already refuses a batch for another
node. These rules bound what that node may say about *jobs*. A job registers before its ranks
start (``POST /api/v1/jobs/{job_id}/credential``, ``tierwatch-server job credential``),
naming its nodes and, optionally, its world size and rank→node layout. Then, for a batch from
node N:

- Checkpoint events, progress, restore reports and latency samples of job J are accepted only
  when J is registered and N is one of its registered nodes (``unregistered_job``,
  ``node_not_in_job``).
- Once J's world size is pinned (given at registration, or the length of its pinned layout),
  an item naming another world size, or a rank at or above it, is refused
  (``world_size_mismatch``): a job restarted at another size registers again.
- Once J's layout is pinned, an item that names rank r is accepted only when ``layout[r]`` is
  N (``rank_on_other_node``), with two exceptions for checkpoint events: ``evicted`` and
  ``failed`` events (a peer tier's replica holder reports them for the ranks whose replicas it
  holds; a restarted job's node evicts what its ranks held under the previous layout) and
  ``committed`` with no rank (the whole step: written by whichever node wrote the persistent
  tier's ``.metadata``) are accepted from any registered node of the job. ``staged`` and
  per-rank ``committed`` events, progress, restore reports and latency samples must come
  from the rank's node.
- A progress report carrying a layout: when J's layout is pinned, it must be that layout
  (``layout_mismatch``); when it is not pinned yet, every node in it must be registered and
  it must name N for the reporting rank (``layout_refused``). The first such layout that is
  applied (``checkpoints.ingest``: the job's newest report, or one of the job's world size)
  pins it, until the job registers again.

The layout is "pinned" when the job is registered and has one: registration sets it (or
clears it when none is given), and only the first accepted progress layout after that sets
it otherwise. Each function returns ``None`` (accepted) or ``(reason, message)``; the
message names the job, node and rank and says what to fix. Jobs are the ``jobs`` table's
rows as dicts (``checkpoints.ingest`` keeps them so); ``None`` is a job the server has no
row for.

Refused items are dropped by the caller, never stored; the batch itself is acked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, LatencySample, RestoreReport

ITEM_EVENT = "checkpoint_event"
ITEM_PROGRESS = "progress"
ITEM_RESTORE = "restore"
ITEM_LATENCY = "latency"
ITEMS = (ITEM_EVENT, ITEM_PROGRESS, ITEM_RESTORE, ITEM_LATENCY)

UNREGISTERED_JOB = "unregistered_job"
NODE_NOT_IN_JOB = "node_not_in_job"
RANK_ON_OTHER_NODE = "rank_on_other_node"
WORLD_SIZE_MISMATCH = "world_size_mismatch"
LAYOUT_MISMATCH = "layout_mismatch"
LAYOUT_REFUSED = "layout_refused"
REASONS = (
    UNREGISTERED_JOB,
    NODE_NOT_IN_JOB,
    RANK_ON_OTHER_NODE,
    WORLD_SIZE_MISMATCH,
    LAYOUT_MISMATCH,
    LAYOUT_REFUSED,
)
#: Event kinds any registered node of the job may report for any rank (see module docs).
ANY_NODE_EVENT_KINDS = frozenset({"evicted", "failed"})
NODES_SHOWN = 8

Job = Mapping[str, Any]
Verdict = tuple[str, str] | None


@dataclass(frozen=True)
class Refusal:
    """One refused item of a batch.

    Attributes:
        node: the reporting node (the agent token's).
        job_id: the job the item names.
        item: ``checkpoint_event`` | ``progress`` | ``restore`` | ``latency``.
        reason: one of :data:`REASONS`.
        message: what was refused and what to fix.
        rank: the rank the item names (None: none).
    """

    node: str
    job_id: str
    item: str
    reason: str
    message: str
    rank: int | None = None


def is_registered(job: Job | None) -> bool:
    """Whether the job has registered (and names at least one node)."""
    return (
        job is not None
        and job.get("registered_at") is not None
        and bool(job.get("registered_nodes"))
    )


def pinned_layout(job: Job | None) -> list[str] | None:
    """The job's pinned rank→node layout, or None while it is not pinned."""
    if not is_registered(job):
        return None
    assert job is not None
    layout = job.get("layout")
    return list(layout) if layout else None


def pinned_world_size(job: Job | None) -> int | None:
    """The job's pinned world size (registered, else its pinned layout's), or None."""
    if not is_registered(job):
        return None
    assert job is not None
    if job.get("registered_world_size") is not None:
        return int(job["registered_world_size"])
    layout = pinned_layout(job)
    return len(layout) if layout else None


def _shown(nodes: Sequence[str]) -> str:
    names = ", ".join(nodes[:NODES_SHOWN])
    return names + (f" and {len(nodes) - NODES_SHOWN} more" if len(nodes) > NODES_SHOWN else "")


def _job_verdict(job: Job | None, job_id: str, node: str) -> Verdict:
    if not is_registered(job):
        return (
            UNREGISTERED_JOB,
            f"job {job_id!r} is not registered: register it before its ranks start "
            f"(`tierwatch-server job credential {job_id} --node {node} ...` or "
            f"POST /api/v1/jobs/{job_id}/credential)",
        )
    assert job is not None
    nodes = list(job["registered_nodes"])
    if node not in nodes:
        return (
            NODE_NOT_IN_JOB,
            f"node {node!r} is not one of the nodes job {job_id!r} registered "
            f"({_shown(nodes)}): if the job runs there, register it again with this node",
        )
    return None


def _size_verdict(job: Job, job_id: str, rank: int | None, world_size: int | None) -> Verdict:
    pinned = pinned_world_size(job)
    if pinned is None:
        return None
    if world_size is not None and world_size != pinned:
        return (
            WORLD_SIZE_MISMATCH,
            f"job {job_id!r} is pinned to world_size {pinned}, not {world_size}: a job that "
            "restarts at another size registers again",
        )
    if rank is not None and rank >= pinned:
        return (
            WORLD_SIZE_MISMATCH,
            f"rank {rank} is not below job {job_id!r}'s pinned world_size {pinned}",
        )
    return None


def _rank_verdict(job: Job, job_id: str, node: str, rank: int) -> Verdict:
    layout = pinned_layout(job)
    if layout is None or (rank < len(layout) and layout[rank] == node):
        return None
    if rank >= len(layout):
        return (
            WORLD_SIZE_MISMATCH,
            f"rank {rank} is not below the {len(layout)} ranks of job {job_id!r}'s layout",
        )
    return (
        RANK_ON_OTHER_NODE,
        f"rank {rank} of job {job_id!r} runs on node {layout[rank]!r} by the job's pinned "
        f"layout, not on {node!r}: only that node's agent reports for it (register the job "
        "again if it moved)",
    )


def _item_verdict(
    job: Job | None,
    job_id: str,
    node: str,
    rank: int | None,
    world_size: int | None,
    *,
    rank_node: bool = True,
) -> Verdict:
    verdict = _job_verdict(job, job_id, node)
    if verdict is None:
        assert job is not None
        verdict = _size_verdict(job, job_id, rank, world_size)
    if verdict is None and rank is not None and rank_node:
        assert job is not None
        verdict = _rank_verdict(job, job_id, node, rank)
    return verdict


def event_verdict(job: Job | None, node: str, event: CheckpointEvent) -> Verdict:
    """Whether ``node`` may report this checkpoint event (None: yes)."""
    return _item_verdict(
        job,
        event.job_id,
        node,
        event.rank,
        event.world_size,
        rank_node=event.kind not in ANY_NODE_EVENT_KINDS,
    )


def restore_verdict(job: Job | None, node: str, report: RestoreReport) -> Verdict:
    """Whether ``node`` may report this rank's restore (None: yes)."""
    return _item_verdict(job, report.job_id, node, report.rank, report.world_size)


def latency_verdict(job: Job | None, node: str, sample: LatencySample) -> Verdict:
    """Whether ``node`` may report this rank's collective latency (None: yes)."""
    return _item_verdict(job, sample.job_id, node, sample.rank, sample.world_size)


def progress_verdict(job: Job | None, node: str, progress: JobProgress) -> Verdict:
    """Whether ``node`` may report this progress, layout included (None: yes)."""
    verdict = _item_verdict(job, progress.job_id, node, progress.rank, progress.world_size)
    if verdict is not None or progress.layout is None:
        return verdict
    assert job is not None
    job_id, layout = progress.job_id, list(progress.layout)
    pinned = pinned_layout(job)
    if pinned is not None:
        if layout != pinned:
            return (
                LAYOUT_MISMATCH,
                f"job {job_id!r}'s layout is pinned ({_shown(pinned)}) and this report names "
                f"another ({_shown(layout)}): register the job again when its placement "
                "changes",
            )
        return None
    registered = set(job["registered_nodes"])
    unknown = sorted({n for n in layout if n not in registered})
    if unknown:
        return (
            LAYOUT_REFUSED,
            f"the layout of job {job_id!r} names node(s) {_shown(unknown)}, which the job did "
            "not register: register it with every node it runs on",
        )
    if layout[progress.rank] != node:
        return (
            LAYOUT_REFUSED,
            f"the layout of job {job_id!r} puts the reporting rank {progress.rank} on "
            f"{layout[progress.rank]!r}, but node {node!r} reported it",
        )
    return None

"""The ingest scoping rules (app/checkpoints/scoping.py) as a table: which node may report
which checkpoint event, progress, restore report and latency sample for which job."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, LatencySample, RestoreReport
from tierwatch.server.checkpoints import scoping

TS = datetime(2026, 1, 1, tzinfo=UTC)
J = "job"


def job(nodes=("a", "b"), layout=None, registered_world_size=None, registered=True):
    return {
        "job_id": J,
        "registered_at": TS if registered else None,
        "registered_nodes": list(nodes),
        "registered_world_size": registered_world_size,
        "layout": layout,
        "world_size": registered_world_size or (len(layout) if layout else None),
    }


def ev(kind="committed", rank=0, world_size=2, tier="memory"):
    return CheckpointEvent(
        job_id=J, step=5, tier=tier, kind=kind, rank=rank, world_size=world_size, ts=TS
    )


def prog(rank=0, world_size=2, layout=None):
    return JobProgress(job_id=J, rank=rank, world_size=world_size, step=5, ts=TS, layout=layout)


def reason(verdict):
    return None if verdict is None else verdict[0]


PINNED = job(layout=["a", "b"])


@pytest.mark.parametrize(
    ("the_job", "node", "event", "expected"),
    [
        (None, "a", ev(), scoping.UNREGISTERED_JOB),
        (job(registered=False), "a", ev(), scoping.UNREGISTERED_JOB),
        (job(), "c", ev(), scoping.NODE_NOT_IN_JOB),
        (job(), "a", ev(rank=1), None),  # no layout yet: any registered node
        (PINNED, "a", ev(rank=0), None),
        (PINNED, "a", ev(rank=1), scoping.RANK_ON_OTHER_NODE),
        (PINNED, "a", ev(kind="staged", rank=1), scoping.RANK_ON_OTHER_NODE),
        (PINNED, "a", ev(rank=None, world_size=None), None),  # the whole step (.metadata)
        (PINNED, "a", ev(kind="evicted", rank=1, tier="peer"), None),  # a replica holder
        (PINNED, "a", ev(kind="failed", rank=1), None),
        (PINNED, "c", ev(kind="evicted", rank=1), scoping.NODE_NOT_IN_JOB),
        (PINNED, "a", ev(rank=0, world_size=1), scoping.WORLD_SIZE_MISMATCH),
        (job(registered_world_size=2), "a", ev(rank=0, world_size=4), scoping.WORLD_SIZE_MISMATCH),
        (
            job(registered_world_size=2),
            "a",
            ev(rank=3, world_size=None),
            scoping.WORLD_SIZE_MISMATCH,
        ),
    ],
)
def test_checkpoint_events(the_job, node, event, expected):
    assert reason(scoping.event_verdict(the_job, node, event)) == expected


@pytest.mark.parametrize(
    ("the_job", "node", "progress", "expected"),
    [
        (None, "a", prog(), scoping.UNREGISTERED_JOB),
        (job(), "c", prog(), scoping.NODE_NOT_IN_JOB),
        (job(), "b", prog(rank=1), None),
        (job(), "a", prog(layout=["a", "b"]), None),
        (job(), "a", prog(layout=["a", "c"]), scoping.LAYOUT_REFUSED),  # c not registered
        (job(), "a", prog(layout=["b", "a"]), scoping.LAYOUT_REFUSED),  # rank 0 is not on a
        (PINNED, "a", prog(layout=["a", "b"]), None),
        (PINNED, "a", prog(layout=["a", "a"]), scoping.LAYOUT_MISMATCH),
        (PINNED, "b", prog(rank=0), scoping.RANK_ON_OTHER_NODE),
        (PINNED, "a", prog(world_size=4, layout=["a", "a", "b", "b"]), scoping.WORLD_SIZE_MISMATCH),
        (job(registered_world_size=2), "a", prog(world_size=3), scoping.WORLD_SIZE_MISMATCH),
    ],
)
def test_progress(the_job, node, progress, expected):
    assert reason(scoping.progress_verdict(the_job, node, progress)) == expected


@pytest.mark.parametrize(
    ("the_job", "node", "rank", "expected"),
    [
        (None, "a", 0, scoping.UNREGISTERED_JOB),
        (job(), "c", 0, scoping.NODE_NOT_IN_JOB),
        (job(), "a", 1, None),
        (PINNED, "a", 0, None),
        (PINNED, "a", 1, scoping.RANK_ON_OTHER_NODE),
    ],
)
def test_restore_reports_and_latency(the_job, node, rank, expected):
    report = RestoreReport(job_id=J, rank=rank, world_size=2, ts=TS, seconds=1.0)
    sample = LatencySample(job_id=J, rank=rank, world_size=2, ts=TS, latency_ms=3.0)
    assert reason(scoping.restore_verdict(the_job, node, report)) == expected
    assert reason(scoping.latency_verdict(the_job, node, sample)) == expected


def test_messages_name_job_node_and_rank_and_say_what_to_do():
    _, message = scoping.event_verdict(PINNED, "a", ev(rank=1))
    for part in ("rank 1", "'b'", "'a'"):
        assert part in message
    _, message = scoping.event_verdict(None, "a", ev())
    assert "tierwatch-server job credential job --node a" in message
    _, message = scoping.event_verdict(job(), "c", ev())
    assert "register it again" in message


def test_pinned_world_size_and_layout():
    assert scoping.pinned_layout(job()) is None
    assert scoping.pinned_world_size(job()) is None
    assert scoping.pinned_world_size(job(registered_world_size=8)) == 8
    assert scoping.pinned_world_size(PINNED) == 2
    # an unregistered job's stored layout pins nothing (its data is refused anyway)
    assert scoping.pinned_layout(job(layout=["a", "b"], registered=False)) is None

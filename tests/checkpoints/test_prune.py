"""The pruner removes old checkpoint history but keeps each tier's newest committed step."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select
from support import auth, post_batch, register_job

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, ReportBatch, utcnow
from tierwatch.server.checkpoints.models import CheckpointEventRow, LedgerRow, ProgressRow
from tierwatch.server.fleet import service as fleet_service


def test_prune_keeps_the_newest_committed_step(client, make_token, session):
    register_job(client, "j", ["n1"])
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    ts = utcnow() - timedelta(hours=2)
    for seq, step in enumerate((10, 20), start=1):
        batch = ReportBatch(
            node="n1",
            epoch="e1",
            seq=seq,
            sent_at=utcnow(),
            progress=[JobProgress(job_id="j", rank=0, world_size=1, step=step, ts=ts)],
            checkpoint_events=[
                CheckpointEvent(
                    job_id="j",
                    step=step,
                    tier="memory",
                    kind="committed",
                    rank=0,
                    world_size=1,
                    ts=ts,
                )
            ],
        )
        assert post_batch(client, agent, batch).status_code == 200
    # both ledger rows were written "now"; prune as if a day had passed
    deleted = fleet_service.prune(
        session,
        now=utcnow() + timedelta(days=1),
        sample_retention_s=3600,
        event_retention_s=3600,
    )
    assert deleted["job_progress"] == 2
    assert deleted["checkpoint_events"] == 2
    assert deleted["checkpoint_ledger"] == 1
    assert session.scalar(select(func.count()).select_from(ProgressRow)) == 0
    assert session.scalar(select(func.count()).select_from(CheckpointEventRow)) == 0
    assert session.scalars(select(LedgerRow.step)).all() == [20]
    job = client.get("/api/v1/jobs/j", headers=auth(viewer)).json()
    assert (job["tiers"]["memory"]["newest_step"], job["tiers"]["memory"]["lag_steps"]) == (20, 0)

"""Jobs API and checkpoint ingest: bad input is a 422 naming the field and loses nothing
already stored; unknown jobs 404; malformed job ids 422; reads need a token."""

from __future__ import annotations

from datetime import timedelta

import pytest
from support import auth, post_batch, register_job

from tierwatch.agent.protocol import CheckpointEvent, JobProgress, ReportBatch, utcnow

JOB = "job-a"


def at(seconds: float = 0.0) -> str:
    return (utcnow() - timedelta(minutes=5) + timedelta(seconds=seconds)).isoformat()


def good_batch(seq: int) -> ReportBatch:
    ts = utcnow() - timedelta(minutes=5)
    return ReportBatch(
        node="n1",
        epoch="e1",
        seq=seq,
        sent_at=utcnow(),
        progress=[
            JobProgress(
                job_id=JOB,
                rank=0,
                world_size=2,
                step=12,
                step_time_s=1.0,
                ts=ts,
                layout=["n1", "n1"],
            )
        ],
        checkpoint_events=[
            CheckpointEvent(
                job_id=JOB,
                step=10,
                tier="memory",
                kind="committed",
                rank=r,
                world_size=2,
                ts=ts,
                bytes=100,
                seconds=0.5,
            )
            for r in (0, 1)
        ],
    )


@pytest.fixture
def stored(client, make_token):
    register_job(client, JOB, ["n1"])
    agent, viewer = make_token("agent", "n1"), make_token("viewer")
    assert post_batch(client, agent, good_batch(1)).status_code == 200
    before = client.get(f"/api/v1/jobs/{JOB}", headers=auth(viewer)).json()
    assert before["tiers"]["memory"]["newest_step"] == 10
    return agent, viewer, before


def event(**over) -> dict:
    body = {
        "job_id": JOB,
        "step": 13,
        "tier": "memory",
        "kind": "committed",
        "rank": 0,
        "world_size": 2,
        "ts": at(1),
        "bytes": 100,
        "seconds": 0.5,
    }
    return {**body, **over}


def progress(**over) -> dict:
    body = {"job_id": JOB, "rank": 0, "world_size": 2, "step": 14, "ts": at(1)}
    return {**body, **over}


def restore(**over) -> dict:
    body = {"job_id": JOB, "rank": 0, "world_size": 2, "step": 10, "ts": at(1), "seconds": 1.0}
    return {**body, **over}


BAD = [
    ("unknown tier", {"checkpoint_events": [event(tier="disk")]}, "checkpoint_events.0.tier"),
    ("unknown kind", {"checkpoint_events": [event(kind="done")]}, "checkpoint_events.0.kind"),
    ("negative step", {"checkpoint_events": [event(step=-1)]}, "checkpoint_events.0.step"),
    ("bad job id", {"checkpoint_events": [event(job_id="../etc")]}, "checkpoint_events.0.job_id"),
    ("rank >= world_size", {"checkpoint_events": [event(rank=2)]}, "checkpoint_events.0.rank"),
    ("negative bytes", {"checkpoint_events": [event(bytes=-5)]}, "checkpoint_events.0.bytes"),
    ("NaN seconds", {"checkpoint_events": [event(seconds="NaN")]}, "checkpoint_events.0.seconds"),
    (
        "NUL in message",
        {"checkpoint_events": [event(message="a\x00b")]},
        "checkpoint_events.0.message",
    ),
    (
        "future time",
        {"checkpoint_events": [event(ts=(utcnow() + timedelta(days=1)).isoformat())]},
        "checkpoint_events.0.ts",
    ),
    ("unknown field", {"checkpoint_events": [event(extra=1)]}, "checkpoint_events.0.extra"),
    ("progress rank >= world_size", {"progress": [progress(rank=5)]}, "progress.0.rank"),
    ("layout of the wrong length", {"progress": [progress(layout=["n1"])]}, "progress.0.layout"),
    (
        "bad node in layout",
        {"progress": [progress(layout=["n1", "bad node"])]},
        "progress.0.layout.1",
    ),
    ("progress before 2000", {"progress": [progress(ts="1999-12-31T00:00:00Z")]}, "progress.0.ts"),
    ("restore rank >= world_size", {"restores": [restore(rank=2)]}, "restores.0.rank"),
    (
        "steps_lost beyond BIGINT",
        {"restores": [restore(steps_lost=2**63)]},
        "restores.0.steps_lost",
    ),
    (
        "unknown tier in files_by_tier",
        {"restores": [restore(files_by_tier={"disk": 1})]},
        "restores.0.files_by_tier.disk.[key]",
    ),
    (
        "file count beyond BIGINT",
        {"restores": [restore(files_by_tier={"peer": 2**63})]},
        "restores.0.files_by_tier.peer",
    ),
    (
        "NUL in a restore source",
        {"restores": [restore(sources={"f": "peer:\x00"})]},
        "restores.0.sources.f",
    ),
    (
        "restore without seconds",
        {"restores": [{k: v for k, v in restore().items() if k != "seconds"}]},
        "restores.0.seconds",
    ),
]


@pytest.mark.parametrize(("content", "field"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_checkpoint_content_is_422_naming_the_field_and_keeps_what_was_stored(
    client, stored, content, field
):
    agent, viewer, before = stored
    body = {"node": "n1", "epoch": "e1", "seq": 2, "sent_at": utcnow().isoformat(), **content}
    r = client.post("/api/v1/ingest/report", json=body, headers=auth(agent))
    assert r.status_code == 422, r.text
    fields = [e["field"] for e in r.json()["errors"]]
    assert f"body.{field}" in fields, fields
    assert field in r.json()["detail"]
    after = client.get(f"/api/v1/jobs/{JOB}", headers=auth(viewer)).json()
    assert after == {**before, "last_seen": after["last_seen"]}
    assert after["last_seen"] == before["last_seen"]  # the refused report touched nothing
    # the agent's next good report (same seq: the refused one was never stored) goes in
    assert post_batch(client, agent, good_batch(2)).json()["stored"] is True


def test_unknown_job_is_404_with_a_clear_message(client, make_token):
    r = client.get("/api/v1/jobs/no-such-job", headers=auth(make_token("viewer")))
    assert r.status_code == 404
    assert r.json()["detail"].startswith("no job 'no-such-job'")
    r = client.get("/api/v1/jobs/no-such-job/history", headers=auth(make_token("viewer")))
    assert r.status_code == 404


@pytest.mark.parametrize("job_id", ["-starts-with-dash", "a" * 129, "sp%20ace", "x%00y"])
def test_malformed_job_id_is_422_naming_the_path(client, make_token, job_id):
    r = client.get(f"/api/v1/jobs/{job_id}", headers=auth(make_token("viewer")))
    assert r.status_code == 422, r.text
    assert [e["field"] for e in r.json()["errors"]] == ["path.job_id"]


def test_history_range_is_checked(client, stored):
    _, viewer, _ = stored
    url = f"/api/v1/jobs/{JOB}/history"
    r = client.get(url, params={"since": at(10), "until": at(0)}, headers=auth(viewer))
    assert r.status_code == 422
    assert "since must not be after until" in r.json()["detail"]
    r = client.get(
        url,
        params={"since": "2026-01-01T00:00:00Z", "until": "2026-03-01T00:00:00Z"},
        headers=auth(viewer),
    )
    assert r.status_code == 422
    assert "31 days" in r.json()["detail"]
    r = client.get(url, params={"since": "yesterday"}, headers=auth(viewer))
    assert r.status_code == 422
    assert [e["field"] for e in r.json()["errors"]] == ["query.since"]
    r = client.get(url, params={"since": "2026-01-01T00:00:00"}, headers=auth(viewer))
    assert r.status_code == 422  # a naive time is ambiguous


def test_job_reads_need_a_persons_token(client, stored, make_token):
    """Any person's role reads jobs; an agent token reads nothing (it only reports)."""
    for path in ("/api/v1/jobs", f"/api/v1/jobs/{JOB}", f"/api/v1/jobs/{JOB}/history"):
        assert client.get(path).status_code == 401, path
        for role in ("viewer", "operator", "admin"):
            assert client.get(path, headers=auth(make_token(role))).status_code == 200
        assert client.get(path, headers=auth(make_token("agent", "n1"))).status_code == 403

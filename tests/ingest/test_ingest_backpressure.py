"""A replica whose ingest queue is full answers 503 + Retry-After and stores nothing."""

from __future__ import annotations

from sqlalchemy import select
from support import make_batch, post_batch

from tierwatch.server.fleet.models import Node


def test_a_full_queue_answers_503_with_retry_after(client, app, agent_token, session):
    token = agent_token("n1")
    app.state.ingest_writer.max_queue = 0  # every report finds the queue full
    resp = post_batch(client, token, make_batch("n1", 1))
    assert resp.status_code == 503
    assert int(resp.headers["Retry-After"]) >= 1
    assert "TIERWATCH_INGEST_MAX_QUEUE" in resp.json()["detail"]
    assert session.scalar(select(Node).where(Node.name == "n1")) is None

    metrics = client.get("/metrics").text
    assert "tierwatch_ingest_shed_total 1.0" in metrics
    assert "tierwatch_ingest_queue_limit 0.0" in metrics

    app.state.ingest_writer.max_queue = 10  # the same batch again, once there is room
    resp = post_batch(client, token, make_batch("n1", 1))
    assert resp.status_code == 200
    assert resp.json()["stored"] is True
    session.expire_all()
    assert session.scalar(select(Node).where(Node.name == "n1")).last_seq == 1

"""Delivery to real webhook receivers on 127.0.0.1: payloads, retries, permanent failures,
give-up, receiver down, several webhooks, and the lease after a crash mid-round."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from alert_support import Receiver, deliver
from fastapi.testclient import TestClient
from procs import wait_for
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.agent.protocol import utcnow
from tierwatch.server.alerts import delivery as alert_delivery
from tierwatch.server.alerts.models import Alert, AlertDelivery
from tierwatch.server.alerts.service import AlertSettings, raise_alert

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def _raise(
    sm: sessionmaker[Session],
    settings: AlertSettings,
    *,
    now: datetime = T0,
    status: str = "firing",
    severity: str = "critical",
    key: str = "node_state:gpu-node-03:unhealthy",
) -> Alert | None:
    with sm() as s:
        alert = raise_alert(
            s,
            settings,
            kind="node_state",
            key=key,
            severity=severity,
            summary="gpu-node-03 is unhealthy: XID 79 (GPU fell off the bus)",
            labels={"node": "gpu-node-03"},
            details={"xid": 79, "gpu_index": 2},
            status=status,
            now=now,
        )
        s.commit()
        return alert


def _deliveries(sm: sessionmaker[Session]) -> list[AlertDelivery]:
    with sm() as s:
        return list(s.scalars(select(AlertDelivery).order_by(AlertDelivery.id)))


def test_json_payload_is_delivered_with_the_bearer_token(sm, receiver: Receiver) -> None:
    settings = AlertSettings(webhooks=[receiver.url], bearer_token="s3cret-token")
    alert = _raise(sm, settings)
    assert alert is not None

    assert deliver(sm, settings, T0) == 1

    assert len(receiver.requests) == 1
    req = receiver.requests[0]
    assert req.path == "/hook"
    assert req.headers["Authorization"] == "Bearer s3cret-token"
    assert req.headers["Content-Type"] == "application/json"
    assert req.body == {
        "version": 1,
        "alert": {
            "id": alert.id,
            "key": "node_state:gpu-node-03:unhealthy",
            "kind": "node_state",
            "severity": "critical",
            "status": "firing",
            "summary": "gpu-node-03 is unhealthy: XID 79 (GPU fell off the bus)",
            "labels": {"node": "gpu-node-03"},
            "details": {"xid": 79, "gpu_index": 2},
            "created_at": "2026-03-01T12:00:00Z",
            "starts_at": "2026-03-01T12:00:00Z",
            "ends_at": None,
            "last_fired_at": "2026-03-01T12:00:00Z",
            "count": 1,
        },
        "source": "tierwatch",
    }
    [d] = _deliveries(sm)
    assert (d.state, d.attempts, d.last_status_code, d.last_error) == ("delivered", 1, 200, "")
    assert d.delivered_at == T0
    assert d.next_attempt_at is None
    assert deliver(sm, settings, T0 + timedelta(hours=1)) == 0  # nothing sent twice


def test_alertmanager_payload_for_firing_and_resolved(sm, receiver: Receiver) -> None:
    settings = AlertSettings(
        webhooks=[receiver.url],
        format="alertmanager",
        external_url="https://tierwatch.example/",
    )
    _raise(sm, settings)
    _raise(sm, settings, now=T0 + timedelta(seconds=90), status="resolved", severity="info")

    assert deliver(sm, settings, T0 + timedelta(seconds=90)) == 2

    firing, resolved = sorted(receiver.requests, key=lambda r: r.body["status"])
    key = "node_state:gpu-node-03:unhealthy"
    labels = {
        "alertname": "node_state",
        "node": "gpu-node-03",
        "alertkey": key,
        "severity": "critical",
    }
    annotations = {
        "summary": "gpu-node-03 is unhealthy: XID 79 (GPU fell off the bus)",
        "description": "gpu-node-03 is unhealthy: XID 79 (GPU fell off the bus)",
    }
    fp = alert_delivery.fingerprint(key)
    assert len(fp) == 16
    assert firing.body == {
        "version": "4",
        "groupKey": '{}:{alertkey="node_state:gpu-node-03:unhealthy"}',
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "tierwatch",
        "groupLabels": {"alertkey": key},
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": "https://tierwatch.example",
        "alerts": [
            {
                "status": "firing",
                "labels": labels,
                "annotations": annotations,
                "startsAt": "2026-03-01T12:00:00Z",
                "endsAt": "0001-01-01T00:00:00Z",
                "generatorURL": "https://tierwatch.example/nodes/gpu-node-03",
                "fingerprint": fp,
            }
        ],
    }
    assert resolved.body["status"] == "resolved"
    assert resolved.body["groupKey"] == firing.body["groupKey"]
    [am] = resolved.body["alerts"]
    assert am["status"] == "resolved"
    assert am["labels"]["severity"] == "info"
    assert am["startsAt"] == "2026-03-01T12:00:00Z"  # when the condition began
    assert am["endsAt"] == "2026-03-01T12:01:30Z"
    assert am["fingerprint"] == fp


def test_5xx_is_retried_with_growing_backoff(sm, receiver: Receiver) -> None:
    settings = AlertSettings(webhooks=[receiver.url], backoff_s=2, max_attempts=8)
    receiver.answer(500, 503)
    _raise(sm, settings)

    assert deliver(sm, settings, T0) == 1
    [d1] = _deliveries(sm)
    assert (d1.state, d1.attempts, d1.last_status_code) == ("pending", 1, 500)
    assert "HTTP 500" in d1.last_error
    assert "receiver says 500" in d1.last_error
    wait1 = (d1.next_attempt_at - T0).total_seconds()
    assert 1.0 <= wait1 <= 2.0  # backoff_s * 2**0, jitter in [0.5, 1]

    assert deliver(sm, settings, d1.next_attempt_at - timedelta(milliseconds=1)) == 0  # not due
    t2 = d1.next_attempt_at
    assert deliver(sm, settings, t2) == 1
    [d2] = _deliveries(sm)
    assert (d2.state, d2.attempts, d2.last_status_code) == ("pending", 2, 503)
    wait2 = (d2.next_attempt_at - t2).total_seconds()
    assert 2.0 <= wait2 <= 4.0
    assert wait2 >= wait1

    assert deliver(sm, settings, d2.next_attempt_at) == 1
    [d3] = _deliveries(sm)
    assert (d3.state, d3.attempts, d3.last_status_code) == ("delivered", 3, 200)
    assert d3.last_error == ""
    assert len(receiver.requests) == 3
    assert receiver.requests[0].body == receiver.requests[2].body  # the same notice each time


def test_retry_after_is_honoured(sm, receiver: Receiver) -> None:
    settings = AlertSettings(webhooks=[receiver.url], backoff_s=1)
    receiver.answer((429, {"Retry-After": "120"}, "slow down"))
    _raise(sm, settings)

    deliver(sm, settings, T0)

    [d] = _deliveries(sm)
    assert (d.state, d.last_status_code) == ("pending", 429)
    assert d.next_attempt_at >= T0 + timedelta(seconds=120)


@pytest.mark.parametrize("code", [400, 404, 410])
def test_4xx_fails_at_once(sm, receiver: Receiver, code: int) -> None:
    settings = AlertSettings(webhooks=[receiver.url])
    receiver.answer((code, {}, "bad payload: field 'x' missing"))
    _raise(sm, settings)

    assert deliver(sm, settings, T0) == 1

    [d] = _deliveries(sm)
    assert (d.state, d.attempts, d.last_status_code) == ("failed", 1, code)
    assert f"HTTP {code}" in d.last_error
    assert "bad payload: field 'x' missing" in d.last_error
    assert "not retried" in d.last_error
    assert d.next_attempt_at is None
    assert deliver(sm, settings, T0 + timedelta(days=1)) == 0
    assert len(receiver.requests) == 1


def test_408_is_retried(sm, receiver: Receiver) -> None:
    settings = AlertSettings(webhooks=[receiver.url])
    receiver.answer(408)
    _raise(sm, settings)
    deliver(sm, settings, T0)
    [d] = _deliveries(sm)
    assert (d.state, d.last_status_code) == ("pending", 408)


def test_fails_after_max_attempts(sm, receiver: Receiver) -> None:
    settings = AlertSettings(webhooks=[receiver.url], max_attempts=3, backoff_s=1)
    receiver.answer(500, 502, 503, 500)
    _raise(sm, settings)

    now = T0
    for _ in range(3):
        assert deliver(sm, settings, now) == 1
        [d] = _deliveries(sm)
        now = d.next_attempt_at or now

    [d] = _deliveries(sm)
    assert (d.state, d.attempts, d.last_status_code) == ("failed", 3, 503)
    assert "gave up after 3 attempts" in d.last_error
    assert d.next_attempt_at is None
    assert deliver(sm, settings, now + timedelta(days=1)) == 0
    assert len(receiver.requests) == 3


def test_receiver_down_is_retried_until_it_is_back(sm, receiver: Receiver) -> None:
    settings = AlertSettings(webhooks=[receiver.url], timeout_s=2)
    receiver.stop()
    _raise(sm, settings)

    assert deliver(sm, settings, T0) == 1
    [d] = _deliveries(sm)
    assert (d.state, d.attempts, d.last_status_code) == ("pending", 1, None)
    assert "ConnectError" in d.last_error

    receiver.start()  # back on the same port
    assert deliver(sm, settings, d.next_attempt_at) == 1
    [d] = _deliveries(sm)
    assert (d.state, d.attempts) == ("delivered", 2)
    assert len(receiver.requests) == 1


def test_each_webhook_gets_its_own_delivery(sm, receiver: Receiver, receiver2: Receiver) -> None:
    settings = AlertSettings(webhooks=[receiver.url, receiver2.url, receiver.url])
    receiver2.answer(500)
    _raise(sm, settings)

    assert deliver(sm, settings, T0) == 2  # the repeated URL counts once

    d1, d2 = _deliveries(sm)
    assert (d1.url, d1.state) == (receiver.url, "delivered")
    assert (d2.url, d2.state, d2.last_status_code) == (receiver2.url, "pending", 500)
    assert len(receiver.requests) == 1
    assert len(receiver2.requests) == 1
    assert receiver.requests[0].body == receiver2.requests[0].body


def test_a_round_that_died_mid_flight_is_resent_after_its_lease(sm, receiver: Receiver) -> None:
    settings = AlertSettings(webhooks=[receiver.url], timeout_s=5)
    _raise(sm, settings)
    # A server that claimed the delivery and died before recording the outcome.
    [claim] = alert_delivery._claim_due(sm, settings, T0, 100)
    [d] = _deliveries(sm)
    assert (d.state, d.attempts) == ("pending", 1)

    assert deliver(sm, settings, T0 + timedelta(seconds=1)) == 0  # still leased
    assert deliver(sm, settings, d.next_attempt_at) == 1
    [d] = _deliveries(sm)
    assert (d.state, d.attempts) == ("delivered", 2)
    assert receiver.requests[0].body == claim.payload


def test_limit_bounds_a_round(sm, receiver: Receiver) -> None:
    settings = AlertSettings(webhooks=[receiver.url])
    for i in range(5):
        _raise(sm, settings, key=f"breaker:b{i}")
    assert deliver(sm, settings, T0, limit=3) == 3
    assert deliver(sm, settings, T0, limit=3) == 2
    assert {d.state for d in _deliveries(sm)} == {"delivered"}


def test_backoff_is_capped() -> None:
    settings = AlertSettings(backoff_s=2, backoff_max_s=300)
    waits = [alert_delivery.backoff_s(n, settings) for n in range(1, 20)]
    assert all(w <= 300 for w in waits)
    assert waits[-1] >= 150
    assert alert_delivery.backoff_s(1, settings, retry_after_s=10_000) == 300


def test_the_running_server_delivers(app, receiver: Receiver) -> None:  # type: ignore[no-untyped-def]
    """Through the app's own background loop (leader), not a hand-run round."""
    app.state.settings.alerts = AlertSettings(webhooks=[receiver.url])
    with TestClient(app):
        with app.state.sessionmaker() as s:
            raise_alert(
                s,
                app.state.settings.alerts,
                kind="breaker",
                key="policy_breaker",
                severity="critical",
                summary="breaker open",
                now=utcnow(),
            )
            s.commit()

        def delivered() -> bool:
            with app.state.sessionmaker() as s:
                return s.scalar(select(AlertDelivery.state)) == "delivered"

        # the background loop ticks on a loaded machine too: wait for it, not for a clock
        wait_for(delivered, timeout=60, interval=0.05, what="the server's own delivery")
    assert [r.body["alert"]["summary"] for r in receiver.requests] == ["breaker open"]

"""GET /api/v1/alerts: newest first, deliveries with states, filters, auth, validation."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient

from tierwatch.server.alerts.service import AlertSettings, raise_alert

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
# Pending deliveries are due only then, so the app's own delivery loop leaves them alone.
FAR = datetime(2099, 1, 1, tzinfo=UTC)
HOOKS = ["https://hooks.example/services/T0/B0/SECRET", "http://am.example:9093/api?token=x"]


@pytest.fixture
def seeded(app) -> dict[str, int]:  # type: ignore[no-untyped-def]
    settings = AlertSettings(webhooks=HOOKS)
    with app.state.sessionmaker() as s:
        node = raise_alert(
            s,
            settings,
            kind="node_state",
            key="node_state:n1:unhealthy",
            severity="critical",
            summary="n1 is unhealthy",
            labels={"node": "n1"},
            details={"xid": 79},
            now=T0,
        )
        breaker = raise_alert(
            s,
            settings,
            kind="breaker",
            key="breaker:isolate",
            severity="warning",
            summary="isolation breaker open",
            now=T0 + timedelta(seconds=1),
        )
        resolved = raise_alert(
            s,
            settings,
            kind="node_state",
            key="node_state:n1:unhealthy",
            severity="info",
            summary="n1 is healthy again",
            labels={"node": "n1"},
            status="resolved",
            now=T0 + timedelta(seconds=2),
        )
        s.flush()
        node.deliveries[0].state = "delivered"
        node.deliveries[0].attempts = 1
        node.deliveries[0].delivered_at = T0
        node.deliveries[1].state = "failed"
        node.deliveries[1].attempts = 1
        node.deliveries[1].last_status_code = 400
        node.deliveries[1].last_error = "HTTP 400 Bad Request: nope (permanent: not retried)"
        for alert in (node, breaker, resolved):
            for d in alert.deliveries:
                d.next_attempt_at = FAR if d.state == "pending" else None
        s.commit()
        return {"node": node.id, "breaker": breaker.id, "resolved": resolved.id}


def _get(client: TestClient, token: str, **params: str | int):  # type: ignore[no-untyped-def]
    return client.get("/api/v1/alerts", params=params, headers={"Authorization": f"Bearer {token}"})


def test_lists_newest_first_with_deliveries(client, make_token, seeded) -> None:  # type: ignore[no-untyped-def]
    r = _get(client, make_token("viewer"))
    assert r.status_code == 200, r.text
    alerts = r.json()["alerts"]
    assert [a["id"] for a in alerts] == [seeded["resolved"], seeded["breaker"], seeded["node"]]
    node = alerts[2]
    assert node["key"] == "node_state:n1:unhealthy"
    assert node["labels"] == {"node": "n1"}
    assert node["details"] == {"xid": 79}
    assert node["created_at"] == "2026-03-01T12:00:00Z"
    assert node["count"] == 1
    first, second = node["deliveries"]
    assert (first["webhook"], first["state"], first["url"]) == (
        1,
        "delivered",
        "https://hooks.example/…",
    )
    assert (second["webhook"], second["state"], second["last_status_code"]) == (2, "failed", 400)
    assert second["url"] == "http://am.example:9093/…"
    assert "SECRET" not in r.text
    assert "token=x" not in r.text
    assert alerts[0]["ends_at"] == "2026-03-01T12:00:02Z"
    assert alerts[0]["starts_at"] == "2026-03-01T12:00:00Z"


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"kind": "breaker"}, ["breaker"]),
        ({"kind": "node_state"}, ["resolved", "node"]),
        ({"status": "resolved"}, ["resolved"]),
        ({"status": "firing"}, ["breaker", "node"]),
        ({"delivery": "failed"}, ["node"]),
        ({"delivery": "pending"}, ["resolved", "breaker"]),
        ({"delivery": "delivered", "kind": "breaker"}, []),
        ({"limit": 2}, ["resolved", "breaker"]),
    ],
)
def test_filters(client, make_token, seeded, params, expected) -> None:  # type: ignore[no-untyped-def]
    r = _get(client, make_token("viewer"), **params)
    assert r.status_code == 200, r.text
    assert [a["id"] for a in r.json()["alerts"]] == [seeded[n] for n in expected]


def test_people_may_read_agents_may_not_and_a_token_is_needed(client, make_token, seeded) -> None:  # type: ignore[no-untyped-def]
    assert _get(client, make_token("viewer")).status_code == 200
    r = _get(client, make_token("agent", "n1"))
    assert r.status_code == 403, r.text
    assert r.json()["detail"].startswith("agent tokens may only report")
    assert client.get("/api/v1/alerts").status_code == 401


@pytest.mark.parametrize(
    ("params", "field"),
    [({"status": "acked"}, "status"), ({"delivery": "lost"}, "delivery"), ({"limit": 0}, "limit")],
)
def test_bad_filters_are_422_naming_the_field(client, make_token, params, field) -> None:  # type: ignore[no-untyped-def]
    r = _get(client, make_token("viewer"), **params)
    assert r.status_code == 422
    assert field in r.json()["detail"]

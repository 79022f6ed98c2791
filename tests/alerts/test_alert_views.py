"""The alerts dashboard page: delivery states, escaping, htmx fragment, sign-in."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tierwatch.server.alerts.service import AlertSettings, raise_alert

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
# Pending deliveries are due only then, so the app's own delivery loop leaves them alone.
FAR = datetime(2099, 1, 1, 12, 0, 0, tzinfo=UTC)
HOOKS = ["https://hooks.example/services/T0/B0/SECRET", "http://am.example:9093/hook"]
EVIL = '<script>alert("x")</script><img src=x onerror=alert(1)>'


@pytest.fixture
def alert_settings() -> AlertSettings:
    return AlertSettings(webhooks=HOOKS)


@pytest.fixture
def seeded(app, alert_settings) -> dict[str, int]:  # type: ignore[no-untyped-def]
    with app.state.sessionmaker() as s:
        a = raise_alert(
            s,
            alert_settings,
            kind="node_state",
            key="node_state:n1:unhealthy",
            severity="critical",
            summary=f"n1 unhealthy {EVIL}",
            labels={"node": "n1"},
            now=T0,
        )
        b = raise_alert(
            s,
            alert_settings,
            kind="breaker",
            key="breaker:isolate",
            severity="warning",
            summary="isolation breaker open",
            now=T0 + timedelta(seconds=1),
        )
        s.flush()
        a.deliveries[0].state = "delivered"
        a.deliveries[0].attempts = 2
        a.deliveries[0].delivered_at = T0
        a.deliveries[1].state = "failed"
        a.deliveries[1].attempts = 8
        a.deliveries[1].last_error = f"HTTP 500: {EVIL} (gave up after 8 attempts)"
        b.deliveries[0].attempts = 1
        b.deliveries[0].last_error = "HTTP 503 Service Unavailable"
        b.deliveries[0].next_attempt_at = FAR
        b.deliveries[1].next_attempt_at = FAR
        s.commit()
        return {"node": a.id, "breaker": b.id}


def _auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_page_shows_delivery_status(client, make_token, seeded) -> None:  # type: ignore[no-untyped-def]
    r = client.get("/alerts", headers=_auth(make_token("viewer")))
    assert r.status_code == 200, r.text
    html = r.text
    assert html.index(f'data-alert="{seeded["breaker"]}"') < html.index(
        f'data-alert="{seeded["node"]}"'
    )  # newest first
    assert 'data-state="delivered"' in html
    assert "after 2 attempts" in html
    assert "pending (attempt 2 of 8, next at" in html
    assert "2099-01-01 12:00:00 UTC" in html
    assert "HTTP 503 Service Unavailable" in html
    assert 'data-state="failed"' in html
    assert "gave up after 8 attempts" in html
    assert "2 webhooks (json payload)" in html
    assert "https://hooks.example/…" in html
    assert "SECRET" not in html
    assert 'href="/alerts"' in html  # nav link
    assert 'hx-trigger="every' in html


def test_html_in_summaries_and_errors_is_inert(client, make_token, seeded) -> None:  # type: ignore[no-untyped-def]
    html = client.get("/alerts", headers=_auth(make_token("viewer"))).text
    assert "<script>alert" not in html
    assert "<img src=x" not in html
    escaped = "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt;&lt;img src=x onerror=alert(1)&gt;"
    assert html.count(escaped) == 2  # the summary and the delivery error


def test_filters_and_htmx_fragment(client, make_token, seeded) -> None:  # type: ignore[no-untyped-def]
    token = make_token("viewer")
    r = client.get(
        "/alerts?kind=breaker&delivery=pending",
        headers={**_auth(token), "HX-Request": "true"},
    )
    assert r.status_code == 200
    assert "HX-Request" in r.headers["Vary"]
    assert r.text.lstrip().startswith('<div id="live"')
    assert "<html" not in r.text
    assert 'hx-get="/alerts?kind=breaker&amp;delivery=pending"' in r.text
    assert f'data-alert="{seeded["breaker"]}"' in r.text
    assert f'data-alert="{seeded["node"]}"' not in r.text

    r = client.get("/alerts?status=resolved", headers=_auth(token))
    assert "No alerts match these filters" in r.text


def test_page_without_webhooks_says_so(app, client, make_token) -> None:  # type: ignore[no-untyped-def]
    app.state.settings.alerts = AlertSettings()
    html = client.get("/alerts", headers=_auth(make_token("viewer"))).text
    assert "no webhooks configured" in html
    assert "No alerts" in html


def test_page_needs_sign_in(client) -> None:  # type: ignore[no-untyped-def]
    r = client.get("/alerts", follow_redirects=False)
    assert r.status_code == 303
    assert r.headers["location"] == "/login?next=%2Falerts"

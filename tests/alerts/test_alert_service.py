"""Raising alerts: deduplication, resolved notices, validation, settings, pruning."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic import ValidationError
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.server.alerts.models import Alert, AlertDelivery
from tierwatch.server.alerts.service import (
    AlertSettings,
    list_alerts,
    prune_alerts,
    raise_alert,
    redact_url,
)
from tierwatch.server.config import Settings

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
HOOK = "http://127.0.0.1:9/hook"
KEY = "node_state:gpu-node-03:unhealthy"


def _raise(
    s: Session, settings: AlertSettings, now: datetime, status: str = "firing"
) -> Alert | None:
    return raise_alert(
        s,
        settings,
        kind="node_state",
        key=KEY,
        severity="critical",
        summary="gpu-node-03 is unhealthy",
        labels={"node": "gpu-node-03"},
        status=status,
        now=now,
    )


def _counts(s: Session) -> tuple[int, int]:
    return (
        s.scalar(select(func.count()).select_from(Alert)) or 0,
        s.scalar(select(func.count()).select_from(AlertDelivery)) or 0,
    )


def test_repeat_within_the_window_is_counted_not_sent(sm: sessionmaker[Session]) -> None:
    settings = AlertSettings(webhooks=[HOOK], dedup_s=300)
    with sm() as s:
        first = _raise(s, settings, T0)
        assert first is not None
        assert _raise(s, settings, T0 + timedelta(seconds=10)) is None
        assert _raise(s, settings, T0 + timedelta(seconds=299)) is None
        s.commit()
    with sm() as s:
        assert _counts(s) == (1, 1)
        alert = s.get(Alert, first.id)
        assert alert.count == 3
        assert alert.last_fired_at == T0 + timedelta(seconds=299)
        assert alert.created_at == T0

        # Past the window a still-firing condition is sent again, keeping its start.
        again = _raise(s, settings, T0 + timedelta(seconds=300))
        s.commit()
        assert again is not None
        assert again.starts_at == T0
        assert _counts(s) == (2, 2)


def test_resolved_is_sent_inside_the_window(sm: sessionmaker[Session]) -> None:
    settings = AlertSettings(webhooks=[HOOK], dedup_s=300)
    with sm() as s:
        _raise(s, settings, T0)
        resolved = _raise(s, settings, T0 + timedelta(seconds=5), status="resolved")
        assert resolved is not None
        assert (resolved.starts_at, resolved.ends_at) == (T0, T0 + timedelta(seconds=5))
        # A duplicate resolved notice is deduplicated like a firing one ...
        assert _raise(s, settings, T0 + timedelta(seconds=6), status="resolved") is None
        # ... and the condition firing again is a transition, so it is sent.
        refired = _raise(s, settings, T0 + timedelta(seconds=7))
        assert refired is not None
        assert refired.starts_at == T0 + timedelta(seconds=7)
        s.commit()
        assert _counts(s) == (3, 3)


def test_dedup_window_zero_sends_every_notice(sm: sessionmaker[Session]) -> None:
    settings = AlertSettings(webhooks=[HOOK], dedup_s=0)
    with sm() as s:
        assert _raise(s, settings, T0) is not None
        assert _raise(s, settings, T0) is not None
        s.commit()
        assert _counts(s) == (2, 2)


def test_without_webhooks_alerts_are_stored_only(sm: sessionmaker[Session]) -> None:
    with sm() as s:
        assert _raise(s, AlertSettings(), T0) is not None
        s.commit()
        assert _counts(s) == (1, 0)


def test_rolled_back_caller_sends_nothing(sm: sessionmaker[Session]) -> None:
    with sm() as s:
        _raise(s, AlertSettings(webhooks=[HOOK]), T0)
        s.rollback()
        assert _counts(s) == (0, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"severity": "fatal"}, "severity 'fatal'"),
        ({"status": "acked"}, "status 'acked'"),
        ({"key": ""}, "key must be"),
        ({"kind": "x" * 33}, "kind must be"),
        ({"labels": {"node": 3}}, "labels must map strings to strings"),
    ],
)
def test_bad_arguments_are_refused(sm, change, message) -> None:  # type: ignore[no-untyped-def]
    args = {
        "kind": "breaker",
        "key": "breaker:isolate",
        "severity": "warning",
        "summary": "open",
        "labels": {},
        "status": "firing",
    }
    with sm() as s, pytest.raises(ValueError, match=message):
        raise_alert(s, AlertSettings(), now=T0, **{**args, **change})


@pytest.mark.parametrize(
    "url", ["ftp://example.com/hook", "example.com/hook", "http://", "http://host:99999/x"]
)
def test_bad_webhook_url_is_refused_with_a_clear_message(url: str) -> None:
    with pytest.raises(ValidationError) as info:
        AlertSettings(webhooks=["https://ok.example/hook", url])
    text = str(info.value)
    assert "TIERWATCH_ALERTS__WEBHOOKS" in text
    assert repr(url) in text


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERWATCH_ALERTS__WEBHOOKS", '["http://a.example/x", "https://b.example"]')
    monkeypatch.setenv("TIERWATCH_ALERTS__FORMAT", "alertmanager")
    monkeypatch.setenv("TIERWATCH_ALERTS__DEDUP_S", "60")
    monkeypatch.setenv("TIERWATCH_ALERTS__BEARER_TOKEN", "zq-9f7e-secret")
    alerts = Settings(dev=True).alerts
    assert alerts.webhooks == ["http://a.example/x", "https://b.example"]
    assert (alerts.format, alerts.dedup_s, alerts.max_attempts) == ("alertmanager", 60, 8)
    assert alerts.bearer_token is not None
    assert alerts.bearer_token.get_secret_value() == "zq-9f7e-secret"
    assert "zq-9f7e-secret" not in repr(alerts)

    monkeypatch.setenv("TIERWATCH_ALERTS__WEBHOOKS", "http://a.example/x, http://c.example/y")
    assert Settings(dev=True).alerts.webhooks == ["http://a.example/x", "http://c.example/y"]

    monkeypatch.setenv("TIERWATCH_ALERTS__WEBHOOKS", '["smtp://mail.example"]')
    with pytest.raises(ValidationError, match="is not an http"):
        Settings(dev=True)


def test_list_filters(sm: sessionmaker[Session]) -> None:
    settings = AlertSettings(webhooks=[HOOK])
    with sm() as s:
        a = raise_alert(
            s,
            settings,
            kind="breaker",
            key="breaker:1",
            severity="warning",
            summary="breaker open",
            now=T0,
        )
        b = raise_alert(
            s,
            settings,
            kind="node_state",
            key="n:1",
            severity="info",
            summary="healthy again",
            status="resolved",
            now=T0 + timedelta(seconds=1),
        )
        s.flush()
        b.deliveries[0].state = "failed"
        s.commit()
        assert [x.id for x in list_alerts(s)] == [b.id, a.id]
        assert [x.id for x in list_alerts(s, kind="breaker")] == [a.id]
        assert [x.id for x in list_alerts(s, status="resolved")] == [b.id]
        assert [x.id for x in list_alerts(s, delivery_state="failed")] == [b.id]
        assert [x.id for x in list_alerts(s, delivery_state="pending")] == [a.id]
        assert [x.id for x in list_alerts(s, limit=1)] == [b.id]
        with pytest.raises(ValueError, match="delivery state"):
            list_alerts(s, delivery_state="lost")


def test_prune_keeps_pending_and_young_alerts(sm: sessionmaker[Session]) -> None:
    settings = AlertSettings(webhooks=[HOOK])
    with sm() as s:
        old_done = raise_alert(
            s, settings, kind="breaker", key="b:1", severity="info", summary="x", now=T0
        )
        old_pending = raise_alert(
            s, settings, kind="breaker", key="b:2", severity="info", summary="x", now=T0
        )
        young = raise_alert(
            s,
            AlertSettings(),
            kind="breaker",
            key="b:3",
            severity="info",
            summary="x",
            now=T0 + timedelta(days=2),
        )
        s.flush()
        old_done.deliveries[0].state = "delivered"
        old_done.deliveries[0].next_attempt_at = None  # as a round leaves a delivered webhook
        s.commit()
        assert prune_alerts(s, now=T0 + timedelta(days=2), retention_s=86400) == 1
        s.commit()
        assert {a.id for a in list_alerts(s)} == {old_pending.id, young.id}
        assert _counts(s) == (2, 1)


def test_redact_url_hides_paths_and_queries() -> None:
    assert redact_url("https://hooks.slack.com/services/T0/B0/XXXX") == "https://hooks.slack.com/…"
    assert redact_url("http://am:9093/?token=abc") == "http://am:9093/…"
    assert redact_url("http://[::1]:8080") == "http://[::1]:8080/"


def test_malformed_webhook_list_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERWATCH_ALERTS__WEBHOOKS", '["http://a.example/x",')
    with pytest.raises(ValidationError, match="is not a JSON list of URLs"):
        Settings(dev=True)

"""Pushing alerts to Alertmanager's API v2: settings, the postable alert, the re-send
decision (pure), and one module-scoped real Alertmanager on 127.0.0.1 that receives a
firing alert, its re-send and its resolution, honours a silence, and never sees a stale
firing notice after a resolution."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from alert_support import Receiver, deliver
from executables import require_executable
from procs import wait_for
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.agent.netutil import free_port
from tierwatch.agent.protocol import utcnow
from tierwatch.server.alerts import delivery as alert_delivery
from tierwatch.server.alerts.models import Alert, AlertDelivery
from tierwatch.server.alerts.service import (
    AlertSettings,
    alertmanager_endpoint,
    is_alertmanager_api,
    prune_alerts,
    raise_alert,
)
from tierwatch.server.config import Settings

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
AM_VAR = "TIERWATCH_ALERTS__ALERTMANAGER_URLS"


# -- settings ------------------------------------------------------------------------------


def test_alertmanager_urls_become_their_api_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AM_VAR, "http://am-0:9093, https://proxy.example/am/")
    monkeypatch.setenv("TIERWATCH_ALERTS__ALERTMANAGER_RESEND_S", "30")
    monkeypatch.setenv("TIERWATCH_ALERTS__ALERTMANAGER_BEARER_TOKEN", "am-7c1e-token")
    monkeypatch.setenv("TIERWATCH_ALERTS__CLUSTER", " prod-a ")
    alerts = Settings(dev=True).alerts
    assert alerts.alertmanager_urls == [
        "http://am-0:9093/api/v2/alerts",
        "https://proxy.example/am/api/v2/alerts",
    ]
    assert (alerts.alertmanager_resend_s, alerts.cluster) == (30, "prod-a")
    assert "am-7c1e-token" not in repr(alerts)
    assert alertmanager_endpoint("http://am:9093/api/v2/alerts") == "http://am:9093/api/v2/alerts"
    assert all(is_alertmanager_api(u) for u in alerts.alertmanager_urls)
    assert not is_alertmanager_api("https://hooks.example/hook")

    both = AlertSettings(webhooks=["http://h.example/hook"], alertmanager_urls=["http://am:9093"])
    assert both.targets == ["http://h.example/hook", "http://am:9093/api/v2/alerts"]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://am.example:9093", "is not an http(s) URL"),
        ("am.example:9093", "is not an http(s) URL"),
        ("http://am.example:99999", "is not a valid URL"),
        ("http://am.example:9093/?token=x", "has a query or fragment"),
        ("http://am.example:9093/api/v1/alerts", "API v1, removed in Alertmanager 0.27"),
    ],
)
def test_bad_alertmanager_url_is_refused_naming_the_variable(url: str, says: str) -> None:
    with pytest.raises(ValidationError) as info:
        AlertSettings(alertmanager_urls=["http://ok.example:9093", url])
    text = str(info.value)
    assert AM_VAR in text
    assert repr(url) in text
    assert says in text


def test_bad_alertmanager_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AM_VAR, '["http://am:9093",')
    with pytest.raises(ValidationError, match=f"{AM_VAR}: .* is not a JSON list of URLs"):
        Settings(dev=True)
    monkeypatch.setenv(AM_VAR, "smtp://mail.example")
    with pytest.raises(ValidationError, match=AM_VAR):
        Settings(dev=True)
    monkeypatch.delenv(AM_VAR)
    monkeypatch.setenv("TIERWATCH_ALERTS__ALERTMANAGER_RESEND_S", "0")
    with pytest.raises(ValidationError, match="alertmanager_resend_s"):
        Settings(dev=True)


def test_a_webhook_pointing_at_the_alerts_api_is_refused() -> None:
    with pytest.raises(ValidationError) as info:
        AlertSettings(webhooks=["http://am.example:9093/api/v2/alerts"])
    text = str(info.value)
    assert "TIERWATCH_ALERTS__WEBHOOKS" in text
    assert AM_VAR in text  # says where it belongs


# -- the postable alert ------------------------------------------------------------------


def _notice(**change: Any) -> Alert:
    fields: dict[str, Any] = {
        "id": 7,
        "key": "node_state:gpu-node-03:unhealthy",
        "kind": "node_state",
        "severity": "critical",
        "status": "firing",
        "summary": "node gpu-node-03 is unhealthy (was healthy): XID 79",
        "labels": {"node": "gpu-node-03", "state": "unhealthy", "bad-name": "x", "__x": "y"},
        "details": {"xid": 79},
        "created_at": T0,
        "starts_at": T0,
        "ends_at": None,
        "last_fired_at": T0,
        "count": 1,
    }
    return Alert(**{**fields, **change})


def test_postable_alert_for_firing_and_resolved() -> None:
    settings = AlertSettings(
        alertmanager_resend_s=60, cluster="prod-a", external_url="https://tw.example"
    )
    firing = _notice()
    now = T0 + timedelta(seconds=5)
    body = alert_delivery.alertmanager_api_alert(firing, firing=firing, settings=settings, now=now)
    identity = {
        "alertname": "node_state",
        "severity": "critical",
        "node": "gpu-node-03",
        "cluster": "prod-a",
        "alertkey": "node_state:gpu-node-03:unhealthy",
    }
    assert body == {
        "labels": identity,
        "annotations": {
            "summary": "node gpu-node-03 is unhealthy (was healthy): XID 79",
            "description": "node gpu-node-03 is unhealthy (was healthy): XID 79",
            "state": "unhealthy",  # other labels are annotations; invalid names are left out
        },
        "startsAt": "2026-03-01T12:00:00Z",
        "endsAt": "2026-03-01T12:04:05Z",  # now + 4 re-send intervals
        "generatorURL": "https://tw.example/nodes/gpu-node-03",
    }

    resolved = _notice(
        id=8,
        severity="info",
        status="resolved",
        summary="node gpu-node-03 is healthy (was unhealthy)",
        labels={"node": "gpu-node-03", "state": "healthy"},
        created_at=T0 + timedelta(minutes=9),
        ends_at=T0 + timedelta(minutes=9),
    )
    later = T0 + timedelta(minutes=10)
    body = alert_delivery.alertmanager_api_alert(
        resolved, firing=firing, settings=settings, now=later
    )
    assert body["labels"] == identity  # the firing notice's label set, severity included
    assert body["endsAt"] == "2026-03-01T12:09:00Z"  # when it was resolved: in the past
    assert body["annotations"]["state"] == "healthy"


# -- the re-send decision (pure) -----------------------------------------------------------

S = AlertSettings(alertmanager_resend_s=60, max_attempts=3, backoff_s=2, backoff_max_s=300)


@dataclass(frozen=True)
class Case:
    ok: bool
    permanent: bool
    attempts: int
    resend: bool
    state: str
    next_s: float | None  # seconds after now; None: never
    error_has: str


CASES = [
    Case(True, False, 1, False, "delivered", None, ""),
    Case(True, False, 1, True, "delivered", 60, ""),
    Case(False, True, 1, True, "failed", None, "permanent: not retried"),
    Case(False, False, 3, False, "failed", None, "gave up after 3 attempts)"),
    Case(False, False, 3, True, "failed", 60, "sent again in 60 s while it fires"),
    Case(False, False, 1, True, "pending", 2, "HTTP 503"),  # backoff_s * 2**0 (upper bound)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.state}-{c.attempts}-{c.resend}")
def test_settle(case: Case) -> None:
    out = alert_delivery.settle(
        ok=case.ok,
        error="" if case.ok else "HTTP 503 Service Unavailable",
        permanent=case.permanent,
        attempts=case.attempts,
        resend=case.resend,
        settings=S,
        now=T0,
    )
    assert out.state == case.state
    if case.next_s is None:
        assert out.next_attempt_at is None
    elif case.state == "pending":
        assert out.next_attempt_at is not None
        assert T0 < out.next_attempt_at <= T0 + timedelta(seconds=case.next_s)
    else:
        assert out.next_attempt_at == T0 + timedelta(seconds=case.next_s)
    assert case.error_has in out.error
    assert (out.error == "") == case.ok


def test_each_target_gets_its_own_bearer_token(sm: sessionmaker[Session]) -> None:
    """Which Authorization header goes where (a real Alertmanager cannot show it): a
    recording HTTP server on 127.0.0.1 stands at both paths."""
    rec = Receiver()
    rec.start()
    try:
        base = f"http://127.0.0.1:{rec.port}"
        settings = AlertSettings(
            webhooks=[f"{base}/hook"],
            alertmanager_urls=[base],
            bearer_token="hook-secret",
            alertmanager_bearer_token="am-secret",
        )
        with sm() as s:
            raise_alert(
                s, settings, kind="breaker", key="policy_breaker", severity="critical",
                summary="breaker open", now=T0,
            )  # fmt: skip
            s.commit()
        assert deliver(sm, settings, T0) == 2
        by_path = {r.path: r for r in rec.requests}
        assert by_path["/hook"].headers["Authorization"] == "Bearer hook-secret"
        assert by_path["/api/v2/alerts"].headers["Authorization"] == "Bearer am-secret"
        assert isinstance(by_path["/api/v2/alerts"].body, list)
    finally:
        rec.stop()


# -- a real Alertmanager -------------------------------------------------------------------

AM_CONFIG = """\
route:
  receiver: "null"
receivers:
  - name: "null"
"""


@dataclass
class AlertmanagerProc:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def alerts(self, key: str, **params: str) -> list[dict[str, Any]]:
        """``GET /api/v2/alerts`` for one ``alertkey`` (Alertmanager's own view)."""
        r = httpx.get(
            f"{self.url}/api/v2/alerts",
            params={"filter": f'alertkey="{key}"', **params},
            timeout=5,
            trust_env=False,
        )
        r.raise_for_status()
        return list(r.json())


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AlertmanagerProc]:
    """Debian's prometheus-alertmanager on 127.0.0.1 (an ephemeral port, clustering off, its
    own storage), once per module; stopped at the end."""
    exe = require_executable("prometheus-alertmanager", "prometheus-alertmanager")
    root = tmp_path_factory.mktemp("alertmanager")
    (root / "am.yml").write_text(AM_CONFIG)
    log = root / "am.log"
    for _ in range(3):  # a port taken between the draw and the bind: draw again
        port = free_port()
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [
                    exe,
                    f"--config.file={root / 'am.yml'}",
                    f"--storage.path={root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--cluster.listen-address=",
                    "--log.level=warn",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        am = AlertmanagerProc(f"http://127.0.0.1:{port}", proc, log)

        def ready(am: AlertmanagerProc = am) -> bool:
            if am.proc.poll() is not None:
                return True  # exited: stop waiting
            r = httpx.get(f"{am.url}/-/ready", timeout=2, trust_env=False)
            return r.status_code == 200

        wait_for(ready, timeout=30, interval=0.05, what="Alertmanager's /-/ready")
        if proc.poll() is None:
            break
    else:
        pytest.fail(f"Alertmanager did not start: {log.read_text()[-2000:]}")
    try:
        yield am
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _key() -> str:
    return f"node_state:gpu-{uuid.uuid4().hex[:8]}:unhealthy"


def _raise(
    sm: sessionmaker[Session],
    settings: AlertSettings,
    key: str,
    *,
    status: str = "firing",
    now: datetime,
) -> Alert:
    node = key.split(":")[1]
    firing = status == "firing"
    with sm() as s:
        alert = raise_alert(
            s,
            settings,
            kind="node_state",
            key=key,
            severity="critical" if firing else "info",
            summary=f"node {node} is {'unhealthy' if firing else 'healthy'}",
            labels={"node": node, "state": "unhealthy" if firing else "healthy"},
            status=status,
            now=now,
        )
        s.commit()
        assert alert is not None
        return alert


def _deliveries(sm: sessionmaker[Session]) -> list[AlertDelivery]:
    with sm() as s:
        return list(s.scalars(select(AlertDelivery).order_by(AlertDelivery.id)))


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


@pytest.mark.one_backend
def test_firing_resend_and_resolution_reach_a_real_alertmanager(
    sm: sessionmaker[Session], alertmanager: AlertmanagerProc
) -> None:
    settings = AlertSettings(
        alertmanager_urls=[alertmanager.url], alertmanager_resend_s=60, cluster="test-cluster"
    )
    key = _key()
    node = key.split(":")[1]
    t1 = utcnow()  # Alertmanager judges endsAt by its own clock: real times here
    _raise(sm, settings, key, now=t1)

    assert deliver(sm, settings, t1) == 1
    [d] = _deliveries(sm)
    assert (d.state, d.attempts, d.last_status_code) == ("delivered", 1, 200)
    assert d.next_attempt_at == t1 + timedelta(seconds=60)  # the re-send is scheduled

    [seen] = wait_for(lambda: alertmanager.alerts(key), timeout=10, what="the pushed alert")
    assert seen["labels"] == {
        "alertname": "node_state",
        "severity": "critical",
        "node": node,
        "cluster": "test-cluster",
        "alertkey": key,
    }
    assert seen["annotations"] == {
        "summary": f"node {node} is unhealthy",
        "description": f"node {node} is unhealthy",
        "state": "unhealthy",
    }
    assert seen["status"]["state"] == "active"
    assert _ts(seen["startsAt"]) == t1.replace(microsecond=t1.microsecond // 1000 * 1000)
    first_end, fingerprint = _ts(seen["endsAt"]), seen["fingerprint"]
    assert abs((first_end - (t1 + timedelta(seconds=240))).total_seconds()) < 0.01

    # Not due before the interval; due at it, and Alertmanager's endsAt moves on.
    assert deliver(sm, settings, t1 + timedelta(seconds=59)) == 0
    t2 = t1 + timedelta(seconds=60)
    assert deliver(sm, settings, t2) == 1
    [d] = _deliveries(sm)
    assert (d.state, d.attempts, d.delivered_at) == ("delivered", 1, t2)
    assert d.next_attempt_at == t2 + timedelta(seconds=60)
    [seen] = wait_for(
        lambda: [a for a in alertmanager.alerts(key) if _ts(a["endsAt"]) > first_end],
        timeout=10,
        what="the re-sent alert's later endsAt",
    )
    assert seen["fingerprint"] == fingerprint  # the same alert, updated
    assert len(alertmanager.alerts(key)) == 1

    # The resolution: same label set, endsAt now; Alertmanager stops listing it as an alert.
    _raise(sm, settings, key, status="resolved", now=utcnow())
    firing_row, resolved_row = _deliveries(sm)
    assert (firing_row.state, firing_row.next_attempt_at) == ("delivered", None)  # re-sends stop
    assert deliver(sm, settings, utcnow()) == 1
    _, resolved_row = _deliveries(sm)
    assert (resolved_row.state, resolved_row.next_attempt_at) == ("delivered", None)
    wait_for(lambda: alertmanager.alerts(key) == [], timeout=10, what="the alert to resolve")
    assert deliver(sm, settings, t2 + timedelta(hours=1)) == 0  # nothing re-sent after it


@pytest.mark.one_backend
def test_a_silence_suppresses_the_pushed_alert(
    sm: sessionmaker[Session], alertmanager: AlertmanagerProc
) -> None:
    settings = AlertSettings(alertmanager_urls=[alertmanager.url])
    key = _key()
    node = key.split(":")[1]
    now = utcnow()
    _raise(sm, settings, key, now=now)
    assert deliver(sm, settings, now) == 1
    wait_for(lambda: alertmanager.alerts(key), timeout=10, what="the pushed alert")

    silence = {
        "matchers": [
            {"name": "alertname", "value": "node_state", "isRegex": False, "isEqual": True},
            {"name": "node", "value": node, "isRegex": False, "isEqual": True},
        ],
        "startsAt": alert_delivery.rfc3339(now),
        "endsAt": alert_delivery.rfc3339(now + timedelta(hours=1)),
        "createdBy": "tierwatch tests",
        "comment": f"maintenance of {node}",
    }
    r = httpx.post(f"{alertmanager.url}/api/v2/silences", json=silence, trust_env=False)
    assert r.status_code == 200, r.text
    silence_id = r.json()["silenceID"]
    try:
        [seen] = wait_for(
            lambda: [a for a in alertmanager.alerts(key) if a["status"]["state"] == "suppressed"],
            timeout=10,
            what="the silence to suppress the alert",
        )
        assert seen["status"]["silencedBy"] == [silence_id]
        assert alertmanager.alerts(key, silenced="false") == []
    finally:
        httpx.delete(f"{alertmanager.url}/api/v2/silence/{silence_id}", trust_env=False)


@pytest.mark.one_backend
def test_a_stale_firing_notice_never_reopens_a_resolved_alert(
    sm: sessionmaker[Session], alertmanager: AlertmanagerProc
) -> None:
    """The firing notice was never delivered (Alertmanager down) when the resolution came:
    only the resolution is sent, and the firing delivery says why it was not."""
    settings = AlertSettings(alertmanager_urls=[alertmanager.url])
    key = _key()
    now = utcnow()
    _raise(sm, settings, key, now=now)
    _raise(sm, settings, key, status="resolved", now=now + timedelta(milliseconds=5))

    assert deliver(sm, settings, utcnow()) == 1  # the resolution only
    firing, resolved = _deliveries(sm)
    assert (firing.state, firing.attempts, firing.next_attempt_at) == ("failed", 0, None)
    assert "superseded by notice" in firing.last_error
    assert resolved.state == "delivered"
    assert alertmanager.alerts(key) == []
    with sm() as s:  # a superseded, settled alert is prunable; nothing of it is outstanding
        assert prune_alerts(s, now=utcnow() + timedelta(days=2), retention_s=86400) == 2
        s.commit()

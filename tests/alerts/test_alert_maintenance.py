"""Alerts under a maintenance window: recorded with the window, not delivered; a resolution
goes where its firing notice went; a silenced alert that outlives its window is delivered
then; an alert already delivered keeps its word; job alerts are never silenced. Also the
node-state alerts resolve whatever path the state took."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.server.actions import notify
from tierwatch.server.actions.models import MaintenanceWindow
from tierwatch.server.alerts.models import Alert, AlertDelivery
from tierwatch.server.alerts.service import AlertSettings, raise_alert
from tierwatch.server.config import Settings

T0 = datetime(2026, 12, 3, 8, 0, tzinfo=UTC)
HOOK = "http://127.0.0.1:9/hook"
SETTINGS = AlertSettings(webhooks=[HOOK], dedup_s=300)


def _open(s: Session, node: str | None, start: datetime, hours: float = 1.0) -> int:
    window = MaintenanceWindow(
        scope="node" if node else "cluster",
        node=node,
        starts_at=start,
        ends_at=start + timedelta(hours=hours),
        reason="planned",
        created_by="token:1",
        created_at=start,
        ended_at=None,
        ended_by="",
    )
    s.add(window)
    s.flush()
    return window.id


def _raise(s: Session, now: datetime, *, status: str = "firing", key: str = "k:n1", **labels):
    return raise_alert(
        s,
        SETTINGS,
        kind="node_state",
        key=key,
        severity="critical",
        summary="x",
        labels=labels or {"node": "n1"},
        status=status,
        now=now,
    )


def _deliveries(s: Session, alert: Alert) -> int:
    return len(s.scalars(select(AlertDelivery).where(AlertDelivery.alert_id == alert.id)).all())


def test_a_covered_nodes_alert_is_recorded_with_its_window_and_not_delivered(
    sm: sessionmaker[Session],
):
    with sm() as s:
        wid = _open(s, "n1", T0)
        silenced = _raise(s, T0 + timedelta(minutes=1))
        other = _raise(s, T0 + timedelta(minutes=1), key="k:n2", node="n2")
        assert silenced is not None
        assert other is not None
        assert silenced.silenced_by == wid
        assert _deliveries(s, silenced) == 0
        assert other.silenced_by is None
        assert _deliveries(s, other) == 1
        # its resolution goes nowhere either, even after the window: nobody saw it fire
        resolved = _raise(s, T0 + timedelta(hours=2), status="resolved")
        assert resolved is not None
        assert resolved.silenced_by == wid
        assert _deliveries(s, resolved) == 0


def test_a_silenced_alert_that_outlives_its_window_is_delivered_then(sm: sessionmaker[Session]):
    with sm() as s:
        _open(s, "n1", T0, hours=0.05)  # 3 minutes
        first = _raise(s, T0 + timedelta(minutes=1))
        assert first is not None
        assert first.silenced_by is not None
        # still firing after the window, inside the dedup time: a new, delivered notice
        after = _raise(s, T0 + timedelta(minutes=4))
        assert after is not None
        assert after.silenced_by is None
        assert _deliveries(s, after) == 1
        assert after.starts_at == first.starts_at  # the same condition, from when it began
        # and its resolution is delivered too
        resolved = _raise(s, T0 + timedelta(minutes=20), status="resolved")
        assert resolved is not None
        assert resolved.silenced_by is None
        assert _deliveries(s, resolved) == 1


def test_an_alert_delivered_before_the_window_keeps_its_word(sm: sessionmaker[Session]):
    with sm() as s:
        before = _raise(s, T0)
        assert before is not None
        assert before.silenced_by is None
        _open(s, "n1", T0 + timedelta(minutes=1))
        # re-raised after the dedup time inside the window: it continues a delivered alert
        again = _raise(s, T0 + timedelta(minutes=10))
        assert again is not None
        assert again.silenced_by is None
        assert _deliveries(s, again) == 1
        # its resolution inside the window is delivered: the receiver saw it fire
        resolved = _raise(s, T0 + timedelta(minutes=20), status="resolved")
        assert resolved is not None
        assert resolved.silenced_by is None
        assert _deliveries(s, resolved) == 1


def test_a_cluster_window_silences_node_and_cluster_alerts_but_not_job_alerts(
    sm: sessionmaker[Session],
):
    with sm() as s:
        wid = _open(s, None, T0)
        now = T0 + timedelta(minutes=1)
        node = _raise(s, now, key="k:n9", node="n9")
        cluster = _raise(s, now, key="policy_breaker", scope="cluster")
        job = _raise(s, now, key="restore:llama:1", job="llama")
        assert node is not None
        assert cluster is not None
        assert job is not None
        assert (node.silenced_by, cluster.silenced_by, job.silenced_by) == (wid, wid, None)
        assert _deliveries(s, job) == 1


def test_a_window_not_open_yet_or_ended_early_silences_nothing(sm: sessionmaker[Session]):
    with sm() as s:
        _open(s, "n1", T0 + timedelta(hours=1))  # scheduled
        early = _open(s, "n2", T0 - timedelta(minutes=30))
        s.get(MaintenanceWindow, early).ended_at = T0 - timedelta(minutes=1)
        s.flush()
        a = _raise(s, T0)
        b = _raise(s, T0, key="k:n2", node="n2")
        assert a is not None
        assert b is not None
        assert (a.silenced_by, b.silenced_by) == (None, None)


def _firing_keys(s: Session) -> set[str]:
    newest: dict[str, str] = {}
    for alert in s.scalars(select(Alert).order_by(Alert.id)):
        newest[alert.key] = alert.status
    return {k for k, v in newest.items() if v == "firing"}


def test_node_state_alerts_resolve_whatever_path_the_state_took(
    sm: sessionmaker[Session], db_url: str
):
    settings = Settings(database_url=db_url, dev=True, alerts={"dedup_s": 0})
    path = ["healthy", "degraded", "unhealthy", "degraded", "healthy"]
    with sm() as s:
        seen = []
        for i, (old, new) in enumerate(zip(path, path[1:], strict=False)):
            notify.node_state_changed(
                s, settings, node="n1", old=old, new=new, message="", now=T0 + timedelta(minutes=i)
            )
            seen.append(_firing_keys(s))
        assert seen == [
            {"node_state:n1:degraded"},
            {"node_state:n1:unhealthy"},
            {"node_state:n1:degraded"},
            set(),
        ]


def test_an_alert_still_firing_when_its_window_ends_is_delivered_by_the_next_pass(
    sm: sessionmaker[Session],
):
    """Nothing raises a node's state alert again while the state holds: the leader's pass
    delivers a silenced alert once its window is over (ended early here), once."""
    from tierwatch.server.alerts.service import deliver_after_maintenance

    with sm() as s:
        wid = _open(s, "n1", T0)
        silenced = _raise(s, T0 + timedelta(minutes=1))
        resolved_key = _raise(s, T0 + timedelta(minutes=1), key="k:gone")
        _raise(s, T0 + timedelta(minutes=2), key="k:gone", status="resolved")
        assert silenced is not None
        assert resolved_key is not None
        # while the window holds, nothing is delivered
        assert deliver_after_maintenance(s, SETTINGS, now=T0 + timedelta(minutes=5)) == 0
        s.get(MaintenanceWindow, wid).ended_at = T0 + timedelta(minutes=10)
        s.flush()
        later = T0 + timedelta(minutes=11)
        assert deliver_after_maintenance(s, SETTINGS, now=later) == 1  # not the resolved one
        newest = s.scalars(select(Alert).where(Alert.key == "k:n1").order_by(Alert.id)).all()
        assert [(a.status, a.silenced_by) for a in newest] == [("firing", wid), ("firing", None)]
        assert _deliveries(s, newest[-1]) == 1
        assert newest[-1].starts_at == silenced.starts_at
        assert deliver_after_maintenance(s, SETTINGS, now=later + timedelta(seconds=1)) == 0


def test_a_silenced_alert_under_another_window_stays_silenced(sm: sessionmaker[Session]):
    from tierwatch.server.alerts.service import deliver_after_maintenance

    with sm() as s:
        first = _open(s, "n1", T0, hours=0.1)
        _open(s, None, T0, hours=2)  # the cluster's, longer
        alert = _raise(s, T0 + timedelta(minutes=1))
        assert alert is not None
        assert alert.silenced_by is not None
        assert first is not None
        assert deliver_after_maintenance(s, SETTINGS, now=T0 + timedelta(minutes=30)) == 0
        assert deliver_after_maintenance(s, SETTINGS, now=T0 + timedelta(hours=3)) == 1

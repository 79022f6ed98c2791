"""Raising alerts into the outbox, listing them, and pruning them.

An alert is raised inside the caller's transaction (``raise_alert``), so the alert and its
deliveries commit or roll back with the state change that caused it: a restart loses
nothing, and a rolled-back state change sends nothing. ``delivery.deliver_due`` sends them.

Deduplication (``dedup_s``): the newest notice for a ``key`` decides. When it has the same
status and was raised less than ``dedup_s`` ago, the new one is counted on it (``count``,
``last_fired_at``) and nothing is sent. A change of status (firing → resolved, resolved →
firing) is always sent, however soon it comes, so a receiver never misses a transition; a
condition that keeps firing is re-sent once per window (like Alertmanager's
``repeat_interval``).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import NoDecode
from sqlalchemy import delete, exists, or_, select
from sqlalchemy.orm import Session, aliased, selectinload

from tierwatch.server.actions import maintenance
from tierwatch.server.alerts.models import (
    DELIVERY_STATES,
    SEVERITIES,
    STATUSES,
    Alert,
    AlertDelivery,
)
from tierwatch.server.db import execute_dml

MAX_KEY_LENGTH = 255
# Alertmanager API v2's alerts endpoint (Alertmanager docs, "Alerts API").
ALERTMANAGER_API_PATH = "/api/v2/alerts"
MAX_KIND_LENGTH = 32
LIST_LIMIT_MAX = 1000


class AlertSettings(BaseModel):
    """Delivery settings (webhooks and Alertmanagers), nested in the server settings as
    ``alerts``.

    Environment: ``TIERWATCH_ALERTS__WEBHOOKS='["https://am.example:9093/hook"]'`` (a JSON
    list, or comma-separated URLs), ``TIERWATCH_ALERTS__FORMAT=alertmanager``,
    ``TIERWATCH_ALERTS__ALERTMANAGER_URLS=http://am-0:9093,http://am-1:9093`` and so on.

    Attributes:
        webhooks: URLs each alert is POSTed to (http or https). Empty (and no
            ``alertmanager_urls``): alerts are only stored and shown on the dashboard.
            A URL whose path ends in ``/api/v2/alerts`` is refused: that is Alertmanager's
            alerts API, which belongs in ``alertmanager_urls``.
        alertmanager_urls: Alertmanagers each alert is pushed to through their API v2
            (``POST <url>/api/v2/alerts``, a list of postable alerts; see
            ``delivery.alertmanager_api_alert``). Give each Alertmanager's base URL
            (``http://am-0:9093``, or with the path prefix it is served under); each is
            stored as its ``…/api/v2/alerts`` endpoint. Every Alertmanager of an HA cluster
            is listed on its own, as Prometheus does (they deduplicate among themselves).
        alertmanager_resend_s: a firing alert is pushed again this often while it holds
            (seconds), with ``endsAt`` ``ALERTMANAGER_ENDS_AT_RESENDS`` (4) resend intervals
            ahead. Source: Alertmanager docs, "Sending alerts" (clients re-send active
            alerts, "usually on the order of 30 seconds to 3 minutes"); the default 60 s and
            the factor 4 are Prometheus's ``--rules.alert.resend-delay`` default and its
            ``rules/alerting.go`` ``ValidUntil = ts + 4 * max(interval, resendDelay)``
            ("allow for two Eval or Alertmanager send failures").
        alertmanager_bearer_token: sent as ``Authorization: Bearer <token>`` to the
            Alertmanagers (``bearer_token`` goes to webhooks only, so a webhook's secret
            never reaches another service).
        cluster: this tierwatch's cluster name, added as the ``cluster`` label of the
            alerts pushed to Alertmanager ("" for none), like a Prometheus external label,
            so one Alertmanager can route and silence several tierwatch installations.
        format: ``json`` (tierwatch's own payload) or ``alertmanager`` (the Alertmanager
            webhook receiver payload, version 4); see ``delivery.build_payload``.
        dedup_s: the same notice (key and status) raised again within this window is
            counted, not sent again (seconds; 0 disables deduplication).
        max_attempts: attempts per delivery before it is marked failed.
        backoff_s: base of the exponential backoff between attempts (seconds): attempt n
            waits ``backoff_s * 2**(n-1)``, capped at ``backoff_max_s``, times a random factor
            in [0.5, 1] (jitter), and at least a server's ``Retry-After``.
        backoff_max_s: the longest wait between attempts (seconds).
        timeout_s: per-request timeout (connect, read, write; seconds).
        bearer_token: sent as ``Authorization: Bearer <token>`` when set.
        external_url: the dashboard's public base URL (``https://tierwatch.example``), for
            links in payloads (Alertmanager ``externalURL``/``generatorURL``); "" for none.
        concurrency: requests in flight at once in one delivery round.
    """

    # NoDecode: the env value is parsed below, so comma-separated URLs work as well as JSON.
    webhooks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    format: Literal["json", "alertmanager"] = "json"
    dedup_s: Annotated[float, Field(ge=0)] = 300.0
    max_attempts: Annotated[int, Field(ge=1, le=100)] = 8
    backoff_s: Annotated[float, Field(gt=0)] = 2.0
    backoff_max_s: Annotated[float, Field(gt=0)] = 300.0
    timeout_s: Annotated[float, Field(gt=0)] = 5.0
    bearer_token: SecretStr | None = None
    external_url: str = ""
    concurrency: Annotated[int, Field(ge=1, le=100)] = 10
    alertmanager_urls: Annotated[list[str], NoDecode] = Field(default_factory=list)
    alertmanager_resend_s: Annotated[float, Field(ge=1, le=3600)] = 60.0
    alertmanager_bearer_token: SecretStr | None = None
    cluster: Annotated[str, Field(max_length=128)] = ""

    @field_validator("webhooks", mode="before")
    @classmethod
    def _split_webhooks(cls, value: Any) -> Any:
        return _split_urls(value, "TIERWATCH_ALERTS__WEBHOOKS")

    @field_validator("alertmanager_urls", mode="before")
    @classmethod
    def _split_alertmanager_urls(cls, value: Any) -> Any:
        return _split_urls(value, "TIERWATCH_ALERTS__ALERTMANAGER_URLS")

    @field_validator("webhooks")
    @classmethod
    def _check_webhooks(cls, value: list[str]) -> list[str]:
        for url in value:
            _check_http_url(url, "TIERWATCH_ALERTS__WEBHOOKS")
            if is_alertmanager_api(url):
                raise ValueError(
                    f"TIERWATCH_ALERTS__WEBHOOKS: {url!r} is Alertmanager's alerts API, which "
                    "takes a list of alerts, not a webhook payload: put the Alertmanager's base "
                    "URL in TIERWATCH_ALERTS__ALERTMANAGER_URLS instead"
                )
        return value

    @field_validator("alertmanager_urls")
    @classmethod
    def _check_alertmanager_urls(cls, value: list[str]) -> list[str]:
        return [alertmanager_endpoint(url) for url in value]

    @field_validator("cluster")
    @classmethod
    def _strip_cluster(cls, value: str) -> str:
        return value.strip()

    @property
    def targets(self) -> list[str]:
        """Every distinct delivery URL, webhooks first: one delivery per alert each."""
        return list(dict.fromkeys([*self.webhooks, *self.alertmanager_urls]))

    @field_validator("external_url")
    @classmethod
    def _check_external_url(cls, value: str) -> str:
        value = value.strip().rstrip("/")
        if value:
            _check_http_url(value, "TIERWATCH_ALERTS__EXTERNAL_URL")
        return value


def _split_urls(value: Any, setting: str) -> Any:
    """A JSON list or comma-separated URLs (an environment value) as a list."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except ValueError as exc:
                raise ValueError(
                    f"{setting}: {text!r} is not a JSON list of URLs ({exc}); "
                    "write '[\"https://a.example/hook\"]' or comma-separated URLs"
                ) from exc
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


def is_alertmanager_api(url: str) -> bool:
    """Whether a delivery URL is an Alertmanager's alerts API (``…/api/v2/alerts``).

    The delivery rows store only their URL, so this is how a round tells the two kinds of
    target apart, whatever the settings were when the alert was raised: webhook URLs with
    this path are refused by the settings.
    """
    return urlsplit(url).path.rstrip("/").endswith(ALERTMANAGER_API_PATH)


def alertmanager_endpoint(url: str) -> str:
    """The ``…/api/v2/alerts`` endpoint of an Alertmanager given by its base URL.

    ``http://am:9093`` → ``http://am:9093/api/v2/alerts``; a path prefix stays
    (``https://proxy/am/`` → ``https://proxy/am/api/v2/alerts``), and a URL that already
    names the endpoint is kept.

    Raises:
        ValueError: not an http(s) URL, a query or fragment (Alertmanager's API takes
            none), or API v1 (removed in Alertmanager 0.27); the message names
            ``TIERWATCH_ALERTS__ALERTMANAGER_URLS``.
    """
    setting = "TIERWATCH_ALERTS__ALERTMANAGER_URLS"
    url = url.strip()
    _check_http_url(url, setting, example="'http://alertmanager.example:9093'")
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise ValueError(
            f"{setting}: {url!r} has a query or fragment; give the Alertmanager's base URL, "
            "such as 'http://alertmanager.example:9093'"
        )
    path = parts.path.rstrip("/")
    if path.endswith("/api/v1/alerts") or path.endswith("/api/v1"):
        raise ValueError(
            f"{setting}: {url!r} is Alertmanager's API v1, removed in Alertmanager 0.27; "
            "give the base URL (tierwatch uses /api/v2/alerts)"
        )
    if not path.endswith(ALERTMANAGER_API_PATH):
        path += ALERTMANAGER_API_PATH
    return parts._replace(path=path).geturl()


def _check_http_url(
    url: str, setting: str, *, example: str = "'https://alertmanager.example:9093/api/hook'"
) -> None:
    """Raise ValueError with a message that says what to fix, unless ``url`` is http(s)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError as exc:
        raise ValueError(f"{setting}: {url!r} is not a valid URL ({exc})") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{setting}: {url!r} is not an http(s) URL; give full URLs such as {example}"
        )


def raise_alert(
    session: Session,
    settings: AlertSettings,
    *,
    kind: str,
    key: str,
    severity: str,
    summary: str,
    labels: dict[str, str] | None = None,
    details: dict[str, Any] | None = None,
    status: str = "firing",
    now: datetime,
) -> Alert | None:
    """Raise an alert inside the caller's transaction (the caller commits).

    Writes the alert and one pending delivery per configured webhook and Alertmanager
    (``settings.targets``), due at ``now`` (none when a maintenance window silences it:
    ``Alert.silenced_by``, :mod:`~tierwatch.server.actions.maintenance`); or, when the
    newest notice for ``key`` has the same ``status`` and is younger than
    ``settings.dedup_s``, bumps its ``count`` and
    ``last_fired_at`` and sends nothing. A new notice supersedes the older notices' pending
    and re-scheduled Alertmanager deliveries (see ``_supersede``).

    Args:
        kind: ``node_state``, ``policy_isolate``, ``breaker``, ``command_failed``, … (≤ 32
            characters).
        key: the dedup key, e.g. ``node_state:gpu-node-03:unhealthy`` (≤ 255 characters).
        severity: ``info`` | ``warning`` | ``critical``.
        summary: one plain-text line (escaped wherever it is shown).
        labels: string labels, e.g. ``{"node": "gpu-node-03"}``.
        details: JSON-serialisable context.
        status: ``firing`` | ``resolved``.
        now: the time of the event (timezone-aware UTC).

    Returns:
        The new alert, or None when it was deduplicated.

    Raises:
        ValueError: an unknown severity or status, an empty or too long key or kind, or a
            non-string label value.
    """
    if severity not in SEVERITIES:
        raise ValueError(f"severity {severity!r}: expected one of {', '.join(SEVERITIES)}")
    if status not in STATUSES:
        raise ValueError(f"status {status!r}: expected one of {', '.join(STATUSES)}")
    if not key or len(key) > MAX_KEY_LENGTH:
        raise ValueError(f"key must be 1 to {MAX_KEY_LENGTH} characters")
    if not kind or len(kind) > MAX_KIND_LENGTH:
        raise ValueError(f"kind must be 1 to {MAX_KIND_LENGTH} characters")
    labels = dict(labels or {})
    bad = [k for k, v in labels.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise ValueError(f"labels must map strings to strings; not so for {bad}")

    newest = _newest(session, key)
    firing = None
    if status == "firing":
        # Only a new condition is silenced: one already delivered as firing keeps its word.
        continues = newest is not None and newest.status == "firing"
        window = (
            None
            if continues and newest is not None and newest.silenced_by is None
            else maintenance.active(session, now).silencing(labels)
        )
        silenced_by = window.id if window is not None else None
    else:
        firing = (
            newest
            if newest is not None and newest.status == "firing"
            else _newest(session, key, status="firing")
        )
        # a resolution goes wherever its firing notice went (nowhere, if it was silenced)
        silenced_by = firing.silenced_by if firing is not None else None
    if (
        newest is not None
        and newest.status == status
        and (now - newest.created_at).total_seconds() < settings.dedup_s
        # a silenced alert that outlives its window is a new notice, and is delivered
        and not (newest.silenced_by is not None and silenced_by is None)
    ):
        newest.count += 1
        newest.last_fired_at = max(newest.last_fired_at, now)
        return None

    if status == "firing":
        # A condition that keeps firing past the window keeps its start time.
        starts_at = newest.starts_at if newest is not None and newest.status == "firing" else now
        ends_at = None
    else:
        starts_at = firing.starts_at if firing is not None else now
        ends_at = now
    alert = Alert(
        key=key,
        kind=kind,
        severity=severity,
        status=status,
        summary=summary,
        labels=labels,
        details=dict(details or {}),
        created_at=now,
        starts_at=starts_at,
        ends_at=ends_at,
        last_fired_at=now,
        count=1,
        silenced_by=silenced_by,
    )
    session.add(alert)
    session.flush()
    if silenced_by is not None:
        return alert  # recorded and shown, not delivered: a maintenance window covers it
    _supersede(session, alert)
    for url in settings.targets:  # one delivery per distinct URL
        session.add(
            AlertDelivery(
                alert_id=alert.id,
                url=url,
                state="pending",
                attempts=0,
                next_attempt_at=now,
                last_error="",
            )
        )
    session.flush()
    return alert


def deliver_after_maintenance(session: Session, settings: AlertSettings, *, now: datetime) -> int:
    """Raise again, to be delivered, every alert still firing whose notice a maintenance
    window silenced and that no window covers any more (the caller commits).

    A silenced condition that outlives its window is news once the window ends, whether or
    not anything raises it again (a node's state alert is raised only when the state
    changes). Call it from the leader's pass.

    Returns:
        How many alerts were raised again.
    """
    later = aliased(Alert)
    silenced = session.scalars(
        select(Alert)
        .where(
            Alert.silenced_by.is_not(None),
            Alert.status == "firing",
            # only a key's newest notice: one query, not one per silenced notice ever
            ~exists().where(later.key == Alert.key, later.id > Alert.id),
        )
        .order_by(Alert.id)
    ).all()
    if not silenced:
        return 0
    windows = maintenance.active(session, now)
    raised = 0
    for alert in silenced:
        if windows.silencing(alert.labels) is not None or not is_newest(session, alert):
            continue
        again = raise_alert(
            session,
            settings,
            kind=alert.kind,
            key=alert.key,
            severity=alert.severity,
            summary=alert.summary,
            labels=dict(alert.labels),
            details={**alert.details, "silenced_by_window": alert.silenced_by},
            now=now,
        )
        raised += again is not None
    return raised


def _supersede(session: Session, newer: Alert) -> None:
    """Stop the Alertmanager deliveries of ``newer``'s key that are still outstanding.

    Alertmanager keeps the newest word it received for a label set, so an older notice
    that arrives after a newer one would undo it (a firing notice re-sent after the
    resolution re-opens the alert until its ``endsAt``). Only the newest notice of a key is
    therefore sent to Alertmanager: an older notice's re-sends stop (it stays
    ``delivered``), and one never delivered becomes ``failed`` with the reason. The rows
    are locked (``FOR UPDATE`` on PostgreSQL), so a delivery round that claimed one first
    is waited for and its outcome is not recorded over this. Webhook deliveries are left
    alone: a webhook receiver is told every notice.
    """
    stmt = (
        select(AlertDelivery)
        .join(Alert, AlertDelivery.alert_id == Alert.id)
        .where(
            Alert.key == newer.key,
            Alert.id != newer.id,
            AlertDelivery.next_attempt_at.is_not(None),
        )
        .order_by(AlertDelivery.id)  # the order a round records in: no deadlock between them
        .with_for_update(of=AlertDelivery)
    )
    for delivery in session.scalars(stmt):
        if not is_alertmanager_api(delivery.url):
            continue
        delivery.next_attempt_at = None
        if delivery.state != "pending":
            continue  # a re-send that was due: it stops
        if delivery.delivered_at is not None:
            delivery.state = "delivered"  # a re-send in progress: the notice was delivered
        else:
            delivery.state = "failed"
            delivery.last_error = (
                f"superseded by notice {newer.id} ({newer.status}) before it was delivered: "
                "Alertmanager is sent only the newest notice of a key"
            )


def is_newest(session: Session, alert: Alert) -> bool:
    """Whether ``alert`` is the newest notice of its key (its word is the current one)."""
    newest = _newest(session, alert.key)
    return newest is not None and newest.id == alert.id


def firing_notice(session: Session, alert: Alert) -> Alert:
    """The firing notice a notice belongs to: itself when firing, else the newest firing
    notice of its key raised before it (itself when there is none).

    Alertmanager identifies an alert by its label set, so a resolution must carry the
    labels of the firing notice it ends (its severity, say, may differ).
    """
    if alert.status == "firing":
        return alert
    stmt = (
        select(Alert)
        .where(Alert.key == alert.key, Alert.status == "firing", Alert.id < alert.id)
        .order_by(Alert.created_at.desc(), Alert.id.desc())
        .limit(1)
    )
    return session.scalars(stmt).first() or alert


def _newest(session: Session, key: str, *, status: str | None = None) -> Alert | None:
    stmt = select(Alert).where(Alert.key == key)
    if status is not None:
        stmt = stmt.where(Alert.status == status)
    stmt = stmt.order_by(Alert.created_at.desc(), Alert.id.desc()).limit(1)
    return session.scalars(stmt).first()


def list_alerts(
    session: Session,
    *,
    kind: str | None = None,
    status: str | None = None,
    delivery_state: str | None = None,
    limit: int = 100,
) -> list[Alert]:
    """Alerts newest first, each with its deliveries loaded (in webhook order).

    Args:
        kind: only this kind.
        status: only ``firing`` or ``resolved`` notices.
        delivery_state: only alerts with at least one delivery in this state
            (``pending`` | ``delivered`` | ``failed``).
        limit: at most this many (1 to 1000).

    Raises:
        ValueError: an unknown status or delivery state, or a limit out of range.
    """
    if status is not None and status not in STATUSES:
        raise ValueError(f"status {status!r}: expected one of {', '.join(STATUSES)}")
    if delivery_state is not None and delivery_state not in DELIVERY_STATES:
        raise ValueError(
            f"delivery state {delivery_state!r}: expected one of {', '.join(DELIVERY_STATES)}"
        )
    if not 1 <= limit <= LIST_LIMIT_MAX:
        raise ValueError(f"limit must be 1 to {LIST_LIMIT_MAX}")
    if kind and "\x00" in kind:
        return []  # no kind holds a NUL (and PostgreSQL text cannot: it would be a 500)
    stmt = select(Alert).options(selectinload(Alert.deliveries))
    if kind:
        stmt = stmt.where(Alert.kind == kind)
    if status:
        stmt = stmt.where(Alert.status == status)
    if delivery_state:
        stmt = stmt.where(
            exists().where(
                AlertDelivery.alert_id == Alert.id, AlertDelivery.state == delivery_state
            )
        )
    stmt = stmt.order_by(Alert.created_at.desc(), Alert.id.desc()).limit(limit)
    return list(session.scalars(stmt))


def prune_alerts(session: Session, *, now: datetime, retention_s: float) -> int:
    """Delete alerts last raised more than ``retention_s`` ago with no outstanding delivery
    (none pending, none with a re-send to Alertmanager scheduled: a condition that has
    been firing longer than the retention keeps its notice).

    Meant for the server's pruner (e.g. with ``event_retention_s``); deliveries go with
    their alert (ON DELETE CASCADE). Returns the number of alerts deleted.
    """
    cutoff = now - timedelta(seconds=retention_s)
    pending = exists().where(
        AlertDelivery.alert_id == Alert.id,
        or_(AlertDelivery.state == "pending", AlertDelivery.next_attempt_at.is_not(None)),
    )
    return execute_dml(
        session,
        delete(Alert)
        .where(Alert.last_fired_at < cutoff, ~pending)
        .execution_options(synchronize_session=False),
    )


def redact_url(url: str) -> str:
    """``scheme://host[:port]/…``: a webhook URL with its path and query hidden.

    Webhook paths and queries often carry the receiver's secret (Slack-style
    ``/services/T000/B000/XXXX``, ``?token=``), and the dashboard and API show deliveries to
    every viewer.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    shown = f"{parts.scheme}://{host}" + (f":{port}" if port else "")
    return shown + ("/…" if (parts.path not in ("", "/") or parts.query) else "/")

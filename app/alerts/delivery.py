"""Sending the outbox: payloads, backoff, re-sends, and one delivery round (``deliver_due``).

A round (``deliver_due``) runs in three steps, so no database transaction is open while a
request waits on the network:

1. claim (one short transaction, in a worker thread): select due pending deliveries, count
   the attempt and move ``next_attempt_at`` forward by a lease, build the payloads;
2. send (no transaction): POST each payload, ``concurrency`` at a time;
3. record (one short transaction, in a worker thread): delivered on 2xx; otherwise the next
   attempt after an exponential backoff with jitter, or failed.

Delivery is at least once: a server that dies between sending and recording sends again
after the lease. On PostgreSQL the claim uses ``FOR UPDATE SKIP LOCKED``, so two rounds
that overlap never claim the same row; the loop is still meant to run in one replica.

Which answers are permanent (failed at once, without retries): 3xx (httpx does not follow
redirects: the URL must be the final one) and 4xx other than 408 Request Timeout and 429
Too Many Requests. 408, 429, 5xx, timeouts and connection errors are retried; for 429 and
503 a ``Retry-After`` in seconds is honoured (up to ``backoff_max_s``).

Two kinds of target share this outbox. A webhook (``settings.webhooks``) is told each
notice once, in ``settings.format``. An Alertmanager (``settings.alertmanager_urls``, rows
whose URL is ``…/api/v2/alerts``) is pushed a list of one postable alert
(``alertmanager_api_alert``) and, because Alertmanager resolves an alert whose ``endsAt``
passes, the newest notice of a key that fires is pushed again every
``alertmanager_resend_s`` while it holds: its delivered row is due again then
(``next_attempt_at``), and the round that sends it starts a fresh attempt count
(``settle`` is the decision). A newer notice of the key stops that (``service._supersede``),
and a resolution carries the firing notice's labels with ``endsAt`` at the resolution, which
ends the alert in Alertmanager. Source: Alertmanager docs, "Sending alerts"
(https://prometheus.io/docs/alerting/latest/clients/) and "Alerts API".
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import anyio
import httpx
from sqlalchemy import or_, select
from sqlalchemy.orm import Session, sessionmaker

from tierwatch import __version__
from tierwatch.server.alerts.models import DELIVERY_STATES, Alert, AlertDelivery
from tierwatch.server.alerts.service import (
    ALERTMANAGER_API_PATH,
    AlertSettings,
    firing_notice,
    is_alertmanager_api,
    is_newest,
    redact_url,
)
from tierwatch.server.db import session_scope

log = logging.getLogger("tierwatch.server.alerts")

LEASE_MARGIN_S = 30.0
ERROR_BODY_CHARS = 200
# Alertmanager's "zero time" for endsAt of an alert that is still firing.
ALERTMANAGER_ZERO_TIME = "0001-01-01T00:00:00Z"
RETRYABLE_4XX = frozenset({408, 429})
# A firing alert pushed to Alertmanager ends this many re-send intervals after it was sent
# unless sent again: Prometheus's factor (rules/alerting.go, "allow for two Eval or
# Alertmanager send failures").
ALERTMANAGER_ENDS_AT_RESENDS = 4
# Alertmanager label and annotation names (Prometheus data model: [a-zA-Z_][a-zA-Z0-9_]*).
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# The alert labels that become Alertmanager labels (beside alertname, severity, cluster and
# alertkey); the others become annotations, so the label set of a key never changes.
ALERTMANAGER_LABELS = ("node", "job")


def rfc3339(value: datetime | None) -> str | None:
    """``2024-05-01T12:00:03.250000Z`` for an aware datetime (UTC), None for None."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def fingerprint(key: str) -> str:
    """A stable 16-hex-digit id of an alert key (SHA-256 prefix), the same for the firing
    and the resolved notice, as Alertmanager's ``fingerprint`` is for a label set."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def json_payload(alert: Alert) -> dict[str, Any]:
    """tierwatch's own webhook payload (``format = "json"``).

    Shape::

        {"version": 1, "source": "tierwatch",
         "alert": {"id", "key", "kind", "severity", "status", "summary", "labels",
                   "details", "created_at", "starts_at", "ends_at", "last_fired_at",
                   "count"}}

    Times are RFC 3339 UTC strings (``ends_at`` null while firing); ``count`` is how many
    times the notice was raised so far (deduplicated repeats included).
    """
    return {
        "version": 1,
        "alert": {
            "id": alert.id,
            "key": alert.key,
            "kind": alert.kind,
            "severity": alert.severity,
            "status": alert.status,
            "summary": alert.summary,
            "labels": dict(alert.labels),
            "details": dict(alert.details),
            "created_at": rfc3339(alert.created_at),
            "starts_at": rfc3339(alert.starts_at),
            "ends_at": rfc3339(alert.ends_at),
            "last_fired_at": rfc3339(alert.last_fired_at),
            "count": alert.count,
        },
        "source": "tierwatch",
    }


def _alertname(alert: Alert) -> str:
    """Alertmanager's ``alertname``: the alert's own ``alertname`` label, else its kind."""
    return alert.labels.get("alertname") or alert.kind


def _generator_url(alert: Alert, external_url: str) -> str:
    """The node's dashboard page when the alert has a ``node`` label, else the alerts page
    ("" without ``external_url``)."""
    if not external_url:
        return ""
    node = alert.labels.get("node")
    return f"{external_url}/nodes/{quote(node, safe='')}" if node else f"{external_url}/alerts"


def alertmanager_labels(alert: Alert, *, cluster: str = "") -> dict[str, str]:
    """The label set that identifies ``alert``'s key in Alertmanager (pass the firing notice).

    ``alertname`` (see ``_alertname``), ``severity``, ``node`` and ``job`` when the alert has
    them (non-empty), ``cluster`` when set, and ``alertkey`` (the dedup key: one Alertmanager
    alert per tierwatch key). Nothing that changes while a key fires (summary, counts,
    times, actor) is a label, so re-sends and the resolution address the same alert.
    """
    labels = {"alertname": _alertname(alert), "severity": alert.severity}
    for name in ALERTMANAGER_LABELS:
        value = alert.labels.get(name)
        if value:
            labels[name] = value
    if cluster:
        labels["cluster"] = cluster
    labels["alertkey"] = alert.key
    return labels


def alertmanager_api_alert(
    alert: Alert, *, firing: Alert, settings: AlertSettings, now: datetime
) -> dict[str, Any]:
    """One postable alert for Alertmanager's API (``POST /api/v2/alerts`` takes a list).

    Source: Alertmanager docs, "Alerts API" (https://prometheus.io/docs/alerting/latest/
    alerts_api/) and "Sending alerts": ``labels`` identify the alert and deduplicate it,
    ``annotations`` are always the most recent received, ``startsAt`` is when it fired,
    ``endsAt`` when it ends, ``generatorURL`` a back-link; times in RFC 3339.

    Shape::

        {"labels": alertmanager_labels(firing), "annotations": {"summary", "description",
         ...the alert's other labels}, "startsAt", "endsAt", "generatorURL"}

    Args:
        alert: the notice sent.
        firing: the firing notice it belongs to (``service.firing_notice``): its labels
            are the identity, so a resolution ends the very alert that fired.
        now: the send time (timezone-aware UTC).

    ``endsAt``: for a firing notice ``now + 4 × alertmanager_resend_s`` (it is re-sent
    every ``alertmanager_resend_s``, so three sends may fail before Alertmanager resolves it
    by itself; Prometheus's rule), never before ``startsAt``; for a resolved notice its
    ``ends_at``, in the past, which resolves it. Annotation names that are not valid label
    names are left out (Alertmanager refuses them).
    """
    labels = alertmanager_labels(firing, cluster=settings.cluster)
    description = alert.details.get("description")
    annotations = {
        "summary": alert.summary,
        "description": description if isinstance(description, str) else alert.summary,
    }
    for name, value in alert.labels.items():
        valid = LABEL_NAME_RE.match(name) and not name.startswith("__")
        if valid and name not in labels and name not in annotations:
            annotations[name] = value
    if alert.status == "firing":
        ends = now + timedelta(
            seconds=ALERTMANAGER_ENDS_AT_RESENDS * settings.alertmanager_resend_s
        )
        ends_at = max(ends, alert.starts_at)
    else:
        ends_at = alert.ends_at or now
    return {
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(alert.starts_at),
        "endsAt": rfc3339(ends_at),
        "generatorURL": _generator_url(alert, settings.external_url),
    }


def alertmanager_payload(alert: Alert, *, external_url: str = "") -> dict[str, Any]:
    """The Alertmanager webhook receiver payload (``format = "alertmanager"``), one alert
    per notification.

    Source: Prometheus Alertmanager documentation, "Configuration → <webhook_config>"
    (https://prometheus.io/docs/alerting/latest/configuration/#webhook_config), payload
    ``version "4"``: ``version``, ``groupKey``, ``truncatedAlerts``, ``status``,
    ``receiver``, ``groupLabels``, ``commonLabels``, ``commonAnnotations``,
    ``externalURL`` and ``alerts`` (each ``status``, ``labels``, ``annotations``,
    ``startsAt``, ``endsAt``, ``generatorURL``, ``fingerprint``); ``endsAt`` of a firing
    alert is the zero time ``0001-01-01T00:00:00Z``.

    Mapping: labels are ``alertname`` (the kind, unless the alert's labels name one), the
    alert's labels, ``alertkey`` (the dedup key) and ``severity``; annotations are
    ``summary`` and ``description`` (``details["description"]`` when it is a string, else
    the summary). Each notification is a group of one, grouped by ``alertkey``, and
    ``fingerprint`` derives from the key too, so the firing and the resolved notice of a
    condition share ``groupKey`` and ``fingerprint`` even when their severity or other
    labels differ. ``receiver`` is ``tierwatch``. ``generatorURL`` links the node's page
    when the alert has a ``node`` label, else the alerts page (empty without
    ``external_url``).
    """
    labels = {
        "alertname": _alertname(alert),
        **alert.labels,
        "alertkey": alert.key,
        "severity": alert.severity,
    }
    description = alert.details.get("description")
    annotations = {
        "summary": alert.summary,
        "description": description if isinstance(description, str) else alert.summary,
    }
    group = {"alertkey": alert.key}
    group_key = "{}:{alertkey=" + json.dumps(alert.key) + "}"
    generator = _generator_url(alert, external_url)
    return {
        "version": "4",
        "groupKey": group_key,
        "truncatedAlerts": 0,
        "status": alert.status,
        "receiver": "tierwatch",
        "groupLabels": group,
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": external_url,
        "alerts": [
            {
                "status": alert.status,
                "labels": labels,
                "annotations": annotations,
                "startsAt": rfc3339(alert.starts_at),
                "endsAt": rfc3339(alert.ends_at) or ALERTMANAGER_ZERO_TIME,
                "generatorURL": generator,
                "fingerprint": fingerprint(alert.key),
            }
        ],
    }


def build_payload(alert: Alert, settings: AlertSettings) -> dict[str, Any]:
    """The body POSTed for ``alert`` in ``settings.format``."""
    if settings.format == "alertmanager":
        return alertmanager_payload(alert, external_url=settings.external_url)
    return json_payload(alert)


def backoff_s(
    attempts: int,
    settings: AlertSettings,
    *,
    retry_after_s: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait after the ``attempts``-th failed attempt (1-based).

    ``min(backoff_max_s, backoff_s * 2**(attempts-1))`` times a random factor in [0.5, 1]
    ("equal jitter": waits never shrink from one attempt to the next, and receivers that
    failed together do not retry together), and at least ``retry_after_s`` (capped at
    ``backoff_max_s``).
    """
    base = min(settings.backoff_max_s, settings.backoff_s * 2.0 ** max(0, attempts - 1))
    wait = base * (rng or random).uniform(0.5, 1.0)
    if retry_after_s is not None:
        wait = max(wait, min(retry_after_s, settings.backoff_max_s))
    return wait


@dataclass(frozen=True)
class Settlement:
    """What a delivery becomes after an attempt: ``state``, when it is due next (None:
    never), and ``last_error``."""

    state: str
    next_attempt_at: datetime | None
    error: str


def settle(
    *,
    ok: bool,
    error: str,
    permanent: bool,
    attempts: int,
    resend: bool,
    settings: AlertSettings,
    now: datetime,
    retry_after_s: float | None = None,
    rng: random.Random | None = None,
) -> Settlement:
    """The outcome of an attempt as a delivery's next state (pure).

    Args:
        ok: a 2xx answer.
        error: what went wrong ("" when ok).
        permanent: an answer that retrying cannot fix (3xx, most 4xx).
        attempts: attempts made in this send, this one included (1-based).
        resend: the delivery is to an Alertmanager and its notice is the newest of its key
            and fires, so it is pushed again every ``alertmanager_resend_s`` while it holds.

    Returns:
        ok → ``delivered``, due again after ``alertmanager_resend_s`` when ``resend``, else
        never. Permanent → ``failed``, never again. ``max_attempts`` used up → ``failed``, and
        when ``resend`` tried afresh after ``alertmanager_resend_s`` (an Alertmanager that
        was down for long gets the alert back once it is up). Otherwise ``pending`` after
        ``backoff_s``.
    """
    resend_at = now + timedelta(seconds=settings.alertmanager_resend_s) if resend else None
    if ok:
        return Settlement("delivered", resend_at, "")
    if permanent:
        return Settlement("failed", None, f"{error} (permanent: not retried)")
    if attempts >= settings.max_attempts:
        tail = (
            f"; sent again in {settings.alertmanager_resend_s:g} s while it fires" if resend else ""
        )
        return Settlement("failed", resend_at, f"{error} (gave up after {attempts} attempts{tail})")
    wait = backoff_s(attempts, settings, retry_after_s=retry_after_s, rng=rng)
    return Settlement("pending", now + timedelta(seconds=wait), error)


@dataclass(frozen=True)
class _Claim:
    delivery_id: int
    url: str
    payload: Any  # a dict for a webhook, a list of one alert for an Alertmanager


@dataclass(frozen=True)
class _Outcome:
    delivery_id: int
    ok: bool
    status_code: int | None = None
    error: str = ""
    permanent: bool = False
    retry_after_s: float | None = None


def _claim_due(
    factory: sessionmaker[Session], settings: AlertSettings, now: datetime, limit: int
) -> list[_Claim]:
    rounds = math.ceil(limit / settings.concurrency)
    lease_until = now + timedelta(seconds=settings.timeout_s * rounds + LEASE_MARGIN_S)
    claims: list[_Claim] = []
    with session_scope(factory) as session:
        stmt = (
            select(AlertDelivery, Alert)
            .join(Alert, AlertDelivery.alert_id == Alert.id)
            # pending rows, and Alertmanager rows (delivered or failed) with a re-send due
            .where(
                AlertDelivery.state.in_(DELIVERY_STATES),
                AlertDelivery.next_attempt_at <= now,
                or_(
                    AlertDelivery.state == "pending",
                    AlertDelivery.url.like(f"%{ALERTMANAGER_API_PATH}"),
                ),
            )
            .order_by(AlertDelivery.next_attempt_at, AlertDelivery.id)
            .limit(limit)
            .with_for_update(skip_locked=True, of=AlertDelivery)
        )
        for delivery, alert in session.execute(stmt).all():
            if delivery.state != "pending":  # a re-send: a fresh send with its own attempts
                delivery.state = "pending"
                delivery.attempts = 0
            delivery.attempts += 1
            delivery.last_attempt_at = now
            delivery.next_attempt_at = lease_until
            if is_alertmanager_api(delivery.url):
                firing = firing_notice(session, alert)
                payload: Any = [
                    alertmanager_api_alert(alert, firing=firing, settings=settings, now=now)
                ]
            else:
                payload = build_payload(alert, settings)
            claims.append(_Claim(delivery.id, delivery.url, payload))
    return claims


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "").strip()
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # an HTTP date: fall back to the backoff


async def _send(client: httpx.AsyncClient, settings: AlertSettings, claim: _Claim) -> _Outcome:
    headers = {"User-Agent": f"tierwatch/{__version__}"}
    alertmanager = is_alertmanager_api(claim.url)
    token = settings.alertmanager_bearer_token if alertmanager else settings.bearer_token
    if token is not None:
        headers["Authorization"] = f"Bearer {token.get_secret_value()}"
    try:
        response = await client.post(
            claim.url,
            json=claim.payload,
            headers=headers,
            timeout=settings.timeout_s,
            follow_redirects=False,
        )
    except httpx.TimeoutException as exc:
        return _Outcome(
            claim.delivery_id,
            ok=False,
            error=f"timed out after {settings.timeout_s:g} s ({type(exc).__name__})",
        )
    except Exception as exc:  # recorded on the delivery and retried, never dropped
        return _Outcome(claim.delivery_id, ok=False, error=f"{type(exc).__name__}: {exc}")
    code = response.status_code
    if 200 <= code < 300:
        return _Outcome(claim.delivery_id, ok=True, status_code=code)
    body = response.text[:ERROR_BODY_CHARS].strip()
    error = f"HTTP {code} {response.reason_phrase}".strip() + (f": {body}" if body else "")
    if 300 <= code < 400:
        location = response.headers.get("location", "")
        setting = "alertmanager URL" if alertmanager else "webhook URL"
        error = f"HTTP {code} redirect to {location!r}: set the {setting} to the final address"
    permanent = 300 <= code < 500 and code not in RETRYABLE_4XX
    retry_after = _retry_after(response) if code in (429, 503) else None
    return _Outcome(
        claim.delivery_id,
        ok=False,
        status_code=code,
        error=error,
        permanent=permanent,
        retry_after_s=retry_after,
    )


def _record(
    factory: sessionmaker[Session],
    settings: AlertSettings,
    outcomes: list[_Outcome],
    now: datetime,
) -> None:
    with session_scope(factory) as session:
        # In id order, as service._supersede locks: the two never wait on each other in turn.
        for outcome in sorted(outcomes, key=lambda o: o.delivery_id):
            # Locked and read afresh: a newer notice that superseded this delivery while it
            # was in flight (service._supersede) is waited for and seen, not overwritten.
            delivery = session.get(AlertDelivery, outcome.delivery_id, with_for_update=True)
            if delivery is None or delivery.state != "pending" or delivery.next_attempt_at is None:
                continue  # pruned, superseded, or settled by an overlapping round
            alert = delivery.alert
            resend = (
                is_alertmanager_api(delivery.url)
                and alert.status == "firing"
                and is_newest(session, alert)
            )
            result = settle(
                ok=outcome.ok,
                error=outcome.error,
                permanent=outcome.permanent,
                attempts=delivery.attempts,
                resend=resend,
                settings=settings,
                now=now,
                retry_after_s=outcome.retry_after_s,
            )
            delivery.last_status_code = outcome.status_code
            delivery.state = result.state
            delivery.next_attempt_at = result.next_attempt_at
            delivery.last_error = result.error
            if outcome.ok:
                delivery.delivered_at = now
            if not outcome.ok:
                log.warning(
                    "alert delivery %s to %s: %s",
                    delivery.id,
                    redact_url(delivery.url),
                    delivery.last_error,
                )


async def deliver_due(
    factory: sessionmaker[Session],
    settings: AlertSettings,
    client: httpx.AsyncClient,
    *,
    now: datetime,
    limit: int = 100,
) -> int:
    """Send the pending deliveries due at ``now`` (at most ``limit``) and record outcomes.

    Database work runs in worker threads (sessions are synchronous); no transaction is
    open while requests are in flight. Times written derive from ``now`` (timezone-aware
    UTC): ``last_attempt_at``, ``delivered_at`` and ``next_attempt_at``.

    Returns:
        How many deliveries were attempted (0: nothing was due).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database failed (claimed rows are retried after
            their lease).
    """
    claims = await anyio.to_thread.run_sync(_claim_due, factory, settings, now, limit)
    if not claims:
        return 0
    outcomes: list[_Outcome] = []
    limiter = anyio.Semaphore(settings.concurrency)

    async def send_one(claim: _Claim) -> None:
        async with limiter:
            outcomes.append(await _send(client, settings, claim))

    async with anyio.create_task_group() as tg:
        for claim in claims:
            tg.start_soon(send_one, claim)
    await anyio.to_thread.run_sync(_record, factory, settings, outcomes, now)
    return len(claims)

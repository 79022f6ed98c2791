"""Sending the outbox: payloads, backoff, and one delivery round (``deliver_due``).

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
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import quote

import anyio
import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tierwatch import __version__
from tierwatch.server.alerts.models import Alert, AlertDelivery
from tierwatch.server.alerts.service import AlertSettings, redact_url
from tierwatch.server.db import session_scope

log = logging.getLogger("tierwatch.server.alerts")

LEASE_MARGIN_S = 30.0
ERROR_BODY_CHARS = 200
# Alertmanager's "zero time" for endsAt of an alert that is still firing.
ALERTMANAGER_ZERO_TIME = "0001-01-01T00:00:00Z"
RETRYABLE_4XX = frozenset({408, 429})


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
        "alertname": alert.kind,
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
    generator = ""
    if external_url:
        node = alert.labels.get("node")
        generator = (
            f"{external_url}/nodes/{quote(node, safe='')}" if node else f"{external_url}/alerts"
        )
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
class _Claim:
    delivery_id: int
    url: str
    payload: dict[str, Any]


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
            .where(AlertDelivery.state == "pending", AlertDelivery.next_attempt_at <= now)
            .order_by(AlertDelivery.next_attempt_at, AlertDelivery.id)
            .limit(limit)
            .with_for_update(skip_locked=True, of=AlertDelivery)
        )
        for delivery, alert in session.execute(stmt).all():
            delivery.attempts += 1
            delivery.last_attempt_at = now
            delivery.next_attempt_at = lease_until
            claims.append(_Claim(delivery.id, delivery.url, build_payload(alert, settings)))
    return claims


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after", "").strip()
    try:
        return max(0.0, float(value)) if value else None
    except ValueError:
        return None  # an HTTP date: fall back to the backoff


async def _send(client: httpx.AsyncClient, settings: AlertSettings, claim: _Claim) -> _Outcome:
    headers = {"User-Agent": f"tierwatch/{__version__}"}
    if settings.bearer_token is not None:
        headers["Authorization"] = f"Bearer {settings.bearer_token.get_secret_value()}"
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
        error = f"HTTP {code} redirect to {location!r}: set the webhook URL to the final address"
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
        for outcome in outcomes:
            delivery = session.get(AlertDelivery, outcome.delivery_id)
            if delivery is None or delivery.state != "pending":
                continue  # pruned, or settled by an overlapping round
            delivery.last_status_code = outcome.status_code
            if outcome.ok:
                delivery.state = "delivered"
                delivery.delivered_at = now
                delivery.next_attempt_at = None
                delivery.last_error = ""
            elif outcome.permanent:
                delivery.state = "failed"
                delivery.next_attempt_at = None
                delivery.last_error = f"{outcome.error} (permanent: not retried)"
            elif delivery.attempts >= settings.max_attempts:
                delivery.state = "failed"
                delivery.next_attempt_at = None
                delivery.last_error = (
                    f"{outcome.error} (gave up after {delivery.attempts} attempts)"
                )
            else:
                wait = backoff_s(delivery.attempts, settings, retry_after_s=outcome.retry_after_s)
                delivery.next_attempt_at = now + timedelta(seconds=wait)
                delivery.last_error = outcome.error
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

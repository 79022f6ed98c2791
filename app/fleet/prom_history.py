"""Node charts from Prometheus: ``GET /api/v1/nodes/{name}/samples`` answered with
``query_range`` when ``TIERWATCH_PROMETHEUS_URL`` is set (docs/operations.md, "Charts from
Prometheus").

Every agent serves its GPUs on ``/metrics`` in dcgm-exporter's format and the cluster's
Prometheus scrapes it, so the chart history is already there at the scrape interval; the
server's own sample rows come at the agents' lower full-sample rate. This module is the
pure part (PromQL, step, answer mapping) and a small client (:class:`PromHistory`).

- **Which series**: a metric of :data:`~tierwatch.server.fleet.models.METRIC_FIELDS` is
  read from the ``DCGM_FI_*`` family that the agent's exporter fills from that
  :class:`~tierwatch.agent.protocol.GpuSample` field (:data:`DCGM_SERIES`, derived from
  ``agent.exporter.DCGM_FIELDS``; same units: °C, W, %, MiB, counts). ``memory_used_mib``
  is ``DCGM_FI_DEV_FB_USED``, NVML's version-2 "used" where the driver has it (without the
  reserved memory), so it can read a little lower than the database's value.
- **Which node and GPU**: ``{<host label>="<node name>"}`` (``Hostname`` by default, the
  agents' ``--metrics-host-label``) and ``gpu="<index>"``. Label values are written as
  PromQL strings with every quote, backslash and control character escaped
  (:func:`promql_string`): a node name cannot end the selector.
- **Buckets**: as the database's ``step``: the value of bucket ``[b, b + step)`` is the
  average of the readings in it (``avg_over_time`` over ``step`` evaluated at ``b + step``;
  ``max_over_time`` for the 0/1 flags, which come back as booleans), buckets aligned to
  multiples of ``step`` since the Unix epoch, ``ts`` = the bucket start. A bucket without a
  reading has no row (a dead node's series end at its last scrape; Prometheus' staleness
  markers are not readings).
- **Step**: the request's ``step``, or ``ceil(range / 720)`` s without one (a chart's
  720 points), and never finer than ``range / 11,000`` (Prometheus refuses more points per
  series).
- **Several series of one GPU** (a MIG GPU's instances, or two scrape jobs of one node):
  device-wide fields take the largest (MIG repeats the device's value on each instance);
  instance-scoped framebuffer fields the sum over instances of each instance's largest.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import httpx

from tierwatch.agent.exporter import DCGM_FIELDS, DcgmField
from tierwatch.server.fleet.models import BOOL_METRICS, METRIC_FIELDS

if TYPE_CHECKING:
    from tierwatch.server.config import Settings

log = logging.getLogger("tierwatch.server.prometheus")

#: The ``DCGM_FI_*`` family of each GpuSample metric that the agents export.
DCGM_SERIES: Mapping[str, DcgmField] = {f.sample: f for f in DCGM_FIELDS if f.sample is not None}
#: Points of one series when the request gives no ``step`` (as node-charts.js draws).
DEFAULT_POINTS = 720
#: Prometheus refuses a range query with more points per series than this.
MAX_POINTS = 11_000
#: The label that carries the metric's name through the union of the per-metric queries.
METRIC_LABEL = "tierwatch_metric"
#: A warning about an unusable Prometheus is logged at most this often (seconds).
WARN_EVERY_S = 60.0


class PrometheusError(RuntimeError):
    """Prometheus could not answer; the message says what happened (no credentials)."""


def check_metric(metric: str | None) -> None:
    """Refuse a metric name the samples API does not know.

    Raises:
        ValueError: ``metric`` is not one of METRIC_FIELDS (the message lists them).
    """
    if metric is not None and metric not in METRIC_FIELDS:
        raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRIC_FIELDS)}")


def promql_string(value: str) -> str:
    """``value`` as a double-quoted PromQL string literal.

    Backslash and double quote are escaped, and every control character (newline, tab,
    DEL…) is written as a ``\\x`` escape, so any text stays one string: a node name such as
    ``a"} or up{x="`` matches a host label of exactly that value and nothing else.
    """
    out = ['"']
    for ch in value:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def duration(seconds: float) -> str:
    """A PromQL duration of ``seconds`` in whole milliseconds, e.g. ``2500ms``."""
    return f"{max(1, round(seconds * 1000))}ms"


def choose_step(span_s: float, step_s: float | None) -> float:
    """The bucket width (s) of a range query over ``span_s`` seconds.

    Args:
        span_s: ``until - since`` in seconds (≥ 0).
        step_s: The requested bucket width in seconds, or None.

    Returns:
        ``step_s`` (or ``ceil(span_s / DEFAULT_POINTS)`` without it, at least 1 s), raised
        to ``ceil(span_s / MAX_POINTS)`` when it would give more points than Prometheus
        answers.
    """
    if step_s is None:
        step_s = float(max(1, math.ceil(span_s / DEFAULT_POINTS)))
    return max(step_s, float(math.ceil(span_s / MAX_POINTS)))


@dataclass(frozen=True)
class RangeQuery:
    """One ``/api/v1/query_range`` request.

    Attributes:
        expr: The PromQL expression.
        start, end: The first and last evaluation time (Unix seconds).
        step: Seconds between evaluations (the bucket width).
        fields: The metrics each answer row carries, in order.
    """

    expr: str
    start: float
    end: float
    step: float
    fields: tuple[str, ...]

    def params(self, timeout_s: float) -> dict[str, str]:
        """The form parameters of the request (Prometheus stops the query at ``timeout_s``)."""
        return {
            "query": self.expr,
            "start": f"{self.start:.3f}",
            "end": f"{self.end:.3f}",
            "step": f"{self.step:g}",
            "timeout": duration(timeout_s),
        }


def series_expr(
    spec: DcgmField, field: str, *, node: str, gpu: int | None, host_label: str, step: float
) -> str:
    """PromQL for one metric of one node: per GPU, each bucket's average (largest for a
    flag), labelled ``tierwatch_metric="<field>"`` (see the module docs)."""
    matchers = [f"{host_label}={promql_string(node)}"]
    if gpu is not None:
        matchers.append(f"gpu={promql_string(str(gpu))}")
    over = "max_over_time" if field in BOOL_METRICS else "avg_over_time"
    inner = f"{over}({spec.name}{{{', '.join(matchers)}}}[{duration(step)}])"
    if spec.per_instance:
        per_gpu = f"sum by (gpu) (max by (gpu, GPU_I_ID) ({inner}))"
    else:
        per_gpu = f"max by (gpu) ({inner})"
    return f'label_replace({per_gpu}, "{METRIC_LABEL}", "{field}", "", "")'


def build_query(
    *,
    node: str,
    gpu: int | None,
    metric: str | None,
    since: datetime,
    until: datetime,
    step_s: float | None,
    host_label: str,
    series: Mapping[str, DcgmField] | None = None,
) -> RangeQuery:
    """The range query behind one samples request.

    Args:
        node: The node's name (the host label's value).
        gpu: One GPU's index, or None for all.
        metric: One metric, or None for every metric of METRIC_FIELDS.
        since, until: The range (aware datetimes; ``since <= until``).
        step_s: The bucket width in seconds (None: derived, :func:`choose_step`).
        host_label: The label that holds the node's name.
        series: The DCGM family of each metric (default :data:`DCGM_SERIES`).

    Returns:
        The query; its ``fields`` are ``[metric]`` or every metric, and those without a
        family in ``series`` are left out of ``expr`` (their values stay None).

    Raises:
        ValueError: no requested metric has a family in ``series``.
    """
    series = DCGM_SERIES if series is None else series
    fields = (metric,) if metric is not None else METRIC_FIELDS
    step = choose_step((until - since).total_seconds(), step_s)
    parts = [
        series_expr(series[f], f, node=node, gpu=gpu, host_label=host_label, step=step)
        for f in fields
        if f in series
    ]
    if not parts:
        raise ValueError(f"no DCGM series for {', '.join(fields)}")
    first = math.floor(since.timestamp() / step) * step
    last = math.floor(until.timestamp() / step) * step
    return RangeQuery(
        expr=" or ".join(parts), start=first + step, end=last + step, step=step, fields=fields
    )


def _number(raw: Any) -> float | None:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def map_matrix(body: Any, query: RangeQuery, *, limit: int) -> list[dict[str, Any]]:
    """Rows of the samples API from a ``query_range`` answer.

    Args:
        body: The decoded JSON answer.
        query: The query it answers.
        limit: At most this many rows (the newest ones).

    Returns:
        ``[{"gpu": int, "ts": datetime (bucket start, UTC), <field>: float | bool | None,
        …}]`` oldest first, then by GPU; every row has every field of ``query.fields``.
        Series without an integer ``gpu`` label are left out.

    Raises:
        PrometheusError: the answer is an error or not a matrix.
    """
    if not isinstance(body, dict) or body.get("status") != "success":
        kind = body.get("errorType", "error") if isinstance(body, dict) else "error"
        what = body.get("error", "no reason given") if isinstance(body, dict) else repr(body)
        raise PrometheusError(f"Prometheus refused the query ({kind}): {what}")
    data = body.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "matrix":
        raise PrometheusError("Prometheus answered something other than a range (matrix)")
    try:
        return _rows(data.get("result") or [], query, limit)
    except (AttributeError, TypeError, ValueError, OverflowError, OSError) as exc:
        raise PrometheusError(
            f"Prometheus answered a range of an unexpected shape: {exc}"
        ) from None


def _rows(result: list[Any], query: RangeQuery, limit: int) -> list[dict[str, Any]]:
    rows: dict[tuple[float, int], dict[str, Any]] = {}
    for series in result:
        labels = series.get("metric") or {}
        field = labels.get(METRIC_LABEL)
        gpu = str(labels.get("gpu", ""))
        if field not in query.fields or not (gpu.isascii() and gpu.isdigit()):
            continue
        for t, raw in series.get("values") or []:
            value = _number(raw)
            start = round(float(t) - query.step, 3)
            row = rows.get((start, int(gpu)))
            if row is None:
                row = {"gpu": int(gpu), "ts": start, **dict.fromkeys(query.fields)}
                rows[(start, int(gpu))] = row
            if value is not None:
                row[field] = value > 0 if field in BOOL_METRICS else value
    ordered = [rows[k] for k in sorted(rows)][-limit:] if limit > 0 else []
    for row in ordered:
        row["ts"] = datetime.fromtimestamp(row["ts"], UTC)
    return ordered


# user[:password]@ right after an optional scheme, also in a URL that lacks its "//"
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*:/*)?[^/@]*@")


def redact(url: str) -> str:
    """``url`` without a user name or password (for logs and messages); a URL that does not
    parse (a bad port, no ``//``) loses everything before its ``@``. Never raises."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return _USERINFO.sub(lambda m: m.group(1) or "", url)
    if not parts.netloc:
        return _USERINFO.sub(lambda m: m.group(1) or "", url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass(frozen=True)
class History:
    """What Prometheus answered for one samples request.

    Attributes:
        samples: The rows (:func:`map_matrix`).
        step: The bucket width used (seconds).
        note: Why there are no rows, when there are none (else None).
    """

    samples: list[dict[str, Any]]
    step: float
    note: str | None = None


class PromHistory:
    """A Prometheus that the node charts read from (thread-safe; one per app).

    A failure that says Prometheus is unreachable, slow or broken (no connection, no answer
    within ``timeout_s``, HTTP 5xx) makes the next ``retry_s`` seconds' requests fail at once
    with the same reason, so a dead Prometheus costs the node page one timeout per
    ``retry_s``, not one per chart refresh; a refusal of one query (HTTP 4xx, a PromQL
    error) does not. Failures are logged as a warning at most every :data:`WARN_EVERY_S`
    seconds, and the first success after them at info.

    Args:
        url: Prometheus' base URL (``http://prometheus:9090``, or with a path prefix); a
            ``user:password@`` in it is sent as basic auth and never logged.
        host_label: The label that holds the node's name.
        timeout_s: Seconds to wait for an answer (connect and read).
        retry_s: Seconds not to try again after Prometheus was unreachable (0: always try).
        transport: httpx transport (tests); default: a real connection pool.
        clock: ``time.monotonic`` (tests pass their own).
    """

    def __init__(
        self,
        url: str,
        *,
        host_label: str = "Hostname",
        timeout_s: float = 5.0,
        retry_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url.rstrip("/")
        self.host_label = host_label
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._clock = clock
        self._transport = transport
        self._client = self._new_client()
        self._lock = threading.Lock()
        self._down_until = -math.inf
        self._down_reason = ""
        self._failing = False
        self._warned_at = -math.inf

    def samples(
        self,
        *,
        node: str,
        gpu: int | None,
        metric: str | None,
        since: datetime,
        until: datetime,
        limit: int,
        step_s: float | None,
    ) -> History:
        """A node's history from Prometheus (arguments as ``GET …/samples``).

        Raises:
            PrometheusError: Prometheus is unreachable, slow or answered an error (or did so
                less than ``retry_s`` ago); the message says which.
            ValueError: no requested metric has a DCGM series (see :func:`covers`).
        """
        query = build_query(
            node=node,
            gpu=gpu,
            metric=metric,
            since=since,
            until=until,
            step_s=step_s,
            host_label=self.host_label,
        )
        with self._lock:
            wait = self._down_until - self._clock()
            if wait > 0:
                raise PrometheusError(f"{self._down_reason} (next try in {math.ceil(wait)} s)")
        try:
            rows = map_matrix(self._post(query), query, limit=limit)
        except _Unreachable as exc:
            self._failed(str(exc), back_off=True)
            raise PrometheusError(str(exc)) from None
        except PrometheusError as exc:
            self._failed(str(exc), back_off=False)
            raise
        self._recovered()
        note = None
        if not rows:
            note = (
                f"Prometheus has no series with {self.host_label}={promql_string(node)} in "
                "this range"
            )
        return History(samples=rows, step=query.step, note=note)

    def _new_client(self) -> httpx.Client:
        return httpx.Client(timeout=self.timeout_s, transport=self._transport)

    def _post(self, query: RangeQuery) -> Any:
        with self._lock:
            if self._client.is_closed:  # the app ran its lifespan again
                self._client = self._new_client()
            client = self._client
        late = _Unreachable(f"Prometheus did not answer within {self.timeout_s:g} s")
        # httpx's timeout bounds each read; the deadline bounds the whole answer, so a
        # Prometheus that trickles bytes holds a request for at most about 2 × timeout_s
        deadline = time.monotonic() + self.timeout_s
        try:
            with client.stream(
                "POST", f"{self.url}/api/v1/query_range", data=query.params(self.timeout_s)
            ) as streamed:
                chunks = []
                for chunk in streamed.iter_bytes():
                    chunks.append(chunk)
                    if time.monotonic() > deadline:
                        raise late
            # iter_bytes decoded the body already: keep no Content-Encoding to undo again
            resp = httpx.Response(
                streamed.status_code,
                headers={"Content-Type": streamed.headers.get("Content-Type", "")},
                content=b"".join(chunks),
            )
        except httpx.TimeoutException:
            raise late from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise _Unreachable(f"cannot reach Prometheus: {exc}") from None
        if resp.status_code >= 500:
            raise _Unreachable(f"Prometheus answered HTTP {resp.status_code}: {_reason(resp)}")
        try:
            body = resp.json()
        except ValueError:
            body = None
        refused = isinstance(body, dict) and body.get("status") == "error"
        if resp.status_code != 200 and not refused:
            raise PrometheusError(f"Prometheus answered HTTP {resp.status_code}: {_reason(resp)}")
        if body is None:
            raise PrometheusError(f"Prometheus answered with no JSON: {_reason(resp)}")
        return body

    def _failed(self, reason: str, *, back_off: bool) -> None:
        now = self._clock()
        with self._lock:
            if back_off and self.retry_s > 0:
                self._down_until = now + self.retry_s
                self._down_reason = reason
            self._failing = True
            warn = now - self._warned_at >= WARN_EVERY_S
            if warn:
                self._warned_at = now
        if warn:
            log.warning(
                "node charts read from tierwatch's database: Prometheus at %s: %s "
                "(this warning repeats at most every %g s)",
                redact(self.url),
                reason,
                WARN_EVERY_S,
            )

    def _recovered(self) -> None:
        with self._lock:
            was_failing, self._failing = self._failing, False
            self._down_until = -math.inf
            self._warned_at = -math.inf
        if was_failing:
            log.info("node charts read from Prometheus at %s again", redact(self.url))

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()


class _Unreachable(Exception):
    """Prometheus is unreachable, slow or broken (the caller backs off)."""


def _reason(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:200] or "no body"
    if isinstance(body, dict) and body.get("error"):
        return str(body["error"])[:200]
    return resp.text.strip()[:200]


def covers(metric: str | None, series: Mapping[str, Any] | None = None) -> bool:
    """Whether Prometheus can answer a samples request for ``metric``: it has a DCGM series
    in ``series`` (default :data:`DCGM_SERIES`; None, every metric: at least one has)."""
    series = DCGM_SERIES if series is None else series
    if metric is None:
        return any(f in series for f in METRIC_FIELDS)
    return metric in series


def from_settings(settings: Settings) -> PromHistory | None:
    """The app's :class:`PromHistory`, or None when ``TIERWATCH_PROMETHEUS_URL`` is empty
    (the charts read from the database)."""
    if not settings.prometheus_url:
        return None
    return PromHistory(
        settings.prometheus_url,
        host_label=settings.prometheus_host_label,
        timeout_s=settings.prometheus_timeout_s,
        retry_s=settings.prometheus_retry_s,
    )

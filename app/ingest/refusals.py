"""Recording report items the server refused (``checkpoints.scoping``).

A refused item is dropped and its batch acked (an agent would otherwise retry it for ever),
so the refusal must be visible elsewhere:

- ``tierwatch_ingest_refused_total{reason, item}`` on ``/metrics``: a counter per server
  process (:class:`RefusalLog`, a prometheus-client custom collector; sum over replicas);
- a WARNING log line per (node, job, reason), at most one per ``log_every_s`` (default
  60 s), naming node, job, ranks and reason and counting the ones not logged since;
- an agent event on the reporting node (the dashboard's node page lists it under "Agent
  events", ``GET /api/v1/events?kind=agent`` too), at most one per (node, reason) per
  :data:`EVENT_WINDOW_S`, written in the report's own transaction
  (:func:`store_refusal_events`). The limit is read from the events table, so it holds
  across server replicas.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timedelta
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from tierwatch.server.checkpoints.scoping import ITEMS, REASONS, Refusal
from tierwatch.server.fleet.models import Event

log = logging.getLogger("tierwatch.server.ingest")

EVENT_KIND = "agent"
#: ``data.agent_kind`` of the server's refusal events (and ``data.source`` "server").
EVENT_AGENT_KIND = "ingest_refused"
#: At most one refusal event per (node, reason) within this window (seconds).
EVENT_WINDOW_S = 300.0
JOBS_SHOWN = 10
RANKS_SHOWN = 16
_MAX_LOG_KEYS = 10_000


def _ranks(refusals: list[Refusal]) -> str:
    ranks = sorted({r.rank for r in refusals if r.rank is not None})
    if not ranks:
        return "-"
    text = ",".join(str(r) for r in ranks[:RANKS_SHOWN])
    return text + (f" (+{len(ranks) - RANKS_SHOWN})" if len(ranks) > RANKS_SHOWN else "")


class RefusalLog(Collector):
    """Counts refused report items for ``/metrics`` and logs them, rate-limited.

    Thread-safe (the ingest writer records from its worker thread while a scrape reads).

    Args:
        log_every_s: at most one WARNING per (node, job, reason) within this time (seconds).
        clock: monotonic clock (seconds), for tests.
    """

    def __init__(
        self, log_every_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.log_every_s = log_every_s
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._logged_at: dict[tuple[str, str, str], float] = {}
        self._unlogged: Counter[tuple[str, str, str]] = Counter()

    def record(self, refusals: Iterable[Refusal]) -> None:
        """Count refusals and log them (one line per node, job and reason)."""
        groups: dict[tuple[str, str, str], list[Refusal]] = defaultdict(list)
        for r in refusals:
            groups[(r.node, r.job_id, r.reason)].append(r)
        now = self._clock()
        lines = []
        with self._lock:
            for key, items in groups.items():
                for r in items:
                    self._counts[(r.reason, r.item)] += 1
                last = self._logged_at.get(key)
                if last is not None and now - last < self.log_every_s:
                    self._unlogged[key] += len(items)
                    continue
                if len(self._logged_at) >= _MAX_LOG_KEYS:
                    self._logged_at.clear()
                self._logged_at[key] = now
                lines.append((key, items, self._unlogged.pop(key, 0)))
        for (node, job_id, reason), items, unlogged in lines:
            kinds = Counter(r.item for r in items)
            log.warning(
                "refused %s from node %s for job %s, ranks %s (%s): %s%s",
                ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
                node,
                job_id,
                _ranks(items),
                reason,
                items[0].message,
                f" [{unlogged} more refused since the last line]" if unlogged else "",
            )

    def count(self, reason: str, item: str) -> int:
        """Refusals counted so far for ``reason`` and ``item``."""
        with self._lock:
            return self._counts[(reason, item)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        """``tierwatch_ingest_refused_total{reason, item}``, every pair listed (0 included)."""
        family = CounterMetricFamily(
            "tierwatch_ingest_refused",
            "Report items refused because the reporting node may not report them for their "
            "job (not registered there, another node's rank, another layout or world size).",
            labels=["reason", "item"],
        )
        with self._lock:
            counts = dict(self._counts)
        for reason in REASONS:
            for item in ITEMS:
                family.add_metric([reason, item], float(counts.get((reason, item), 0)))
        yield family


#: The log ``ingest_reports`` uses when it is given none (outside an app).
DEFAULT_REFUSAL_LOG = RefusalLog()


def store_refusal_events(
    session: Session, refusals: list[Refusal], *, node_ids: dict[str, int], now: datetime
) -> int:
    """Add an agent event per (node, reason) with refusals, unless one was added within
    :data:`EVENT_WINDOW_S` (the caller commits).

    Returns:
        Events added.
    """
    groups: dict[tuple[int, str], list[Refusal]] = defaultdict(list)
    for r in refusals:
        groups[(node_ids[r.node], r.reason)].append(r)
    recent = session.execute(
        select(Event.node_id, Event.data).where(
            Event.kind == EVENT_KIND,
            Event.node_id.in_(sorted({n for n, _ in groups})),
            Event.ts >= now - timedelta(seconds=EVENT_WINDOW_S),
        )
    ).all()
    done = {
        (node_id, data.get("reason"))
        for node_id, data in recent
        if isinstance(data, dict) and data.get("agent_kind") == EVENT_AGENT_KIND
    }
    rows: list[dict[str, Any]] = []
    for (node_id, reason), items in groups.items():
        if (node_id, reason) in done:
            continue
        jobs = sorted({r.job_id for r in items})
        kinds = Counter(r.item for r in items)
        shown = ", ".join(jobs[:JOBS_SHOWN]) + (
            f" and {len(jobs) - JOBS_SHOWN} more" if len(jobs) > JOBS_SHOWN else ""
        )
        rows.append(
            {
                "node_id": node_id,
                "kind": EVENT_KIND,
                "gpu_index": None,
                "code": None,
                "ts": now,
                "received_at": now,
                "severity": "warning",
                "message": f"server refused {len(items)} report item(s) for job(s) {shown} "
                f"({reason}): {items[0].message}"[:2000],
                "data": {
                    "agent_kind": EVENT_AGENT_KIND,
                    "source": "server",
                    "reason": reason,
                    "jobs": jobs[:JOBS_SHOWN],
                    "items": dict(kinds),
                    "ranks": sorted({r.rank for r in items if r.rank is not None})[:RANKS_SHOWN],
                    "window_s": EVENT_WINDOW_S,
                },
            }
        )
    if rows:
        session.execute(insert(Event.__table__), rows)
    return len(rows)

"""Group commit for agent reports.

Every report request hands its validated batch to the :class:`IngestWriter` and waits for
its ack. The writer takes whatever has queued up (at most ``max_group`` reports, waiting at
most ``max_delay_s`` after the first one) and stores the whole group in one transaction on a
worker thread, while the event loop keeps accepting requests for the next group. An agent
gets its ack only after the transaction that stored its batch has committed, so an ack still
means "stored".

If a group fails, each of its reports is retried alone, so one report the database refuses
fails only its own request and never stalls the other nodes.

Back-pressure: the writer holds at most ``max_queue`` reports (waiting or being stored). One
more is shed at once with :class:`IngestBusy`, which the route answers with 503 and a
``Retry-After`` of the time the backlog needs to drain (:func:`retry_after_s`). Shedding at
the door keeps an overloaded replica's latency bounded: without it every report waits behind
the whole backlog, the agents time out, retry, and add to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from anyio import to_thread
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker

from tierwatch.agent.protocol import ReportAck, ReportBatch, utcnow
from tierwatch.server.config import Settings
from tierwatch.server.fleet.ingest import ingest_reports
from tierwatch.server.ingest.refusals import RefusalLog

log = logging.getLogger("tierwatch.server.ingest")


#: Bounds of the ``Retry-After`` a shed report gets (seconds).
RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 30


class IngestUnavailable(RuntimeError):
    """The writer is stopped or could not store the report; the agent should retry.

    Attributes:
        retry_after_s: whole seconds the agent should wait before it sends again.
    """

    def __init__(self, message: str, retry_after_s: int = RETRY_AFTER_MIN_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class IngestBusy(IngestUnavailable):
    """The writer's queue is full: the report was shed, not stored (503, ``Retry-After``)."""


def retry_after_s(backlog: int, store_s_per_report: float) -> int:
    """Seconds until a backlog of reports has been stored, as a ``Retry-After`` value.

    Args:
        backlog: reports waiting or being stored.
        store_s_per_report: recent storing time per report (seconds; the writer's moving
            average over its groups).

    Returns:
        ``ceil(backlog × store_s_per_report)``, clamped to [RETRY_AFTER_MIN_S,
        RETRY_AFTER_MAX_S]; HTTP's ``Retry-After`` takes whole seconds (RFC 9110, 10.2.3).
    """
    wait = math.ceil(max(0, backlog) * max(0.0, store_s_per_report))
    return max(RETRY_AFTER_MIN_S, min(RETRY_AFTER_MAX_S, wait))


@dataclass
class _Pending:
    batch: ReportBatch
    future: asyncio.Future[ReportAck] = field(repr=False)
    queued_at: float = field(default_factory=time.monotonic)


class IngestWriter:
    """Collects concurrent reports into groups and stores each group in one transaction.

    Args:
        factory: session factory of the app's database.
        settings: server settings.
        max_group: most reports stored in one transaction.
        max_delay_s: longest a report waits for others to join its group (seconds).
        refusals: counts the report items refused for their job (``checkpoints.scoping``);
            default: a log of its own (:attr:`refusals`, a collector for ``/metrics``).
        max_queue: most reports held (waiting or being stored); more are shed with
            :class:`IngestBusy`. Default: ``settings.ingest_max_queue``.
    """

    def __init__(
        self,
        factory: sessionmaker[Session],
        settings: Settings,
        *,
        max_group: int = 256,
        max_delay_s: float = 0.01,
        refusals: RefusalLog | None = None,
        max_queue: int | None = None,
    ) -> None:
        self._factory = factory
        self.refusals = refusals if refusals is not None else RefusalLog()
        self._settings = settings
        self._max_group = max_group
        self._max_delay_s = max_delay_s
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.groups_written = 0
        self.reports_written = 0
        self._waiting: dict[int, float] = {}  # id(pending) -> queued_at, until answered
        self.max_queue = max_queue if max_queue is not None else settings.ingest_max_queue
        self.shed = 0  # reports refused with IngestBusy since start
        # moving average of storing time per report (s); starts at 10 ms, a cold guess
        self._store_s_per_report = 0.01

    async def start(self) -> None:
        """Start the writer loop on the running event loop."""
        self._task = asyncio.create_task(self._run(), name="tierwatch-ingest-writer")

    async def stop(self) -> None:
        """Store what is queued, then stop; later submissions are refused."""
        task, self._task = self._task, None
        if task is None:
            return
        await self._queue.put(_Pending(None, None))  # type: ignore[arg-type]  # sentinel
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def submit(self, batch: ReportBatch) -> ReportAck:
        """Queue one report and wait until it is stored.

        Raises:
            IngestBusy: ``max_queue`` reports are held already; nothing was stored.
            IngestUnavailable: the writer is not running, or storing this report failed.
        """
        if self._task is None or self._task.done():
            raise IngestUnavailable("the server is shutting down; retry shortly")
        backlog = len(self._waiting)
        if backlog >= self.max_queue:
            self.shed += 1
            wait = retry_after_s(backlog, self._store_s_per_report)
            raise IngestBusy(
                f"the server holds {backlog} reports (its limit, TIERWATCH_INGEST_MAX_QUEUE, "
                f"is {self.max_queue}); this one was not stored: send it again in {wait} s",
                retry_after_s=wait,
            )
        future: asyncio.Future[ReportAck] = asyncio.get_running_loop().create_future()
        pending = _Pending(batch, future)
        self._waiting[id(pending)] = pending.queued_at
        try:
            await self._queue.put(pending)
            return await future
        finally:
            self._waiting.pop(id(pending), None)

    def lag(self) -> tuple[float, int]:
        """(age in s of the oldest report submitted and not yet answered, reports waiting).

        Safe to call from any thread (the policy's guard reads it: a stalled database shows
        here first, as reports that wait).
        """
        waiting = list(self._waiting.values())
        if not waiting:
            return 0.0, 0
        return max(0.0, time.monotonic() - min(waiting)), len(waiting)

    async def _run(self) -> None:
        carry: list[_Pending] = []
        stopping = False
        while not stopping or carry:
            group, carry, stopping = await self._collect(carry, stopping)
            if group:
                await self._write(group)

    async def _collect(
        self, carry: list[_Pending], stopping: bool
    ) -> tuple[list[_Pending], list[_Pending], bool]:
        """The next group: reports carried over first, one per node, up to ``max_group``."""
        group: list[_Pending] = []
        nodes: set[str] = set()
        later: list[_Pending] = []

        def take(item: _Pending) -> None:
            if item.batch.node in nodes or len(group) >= self._max_group:
                later.append(item)  # a node's second report waits for the next group
            else:
                nodes.add(item.batch.node)
                group.append(item)

        for item in carry:
            take(item)
        if not group and not stopping:
            item = await self._queue.get()
            if item.batch is None:
                return [], [], True
            take(item)
        deadline = asyncio.get_running_loop().time() + self._max_delay_s
        while len(group) < self._max_group and not stopping:
            timeout = deadline - asyncio.get_running_loop().time()
            try:
                item = (
                    self._queue.get_nowait()
                    if timeout <= 0
                    else await asyncio.wait_for(self._queue.get(), timeout)
                )
            except (TimeoutError, asyncio.QueueEmpty):
                break
            if item.batch is None:
                stopping = True
                break
            take(item)
        return group, later, stopping

    async def _write(self, group: list[_Pending]) -> None:
        started = time.monotonic()
        try:
            acks = await to_thread.run_sync(self._store, [p.batch for p in group])
        except Exception:
            log.exception("storing a group of %d reports failed; retrying one by one", len(group))
            for p in group:
                try:
                    [ack] = await to_thread.run_sync(self._store, [p.batch])
                except Exception as exc:  # this report alone fails; the others go on
                    log.exception("storing the report of %s failed", p.batch.node)
                    _resolve(
                        p.future,
                        exc=IngestUnavailable(
                            f"could not store this report ({type(exc).__name__}); "
                            "the details are in the server log"
                        ),
                    )
                else:
                    _resolve(p.future, ack=ack)
            return
        self.groups_written += 1
        self.reports_written += len(group)
        per_report = (time.monotonic() - started) / len(group)
        self._store_s_per_report += 0.2 * (per_report - self._store_s_per_report)
        for p, ack in zip(group, acks, strict=True):
            _resolve(p.future, ack=ack)

    def _store(self, batches: list[ReportBatch]) -> list[ReportAck]:
        with self._factory() as session:
            return ingest_reports(
                session,
                batches=batches,
                settings=self._settings,
                now=utcnow(),
                refusal_log=self.refusals,
            )


class WriterMetrics(Collector):
    """This replica's ingest back-pressure on ``/metrics``.

    Families: ``tierwatch_ingest_queue_reports`` (reports held now: waiting or being stored),
    ``tierwatch_ingest_queue_limit`` (``TIERWATCH_INGEST_MAX_QUEUE``) and
    ``tierwatch_ingest_shed_total`` (reports answered 503 because the queue was full, since
    this process started). Per replica: Prometheus sums them over its targets.
    """

    def __init__(self, writer: IngestWriter) -> None:
        self._writer = writer

    def collect(self) -> Iterator[Metric]:
        w = self._writer
        yield GaugeMetricFamily(
            "tierwatch_ingest_queue_reports",
            "Agent reports this replica holds (waiting or being stored).",
            value=float(w.lag()[1]),
        )
        yield GaugeMetricFamily(
            "tierwatch_ingest_queue_limit",
            "Most agent reports this replica holds before it sheds more with 503.",
            value=float(w.max_queue),
        )
        yield CounterMetricFamily(
            "tierwatch_ingest_shed",
            "Agent reports shed with 503 because the ingest queue was full.",
            value=float(w.shed),
        )


def _resolve(
    future: asyncio.Future[Any], *, ack: ReportAck | None = None, exc: Exception | None = None
) -> None:
    if future.done():  # the request was cancelled (client went away)
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(ack)

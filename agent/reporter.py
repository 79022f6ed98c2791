"""Batching, sequence numbers, the on-disk spool and delivery to the control plane.

Every batch goes through the spool (write-ahead): :meth:`Reporter.report` assigns the next
sequence number, writes the batch as one JSON file into the spool folder (``.tmp`` file,
fsync, rename) and wakes the sender thread, which deletes the file once the server has
acknowledged it.

Sending order (:func:`tierwatch.agent.sendorder.next_to_send`, where the reasons are): while
the link is up the spool holds one batch and there is no order to choose. After an outage,
or while the server is slower than the report interval, the **newest** batch goes first
(just after the newest batch with samples when the newest is a heartbeat), so the server
shows the node as it is now within one report interval; the rest is backfilled behind it,
urgent batches (XIDs, command results) first, each oldest first, and a batch spooled during
the backfill jumps the queue again. The order is chosen afresh at every attempt, so a retry
after a failure sends whatever is newest then. Batches of earlier agent runs found in the
spool at start keep their own epoch and seq and are backfill: this run's batches go ahead of
them. The server takes any order (idempotent on node, epoch and seq; ``acked_seq`` is the
highest seq it holds; older samples are stored, not evaluated).

Delivery: ``POST {server}/api/v1/ingest/report`` with ``Authorization: Bearer <token>`` and
the batch JSON; the answer is a :class:`~tierwatch.agent.protocol.ReportAck` (any ``commands``
in it go to the ``on_commands`` callback; the agent runtime hands them to its command
executor).

- Transient failures (connection errors, timeouts, HTTP 5xx, HTTP 429) are retried with
  exponential backoff and jitter (tenacity), honouring ``Retry-After``; the backoff grows
  across attempts until one succeeds, whichever batch each attempt sends, and the sleep is
  cut short by :meth:`Reporter.push_now` and by shutdown.
- Permanent failures (any other 4xx such as 401, 403, 422, or a redirect) are logged at ERROR
  with the server's message, the batch file moves to ``<spool>/rejected/`` (bounded like the
  spool) and an ``report_rejected`` event goes out with the next batch; the sender moves on.
- A full spool (``max_batches`` files) drops its oldest batch (never the one in flight) for
  each new one, and counts them. ``dropped_batches`` in every batch is the number of batches
  dropped **since this agent started** (cumulative per epoch, so a lost batch cannot lose the
  count); each drop also becomes a ``spool_full`` event.

Files are named ``<ordinal:016d>.<epoch>.<seq:010d>.json``: the ordinal grows across agent
restarts (it continues from the highest one found), so names sort by age, and within one
epoch they sort by seq. Whether a batch carries samples or is urgent is kept in memory only:
a batch found at start counts as carrying samples and not urgent (it is backfill anyway).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import ValidationError
from tenacity import RetryCallState, Retrying, retry_if_exception_type, wait_exponential_jitter

from tierwatch import __version__
from tierwatch.agent.fsutil import atomic_write_bytes
from tierwatch.agent.httputil import error_detail
from tierwatch.agent.protocol import (
    AgentEvent,
    CheckpointEvent,
    Command,
    CommandResult,
    GpuInfo,
    GpuSample,
    JobProgress,
    LatencySample,
    ReportAck,
    ReportBatch,
    RestoreReport,
    XidEvent,
    utcnow,
)
from tierwatch.agent.sendorder import next_to_send
from tierwatch.agent.urlsafe import redact_url

log = logging.getLogger(__name__)

INGEST_PATH = "/api/v1/ingest/report"
MAX_EVENTS_PER_BATCH = 1024
REJECTED_DIR = "rejected"
DETAIL_LIMIT = 300  # characters of a refusal's detail kept in last_error

CommandCallback = Callable[[list[Command]], None]


# ----------------------------------------------------------------------------------------
# Spool
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpoolItem:
    """One spooled batch file.

    Attributes:
        path: The JSON file.
        ordinal: Position in age order (grows across agent runs).
        epoch: The batch's agent epoch.
        seq: The batch's sequence number.
        has_samples: Whether it carries GPU samples (False: a heartbeat); True when unknown
            (a file found at start).
        urgent: Whether it was pushed at once (XIDs, command results); False when unknown.
    """

    path: Path
    ordinal: int
    epoch: str
    seq: int
    has_samples: bool = True
    urgent: bool = False

    @classmethod
    def from_path(cls, path: Path) -> SpoolItem | None:
        """Parse a spool file name; None when the name is not a spool file."""
        parts = path.name.split(".")
        if (
            len(parts) != 4
            or parts[3] != "json"
            or not parts[0].isdigit()
            or not parts[2].isdigit()
        ):
            return None
        return cls(path=path, ordinal=int(parts[0]), epoch=parts[1], seq=int(parts[2]))


class Spool:
    """A bounded store of batch files in one folder, in age order (thread-safe).

    Which one is sent next is the sender's choice (:mod:`tierwatch.agent.sendorder`); the
    spool only keeps them, and drops the oldest when full.

    Args:
        directory: The spool folder (created if missing).
        max_batches: Most files kept; :meth:`put` drops the oldest beyond that.

    Raises:
        OSError: the folder cannot be created or listed.
    """

    def __init__(self, directory: Path, max_batches: int) -> None:
        if max_batches < 1:
            raise ValueError("max_batches must be >= 1")
        self.directory = Path(directory)
        self.rejected_dir = self.directory / REJECTED_DIR
        self.max_batches = max_batches
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        items = []
        for path in self.directory.iterdir():
            if path.name.startswith(".tmp-"):
                path.unlink(missing_ok=True)  # a write interrupted by a crash
                continue
            item = SpoolItem.from_path(path)
            if item is not None:
                items.append(item)
            elif path.is_file():
                log.warning("ignoring unexpected file in spool: %s", path)
        items.sort(key=lambda i: i.ordinal)
        self._items: deque[SpoolItem] = deque(items)
        self._next_ordinal = items[-1].ordinal + 1 if items else 1
        self._in_flight: Path | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def make_room(self) -> int:
        """Drop the oldest batches (never the one in flight) so one more fits.

        Returns:
            How many batches were dropped.
        """
        with self._lock:
            dropped = 0
            while len(self._items) >= self.max_batches:
                victim = self._items[0]
                if victim.path == self._in_flight:
                    if len(self._items) < 2:
                        break
                    victim = self._items[1]
                self._items.remove(victim)
                victim.path.unlink(missing_ok=True)
                dropped += 1
            return dropped

    def put(
        self, body: bytes, epoch: str, seq: int, *, has_samples: bool = True, urgent: bool = False
    ) -> int:
        """Append one batch atomically (tmp file, fsync, rename), dropping the oldest if full.

        Args:
            body: The batch JSON.
            epoch: Its epoch.
            seq: Its sequence number.
            has_samples: Whether it carries GPU samples.
            urgent: Whether it was pushed at once (backfilled before the others).

        Returns:
            How many old batches were dropped to make room.

        Raises:
            OSError: the file cannot be written.
        """
        dropped = self.make_room()
        with self._lock:
            ordinal = self._next_ordinal
            self._next_ordinal += 1
            name = f"{ordinal:016d}.{epoch}.{seq:010d}.json"
            path = self.directory / name
            atomic_write_bytes(path, body)
            self._items.append(
                SpoolItem(
                    path=path,
                    ordinal=ordinal,
                    epoch=epoch,
                    seq=seq,
                    has_samples=has_samples,
                    urgent=urgent,
                )
            )
            return dropped

    def oldest(self) -> SpoolItem | None:
        """The oldest batch, or None when the spool is empty."""
        with self._lock:
            return self._items[0] if self._items else None

    def items(self) -> list[SpoolItem]:
        """All spooled batches, oldest first."""
        with self._lock:
            return list(self._items)

    def set_in_flight(self, item: SpoolItem | None) -> None:
        """Mark the batch being sent, so a full spool does not drop it meanwhile."""
        with self._lock:
            self._in_flight = item.path if item else None

    def remove(self, item: SpoolItem) -> None:
        """Forget a delivered batch and delete its file."""
        with self._lock:
            if item in self._items:
                self._items.remove(item)
            item.path.unlink(missing_ok=True)

    def reject(self, item: SpoolItem) -> Path:
        """Move a permanently refused batch to ``rejected/`` (keeping at most max_batches).

        Returns:
            The batch's new path.
        """
        with self._lock:
            if item in self._items:
                self._items.remove(item)
            self.rejected_dir.mkdir(exist_ok=True)
            target = self.rejected_dir / item.path.name
            try:
                os.replace(item.path, target)
            except FileNotFoundError:
                pass
            kept = sorted(p for p in self.rejected_dir.iterdir() if p.suffix == ".json")
            for old in kept[: max(0, len(kept) - self.max_batches)]:
                old.unlink(missing_ok=True)
            return target


# ----------------------------------------------------------------------------------------
# Delivery
# ----------------------------------------------------------------------------------------
class TransientReportError(Exception):
    """Delivery failed in a way worth retrying (connection, timeout, 5xx, 429).

    Attributes:
        retry_after_s: The server's ``Retry-After``, seconds, if it sent one.
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class PermanentReportError(Exception):
    """The server refused the batch for good (4xx other than 429, or a redirect).

    Attributes:
        status_code: The HTTP status.
    """

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass
class ReporterStatus:
    """What the reporter has done so far (for the local status API)."""

    epoch: str
    last_seq: int  # newest seq built in this epoch (0: none yet)
    last_sent_seq: int  # newest seq of this epoch the server acknowledged receiving
    last_acked_seq: int  # the server's acked_seq (highest seq it holds for this epoch)
    spool_depth: int
    dropped_batches: int
    rejected_batches: int
    delivered_batches: int
    consecutive_failures: int
    last_error: str | None
    last_success_at: str | None


class Reporter:
    """Builds report batches and delivers them through the spool (see module docs).

    Args:
        node: This node's name.
        server: Control-plane base URL (``http(s)://host:port``).
        token: The agent's bearer token.
        spool_dir: Spool folder.
        spool_max_batches: Spool bound, batches.
        collector: Collector name sent in each batch.
        simulated: Whether the collector is simulated (sent in each batch).
        interval_s: Report interval, seconds (sent in each batch).
        on_commands: Called with the commands of each acknowledgement that has some.
        backoff_initial_s: First retry delay, seconds.
        backoff_max_s: Largest retry delay, seconds.
        timeout_s: HTTP timeout of one POST, seconds.

    Raises:
        OSError: the spool folder cannot be created.
    """

    def __init__(
        self,
        *,
        node: str,
        server: str,
        token: str,
        spool_dir: Path,
        spool_max_batches: int = 10000,
        collector: str = "",
        simulated: bool = False,
        interval_s: float = 5.0,
        sample_every: int = 1,
        on_commands: CommandCallback | None = None,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        timeout_s: float = 10.0,
    ) -> None:
        self.node = node
        self.server = server.rstrip("/")
        self.shown_server = redact_url(self.server)  # for messages: never the credentials
        self.epoch = uuid.uuid4().hex
        self.collector = collector
        self.simulated = simulated
        self.interval_s = interval_s
        self.sample_every = sample_every
        self.spool = Spool(spool_dir, spool_max_batches)
        self._on_commands = on_commands
        self._backoff_initial = backoff_initial_s
        self._backoff_max = backoff_max_s
        self._client = httpx.Client(
            base_url=self.server,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
                "User-Agent": f"tierwatch-agent/{__version__}",
            },
        )
        self._build_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._seq = 0
        self._dropped = 0
        self._rejected = 0
        self._delivered = 0
        self._last_sent_seq = 0
        self._last_acked_seq = 0
        self._failures = 0
        self._outage_started: float | None = None
        self._last_error: str | None = None
        self._last_success_at: str | None = None
        self._events: list[AgentEvent] = []
        self._wake = threading.Event()  # new batch spooled / closing
        self._nudge = threading.Event()  # cut a backoff sleep short
        self._closing = threading.Event()  # drain the spool, then stop
        self._abort = threading.Event()  # stop now, even mid-retry
        self._thread: threading.Thread | None = None
        found = self.spool.items()
        # The newest ordinal delivered (sendorder's head). What an earlier run left is older
        # than anything this run reports, so it starts as backfill.
        self._head = found[-1].ordinal if found else 0
        if found:
            log.info(
                "spool %s holds %d unsent batch(es) from earlier; they are backfilled behind "
                "this run's newest batch",
                self.spool.directory,
                len(found),
            )

    # -- building ------------------------------------------------------------------------
    def report(
        self,
        *,
        gpus: Sequence[GpuInfo] = (),
        samples: Sequence[GpuSample] = (),
        xids: Sequence[XidEvent] = (),
        latency: Sequence[LatencySample] = (),
        events: Sequence[AgentEvent] = (),
        checkpoint_events: Sequence[CheckpointEvent] = (),
        progress: Sequence[JobProgress] = (),
        restores: Sequence[RestoreReport] = (),
        command_results: Sequence[CommandResult] = (),
        urgent: bool = False,
    ) -> ReportBatch:
        """Build the next batch, spool it and wake the sender.

        Args:
            gpus: The node's GPU inventory.
            samples: GPU samples (at most 4096).
            xids: XID events (at most 4096).
            latency: Collective-latency samples (at most 4096).
            events: Agent events; the reporter adds its own (spool drops, rejections).
            checkpoint_events: Checkpoint events (at most 4096).
            progress: Training progress of local ranks (at most 4096).
            restores: Restore outcomes (at most 1024).
            command_results: What became of commands from the server (at most 1024).
            urgent: Cut a running retry backoff short (see :meth:`push_now`). A batch that
                is urgent or carries XIDs is backfilled before the others after an outage.

        Returns:
            The batch as spooled.

        Raises:
            pydantic.ValidationError: the contents exceed the protocol's limits.
            OSError: the spool file cannot be written.
        """
        with self._build_lock:
            # Make room first, so this batch's dropped_batches includes what it displaces.
            newly_dropped = self.spool.make_room()
            if newly_dropped:
                with self._state_lock:
                    self._dropped += newly_dropped
                    total = self._dropped
                self._add_event(
                    "spool_full",
                    f"spool full ({self.spool.max_batches} "
                    f"batches): dropped {newly_dropped} oldest batch(es), "
                    f"{total} since start",
                )
            with self._state_lock:
                own = self._events
                room = max(0, MAX_EVENTS_PER_BATCH - len(events))
                self._events = own[room:]
                all_events = [*events, *own[:room]]
                dropped = self._dropped
            batch = ReportBatch(
                node=self.node,
                epoch=self.epoch,
                seq=self._seq + 1,
                sent_at=utcnow(),
                agent_version=__version__,
                collector=self.collector,
                simulated=self.simulated,
                interval_s=self.interval_s,
                sample_every=self.sample_every,
                gpus=list(gpus),
                samples=list(samples),
                xids=list(xids),
                latency=list(latency),
                events=all_events,
                checkpoint_events=list(checkpoint_events),
                progress=list(progress),
                restores=list(restores),
                command_results=list(command_results),
                dropped_batches=dropped,
            )
            late_drops = self.spool.put(
                batch.model_dump_json().encode(),
                batch.epoch,
                batch.seq,
                has_samples=bool(batch.samples),
                urgent=urgent or bool(batch.xids),
            )
            self._seq = batch.seq
        if late_drops:  # only if the sender's in-flight batch blocked make_room (rare)
            with self._state_lock:
                self._dropped += late_drops
        self._wake.set()
        if urgent:
            self._nudge.set()
        return batch

    def push_now(
        self,
        *,
        gpus: Sequence[GpuInfo] = (),
        xids: Sequence[XidEvent] = (),
        samples: Sequence[GpuSample] = (),
        events: Sequence[AgentEvent] = (),
    ) -> ReportBatch:
        """Send a batch immediately (e.g. for an XID) instead of at the next interval.

        The sender is woken and a retry backoff in progress is cut short. Being the newest,
        the batch goes ahead of any backlog (just after the newest batch with samples, if
        that is not sent yet); if it is backfilled after all (a newer batch was spooled
        meanwhile) it goes before the non-urgent ones.

        Returns:
            The batch as spooled.

        Raises:
            OSError: the spool file cannot be written.
        """
        return self.report(gpus=gpus, samples=samples, xids=xids, events=events, urgent=True)

    def _add_event(self, kind: str, message: str) -> None:
        with self._state_lock:
            self._events.append(AgentEvent(kind=kind, ts=utcnow(), message=message[:2000]))
            del self._events[:-MAX_EVENTS_PER_BATCH]

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the sender thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tierwatch-reporter", daemon=True)
        self._thread.start()

    def close(self, flush_timeout_s: float = 5.0) -> bool:
        """Try to deliver what is spooled for up to ``flush_timeout_s``, then stop.

        Whatever is not delivered stays in the spool for the next start.

        Returns:
            True when the spool is empty.
        """
        self._closing.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(flush_timeout_s)
            if self._thread.is_alive():
                self._abort.set()
                self._nudge.set()
                self._thread.join(15.0)
            self._thread = None
        self._client.close()
        left = len(self.spool)
        if left:
            log.warning(
                "%d batch(es) left in the spool %s; they are sent on the next start",
                left,
                self.spool.directory,
            )
        return left == 0

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until the spool is empty (for tests and shutdown); True if it is."""
        deadline = time.monotonic() + timeout_s
        while len(self.spool):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def status(self) -> ReporterStatus:
        """A snapshot of sequence numbers, spool depth and counters."""
        with self._state_lock:
            return ReporterStatus(
                epoch=self.epoch,
                last_seq=self._seq,
                last_sent_seq=self._last_sent_seq,
                last_acked_seq=self._last_acked_seq,
                spool_depth=len(self.spool),
                dropped_batches=self._dropped,
                rejected_batches=self._rejected,
                delivered_batches=self._delivered,
                consecutive_failures=self._failures,
                last_error=self._last_error,
                last_success_at=self._last_success_at,
            )

    # -- sending -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._abort.is_set():
            if not len(self.spool):
                if self._closing.is_set():
                    return
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            try:
                self._deliver_one()
            except Exception as exc:  # noqa: BLE001 - never let the sender die silently
                log.exception("unexpected error delivering a spooled batch")
                self._record_failure(f"unexpected error: {exc}")
                self._abort.wait(1.0)

    def _deliver_one(self) -> None:
        """Deliver one batch, retrying transient failures with backoff until one attempt
        succeeds (or shutdown aborts). Each attempt sends the batch :func:`next_to_send`
        picks at that moment, so a batch spooled during the wait goes first; the backoff
        keeps growing across them (one outage, one backoff)."""
        retrying = Retrying(
            retry=retry_if_exception_type(TransientReportError),
            wait=self._wait,
            stop=lambda _state: self._abort.is_set(),
            sleep=self._sleep,
            before_sleep=self._before_sleep,
            reraise=True,
        )
        try:
            retrying(self._attempt)
        except TransientReportError:
            return  # aborted by shutdown; the batch stays spooled

    def _attempt(self) -> None:
        """One delivery attempt of the batch to send now.

        A delivered batch is deleted and becomes the head (the newest one the server has);
        a refused one moves to ``rejected/``.

        Raises:
            TransientReportError: worth retrying; the batch stays spooled.
        """
        item = next_to_send(self.spool.items(), self._head)
        if item is None:
            return
        try:
            body = item.path.read_bytes()
        except FileNotFoundError:  # dropped meanwhile
            self.spool.remove(item)
            return
        self.spool.set_in_flight(item)
        try:
            ack = self._post_once(body)
        except PermanentReportError as exc:
            self._reject(item, exc)
            return
        finally:
            self.spool.set_in_flight(None)
        self.spool.remove(item)
        self._head = max(self._head, item.ordinal)
        self._record_success(item, ack)

    def _reject(self, item: SpoolItem, exc: PermanentReportError) -> None:
        target = self.spool.reject(item)
        with self._state_lock:
            self._rejected += 1
            self._last_error = str(exc)
        hint = ""
        if exc.status_code in (401, 403):
            hint = f" (check the agent token and that it belongs to node {self.node!r})"
        log.error(
            "server refused batch epoch=%s seq=%d for good: %s%s; moved to %s",
            item.epoch,
            item.seq,
            exc,
            hint,
            target,
        )
        self._add_event(
            "report_rejected", f"batch epoch={item.epoch} seq={item.seq} refused: {exc}{hint}"
        )

    def _wait(self, state: RetryCallState) -> float:
        exp = wait_exponential_jitter(
            multiplier=self._backoff_initial, max=self._backoff_max, jitter=self._backoff_initial
        )(state)
        exc = state.outcome.exception() if state.outcome else None
        return retry_wait_s(exp, getattr(exc, "retry_after_s", None), self._backoff_max)

    def _sleep(self, seconds: float) -> None:
        self._nudge.wait(seconds)
        self._nudge.clear()

    def _before_sleep(self, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        self._record_failure(str(exc))
        wait = state.next_action.sleep if state.next_action else 0.0
        level = (
            logging.WARNING
            if state.attempt_number in (1, 10) or state.attempt_number % 100 == 0
            else logging.DEBUG
        )
        log.log(
            level,
            "report delivery failed (attempt %d): %s; retrying in %.1f s (%d batch(es) spooled)",
            state.attempt_number,
            exc,
            wait,
            len(self.spool),
        )

    def _post_once(self, body: bytes) -> ReportAck | None:
        """POST one batch.

        Returns:
            The acknowledgement, or None when a 2xx answer is not a valid ReportAck.

        Raises:
            TransientReportError: connection error, timeout, 5xx or 429.
            PermanentReportError: other non-2xx answers.
        """
        try:
            resp = self._client.post(INGEST_PATH, content=body)
        except httpx.TransportError as exc:
            raise TransientReportError(
                f"cannot reach {self.shown_server}: {type(exc).__name__}: {exc}"
            ) from exc
        status = resp.status_code
        if status == 429 or status >= 500:
            raise TransientReportError(
                f"HTTP {status} from {self.shown_server}: {error_detail(resp, limit=DETAIL_LIMIT)}",
                retry_after_s=_retry_after(resp),
            )
        if not 200 <= status < 300:
            raise PermanentReportError(
                f"HTTP {status}: {error_detail(resp, limit=DETAIL_LIMIT)}", status
            )
        try:
            return ReportAck.model_validate_json(resp.content)
        except ValidationError as exc:
            log.error("server answered HTTP %d with an invalid acknowledgement: %s", status, exc)
            self._add_event(
                "bad_ack",
                f"HTTP {status} answer is not a ReportAck "
                f"({exc.error_count()} error(s)); batch counted as delivered",
            )
            return None

    def _record_failure(self, error: str) -> None:
        with self._state_lock:
            self._failures += 1
            self._last_error = error
            if self._outage_started is None:
                self._outage_started = time.monotonic()

    def _record_success(self, item: SpoolItem, ack: ReportAck | None) -> None:
        with self._state_lock:
            outage = self._outage_started
            failures = self._failures
            self._outage_started = None
            self._failures = 0
            self._last_error = None
            self._delivered += 1
            self._last_success_at = utcnow().isoformat()
            if item.epoch == self.epoch:
                self._last_sent_seq = max(self._last_sent_seq, item.seq)
                if ack is not None and ack.epoch == self.epoch:
                    self._last_acked_seq = max(self._last_acked_seq, ack.acked_seq)
        if outage is not None:
            took = time.monotonic() - outage
            backlog = len(self.spool)
            log.info(
                "server reachable again after %.1f s (%d failed attempt(s)); sent epoch=%s "
                "seq=%d first, backfilling %d spooled batch(es) behind it",
                took,
                failures,
                item.epoch,
                item.seq,
                backlog,
            )
            self._add_event(
                "server_unreachable",
                f"reports could not be delivered for {took:.0f} s ({failures} failed "
                f"attempt(s)); the newest state went first (seq {item.seq}), {backlog} "
                "spooled batch(es) are backfilled behind it",
            )
        if ack is not None and ack.commands:
            log.info(
                "server sent %d command(s): %s",
                len(ack.commands),
                ", ".join(f"{c.kind}({c.id})" for c in ack.commands),
            )
            if self._on_commands is not None:
                try:
                    self._on_commands(list(ack.commands))
                except Exception:  # noqa: BLE001 - a bad callback must not stop delivery
                    log.exception("command callback failed")


#: A ``Retry-After`` wait is stretched by a random 0 to this fraction of itself.
RETRY_AFTER_SPREAD = 0.5


def retry_wait_s(
    backoff_s: float,
    retry_after_s: float | None,
    backoff_max_s: float,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before the next delivery attempt.

    Args:
        backoff_s: the jittered exponential backoff for this attempt (seconds).
        retry_after_s: the server's ``Retry-After`` (seconds), or None.
        backoff_max_s: the longest wait (seconds; at least 1 s when the server asked).
        rand: uniform [0, 1) source (tests pass a fixed one).

    Returns:
        ``backoff_s`` without a ``Retry-After``. With one: at least the server's wait,
        stretched by a random 0–50 % (``RETRY_AFTER_SPREAD``), capped at ``backoff_max_s``.
        The stretch matters at scale: every agent a busy server sheds gets the same whole
        number of seconds, and without it they would all come back in the same instant.
    """
    if retry_after_s is None:
        return backoff_s
    spread = retry_after_s * (1.0 + RETRY_AFTER_SPREAD * rand())
    return min(max(backoff_s, spread), max(backoff_max_s, 1.0))


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def iter_spooled_batches(spool_dir: Path) -> Iterable[ReportBatch]:
    """Read the batches waiting in a spool folder, oldest first (for inspection).

    Raises:
        pydantic.ValidationError: a spool file is not a valid batch.
    """
    for item in Spool(spool_dir, max_batches=10**9).items():
        yield ReportBatch.model_validate_json(item.path.read_bytes())

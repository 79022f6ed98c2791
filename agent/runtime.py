"""The agent main loop: collect, batch, report, serve the local API, shut down cleanly.

Lifecycle: :meth:`AgentRuntime.start` starts the collector (with :meth:`~AgentRuntime.on_xid`
as its XID callback), the reporter's sender thread and the local API; :meth:`~AgentRuntime.run`
then builds one batch every ``interval`` seconds (samples + collector latency + trainer
latency + agent events) until :meth:`~AgentRuntime.stop` (SIGTERM/SIGINT in the CLI). XIDs do
not wait for the interval: each one is pushed at once in its own batch.

Checkpoints: with ``checkpoints`` on (the default when the API is served), :meth:`start` also
starts the tiered checkpoint store
(:class:`~tierwatch.agent.checkpoint.tierstore.api.CheckpointService`):
it writes ``<memory-dir>/agent.json`` and runs the tier worker. Its checkpoint events, and the
events, progress and restore reports that local ranks post, go into the next batch. A memory
folder or persistent URL that cannot be used is logged and reported as an agent event
(``checkpoint_error``); GPU health reporting goes on without the checkpoint store.

Metrics: every :meth:`~AgentRuntime.tick` also hands the samples and the collector's extra
readings to :attr:`AgentRuntime.metrics` (:class:`~tierwatch.agent.exporter.MetricsState`), and
every XID is counted there; ``GET /metrics`` on the local API, and on the separate metrics
listener when ``metrics_listen`` is set, renders a snapshot of it (no collector call per
scrape). See :mod:`tierwatch.agent.exporter`.

Shutdown: the local API and the metrics listener stop, the tier worker stops, a last batch
holds what was collected or queued since the previous one, the collector shuts down, and the
reporter tries to deliver the spool for up to ``flush_timeout_s``; what is still unsent stays
in the on-disk spool for the next start.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

from tierwatch import __version__
from tierwatch.agent.collectors import GpuCollector, make_collector
from tierwatch.agent.commands import CommandExecutor
from tierwatch.agent.config import AgentSettings, SettingsError, is_loopback_host
from tierwatch.agent.credential_keys import ServerKeys
from tierwatch.agent.credentials import CredentialError
from tierwatch.agent.exporter import (
    MIN_MAX_AGE_S,
    STALE_INTERVALS,
    ExportOptions,
    MetricsState,
    render,
)
from tierwatch.agent.protocol import (
    AgentEvent,
    CheckpointEvent,
    Command,
    CommandResult,
    JobProgress,
    LatencySample,
    RestoreReport,
    XidEvent,
    utcnow,
)
from tierwatch.agent.reporter import MAX_EVENTS_PER_BATCH, Reporter
from tierwatch.agent.sampling import SampleGate
from tierwatch.agent.urlsafe import redact_url

if TYPE_CHECKING:
    from tierwatch.agent.checkpoint.tierstore.api import CheckpointService

log = logging.getLogger(__name__)

MAX_PER_BATCH = 4096  # protocol limit on samples / xids / latency per batch
MAX_QUEUED_LATENCY = 20000
MAX_RESTORES_PER_BATCH = 1024  # protocol limit on restores per batch
MAX_QUEUED_CKPT = 20000  # per queue: checkpoint events, progress, restores


class LocalApiServer:
    """uvicorn serving the local API in a background thread.

    Args:
        app: The ASGI app.
        host: Bind address.
        port: Bind port (0: ephemeral).
        what: What it serves and the option that sets its address (for messages).
    """

    def __init__(
        self, app: Any, host: str, port: int, what: tuple[str, str] = ("local API", "--listen")
    ) -> None:
        import uvicorn  # imported here: only `run` needs it

        self._server = uvicorn.Server(
            uvicorn.Config(
                app, host=host, port=port, log_level="warning", lifespan="off", access_log=False
            )
        )
        self._thread = threading.Thread(
            target=self._server.run, name=f"tierwatch-{what[0].replace(' ', '-')}", daemon=True
        )
        self.host = host
        self.port = port
        self.what = what

    def start(self, timeout_s: float = 10.0) -> None:
        """Start serving and wait until the socket listens.

        Raises:
            RuntimeError: the server did not start (e.g. the address is in use).
        """
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                name, option = self.what
                raise RuntimeError(
                    f"{name} could not listen on {self.host}:{self.port} (address in use? "
                    f"pick another with {option})"
                )
            time.sleep(0.01)
        sockets = [s for srv in self._server.servers for s in srv.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]

    def stop(self) -> None:
        """Stop serving and wait for the thread (up to 5 s)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(5.0)


class AgentRuntime:
    """One running node agent.

    Args:
        settings: Agent settings (node, server and token must be set).
        collector: The collector to use; None picks one from ``settings.collector``.
        reporter: The reporter to use; None creates one from the settings.
        nvml: A ``pynvml``-compatible module for collector selection (None: nvidia-ml-py).
        flush_timeout_s: How long shutdown tries to deliver the spool, seconds (None:
            ``settings.shutdown_flush_s``).

    Raises:
        SettingsError: node, server or token is missing.
        CollectorError: the requested collector is not available.
    """

    def __init__(
        self,
        settings: AgentSettings,
        *,
        collector: GpuCollector | None = None,
        reporter: Reporter | None = None,
        nvml: ModuleType | None = None,
        flush_timeout_s: float | None = None,
    ) -> None:
        settings.check_runnable()
        self.settings = settings
        self.collector = collector if collector is not None else make_collector(settings, nvml)
        self.sample_gate = SampleGate(full_every=settings.full_sample_every)
        self.reporter = (
            reporter
            if reporter is not None
            else Reporter(
                node=settings.node or "",
                server=settings.server or "",
                token=settings.token_value or "",
                spool_dir=settings.resolved_spool_dir(),
                spool_max_batches=settings.spool_max_batches,
                collector=self.collector.name,
                simulated=self.collector.simulated,
                interval_s=settings.interval,
                sample_every=settings.full_sample_every,
                on_commands=self.on_commands,
                # Retry at least once per report interval, so after an outage a node is seen
                # again within one interval, well before the 3-interval heartbeat window.
                backoff_max_s=min(30.0, max(1.0, settings.interval)),
            )
        )
        self.flush_timeout_s = (
            settings.shutdown_flush_s if flush_timeout_s is None else flush_timeout_s
        )
        self.commands = CommandExecutor(
            node=settings.node or "",
            state_dir=settings.resolved_state_dir(),
            isolation_command=settings.isolation_command,
            isolation_timeout_s=settings.isolation_timeout,
            restore_sink=self._hand_restore,
            report=self.report_command_results,
        )
        self._latency: deque[LatencySample] = deque()
        self._events: list[AgentEvent] = []
        self._ckpt_events: deque[CheckpointEvent] = deque()
        self._progress: deque[JobProgress] = deque()
        self._restores: deque[RestoreReport] = deque()
        self.ckpt: CheckpointService | None = None
        # the server's public keys: job credentials of local ranks are checked with them
        self.keys = ServerKeys(
            server=settings.server,
            token=settings.token_value,
            keys_file=settings.credential_keys_file,
            state_dir=settings.resolved_state_dir(),
        )
        self.export_options = ExportOptions(
            host_label=settings.metrics_host_label,
            model_label=settings.metrics_model_label,
            dcgm_fields=self.collector.exports_dcgm_fields,
            dcgm_names=settings.metrics_dcgm_names,
        )
        self.metrics = MetricsState(
            node=settings.node or "",
            collector=self.collector.name,
            simulated=self.collector.simulated,
            version=__version__,
            max_age_s=max(STALE_INTERVALS * settings.interval, MIN_MAX_AGE_S),
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._api: LocalApiServer | None = None
        self._metrics_server: LocalApiServer | None = None
        self._started = False
        self._ticks = 0

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, serve_api: bool = True, checkpoints: bool | None = None) -> None:
        """Start the collector, the reporter and (optionally) the local API and the
        checkpoint store.

        Args:
            serve_api: Serve the local API.
            checkpoints: Run the checkpoint store (None: when the API is served).

        The separate metrics listener (``settings.metrics_listen``) starts whatever
        ``serve_api`` says.

        Raises:
            CollectorError: the collector cannot start.
            RuntimeError: the local API or the metrics listener cannot listen.
        """
        try:
            self.keys.load()
        except CredentialError as exc:
            raise SettingsError(
                f"--credential-keys-file (TIERWATCH_CREDENTIAL_KEYS_FILE) {exc}"
            ) from None
        self.collector.start(self.on_xid)
        self.reporter.start()
        self.commands.start()
        if checkpoints is None:
            checkpoints = serve_api
        if checkpoints:
            self._make_ckpt()
        if serve_api:
            from tierwatch.agent.server import create_app

            self._api = LocalApiServer(
                create_app(self), self.settings.listen_host, self.settings.listen_port
            )
            self._api.start()
            log.info("local API on http://%s:%d", self._api.host, self._api.port)
            if not is_loopback_host(self.settings.listen_host):
                log.warning(
                    "local API listens on a non-loopback address (%s); control "
                    "endpoints require the agent token from other hosts",
                    self.settings.listen_host,
                )
        self._start_metrics_listener()
        if self.ckpt is not None:
            try:
                self.ckpt.start(
                    self.settings.listen_host, self.api_port or self.settings.listen_port
                )
            except OSError as exc:
                log.error("checkpoint store disabled: %s", exc)
                self.add_event("checkpoint_error", f"checkpoint store disabled: {exc}")
                self.ckpt = None
        self._started = True
        log.info(
            "agent started: node=%s collector=%s%s server=%s interval=%gs epoch=%s",
            self.settings.node,
            self.collector.name,
            " (SIMULATED)" if self.collector.simulated else "",
            redact_url(self.settings.server or ""),
            self.settings.interval,
            self.reporter.epoch,
        )

    def _start_metrics_listener(self) -> None:
        address = self.settings.metrics_address
        if address is None:
            return
        from tierwatch.agent.server import create_metrics_app

        host, port = address
        server = LocalApiServer(
            create_metrics_app(self), host, port, what=("metrics listener", "--metrics-listen")
        )
        server.start()
        self._metrics_server = server
        log.info("metrics on http://%s:%d/metrics", server.host, server.port)

    def render_metrics(self) -> bytes:
        """``GET /metrics``: the exposition of the latest readings (never calls the
        collector; see :mod:`tierwatch.agent.exporter`)."""
        return render(self.metrics.snapshot(), self.export_options)

    def _make_ckpt(self) -> None:
        from tierwatch.agent.checkpoint.tierstore.api import CheckpointService
        from tierwatch.agent.checkpoint.tierstore.persister import PersistentError
        from tierwatch.agent.registry import PeerRegistry

        registry = None
        try:
            registry = PeerRegistry(
                node=self.settings.node or "",
                server=self.settings.server or "",
                token=self.settings.token_value or "",
                state_dir=self.settings.resolved_state_dir(),
                keys=self.keys,
            )
        except (OSError, ValueError) as exc:
            log.error("no peer tier: this node's key cannot be loaded: %s", exc)
            self.add_event("checkpoint_error", f"no peer tier: node key unusable: {exc}")
        try:
            self.ckpt = CheckpointService(
                self.settings, emit=self.add_checkpoint_event, registry=registry, keys=self.keys
            )
        except (OSError, PersistentError, ValueError) as exc:
            log.error("checkpoint store disabled: %s", exc)
            self.add_event("checkpoint_error", f"checkpoint store disabled: {exc}")
            self.ckpt = None

    @property
    def api_port(self) -> int | None:
        """The port the local API listens on (None when not serving)."""
        return self._api.port if self._api else None

    @property
    def metrics_port(self) -> int | None:
        """The port the metrics listener listens on (None without one)."""
        return self._metrics_server.port if self._metrics_server else None

    def stop(self) -> None:
        """Ask :meth:`run` to finish (thread- and signal-safe)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """Make SIGTERM and SIGINT stop the agent gracefully (main thread only)."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            log.info("received %s; shutting down", signal.Signals(signum).name)
            self.stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self) -> int:
        """Report every interval until :meth:`stop`, then shut down.

        Returns:
            0 when the shutdown was clean.
        """
        if not self._started:
            self.start()
        interval = self.settings.interval
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.tick()
            next_at += interval
            now = time.monotonic()
            if next_at < now:  # fell behind (slow collector): do not burst to catch up
                next_at = now + interval
            self._stop.wait(next_at - now)
        return self.shutdown()

    def shutdown(self) -> int:
        """Stop the API, send a last batch, stop the collector and flush the reporter.

        Returns:
            0.
        """
        if self._api is not None:
            self._api.stop()
            self._api = None
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
        self.commands.stop()
        if self.ckpt is not None:
            self.ckpt.stop()
        try:
            self.tick()
        except OSError as exc:
            log.error("could not spool the last batch: %s", exc)
        self.collector.shutdown()
        delivered = self.reporter.close(self.flush_timeout_s)
        log.info(
            "agent stopped (%s)",
            "all reports delivered"
            if delivered
            else f"{len(self.reporter.spool)} batch(es) left in the spool",
        )
        return 0

    # -- work ----------------------------------------------------------------------------
    def tick(self) -> None:
        """Collect once and hand one batch to the reporter (never raises for collector bugs).

        Raises:
            OSError: the batch cannot be written to the spool.
        """
        self._ticks += 1
        try:
            samples = self.collector.collect()
            extras = self.collector.extras()
        except Exception as exc:  # noqa: BLE001 - a collector bug becomes an event
            log.exception("collector %s failed", self.collector.name)
            samples, extras = [], {}
            self.add_event("collector_error", f"{self.collector.name}: {exc!r}")
        inventory = self.collector.inventory()
        self.metrics.update(inventory, samples, extras)
        try:
            own_latency = self.collector.latency()
        except Exception as exc:  # noqa: BLE001
            log.exception("collector latency failed")
            own_latency = []
            self.add_event("collector_error", f"{self.collector.name} latency: {exc!r}")
        with self._lock:
            latency = own_latency[:MAX_PER_BATCH]
            while self._latency and len(latency) < MAX_PER_BATCH:
                latency.append(self._latency.popleft())
        events = self._take_events()
        with self._lock:
            ckpt_events = _take(self._ckpt_events, MAX_PER_BATCH)
            progress = _take(self._progress, MAX_PER_BATCH)
            restores = _take(self._restores, MAX_RESTORES_PER_BATCH)
        # full samples every N reports, and any report whose health readings changed
        sent = samples[:MAX_PER_BATCH] if self.sample_gate.admit(samples) else []
        self.reporter.report(
            gpus=inventory,
            samples=sent,
            latency=latency,
            events=events,
            checkpoint_events=ckpt_events,
            progress=progress,
            restores=restores,
        )

    def on_xid(self, event: XidEvent) -> None:
        """Count an XID for ``/metrics`` and push it (from any thread) to the server at once,
        in its own batch.

        A value found already set at start (``event.before_start``, dcgm-exporter) is pushed
        but not counted: it is no occurrence seen by this agent, and counting it at every
        start would inflate ``tierwatch_xid_events_total``.
        """
        if not event.before_start:
            self.metrics.count_xid(event)
        try:
            self.reporter.push_now(
                gpus=self.collector.inventory(), xids=[event], events=self._take_events()
            )
        except OSError as exc:
            log.error("could not spool XID %d on GPU %d: %s", event.xid, event.gpu, exc)

    def on_commands(self, commands: list[Command]) -> None:
        """Run commands from the server (each at most once; see ``agent.commands``)."""
        for command in commands:
            log.info("command %s (%s) received: %s", command.id, command.kind, command.args)
        self.commands.submit(commands)

    def _hand_restore(self, command: Command) -> None:
        if self.ckpt is None:
            raise RuntimeError("the checkpoint store is not running on this agent")
        self.ckpt.add_restore_request(command)

    def report_command_results(self, results: list[CommandResult]) -> None:
        """Send command results to the server now, in a batch of their own."""
        try:
            self.reporter.report(
                gpus=self.collector.inventory(), command_results=results, urgent=True
            )
        except OSError as exc:
            log.error("could not spool %d command result(s): %s", len(results), exc)

    def add_latency(self, samples: Iterable[LatencySample]) -> None:
        """Queue collective-latency samples from local ranks for the next batch."""
        with self._lock:
            self._latency.extend(samples)
            overflow = len(self._latency) - MAX_QUEUED_LATENCY
            for _ in range(max(0, overflow)):
                self._latency.popleft()
        if overflow > 0:
            self.add_event(
                "latency_dropped",
                f"trainer latency queue full: dropped {overflow} oldest sample(s)",
            )

    def add_checkpoint_event(self, event: CheckpointEvent) -> None:
        """Queue one checkpoint event (from any thread) for the next batch."""
        self.add_checkpoint_reports([event], [], [])

    def add_checkpoint_reports(
        self,
        events: Iterable[CheckpointEvent],
        progress: Iterable[JobProgress],
        restores: Iterable[RestoreReport],
    ) -> dict[str, int]:
        """Queue checkpoint events, progress and restore reports for the next batch(es).

        Each queue holds at most ``MAX_QUEUED_CKPT`` entries; beyond, the oldest are dropped
        and an agent event says how many.

        Returns:
            How many of each were queued: ``{events, progress, restores}``.
        """
        counts = {}
        dropped = {}
        with self._lock:
            for name, queue, items in (
                ("events", self._ckpt_events, events),
                ("progress", self._progress, progress),
                ("restores", self._restores, restores),
            ):
                before = len(queue)
                queue.extend(items)
                counts[name] = len(queue) - before
                overflow = len(queue) - MAX_QUEUED_CKPT
                for _ in range(max(0, overflow)):
                    queue.popleft()
                if overflow > 0:
                    dropped[name] = overflow
        for name, n in dropped.items():
            self.add_event(
                "checkpoint_queue_full",
                f"checkpoint {name} queue full: dropped {n} oldest entr{'y' if n == 1 else 'ies'}",
            )
        return counts

    def add_event(self, kind: str, message: str, gpu: int | None = None) -> None:
        """Queue an agent event for the next batch."""
        with self._lock:
            self._events.append(AgentEvent(kind=kind, ts=utcnow(), message=message[:2000], gpu=gpu))

    def _take_events(self) -> list[AgentEvent]:
        collected = self.collector.drain_events()
        with self._lock:
            self._events.extend(collected)
            events = self._events[:MAX_EVENTS_PER_BATCH]
            self._events = self._events[MAX_EVENTS_PER_BATCH:]
        return events

    def status(self) -> dict[str, Any]:
        """The agent's state for ``GET /v1/status``."""
        rep = self.reporter.status()
        with self._lock:
            queued_latency = len(self._latency)
        metrics = self._metrics_server
        return {
            "node": self.settings.node,
            "agent_version": __version__,
            "collector": self.collector.name,
            "simulated": self.collector.simulated,
            "gpus": len(self.collector.inventory()),
            "server": redact_url(self.settings.server or ""),
            "interval_s": self.settings.interval,
            "epoch": rep.epoch,
            "last_seq": rep.last_seq,
            "last_seq_sent": rep.last_sent_seq,
            "last_seq_acked": rep.last_acked_seq,
            "spool_depth": rep.spool_depth,
            "spool_dir": str(self.reporter.spool.directory),
            "dropped_batches": rep.dropped_batches,
            "rejected_batches": rep.rejected_batches,
            "delivered_batches": rep.delivered_batches,
            "consecutive_failures": rep.consecutive_failures,
            "last_error": rep.last_error,
            "last_success_at": rep.last_success_at,
            "queued_latency_samples": queued_latency,
            "commands_running": self.commands.busy(),
            "checkpoints": self.ckpt is not None,
            "queued_checkpoint_events": len(self._ckpt_events),
            "metrics_listen": f"{metrics.host}:{metrics.port}" if metrics else None,
        }


def _take(queue: deque[Any], limit: int) -> list[Any]:
    out: list[Any] = []
    while queue and len(out) < limit:
        out.append(queue.popleft())
    return out

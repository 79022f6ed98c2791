"""The training side's HTTP client for its node agent (no torch).

:class:`AgentClient` wraps the agent's checkpoint endpoints (``docs/checkpointing.md``).
:class:`EventSender` queues checkpoint events, progress and restore reports and posts them
from its own thread, so the training thread never waits on the network and an agent that is
down (or restarting) costs nothing but a bounded queue: what could not be sent is retried, the
oldest dropped beyond ``max_queued`` (and counted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from tierwatch.agent.fsutil import atomic_write_json
from tierwatch.agent.protocol import CheckpointEvent, JobProgress, RestoreReport

log = logging.getLogger(__name__)


class AgentUnavailable(RuntimeError):
    """The node agent could not be reached or refused the request (message says which)."""


class AgentRefused(AgentUnavailable):
    """The agent refused the caller's credential (HTTP 401 or 403; the message says why)."""


class AgentClient:
    """Calls to one node agent's local API.

    Args:
        base_url: The agent's URL, e.g. ``http://127.0.0.1:9470``.
        token: The job's credential (or the node's agent token), sent as a bearer token with
            every call; the agent refuses calls without one.
        timeout_s: Per-request timeout for quick calls (seconds).
        stage_timeout_s: Timeout for ``stage`` (copies whole shards; seconds).
        list_timeout_s: Timeout for ``available`` with the persistent tier (the agent lists
            an object store, whose client retries a slow or unreachable endpoint for several
            seconds before it answers with the cause; seconds).
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        stage_timeout_s: float = 1800.0,
        list_timeout_s: float = 120.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 2.0)),
        )
        self._stage_timeout = stage_timeout_s
        self._list_timeout = list_timeout_s
        self._lock = threading.Lock()

    def close(self) -> None:
        """Close the connection pool."""
        self._http.close()

    @property
    def closed(self) -> bool:
        """True once ``close()`` ran: every later call raises AgentUnavailable."""
        return self._http.is_closed

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            resp = self._http.request(method, path, **kwargs)
        except RuntimeError:
            if not self._http.is_closed:
                raise
            # a background sender that outlived close() (its last send was still running)
            raise AgentUnavailable(f"agent client for {self.base_url} is closed") from None
        except httpx.HTTPError as exc:
            raise AgentUnavailable(
                f"agent {self.base_url} unreachable ({exc!r}); is "
                "tierwatch-agent running on this node?"
            ) from None
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            error = AgentRefused if resp.status_code in (401, 403) else AgentUnavailable
            raise error(
                f"agent {self.base_url} answered {method} {path} with HTTP "
                f"{resp.status_code}: {str(detail)[:500]}"
            )
        return resp.json() if resp.content else {}

    def info(self) -> dict[str, Any]:
        """``GET /v1/ckpt/info``: node, memory_dir, peer_url, memory_budget_bytes, ...

        Raises:
            AgentUnavailable: unreachable or an HTTP error.
        """
        return self._request("GET", "/v1/ckpt/info")

    def post_events(
        self,
        *,
        events: list[dict[str, Any]],
        progress: list[dict[str, Any]],
        restores: list[dict[str, Any]],
    ) -> None:
        """``POST /v1/ckpt/events``.

        Raises:
            AgentUnavailable: unreachable or an HTTP error.
        """
        self._request(
            "POST",
            "/v1/ckpt/events",
            json={"events": events, "progress": progress, "restores": restores},
        )

    def notify(self, job_id: str, step: int) -> None:
        """``POST /v1/ckpt/notify``: a local rank committed ``step``.

        Raises:
            AgentUnavailable: unreachable or an HTTP error.
        """
        self._request("POST", "/v1/ckpt/notify", json={"job_id": job_id, "step": step})

    def post_latency(self, samples: list[dict[str, Any]]) -> None:
        """``POST /v1/trainer/latency``: collective-latency samples (ms) for the next report.

        Raises:
            AgentUnavailable: unreachable or an HTTP error.
        """
        self._request("POST", "/v1/trainer/latency", json=samples)

    def available(self, job_id: str, *, persistent: bool) -> dict[str, Any]:
        """``GET /v1/ckpt/jobs/{job_id}/available``.

        Raises:
            AgentUnavailable: unreachable or an HTTP error.
        """
        return self._request(
            "GET",
            f"/v1/ckpt/jobs/{job_id}/available",
            params={"persistent": int(persistent)},
            **({"timeout": self._list_timeout} if persistent else {}),
        )

    def stage(self, job_id: str, step: int, files: list[dict[str, Any]]) -> dict[str, Any]:
        """``POST /v1/ckpt/jobs/{job_id}/stage``: assemble ``files`` for a restore.

        Raises:
            AgentUnavailable: unreachable or an HTTP error.
        """
        return self._request(
            "POST",
            f"/v1/ckpt/jobs/{job_id}/stage",
            json={"step": step, "files": files},
            timeout=self._stage_timeout,
        )

    def restore_requests(self, job_id: str) -> dict[str, Any]:
        """``GET /v1/ckpt/jobs/{job_id}/restore-requests``: ``{requests: [...]}``.

        Raises:
            AgentUnavailable: unreachable or an HTTP error.
        """
        return self._request("GET", f"/v1/ckpt/jobs/{job_id}/restore-requests")

    def retire_restore_requests(self, job_id: str, up_to: int) -> dict[str, Any]:
        """``DELETE /v1/ckpt/jobs/{job_id}/restore-requests/{up_to}``: the requests with ids
        ≤ ``up_to`` are served or superseded → ``{retired: [id]}``.

        Raises:
            AgentUnavailable: unreachable or an HTTP error.
        """
        return self._request("DELETE", f"/v1/ckpt/jobs/{job_id}/restore-requests/{up_to}")

    def rollback(
        self, job_id: str, *, request_id: int, step: int, persistent: bool
    ) -> dict[str, Any]:
        """``POST /v1/ckpt/jobs/{job_id}/rollback``: drop the job's steps above ``step`` from
        the replicas this agent holds (and with ``persistent`` from the persistent tier).

        Raises:
            AgentUnavailable: unreachable or an HTTP error.
        """
        return self._request(
            "POST",
            f"/v1/ckpt/jobs/{job_id}/rollback",
            json={"request_id": request_id, "step": step, "persistent": persistent},
            timeout=max(60.0, self._http.timeout.read or 0.0),
        )


class EventSender:
    """Posts queued events to the agent from a background thread.

    Args:
        client: The agent client.
        period_s: How often the queue is flushed (seconds).
        max_queued: Bound of each queue; the oldest entries are dropped beyond it.
    """

    def __init__(
        self,
        client: AgentClient,
        *,
        period_s: float = 1.0,
        max_queued: int = 10000,
        progress_file: Path | None = None,
    ) -> None:
        self.client = client
        self.progress_file = progress_file
        self._last_step: int | None = None
        self._written_step: int | None = None
        self.period_s = period_s
        self._events: deque[CheckpointEvent] = deque(maxlen=max_queued)
        self._progress: deque[JobProgress] = deque(maxlen=max_queued)
        self._restores: deque[RestoreReport] = deque(maxlen=max_queued)
        self._lock = threading.Lock()
        # One send at a time: a flush that finds the queues empty while the background
        # thread's post is still in flight must wait for it, not report "delivered" (a
        # refused restore's process exits right after its flush, killing that post).
        self._send_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.sent = 0
        self.failures = 0
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="tierwatch-ckpt-events", daemon=True)
        self._thread.start()

    def event(self, event: CheckpointEvent) -> None:
        """Queue a checkpoint event (never blocks on the network)."""
        with self._lock:
            self._events.append(event)

    def progress(self, progress: JobProgress, *, completed: bool = True) -> None:
        """Queue a progress report, replacing an unsent one of the same rank.

        Args:
            progress: the report.
            completed: ``progress.step`` was really trained (False for the layout report a
                rank sends at start: it is sent with ``starting`` set, so the server never
                lets a start that may still be refused change a known job); only completed
                steps go to the progress file.
        """
        if completed:
            self._last_step = progress.step
        else:
            progress = progress.model_copy(update={"starting": True})
        with self._lock:
            if (
                self._progress
                and self._progress[-1].rank == progress.rank
                and progress.layout is None
                and self._progress[-1].layout is None
            ):
                self._progress[-1] = progress
            else:
                self._progress.append(progress)

    def restore(self, report: RestoreReport) -> None:
        """Queue a restore outcome and send it soon."""
        with self._lock:
            self._restores.append(report)
        self._wake.set()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Try to send everything queued now; True when the queues are empty."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._send_once():
                return True
            if self.client.closed:
                return False  # nothing can be delivered any more
            time.sleep(0.2)
        return False

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread after a last flush; True when everything was delivered."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s + 1)
        return self.flush(timeout_s)

    def _take(self) -> tuple[list[CheckpointEvent], list[JobProgress], list[RestoreReport]]:
        with self._lock:
            events = [self._events.popleft() for _ in range(min(len(self._events), 1000))]
            progress = [self._progress.popleft() for _ in range(min(len(self._progress), 1000))]
            restores = [self._restores.popleft() for _ in range(min(len(self._restores), 200))]
        return events, progress, restores

    def _put_back(
        self,
        events: list[CheckpointEvent],
        progress: list[JobProgress],
        restores: list[RestoreReport],
    ) -> None:
        with self._lock:
            self._events.extendleft(reversed(events))
            self._progress.extendleft(reversed(progress))
            self._restores.extendleft(reversed(restores))

    def _send_once(self) -> bool:
        """Send one batch of what is queued; True when everything queued was delivered."""
        with self._send_lock:
            return self._send_locked()

    def _send_locked(self) -> bool:
        events, progress, restores = self._take()
        if not (events or progress or restores):
            return True
        try:
            self.client.post_events(
                events=[e.model_dump(mode="json") for e in events],
                progress=[p.model_dump(mode="json") for p in progress],
                restores=[r.model_dump(mode="json") for r in restores],
            )
        except AgentUnavailable as exc:
            self.failures += 1
            if self.last_error is None or self.failures % 30 == 1:
                log.warning("checkpoint events not delivered (will retry): %s", exc)
            self.last_error = str(exc)
            self._put_back(events, progress, restores)
            return False
        self.sent += len(events) + len(progress) + len(restores)
        self.last_error = None
        with self._lock:
            return not (self._events or self._progress or self._restores)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.period_s)
            self._wake.clear()
            self._write_progress()
            self._send_once()
            if self.client.closed:
                # a closed client never delivers again: stop instead of retrying forever
                log.warning(
                    "checkpoint event sender stopped: the agent client is closed "
                    "(%d entries undelivered)",
                    self.pending(),
                )
                return

    def pending(self) -> int:
        """How many events, progress reports and restore outcomes are queued, unsent."""
        with self._lock:
            return len(self._events) + len(self._progress) + len(self._restores)

    def _write_progress(self) -> None:
        """Record the newest completed step in the memory folder (restore's steps lost)."""
        step = self._last_step
        if self.progress_file is None or step is None or step == self._written_step:
            return
        try:
            atomic_write_json(self.progress_file, {"step": step}, fsync=False)
            self._written_step = step
        except OSError as exc:
            log.debug("cannot write %s: %s", self.progress_file, exc)

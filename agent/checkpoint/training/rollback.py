"""The trainer's side of operator restore requests: read them from the agent, and agree
on which one every rank acts on (no torch in this module's imports).

See :mod:`tierwatch.agent.checkpoint.format.rollback` for the whole flow.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from tierwatch.agent.checkpoint.format.rollback import RestoreRequest
from tierwatch.agent.checkpoint.training.client import AgentClient, AgentUnavailable

log = logging.getLogger(__name__)


def newest_unserved(requests: Iterable[RestoreRequest], served: int) -> int:
    """The newest request id above ``served`` (0: none); what a rank contributes to the
    all_reduce MIN that decides which request all ranks know."""
    return max((r.request_id for r in requests if r.request_id > served), default=0)


def pick_request(copies: Iterable[RestoreRequest | None], request_id: int
                 ) -> RestoreRequest | None:
    """The agreed request's arguments from the ranks' copies (each rank's agent got the same
    command; a rank whose agent has not got this id contributes None)."""
    for c in copies:
        if c is not None and c.request_id == request_id:
            return c
    return None


class RequestPoller:
    """Reads the job's pending restore requests from the agent on its own thread.

    Args:
        client: The rank's agent client.
        job_id: The job.
        period_s: Seconds between two reads.

    The training thread only takes :meth:`snapshot` (no network). An agent that is down keeps
    the last answer in place: requests are durable on the agent, and a retired one is
    filtered by the ranks' ``served``.
    """

    def __init__(self, client: AgentClient, job_id: str, *, period_s: float = 0.5) -> None:
        self.client = client
        self.job_id = job_id
        self.period_s = period_s
        self._requests: list[RestoreRequest] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.polls = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="tierwatch-ckpt-requests",
                                        daemon=True)
        self._thread.start()

    def snapshot(self) -> list[RestoreRequest]:
        """The requests of the last successful read."""
        with self._lock:
            return list(self._requests)

    def refresh(self) -> list[RestoreRequest]:
        """Read now (on the caller's thread); the last answer when the agent is down."""
        try:
            answer = self.client.restore_requests(self.job_id)
            requests = [RestoreRequest.model_validate(r) for r in answer.get("requests", [])]
        except (AgentUnavailable, ValueError) as exc:
            self.failures += 1
            if self.failures % 120 == 1:
                log.debug("restore requests of %s not read: %s", self.job_id, exc)
            return self.snapshot()
        with self._lock:
            self._requests = requests
        self.polls += 1
        return list(requests)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.refresh()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout_s)

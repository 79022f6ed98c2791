"""The trainer's side of operator restore requests: read them from the agent, agree on
which one every rank acts on, and serve it (roll the live state back).

See :mod:`tierwatch.agent.checkpoint.format.rollback` for the whole flow. The
:class:`RequestPoller` and the agreement helpers import no torch; :class:`RollbackServer`
runs restore (torch) through the checkpointer it serves, imported when a request is served.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tierwatch.agent.checkpoint.format.rollback import RestoreRequest, Timeline, pins_of
from tierwatch.agent.checkpoint.training.client import AgentClient, AgentUnavailable
from tierwatch.agent.checkpoint.training.errors import CheckpointError, ModelMismatchError
from tierwatch.agent.protocol import RestoreReport, utcnow

if TYPE_CHECKING:
    from tierwatch.agent.checkpoint.training.checkpointer import TieredCheckpointer

log = logging.getLogger(__name__)


def newest_unserved(requests: Iterable[RestoreRequest], served: int) -> int:
    """The newest request id above ``served`` (0: none); what a rank contributes to the
    all_reduce MIN that decides which request all ranks know."""
    return max((r.request_id for r in requests if r.request_id > served), default=0)


def pick_request(copies: Iterable[RestoreRequest | None], request_id: int) -> RestoreRequest | None:
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
        self._thread = threading.Thread(
            target=self._run, name="tierwatch-ckpt-requests", daemon=True
        )
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


class RollbackServer:
    """Serves operator restore requests for one checkpointer (collective: every rank runs
    the same calls at the same place).

    Args:
        ckpt: The rank's checkpointer (its collectives, agent client, events, memory files).
        poller: The rank's request poller.
        timeline: The rollbacks served so far, merged over every rank's ``timeline.json``.
        every: :meth:`maybe_rollback` also runs its own all_reduce on every this many calls
            (None: never; the check rides on the saves, :meth:`offer`).

    Attributes:
        timeline: What the ranks served (written to ``timeline.json`` on each change).
    """

    def __init__(
        self,
        ckpt: TieredCheckpointer,
        poller: RequestPoller,
        timeline: Timeline,
        *,
        every: int | None,
    ) -> None:
        self.ckpt = ckpt
        self.poller = poller
        self.timeline = timeline
        self.every = every
        self.calls = 0
        self.collective_checks = 0
        # save index -> the request every rank knew at that save's first exchange
        self._offers: dict[int, int] = {}
        self._offers_lock = threading.Lock()

    def newest_unserved(self) -> int:
        """This rank's newest pending request above the served ones (0: none); what it
        contributes to a save's first exchange."""
        return newest_unserved(self.poller.snapshot(), self.timeline.served)

    def offer(self, index: int, agreed: int) -> None:
        """Record what save number ``index`` agreed on (called when this rank joins it).

        A rank joins save ``index`` at its next :meth:`save` call at the latest (or earlier,
        in ``wait()``), so at any :meth:`maybe_rollback` call made after ``saves`` save()
        calls, every rank holds the offers of every index below ``saves``, and they all read
        the same one: the newest below ``saves`` (:meth:`agreed_by_saves`).
        """
        with self._offers_lock:
            self._offers[index] = agreed

    def agreed_by_saves(self, saves: int) -> int:
        """The request id the newest save before save number ``saves`` agreed on (0: none);
        older offers are dropped."""
        with self._offers_lock:
            ready = [i for i in self._offers if i < saves]
            if not ready:
                return 0
            newest = max(ready)
            for i in ready:
                if i != newest:
                    del self._offers[i]
            return self._offers[newest]

    def pinned_steps(self) -> dict[int, list[int]]:
        """Steps the pending requests of this rank's agent name: step → request ids."""
        return pins_of(self.poller.snapshot(), served=self.timeline.served)

    def serve_pending_at_start(self, state: dict[str, Any]) -> int | None:
        """Serve the newest request every rank's agent holds, at a start (collective).

        Requests the ranks served before (``timeline.json``) are retired on the agent again.

        Returns:
            The step loaded, or None (no request pending, or it failed: reported).
        """
        requests = self.poller.refresh()
        stale = [r.request_id for r in requests if r.request_id <= self.timeline.served]
        if stale:
            self._retire(max(stale))
        agreed = self.ckpt.collectives.min_over_ranks(
            newest_unserved(requests, self.timeline.served)
        )
        if agreed <= self.timeline.served:
            return None
        return self._serve(state, agreed, requests, last_done=None)

    def maybe_rollback(
        self, state: dict[str, Any], *, last_done: int | None, saves: int
    ) -> int | None:
        """One :meth:`TieredCheckpointer.maybe_rollback
        <tierwatch.agent.checkpoint.training.checkpointer.TieredCheckpointer.maybe_rollback>`
        call (``last_done``: the step the loop just completed; ``saves``: the save() calls
        made so far).

        Returns:
            None, or the step now loaded.
        """
        self.calls += 1
        pending = self.poller.snapshot()
        if not self.ckpt.distributed:
            agreed = newest_unserved(pending, self.timeline.served)
        elif self.every is not None and self.calls % self.every == 0:
            self.collective_checks += 1
            agreed = self.ckpt.collectives.min_over_ranks(
                newest_unserved(pending, self.timeline.served)
            )
        else:
            agreed = self.agreed_by_saves(saves)
        if agreed <= self.timeline.served:
            return None
        return self._serve(state, agreed, pending, last_done=last_done)

    def _serve(
        self,
        state: dict[str, Any],
        request_id: int,
        pending: list[RestoreRequest],
        *,
        last_done: int | None,
    ) -> int | None:
        """Carry out request ``request_id``, which every rank knows (collective; ``pending``:
        the requests this rank's agent listed)."""
        from tierwatch.agent.checkpoint.training.restore import RestoreRun, restore_state

        ckpt = self.ckpt
        mine = next((r for r in pending if r.request_id == request_id), None)
        request = pick_request(ckpt.collectives.all_gather_control(mine), request_id)
        assert request is not None  # the rank(s) whose newest id is request_id hold it
        for older in pending:
            if self.timeline.served < older.request_id < request_id:
                self._report(
                    older,
                    "failed",
                    message=(f"superseded by restore request {request_id} (step {request.step})"),
                )
        log.info(
            "rank %d: restore request %d: rolling %s back to step %d%s (%s, by %s)",
            ckpt.rank,
            request_id,
            ckpt.job_id,
            request.step,
            f" from the {request.tier} tier" if request.tier else "",
            request.reason or "no reason given",
            request.actor or "unknown",
        )
        ckpt.wait()
        self._report(
            request,
            "staging",
            step=request.step,
            message=(
                f"rolling back to step {request.step}"
                + (f" from the {request.tier} tier" if request.tier else "")
                + f": {request.reason or 'no reason given'} (by {request.actor or 'unknown'})"
            ),
        )
        loaded: int | None = None
        run = RestoreRun(request_id=request_id)
        try:
            loaded = restore_state(
                ckpt,
                state,
                wanted=request.step,
                tier=request.tier,
                request_id=request_id,
                last_done=last_done,
                on_loaded=lambda s: self._drop_future(request, s),
                run=run,
            )
        except (CheckpointError, ModelMismatchError) as exc:
            if run.loading:
                raise CheckpointError(
                    f"restore request {request_id}: loading step {request.step} failed "
                    f"({exc}); the live state may be partly overwritten: restart the job "
                    "(it loads the requested step at start)"
                ) from exc
            log.error("rank %d: restore request %d not served: %s", ckpt.rank, request_id, exc)
        if loaded is None:
            self._set_timeline(self.timeline.after(request_id, loaded_step=None))
        self._retire(request_id)
        return loaded

    def _drop_future(self, request: RestoreRequest, step: int) -> list[str]:
        """After ``step`` is loaded for ``request``: fence the diverged future off and drop
        it from every tier. Returns notes for the report."""
        ckpt = self.ckpt
        why = f"rolled back to step {step} by restore request {request.request_id}"
        self._set_timeline(self.timeline.after(request.request_id, loaded_step=step))
        ckpt.drop_steps_after(step, why=why)
        notes: list[str] = []
        try:
            answer = ckpt.client.rollback(
                ckpt.job_id, request_id=request.request_id, step=step, persistent=ckpt.rank == 0
            )
            notes += [f"agent {ckpt.node}: {e}" for e in answer.get("errors", [])]
        except AgentUnavailable as exc:
            notes.append(f"newer steps not dropped from the replicas/persistent tier: {exc}")
            log.warning("rank %d: %s", ckpt.rank, notes[-1])
        return notes

    def _set_timeline(self, timeline: Timeline) -> None:
        self.timeline = timeline
        path = self.ckpt.layout.timeline_file(self.ckpt.job_id)
        try:
            timeline.write(path)
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)

    def _retire(self, request_id: int) -> None:
        try:
            self.ckpt.client.retire_restore_requests(self.ckpt.job_id, request_id)
        except AgentUnavailable as exc:  # retired again at the next start
            log.warning(
                "rank %d: restore request %d not retired on the agent: %s",
                self.ckpt.rank,
                request_id,
                exc,
            )

    def _report(
        self, request: RestoreRequest, phase: str, *, step: int | None = None, message: str = ""
    ) -> None:
        ckpt = self.ckpt
        report = RestoreReport(
            job_id=ckpt.job_id,
            rank=ckpt.rank,
            world_size=ckpt.world_size,
            step=step,
            ts=utcnow(),
            seconds=0.0,
            ok=phase != "failed",
            message=message[:2000],
            request_id=request.request_id,
            phase=phase,
        )  # type: ignore[arg-type]
        ckpt.events.restore(report)

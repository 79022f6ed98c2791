"""Is the control plane itself the likely cause of nodes going silent? (pure, plus the small
in-memory watch the leader keeps).

A node is "unreachable" when the server has received nothing from it for a while. That is
evidence against the node only if the server was listening the whole time. When the server
or its database stalled, restarted, or a new replica just took over as leader, healthy nodes
age into "unreachable" together, and isolating them would turn a control-plane hiccup into a
cluster-wide drain. So the policy never isolates for unreachability while any of these holds
(docs/operations.md, "Remediation safety"):

1. **Ingest lag.** The oldest report still waiting to be stored in this replica has waited
   longer than ``suspect_ingest_lag_s``: the database is slow or stalled.
2. **Not listening long enough.** This replica became leader, started, or resumed after its
   own loop stalled (the server or the database was down, or its passes failed) less than
   ``control_plane_window_s`` ago. A stall also raises the alert by itself, on the first pass
   after it, even when no node is held: the operator learns that verdicts are on hold.
   Agents back off up to 30 s between retries after an outage (``tierwatch.agent.reporter``),
   so a restart must not be followed by instant verdicts.
3. **Many at once.** More than ``max(1, suspect_unreachable_pct % of nodes)`` nodes went
   silent within the last ``control_plane_window_s``. Independent node failures are rare
   (Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs: about one every three
   hours, Dubey et al. 2024, Table 5); many nodes falling silent together points to a shared
   cause: the server, its database or the network in front of it.

Hardware findings (XIDs, ECC, row remapping) still act: they come from the node's own report,
which proves the node reached the server.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

STALL_MIN_S = 5.0
"""A gap between two leader passes longer than ``max(STALL_MIN_S, 5 × tick)`` counts as the
control plane having been down (the pass could not reach the database, or the process was
stopped)."""


@dataclass(frozen=True)
class ControlPlaneFacts:
    """What the leader knows about its own health at one policy pass.

    Attributes:
        now: the pass's time (UTC).
        listening_since: since when this replica has been leader and running its passes
            without a stall (UTC).
        ingest_lag_s: age of the oldest report waiting to be stored in this replica (s).
        ingest_waiting: reports waiting to be stored in this replica.
        cause: why ``listening_since`` is what it is: ``started``, ``became leader``,
            ``resumed after a stall of N s``.
        stall: set on the first pass after the leader found it had stalled (its passes
            could not run or reach the database): what happened; None otherwise.
    """

    now: datetime
    listening_since: datetime
    ingest_lag_s: float = 0.0
    ingest_waiting: int = 0
    cause: str = "started"
    stall: str | None = None


@dataclass(frozen=True)
class Silent:
    """A node the server has not heard from: its name and when it was last heard."""

    name: str
    last_seen: datetime


@dataclass(frozen=True)
class Suspicion:
    """Why the control plane is suspect now.

    Attributes:
        reasons: one line per condition that holds (empty: not suspect).
        evidence: the numbers behind them, for the alert and the audit log.
    """

    reasons: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def suspect(self) -> bool:
        return bool(self.reasons)

    def summary(self) -> str:
        return "; ".join(self.reasons)


def mass_limit(pct: float, nodes: int) -> float:
    """Newly silent nodes tolerated in one window before it counts as a mass:
    ``max(1, pct / 100 × nodes)`` (more than this is suspect)."""
    return max(1.0, pct / 100.0 * nodes)


def assess(
    facts: ControlPlaneFacts | None,
    silent: Sequence[Silent],
    *,
    nodes: int,
    window_s: float,
    ingest_lag_limit_s: float,
    mass_pct: float,
) -> Suspicion:
    """Decide whether the control plane is the likely cause of nodes being silent.

    Args:
        facts: the leader's own state; None when unknown (a direct call of the policy
            outside a server: then only the mass rule applies).
        silent: the nodes unreachable now.
        nodes: all nodes of the cluster.
        window_s: ``control_plane_window_s`` (s).
        ingest_lag_limit_s: ``suspect_ingest_lag_s`` (s).
        mass_pct: ``suspect_unreachable_pct`` (%).

    Returns:
        A :class:`Suspicion`; ``suspect`` is False when none of the three rules holds.
    """
    reasons: list[str] = []
    evidence: dict[str, Any] = {"unreachable": len(silent), "nodes": nodes}
    now = facts.now if facts is not None else None
    if facts is not None:
        if facts.stall is not None:
            reasons.append(f"the control plane stalled: {facts.stall}")
        evidence["ingest_lag_s"] = round(facts.ingest_lag_s, 2)
        evidence["ingest_waiting"] = facts.ingest_waiting
        listening_s = (facts.now - facts.listening_since).total_seconds()
        evidence["listening_s"] = round(listening_s, 1)
        evidence["listening_since"] = facts.listening_since.isoformat()
        if facts.ingest_lag_s > ingest_lag_limit_s:
            reasons.append(
                f"ingest lag {facts.ingest_lag_s:.1f} s (limit {ingest_lag_limit_s:g} s, "
                f"{facts.ingest_waiting} report(s) waiting): the database is slow or stalled"
            )
        if listening_s < window_s:
            reasons.append(
                f"the control plane has been listening for only {listening_s:.0f} s "
                f"({facts.cause}; window {window_s:g} s)"
            )
    if silent:
        newest = max(s.last_seen for s in silent)
        ref = now or newest
        recent = [s for s in silent if s.last_seen >= ref - timedelta(seconds=window_s)]
        limit = mass_limit(mass_pct, nodes)
        evidence["newly_unreachable"] = len(recent)
        evidence["mass_limit"] = math.floor(limit)
        if len(recent) > limit:
            reasons.append(
                f"{len(recent)} of {nodes} nodes went unreachable within {window_s:g} s "
                f"(more than {mass_pct:g} %, at least 2): a shared cause is more likely"
            )
    return Suspicion(reasons, evidence)


class ControlPlaneWatch:
    """The leader's own record of when it has been listening (in memory, per replica).

    :meth:`facts` is called at the start of every leader pass, :meth:`pass_done` at its end
    and :meth:`lost` when the replica is not (or no longer) the leader. A gap between passes,
    or a pass, longer than the stall limit restarts the listening period: the control plane
    (the process or its database) was down in between.

    Args:
        tick_s: the leader's pass interval (s).
        ingest_lag: returns (age of the oldest report waiting to be stored in s, reports
            waiting); None: no ingest in this process.
        clock: monotonic seconds (tests).
        wall: UTC now (tests).
    """

    def __init__(
        self,
        *,
        tick_s: float,
        ingest_lag: Callable[[], tuple[float, int]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] | None = None,
    ) -> None:
        from tierwatch.agent.protocol import utcnow

        self._stall_s = max(STALL_MIN_S, 5 * tick_s)
        self._ingest_lag = ingest_lag
        self._clock = clock
        self._wall = wall or utcnow
        self._lock = threading.Lock()
        self._last_pass: float | None = None
        self._pass_started: float | None = None
        self._since: datetime = self._wall()
        self._cause = "started"
        self._stall: str | None = None

    def lost(self) -> None:
        """This replica is not the leader (the next pass that leads starts a new period)."""
        with self._lock:
            self._last_pass = None
            self._cause = "became leader"

    def facts(self) -> ControlPlaneFacts:
        """The facts for the pass about to run (call at its start)."""
        now_m, now = self._clock(), self._wall()
        with self._lock:
            if self._last_pass is None:
                self._since, self._last_pass = now, now_m
            elif now_m - self._last_pass > self._stall_s:
                gap = now_m - self._last_pass
                self._cause = f"resumed after a stall of {gap:.0f} s"
                self._stall = f"no leader pass completed for {gap:.0f} s"
                self._since = now
            self._pass_started = now_m
            since, cause, stall = self._since, self._cause, self._stall
            self._stall = None
        lag, waiting = self._ingest_lag() if self._ingest_lag is not None else (0.0, 0)
        return ControlPlaneFacts(
            now=now,
            listening_since=since,
            ingest_lag_s=lag,
            ingest_waiting=waiting,
            cause=cause,
            stall=stall,
        )

    def pass_done(self, *, ok: bool = True) -> None:
        """A leader pass ended. A pass that took longer than the stall limit (it waited on a
        stalled database) restarts the listening period as a gap does; a failed pass (the
        database refused or dropped it) does not count as listening at all."""
        now_m = self._clock()
        with self._lock:
            if not ok:
                return
            started = self._pass_started
            if started is not None and now_m - started > self._stall_s:
                waited = now_m - started
                self._cause = f"a leader pass waited {waited:.0f} s on the database"
                self._stall = self._cause
                self._since = self._wall()
            self._last_pass = now_m

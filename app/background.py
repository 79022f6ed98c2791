"""The server's background work, run by the leader replica only (``leader.LeaderLock``).

Every ``tick_s`` (1 s) the leader expires commands and restore requests, runs one pass of
the auto-isolation policy and delivers due alerts; every ``ROLLUP_PASS_S`` (60 s) it creates
the raw samples' partitions ahead (PostgreSQL, ``fleet.partitions``) and rolls up closed
5-minute buckets (``fleet.rollups``); every ``prune_interval_s`` it prunes raw history.
Cluster-driver commands (slurm, kubernetes) run in a task of their own, one at a time, so a
slow ``scontrol`` never delays the policy. A replica that is not the leader only checks, each
tick, whether the lock became free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import httpx
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from tierwatch.agent.protocol import utcnow
from tierwatch.server.actions import policy, queue, restores
from tierwatch.server.actions.control_plane import ControlPlaneFacts, ControlPlaneWatch
from tierwatch.server.actions.drivers import (
    ClusterDriver,
    DriverConfigError,
    DriverResult,
    make_cluster_driver,
)
from tierwatch.server.actions.ingest import record_command_outcome
from tierwatch.server.actions.models import CommandRow
from tierwatch.server.actions.queue import prune as prune_actions
from tierwatch.server.alerts.delivery import deliver_due
from tierwatch.server.alerts.service import deliver_after_maintenance, prune_alerts
from tierwatch.server.config import ConfigError, Settings
from tierwatch.server.fleet import partitions, rollups
from tierwatch.server.fleet import service as fleet_service
from tierwatch.server.fleet.models import Node
from tierwatch.server.leader import LeaderLock

log = logging.getLogger("tierwatch.server.background")

# How often the leader creates the sample partitions ahead and rolls up closed buckets (s).
ROLLUP_PASS_S = 60.0


class BackgroundWork:
    """The leader's loops.

    Args:
        factory: session factory of the app.
        engine: the app's engine (for the leader lock).
        settings: server settings.
        tick_s: seconds between passes.

        ingest_lag: the ingest writer's ``lag`` (for the control-plane guard).

    Raises:
        ConfigError: the configured cluster driver cannot be set up (e.g. no kubeconfig).
    """

    def __init__(
        self,
        factory: sessionmaker[Session],
        engine: Engine,
        settings: Settings,
        *,
        tick_s: float = 1.0,
        ingest_lag: Callable[[], tuple[float, int]] | None = None,
    ) -> None:
        self._factory = factory
        self._settings = settings
        self._tick_s = tick_s
        self.lock = LeaderLock(engine)
        try:
            self._driver: ClusterDriver | None = make_cluster_driver(settings.isolation)
        except DriverConfigError as exc:
            raise ConfigError(f"isolation driver {settings.isolation.driver}: {exc}") from exc
        scontrol = settings.isolation.scontrol
        if settings.isolation.driver == "slurm" and shutil.which(scontrol) is None:
            raise ConfigError(
                f"isolation driver slurm: {scontrol!r} is not an executable "
                "on PATH: install Slurm's client tools on the server or set "
                "TIERWATCH_ISOLATION__SCONTROL to scontrol's path"
            )
        # A driver run with no result after this is given up (the agent enforces
        # --isolation-timeout, the server the driver's timeout_s; the margin covers reports).
        self._run_limit_s = max(3 * settings.isolation.timeout_s, 2 * settings.commands.ttl_s)
        self._tasks: list[asyncio.Task[None]] = []
        self._last_prune = time.monotonic()
        self._last_rollup = 0.0
        self._rolled_up_to: datetime | None = None
        self._wake_drivers = asyncio.Event()
        self.ticks = 0
        self.watch = ControlPlaneWatch(tick_s=tick_s or 1.0, ingest_lag=ingest_lag)

    def start(self) -> None:
        """Start the loops on the running event loop (none with ``background_tick_s=0``)."""
        if self._tick_s <= 0:
            return
        self._tasks = [asyncio.create_task(self._main()), asyncio.create_task(self._drivers())]

    async def stop(self) -> None:
        """Stop the loops and give up the lock."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await run_in_threadpool(self.lock.release)

    def wake_drivers(self) -> None:
        """Run queued cluster-driver commands now (called after an isolate/release)."""
        self._wake_drivers.set()

    # -- main loop ------------------------------------------------------------------------
    async def _main(self) -> None:
        async with httpx.AsyncClient(timeout=self._settings.alerts.timeout_s) as client:
            while True:
                try:
                    if await run_in_threadpool(self.lock.check):
                        await self.tick(client)
                    else:
                        self.watch.lost()
                except Exception:  # noqa: BLE001 - log and go on at the next tick
                    log.exception("background pass failed")
                await asyncio.sleep(self._tick_s)

    async def tick(self, client: httpx.AsyncClient) -> None:
        """One leader pass: expiry, policy, alerts, and pruning when due."""
        await run_in_threadpool(self._expire_and_police)
        await deliver_due(self._factory, self._settings.alerts, client, now=utcnow())
        interval = self._settings.prune_interval_s
        if interval > 0 and time.monotonic() - self._last_prune >= interval:
            self._last_prune = time.monotonic()
            await run_in_threadpool(self._prune)
        if time.monotonic() - self._last_rollup >= ROLLUP_PASS_S:
            self._last_rollup = time.monotonic()
            await run_in_threadpool(self._roll_up)
        self.ticks += 1

    def _expire_and_police(self) -> None:
        facts = self.watch.facts()
        try:
            self._police(facts)
        except BaseException:
            self.watch.pass_done(ok=False)
            raise
        self.watch.pass_done()

    def _police(self, facts: ControlPlaneFacts) -> None:
        now = facts.now
        with self._factory() as session:
            expired = queue.expire(session, now=now, run_limit_s=self._run_limit_s)
            names = _names(session, [r.node_id for r in expired])
            for row in expired:
                record_command_outcome(
                    session, self._settings, row, names.get(row.node_id, "?"), now=now
                )
            restores.expire_requests(session, now=now, settings=self._settings)
            # a silenced alert that outlived its maintenance window is delivered now
            deliver_after_maintenance(session, self._settings.alerts, now=now)
            session.commit()
        with self._factory() as session:
            run = policy.run(
                session,
                self._settings,
                now=now,
                facts=facts,
                observe=self._driver.observe if self._driver is not None else None,
            )
            session.commit()
        if run.isolated:
            log.warning("policy isolated %s", ", ".join(run.isolated))
            self.wake_drivers()
        if run.suspect is not None:
            log.warning(
                "control plane suspect, not isolating %s: %s",
                ", ".join(run.held_unreachable),
                run.suspect.summary(),
            )
        if run.tripped:
            log.error("auto-isolation circuit breaker tripped; holding %s", ", ".join(run.held))

    def _roll_up(self) -> None:
        """Create the sample partitions ahead (PostgreSQL) and roll up closed buckets."""
        now = utcnow()
        with self._factory() as session:
            engine = session.get_bind()
            if engine.dialect.name == "postgresql":
                with engine.connect() as conn:  # type: ignore[union-attr]
                    partitions.maintain(conn, now=now, cut=None)
            self._rolled_up_to = rollups.roll_up(session, now=now, after=self._rolled_up_to)

    def _prune(self) -> None:
        now = utcnow()
        with self._factory() as session:
            deleted = fleet_service.prune(
                session,
                now=now,
                sample_retention_s=self._settings.sample_retention_s,
                event_retention_s=self._settings.event_retention_s,
                rollup_retention_s=self._settings.rollup_retention_s,
            )
            deleted["alerts"] = prune_alerts(
                session, now=now, retention_s=self._settings.event_retention_s
            )
            deleted |= prune_actions(session, now=now, retention_s=self._settings.event_retention_s)
            session.commit()
        log.info("pruned %s", deleted)

    # -- cluster drivers ------------------------------------------------------------------
    async def _drivers(self) -> None:
        while True:
            try:
                if self.lock.held:
                    while await self._run_one_batch():
                        pass
            except Exception:  # noqa: BLE001
                log.exception("running driver commands failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake_drivers.wait(), self._tick_s)
            self._wake_drivers.clear()

    async def _run_one_batch(self) -> bool:
        claimed = await run_in_threadpool(self._claim)
        for command_id, kind, node, reason in claimed:
            result = await run_in_threadpool(self._run_driver, kind, node, reason)
            await run_in_threadpool(self._finish, command_id, result)
        return bool(claimed)

    def _claim(self) -> list[tuple[str, str, str, str]]:
        with self._factory() as session:
            rows = queue.claim_server_commands(session, now=utcnow())
            names = _names(session, [r.node_id for r in rows])
            out = [(r.id, r.kind, names.get(r.node_id, ""), r.reason) for r in rows]
            session.commit()
        return out

    def _run_driver(self, kind: str, node: str, reason: str) -> DriverResult:
        if self._driver is None:
            return DriverResult(
                False,
                None,
                (
                    f"isolation driver {self._settings.isolation.driver!r} is not usable on the "
                    "server (no cluster driver configured)"
                ),
            )
        run: Callable[[str, str], Any] = (
            self._driver.isolate if kind == "isolate" else self._driver.release
        )
        try:
            res: DriverResult = run(node, reason)
        except Exception as exc:  # noqa: BLE001 - a driver bug fails this run, not the loop
            log.exception("isolation driver %s failed on %s", self._driver.name, node)
            return DriverResult(False, None, f"driver error: {exc!r}")
        return res

    def _finish(self, command_id: str, result: DriverResult) -> None:
        now = utcnow()
        with self._factory() as session:
            row = session.get(CommandRow, command_id)
            if row is None:
                return
            if queue.finish(
                row, ok=result.ok, exit_code=result.exit_code, output=result.output, now=now
            ):
                names = _names(session, [row.node_id])
                record_command_outcome(
                    session,
                    self._settings,
                    row,
                    names.get(row.node_id, "?"),
                    now=now,
                    detail=result.detail,
                )
            session.commit()


def _names(session: Session, node_ids: list[int]) -> dict[int, str]:
    if not node_ids:
        return {}
    return dict(
        session.execute(select(Node.id, Node.name).where(Node.id.in_(sorted(set(node_ids)))))
        .tuples()
        .all()
    )

"""Launch the training job on the cluster's usable nodes, and relaunch it after a failure.

A small launcher around ``examples/launch.py`` (one process per rank, gloo on loopback):
before every (re)launch it asks tierwatch for a fresh verdict on the nodes and places the
ranks on nodes that are reachable, not isolated and not unhealthy, keeping each rank on
its previous node when that node is still usable and taking spares (in name order) for the
others. It never decides on its own that a node is bad: it waits for the server (the
health engine and the auto-isolation policy) to say so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from demo.cluster import Cluster, detach, end_child

REPO = Path(__file__).resolve().parent.parent
USABLE_STATES = ("healthy", "degraded")


def usable(view: dict[str, Any]) -> bool:
    """A node a rank may be placed on: reachable, not isolated, not unhealthy."""
    return not view["isolated"] and view["state"] in USABLE_STATES


def place(
    previous: list[str] | None, views: dict[str, dict[str, Any]], world_size: int
) -> list[str] | None:
    """The node of every rank (index = rank), or None when too few nodes are usable.

    Ranks stay on their previous node when it is still usable; the others take the usable
    nodes not in use, in name order.
    """
    ok = sorted(n for n, v in views.items() if usable(v))
    if len(ok) < world_size:
        return None
    layout: list[str | None] = [None] * world_size
    if previous and len(previous) == world_size:
        for r, n in enumerate(previous):
            if n in ok:
                layout[r] = n
    free = [n for n in ok if n not in layout]
    for r in range(world_size):
        if layout[r] is None:
            layout[r] = free.pop(0)
    return [n for n in layout if n is not None]


def seen_after(view: dict[str, Any], since: datetime) -> bool:
    """Whether the node's last report (``last_seen``) is newer than ``since``."""
    last = view.get("last_seen")
    return bool(last) and datetime.fromisoformat(last.replace("Z", "+00:00")) > since


@dataclass
class Job:
    """One launch of the job: the launcher process and where its ranks run."""

    layout: list[str]
    proc: subprocess.Popen[bytes]
    ranks_file: Path
    started: float  # time.time()
    log: IO[bytes]

    def pid(self, rank: int, timeout: float = 30.0) -> int:
        """The process id of ``rank`` (from the launcher's ranks file).

        Raises:
            RuntimeError: the launcher did not write it within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                ranks = json.loads(self.ranks_file.read_text())["ranks"]
                return int(ranks[rank]["pid"])
            except (OSError, ValueError, KeyError, IndexError):
                time.sleep(0.05)
        raise RuntimeError(f"the launcher wrote no {self.ranks_file} in {timeout:g} s")

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the launcher (it stops its ranks) and wait for it."""
        end_child(self.proc, signal.SIGTERM, 60)
        self.log.close()


class Supervisor:
    """Places and (re)launches the job. ``train_args`` are ``examples/train_gpt.py``'s.

    With ``standby`` (the default) it keeps the next incarnation warm: a launcher whose ranks
    have started Python and imported torch and tierwatch (about 5 s of CPU per rank here)
    and wait for a go file that names their nodes. A relaunch then costs the process
    group, the model, the restore and the first step, not the imports.
    """

    def __init__(
        self,
        cluster: Cluster,
        *,
        world_size: int,
        train_args: list[str],
        verdict_timeout_s: float = 30.0,
        standby: bool = True,
        job_id: str = "demo-gpt",
    ) -> None:
        self.cluster = cluster
        self.job_id = job_id
        self.world_size = world_size
        self.train_args = train_args
        self.verdict_timeout_s = verdict_timeout_s
        self.use_standby = standby
        self.layout: list[str] | None = None
        self.launches = 0
        self.standby: Job | None = None
        self.standby_go: Path | None = None

    def _start(self, nodes: list[str] | None) -> Job:
        self.launches += 1
        k = self.launches
        ranks_file = self.cluster.var / f"ranks-{k}.json"
        if nodes is None:
            self.standby_go = self.cluster.var / f"go-{k}.json"
            where = ["--standby", str(self.standby_go), "--nnodes", str(self.world_size)]
        else:
            where = [f"--node={n}={self.cluster.nodes[n].url}" for n in nodes]
        env = dict(os.environ)
        if nodes is not None:  # the job's own (re)start registers it on its nodes
            env["TIERWATCH_JOB_CREDENTIAL"] = self.cluster.job_credential(self.job_id, nodes)
        log = open(self.cluster.logs / "train.log", "ab")  # noqa: SIM115 - closed by Job.stop
        proc = subprocess.Popen(
            [
                sys.executable,
                str(REPO / "examples" / "launch.py"),
                *where,
                "--ranks-file",
                str(ranks_file),
                "--",
                str(REPO / "examples" / "train_gpt.py"),
                *self.train_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=str(self.cluster.var),
            env=env,
            preexec_fn=detach,
        )
        return Job(nodes or [], proc, ranks_file, time.time(), log)

    def prepare(self) -> None:
        """Start a warm standby incarnation (no-op without ``standby`` or when one runs)."""
        if self.use_standby and (self.standby is None or not self.standby.running):
            self.standby = self._start(None)

    def launch(self, layout: list[str]) -> Job:
        """Run the job with rank r on ``layout[r]``: hand the nodes to the warm standby if
        there is one (its go file), else start a launcher from scratch."""
        self.layout = layout
        job, go = self.standby, self.standby_go
        self.standby = self.standby_go = None
        if job is not None and go is not None and job.running:
            credential = self.cluster.job_credential(self.job_id, layout)
            tmp = go.with_suffix(".tmp")
            tmp.touch(mode=0o600)
            tmp.write_text(
                json.dumps(
                    {
                        "nodes": [[n, self.cluster.nodes[n].url] for n in layout],
                        "credential": credential,
                    }
                )
            )
            tmp.replace(go)
            job.layout, job.started = list(layout), time.time()
            return job
        if job is not None:
            job.stop()
        return self._start(layout)

    def stop(self) -> None:
        """Stop the standby incarnation, if any."""
        if self.standby is not None:
            self.standby.stop()
            self.standby = None

    def wait_for_verdict(
        self, since: datetime, *, stop: Any = None, tick: Any = None
    ) -> tuple[list[str] | None, dict[str, dict[str, Any]]]:
        """Wait until the server has a verdict newer than ``since`` on every node of the
        last layout (a report after it, or an isolation), and usable nodes for every rank.

        A node that is unhealthy or unreachable but not isolated yet is waited for: the
        auto-isolation policy acts within a background tick. After ``verdict_timeout_s``
        the placement uses whatever the server says then. ``stop()`` ends the wait early;
        ``tick()`` runs on every poll (the demo's repairs go on meanwhile).

        Returns:
            (layout or None when too few nodes are usable, the node views last read).
        """
        deadline = time.monotonic() + self.verdict_timeout_s
        views: dict[str, dict[str, Any]] = {}
        while True:
            try:
                views = self.cluster.node_views()
            except Exception:  # noqa: BLE001 - the server is busy: ask again
                views = views or {}
            prev = self.layout or []
            settled = all(
                n in views
                and (
                    views[n]["isolated"]
                    or (seen_after(views[n], since) and views[n]["state"] in USABLE_STATES)
                )
                for n in prev
            )
            layout = place(self.layout, views, self.world_size) if views else None
            if (settled and layout) or time.monotonic() > deadline or (stop and stop()):
                return layout, views
            if tick is not None:
                tick()
            time.sleep(0.2)


def utcnow() -> datetime:
    return datetime.now(UTC)

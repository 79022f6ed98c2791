"""``make demo``: a training job on 5 simulated nodes that survives injected failures.

Starts tierwatch-server (SQLite, auto-isolation policy on) and 5 agents with simulated GPUs
(4 nodes in use, 1 spare), launches ``examples/train_gpt.py`` on 4 ranks (one per node,
gloo) checkpointing through the memory, peer and persistent tiers, then injects failures
drawn from the Llama 3 interruption table (:mod:`demo.faults`) and makes each real
(:mod:`demo.injector`). tierwatch flags the node, the policy isolates it, the supervisor
(:mod:`demo.supervisor`) relaunches the job with the spare in its place, the ranks restore
from the fastest tier that survived, and the node is released after a simulated repair.
The report (:mod:`demo.report`) is kept up to date in ``var/demo-report.json`` and shown at
``/demo`` on the dashboard; it is printed at the end.

Environment (or options): ``DEMO_SECONDS`` (0: until Ctrl-C), ``DEMO_MTBF`` (60 s),
``DEMO_SEED`` (3), ``DEMO_PROMETHEUS`` (0; 1: a Prometheus scrapes the agents and the node
charts read from it, :mod:`demo.prometheus`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fsspec
from pydantic import Field

from demo import cluster as cluster_mod
from demo import faults, report
from demo.cluster import Cluster, port_free
from demo.injector import strike
from demo.prometheus import DemoPrometheus
from demo.prometheus import find_executable as find_prometheus
from demo.supervisor import Job, Supervisor, seen_after
from tierwatch.server.demo.report import DemoReport, Failure

REPO = Path(__file__).resolve().parent.parent
JOB = "demo-gpt"
WORLD = 4
NODES = 5
WARMUP_S = 15.0
TAIL_S = 25.0
REPAIR_S = 20.0


def env_number(name: str, default: float, kind: type = float) -> Any:
    """``kind(os.environ[name])`` or ``default``.

    Raises:
        SystemExit: the variable is set but not a finite number (the message names it).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise SystemExit(f"error: {name}={raw!r} is not a {'whole ' if kind is int else ''}number")
    return value


def env_flag(name: str) -> bool:
    """Whether ``os.environ[name]`` is on (``1``/``true``/``yes``; unset, empty,
    ``0``/``false``/``no``: off).

    Raises:
        SystemExit: any other value (the message names the variable).
    """
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise SystemExit(f"error: {name}={os.environ[name]!r} is not 0 or 1")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of ``path`` ([] when absent; a torn last line is skipped)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def iso(ts: float) -> str:
    return utc(ts).isoformat()


class FailureRecord(Failure):
    """One injected failure and how the job came back: the report's ``failures`` item (the
    dashboard's schema, :class:`~tierwatch.server.demo.report.Failure`), plus the
    measured costs of this recovery, which feed the report's ``costs`` and ``baseline``."""

    restore_s: float | None = Field(default=None, exclude=True)
    restart_s: float | None = Field(default=None, exclude=True)


class Demo:
    """The run: cluster, supervisor, failure schedule, records, report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.var: Path = args.var_dir
        self.report_path: Path = args.report
        self.real_gpus = args.collector == "nvml" or (
            args.collector == "auto" and cluster_mod.nvml_gpus() > 0
        )
        self.cluster = Cluster(
            var=self.var,
            port=args.port,
            agent_port=args.agent_port,
            gpus=args.gpus,
            interval_s=args.interval,
            report=self.report_path.resolve(),
            collector="nvml" if self.real_gpus else "simulated",
        )
        self.prometheus = (
            DemoPrometheus(
                root=self.var / "prometheus",
                targets=self.cluster.agent_targets(NODES),
                executable=args.prometheus_exe,
            )
            if args.prometheus
            else None
        )
        self.log_dir = self.var / "train"
        self.train_args = [
            "--job-id",
            JOB,
            "--steps",
            "1000000",
            "--width",
            "128",
            "--layers",
            "2",
            "--batch-size",
            "8",
            "--persist-every",
            str(args.persist_every),
            "--save-every",
            str(args.save_every),
            "--keep-memory",
            "2",
            "--step-sleep",
            str(args.step_sleep),
            "--latency-every",
            "20",
            "--log-dir",
            str(self.log_dir.resolve()),
            "--sdc-signal",
        ]
        self.sup = Supervisor(
            self.cluster,
            world_size=WORLD,
            train_args=self.train_args,
            standby=args.standby,
            job_id=JOB,
        )
        self.rng = random.Random(args.seed)
        self.records: list[FailureRecord] = []
        self.repairs: list[tuple[float, str, str]] = []  # (due, node, effect action)
        self.t0: float | None = None  # wall time training started (first step began)
        self.started_at = time.time()
        self.stopping = False
        self.job: Job | None = None
        self.persistent_restore_s: float | None = None
        self.planned: int | None = None
        self.write_samples: list[float] = []  # δ samples: memory + persistent commit medians

    # -- logs --------------------------------------------------------------------------
    def steps(self, rank: int = 0) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.log_dir / f"rank-{rank}.jsonl") if report.is_step(e)]

    def restores(self, rank: int) -> list[dict[str, Any]]:
        return read_jsonl(self.log_dir / f"restores-{rank}.jsonl")

    def say(self, msg: str) -> None:
        el = f"{time.time() - self.t0:7.1f}s" if self.t0 else "  setup "
        print(f"[demo {el}] {msg}", flush=True)

    # -- set-up ------------------------------------------------------------------------
    def start(self) -> None:
        self.var.mkdir(parents=True, exist_ok=True)
        # a fresh run: a previous run's go files would start this run's standby at once
        for stale in ("train", "nodes", "persistent", "logs"):
            _rmtree(self.var / stale)
        for pattern in ("ranks-*.json", "go-*.json", "go-*.tmp"):
            for f in self.var.glob(pattern):
                f.unlink()
        self.report_path.unlink(missing_ok=True)
        if self.prometheus is not None:
            # before the server: its first chart request already finds Prometheus up
            self.prometheus.start()
            self.cluster.prometheus_url = self.prometheus.url
            self.say(f"Prometheus on {self.prometheus.url} scrapes the agents' /metrics")
        self.cluster.start_server()
        names = [f"gpu-node-{i + 1:02d}" for i in range(NODES)]
        for i, name in enumerate(names):
            self.cluster.add_node(name, i)
        for name in names:
            self.cluster.nodes[name].wait_ready()
        since = utc(time.time())
        layout = None
        views: dict[str, Any] = {}
        deadline = time.monotonic() + 60
        while layout is None or not all(seen_after(v, since) for v in views.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the nodes did not report healthy within 60 s; see {self.cluster.logs}"
                )
            time.sleep(0.3)
            views = self.cluster.node_views()
            layout = self.sup.wait_for_verdict(since)[0] if len(views) == NODES else None
        self.sup.prepare()
        self.job = self.sup.launch(layout)
        self.say(
            f"job {JOB} launched on {', '.join(layout)} (spare: "
            f"{', '.join(n for n in names if n not in layout)})"
        )

    def wait_first_step(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.steps()
            if s:
                self.t0 = s[0]["t"] - s[0].get("step_s", 0.0)
                return
            if self.job is not None and not self.job.running:
                raise RuntimeError(
                    f"the job exited before its first step; see {self.cluster.logs / 'train.log'}"
                )
            time.sleep(0.2)
        raise RuntimeError(
            f"no training step within {timeout:g} s; see {self.cluster.logs / 'train.log'}"
        )

    # -- repairs -----------------------------------------------------------------------
    def do_repairs(self, force: bool = False) -> None:
        now = time.time()
        for item in list(self.repairs):
            due, name, action = item
            if now < due and not force:
                continue
            self.repairs.remove(item)
            node = self.cluster.nodes[name]
            if action == "host":
                node.start()
                node.wait_ready()
            else:
                node.inject("clear")
            r = self.cluster.api(
                "POST",
                f"/nodes/{name}/release",
                json={"reason": f"demo: repaired (simulated repair time {self.args.repair:g} s)"},
            )
            self.say(f"{name} repaired and released ({r.status_code}); it is a spare now")

    # -- one failure -------------------------------------------------------------------
    def inject(self, plan: faults.PlannedFailure) -> FailureRecord:
        assert self.job is not None
        assert self.t0 is not None
        effect = faults.effect_of(plan.kind, real_gpus=self.real_gpus)
        rank = 0 if effect.action == "sdc" else plan.rank
        node_name = self.job.layout[rank]
        node = self.cluster.nodes[node_name]
        pid = self.job.pid(rank)
        fail_t = time.time()
        last_before = self.steps()[-1]["step"] if self.steps() else None
        injected = strike(effect, node, pid, self.rng, self.args.gpus)
        rec = FailureRecord(
            at_s=round(fail_t - self.t0, 2),
            component=plan.kind.component,
            category=plan.kind.category,
            failure_class=plan.kind.failure_class,
            node=node_name,
            rank=rank,
            injected=injected,
            recovered=False,
        )
        self.say(
            f"failure {plan.index + 1}: {plan.kind.component} ({plan.kind.failure_class})"
            f" on {node_name} (rank {rank}): {injected}"
        )
        if effect.action == "sdc":
            self.recover_sdc(rec, fail_t)
        else:
            self.recover_restart(
                rec,
                fail_t,
                last_before,
                node_bad=plan.kind.failure_class == "node",
                action=effect.action,
            )
        return rec

    def recover_restart(
        self,
        rec: FailureRecord,
        fail_t: float,
        last_before: int | None,
        *,
        node_bad: bool,
        action: str,
    ) -> None:
        assert self.job is not None
        while self.job.running:  # the launcher stops the other ranks
            time.sleep(0.05)
        down_t = time.time()
        self.job.stop()
        if not node_bad:
            rec.detected_after_s = round(down_t - fail_t, 2)
        # the server's verdict: the health engine flags the node, the policy isolates it
        since = utc(fail_t)
        layout, views = None, {}
        while layout is None and not self.stopping:
            layout, views = self.sup.wait_for_verdict(
                since, stop=lambda: self.stopping, tick=self.do_repairs
            )
            if node_bad and rec.detected_after_s is None:
                rec.detected_after_s = self._detected(rec.node, fail_t)
            if layout is None:
                self.say("too few usable nodes: waiting for a repair")
                self.do_repairs(force=True)
        if layout is None:
            return
        view = views.get(rec.node or "", {})
        rec.isolated = bool(view.get("isolated"))
        if rec.isolated:
            iso = view.get("isolation") or {}
            at = ""
            if iso.get("at") and self.t0:
                stamp = datetime.fromisoformat(iso["at"].replace("Z", "+00:00")).timestamp()
                at = f" at {stamp - self.t0:.1f} s"
            self.say(f"{rec.node} isolated{at} by {iso.get('by')}: {iso.get('reason', '')}")
            self.repairs.append((time.time() + self.args.repair, rec.node or "", action))
        new = layout[rec.rank or 0]
        rec.replaced_by = new if new != rec.node else None
        relaunch_t = time.time()
        seen = {r: len(self.restores(r)) for r in range(WORLD)}
        self.job = self.sup.launch(layout)
        self.say(
            f"relaunched on {', '.join(layout)}"
            + (f" ({new} replaces {rec.node})" if rec.replaced_by else "")
        )
        # restored: every rank's restore report; resumed: rank 0's first new step
        reps: dict[int, dict[str, Any]] = {}
        first = None
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not self.stopping:
            for r in range(WORLD):
                new_reps = self.restores(r)[seen[r] :]
                if new_reps:
                    reps[r] = new_reps[-1]
            first = next((e for e in self.steps() if e["t"] > relaunch_t), None)
            if len(reps) == WORLD and first is not None:
                break
            if not self.job.running:
                rec.note = "the relaunched job exited; see logs/train.log"
                break
            self.do_repairs()
            time.sleep(0.1)
        else:
            if self.stopping:
                rec.note = "the demo was stopped during this recovery"
            else:
                rec.note = "no restore report from every rank within 180 s; see logs/train.log"
        self._fill_restore(rec, reps, last_before)
        if first is not None and len(reps) == WORLD:
            resumed = first["t"] - first.get("step_s", 0.0)
            rec.downtime_s = round(resumed - fail_t, 2)
            rec.restart_s = round(resumed - relaunch_t - (rec.restore_s or 0.0), 2)
            rec.recovered = all(r.get("ok") for r in reps.values())
            self.sup.prepare()  # the next incarnation warms up while this one trains
            self.say(
                f"recovered: step {rec.restored_step} from {rec.restore_tier} "
                f"(ranks: {rec.rank_tiers}), {rec.steps_lost} step(s) lost, down "
                f"{rec.downtime_s:.1f} s"
            )

    def recover_sdc(self, rec: FailureRecord, fail_t: float) -> None:
        assert self.job is not None
        event = None
        deadline = time.monotonic() + 60
        while event is None and time.monotonic() < deadline:
            event = next(
                (
                    e
                    for e in read_jsonl(self.log_dir / "rank-0.jsonl")
                    if e.get("event") == "sdc" and e["t"] >= fail_t
                ),
                None,
            )
            time.sleep(0.05)
        if event is None:
            rec.note = "rank 0 did not log the corruption"
            return
        bad = int(event["step"])
        announce_t = time.time()
        rec.detected_after_s = round(announce_t - fail_t, 2)
        self.say(
            f"silent data corruption announced: weights wrong from step {bad}; rolling the job back"
        )
        reason = f"demo: silent data corruption detected in step {bad}"
        target = bad - 1
        r = self.cluster.api(
            "POST", f"/jobs/{JOB}/restore", json={"step": target, "reason": reason}
        )
        if r.status_code == 409:
            held = {s: t for s, t in _restorable(r.json()).items() if s < bad}
            # the newest persisted step before the corruption (kept longest, so it is still
            # there when the request reaches the agents), else the newest of any tier
            persisted = [s for s, t in held.items() if "persistent" in t]
            if not held:
                rec.note = f"no step before {bad} is restorable: {r.text}"
                return
            target = max(persisted or held)
            r = self.cluster.api(
                "POST", f"/jobs/{JOB}/restore", json={"step": target, "reason": reason}
            )
        if r.status_code != 202:
            rec.note = f"restore refused: {r.status_code} {r.text}"
            return
        request_id = r.json()["id"]
        reps: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + 120
        while len(reps) < WORLD and time.monotonic() < deadline and not self.stopping:
            self.do_repairs()
            for rk in range(WORLD):
                done = [
                    x
                    for x in self.restores(rk)
                    if x.get("request_id") == request_id and x.get("phase") in ("loaded", "failed")
                ]
                if done:
                    reps[rk] = done[-1]
            time.sleep(0.1)
        self._fill_restore(rec, reps, None)
        if len(reps) < WORLD:
            rec.note = (
                "the demo was stopped during this rollback"
                if self.stopping
                else f"not every rank reported restore request {request_id} in 120 s"
            )
        if len(reps) == WORLD:
            loaded_t = max(datetime.fromisoformat(x["ts"]).timestamp() for x in reps.values())
            rec.downtime_s = round(loaded_t - fail_t, 2)
            rec.recovered = all(x.get("ok") and x.get("phase") == "loaded" for x in reps.values())
            self.say(
                f"rolled back to step {rec.restored_step} from {rec.restore_tier}, "
                f"{rec.steps_lost} step(s) lost"
            )
            if rec.restore_tier == "persistent":
                self.persistent_restore_s = rec.restore_s

    def _detected(self, node: str | None, fail_t: float) -> float | None:
        """Seconds from the failure to the server showing the node not usable (the node's
        ``state_since`` or isolation time, whichever came first after the failure)."""
        try:
            view = self.cluster.node_views().get(node or "")
        except Exception:  # noqa: BLE001 - no verdict to read now
            return None
        if not view:
            return None
        stamps = []
        for key in ("state_since",):
            if view.get(key) and view["state"] not in ("healthy", "degraded"):
                stamps.append(view[key])
        if view.get("isolation") and view["isolation"].get("at"):
            stamps.append(view["isolation"]["at"])
        if view["state"] == "unreachable" and view.get("last_seen"):
            # unreachable is computed from the last report: it showed 3 intervals after it
            last = datetime.fromisoformat(view["last_seen"].replace("Z", "+00:00"))
            stamps.append(last.timestamp() + 3 * self.args.interval)
        times = [
            s
            if isinstance(s, float)
            else datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()
            for s in stamps
        ]
        times = [t for t in times if t >= fail_t - 1]
        return round(max(0.0, min(times) - fail_t), 2) if times else None

    def _fill_restore(
        self, rec: FailureRecord, reps: dict[int, dict[str, Any]], last_before: int | None
    ) -> None:
        if not reps:
            return
        steps = {x.get("step") for x in reps.values()}
        rec.restored_step = min(s for s in steps if s is not None) if steps - {None} else None
        rec.rank_tiers = report.shard_tiers([x.get("sources", {}) for x in reps.values()])
        rec.restore_tier = report.slowest_tier(rec.rank_tiers.values())
        lost = [x.get("steps_lost") for x in reps.values() if x.get("steps_lost") is not None]
        if lost:
            rec.steps_lost = max(lost)
        elif last_before is not None and rec.restored_step is not None:
            rec.steps_lost = max(0, last_before - rec.restored_step)
        rec.restore_s = round(max(x.get("seconds", 0.0) for x in reps.values()), 3)

    # -- the report --------------------------------------------------------------------
    def measure_persistent_read(self) -> float | None:
        """Seconds to read one rank's share of the newest persistent step (the slowest
        rank), through fsspec as the agents do."""
        root = self.cluster.persistent_dir / JOB
        steps = sorted(
            (p for p in root.glob("step-*") if (p / ".metadata").exists()),
            key=lambda p: int(p.name.split("-")[1]),
        )
        if not steps:
            return None
        fs = fsspec.filesystem("file")
        worst = 0.0
        for r in range(WORLD):
            t = time.perf_counter()
            for f in steps[-1].glob(f"__{r}_*.distcp"):
                with fs.open(str(f), "rb") as fh:
                    while fh.read(1 << 22):
                        pass
            worst = max(worst, time.perf_counter() - t)
        return worst

    def job_tiers(self) -> dict[str, Any]:
        try:
            r = self.cluster.api("GET", f"/jobs/{JOB}")
            return r.json().get("tiers", {}) if r.status_code == 200 else {}
        except Exception:  # noqa: BLE001 - the report goes on without them
            return {}

    def build_report(self, status: str) -> dict[str, Any]:
        now = time.time()
        entries = self.steps()
        wall = (now - self.t0) if self.t0 else 0.0
        survivors = report.surviving_steps(entries)
        eff = report.effective_training_time(entries, wall) if wall > 0 else None
        tiers = self.job_tiers()
        # δ of a synchronous persistent-only save: the serialization our memory tier's
        # write measures plus the transfer our persistent upload measures. The server gives
        # each tier's median commit time over its recent commits; the run's δ is the median
        # of those, sampled at every report (the newest steps are never all committed).
        writes = [_commit_median(tiers.get(t) or {}) for t in ("memory", "persistent")]
        if all(w is not None for w in writes):
            self.write_samples.append(sum(w for w in writes if w is not None))
        persist_write = report.median(self.write_samples)
        restores = [r.restore_s for r in self.records if r.restore_s is not None]
        restore_med = report.median(restores)
        read_s = self.measure_persistent_read() if status == "finished" else None
        persistent_restore = self.persistent_restore_s
        if persistent_restore is None and restore_med is not None and read_s is not None:
            persistent_restore = restore_med + read_s
        baseline = None
        base_eff = None
        recovered = [r for r in self.records if r.downtime_s is not None]
        if persist_write and wall > 0 and (persistent_restore is not None or not recovered):
            pr = persistent_restore or 0.0
            bf = [
                report.BaselineFailure(r.at_s, max(0.0, r.downtime_s - (r.restore_s or 0.0)) + pr)
                for r in recovered
            ]
            rho = report.compute_share(entries)
            base_eff, tau = report.persistent_only(
                bf,
                wall_s=wall,
                checkpoint_s=persist_write,
                mtbf_s=self.args.mtbf,
                compute_share=rho,
            )
            baseline = {
                "interval_s": round(tau, 2),
                "checkpoint_s": round(persist_write, 3),
                "restart_s": report.median(
                    r.restart_s for r in recovered if r.restart_s is not None
                )
                or 0.0,
                "restore_s": round(pr, 3),
                "mtbf_s": self.args.mtbf,
                "compute_share": round(rho, 3),
                "formula": "Young (1974): τ = √(2·δ·M); each failure loses the work "
                "since the last complete persistent checkpoint",
            }
        stalls = [e.get("save_s", 0.0) for e in entries]
        costs = {
            k: v
            for k, v in {
                "restart_s": report.median(r.restart_s for r in recovered if r.restart_s),
                "restore_s": restore_med,
                "downtime_s": report.median(r.downtime_s for r in recovered),
                "detect_s": report.median(
                    r.detected_after_s for r in self.records if r.detected_after_s is not None
                ),
                "save_stall_s": report.median(stalls),
                "step_s": report.median(e.get("step_s", 0.0) for e in entries),
                "persistent_write_s": persist_write,
                "persistent_read_s": read_s,
            }.items()
            if v is not None
        }
        views = {}
        try:
            views = self.cluster.node_views()
        except Exception:  # noqa: BLE001
            pass
        in_use = list(self.job.layout) if self.job else []
        used = sorted(
            {t for r in self.records for t in r.rank_tiers.values() if t in report.TIER_ORDER},
            key=report.TIER_ORDER.index,
        )
        curve = [[e["step"], round(e["loss"], 4)] for e in survivors]
        if len(curve) > 400:
            stride = len(curve) // 400 + 1
            curve = curve[::stride] + ([curve[-1]] if (len(curve) - 1) % stride else [])
        head = [e["loss"] for e in survivors[:10]]
        tail = [e["loss"] for e in survivors[-10:]]
        return {
            "version": 1,
            "status": status,
            "seed": self.args.seed,
            "mtbf_s": self.args.mtbf,
            "failures_planned": self.planned,
            "seconds": self.args.seconds,
            "started_at": iso(self.started_at),
            "updated_at": iso(now),
            "duration_s": round(wall, 2),
            "effective_training_time": None if eff is None else round(eff, 4),
            "baseline_persistent_only": None if base_eff is None else round(base_eff, 4),
            "baseline": baseline,
            "loss_start": round(sum(head) / len(head), 4) if head else None,
            "loss_end": round(sum(tail) / len(tail), 4) if tail else None,
            "steps": {
                "final": survivors[-1]["step"] if survivors else 0,
                "useful": len(survivors),
                "lost": len(entries) - len(survivors),
            },
            "tiers_used": used,
            "costs": {k: round(v, 3) for k, v in costs.items()},
            "loss_curve": curve,
            "nodes": {
                "in_use": in_use,
                "spare": sorted(
                    n for n, v in views.items() if n not in in_use and not v["isolated"]
                ),
                "isolated": sorted(n for n, v in views.items() if v["isolated"]),
            },
            "failures": [r.model_dump(mode="json") for r in self.records],
        }

    def write_report(self, status: str) -> dict[str, Any]:
        rep = self.build_report(status)
        DemoReport.model_validate(rep)  # what the dashboard will read (raises on a mismatch)
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.report_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(rep, indent=2))
        tmp.replace(self.report_path)
        return rep

    # -- the run -----------------------------------------------------------------------
    def run(self) -> int:
        self.start()
        self.wait_first_step()
        self.sup.prepare()  # a warm standby for the first relaunch
        self.say(
            f"training started; dashboard {self.cluster.url}/ , report {self.cluster.url}/demo"
        )
        print(
            BANNER.format(
                url=self.cluster.url,
                token=self.cluster.token,
                report=self.report_path,
                logs=self.cluster.logs,
                charts=(
                    f"from Prometheus ({self.prometheus.url}, scraping the agents every second)"
                    if self.prometheus is not None
                    else "from tierwatch's database (DEMO_PROMETHEUS=1: from a Prometheus)"
                ),
            ),
            flush=True,
        )
        catalog = faults.load_catalog()
        forced = faults.pick(catalog, self.args.failure) if self.args.failure else None
        plan = faults.schedule(
            catalog,
            seconds=self.args.seconds,
            mtbf_s=self.args.mtbf,
            seed=self.args.seed,
            world_size=WORLD,
            warmup_s=WARMUP_S,
            tail_s=TAIL_S,
            forced=forced,
        )
        self.planned = (
            faults.failure_count(self.args.seconds, self.args.mtbf)
            if self.args.seconds > 0
            else None
        )
        upcoming = next(plan, None)
        last_write = 0.0
        assert self.t0 is not None
        end = self.t0 + self.args.seconds if self.args.seconds > 0 else None
        while not self.stopping and (end is None or time.time() < end):
            self.do_repairs()
            if upcoming is not None and time.time() >= self.t0 + upcoming.at_s:
                self.records.append(self.inject(upcoming))
                self.write_report("running")
                upcoming = next(plan, None)
            elif self.job is not None and not self.job.running:
                raise RuntimeError(
                    "the job stopped without an injected failure; see "
                    f"{self.cluster.logs / 'train.log'}"
                )
            if time.time() - last_write > 5:
                self.write_report("running")
                last_write = time.time()
            time.sleep(0.1)
        if self.job is not None:
            self.job.stop()
        self.sup.stop()
        rep = self.write_report("finished")
        print_report(rep, self.report_path)
        lost = [f for f in rep["failures"] if not f["recovered"]]
        if lost and not self.stopping:
            print(
                f"error: {len(lost)} failure(s) were not recovered from: "
                + "; ".join(
                    f"{f['component']} at {f['at_s']:g} s: {f['note'] or '?'}" for f in lost
                ),
                file=sys.stderr,
            )
            return 1
        return 0


BANNER = """
tierwatch demo is running: {url}/  (sign in with the token below)

  sign in   : {token}
  report    : {url}/demo  (also {report})
  API       : curl -H 'Authorization: Bearer {token}' {url}/api/v1/nodes
  charts    : {charts}
  logs      : {logs}
"""


def print_report(rep: dict[str, Any], path: Path) -> None:
    """The report's headline and failure table, on stdout."""

    def pct(v: float | None) -> str:
        return "n/a" if v is None else f"{100 * v:.1f} %"

    print(f"\ndemo report ({path})")
    print(
        f"  duration            {rep['duration_s']:.1f} s, seed {rep['seed']}, "
        f"MTBF {rep['mtbf_s']:g} s"
    )
    print(
        f"  effective training  {pct(rep['effective_training_time'])}   (persistent-only at "
        f"Young's interval: {pct(rep['baseline_persistent_only'])})"
    )
    print(f"  loss                {rep['loss_start']} → {rep['loss_end']}  (steps: {rep['steps']})")
    print(f"  tiers used          {', '.join(rep['tiers_used']) or 'none'}")
    planned = rep.get("failures_planned")
    print(
        f"  failures            {len(rep['failures'])} injected"
        + ("" if planned is None else f" of {planned} planned")
        + f", {sum(1 for f in rep['failures'] if f['recovered'])} recovered"
    )
    print(f"  costs               {rep['costs']}")
    print(
        f"  {'at_s':>6} {'failure':<32} {'node':<12} {'tier':<11} {'step':>6} {'lost':>5} "
        f"{'down_s':>7} recovered"
    )
    for f in rep["failures"]:
        print(
            f"  {f['at_s']:>6.1f} {f['component'][:32]:<32} {f['node'] or '-':<12} "
            f"{f['restore_tier'] or '-':<11} {f['restored_step'] if f['restored_step'] is not None else '-':>6} "  # noqa: E501
            f"{f['steps_lost'] if f['steps_lost'] is not None else '-':>5} "
            f"{f['downtime_s'] if f['downtime_s'] is not None else '-':>7} "
            f"{'yes' if f['recovered'] else 'NO'}"
        )
    print(flush=True)


def _commit_median(tier: dict[str, Any]) -> float | None:
    """A tier's median commit time from ``GET /api/v1/jobs/{id}`` (its interval advice's
    ``commit_s``; the newest step's own time when there is no advice yet)."""
    advice = tier.get("advice") or {}
    value = advice.get("commit_s") or tier.get("commit_s")
    return float(value) if value else None


def _restorable(body: Any) -> dict[int, list[str]]:
    """The steps a 409 answer of ``POST …/restore`` lists, with their tiers
    (``"… steps that can be restored: 33 (memory), 31 (memory/persistent) …"``)."""
    detail = body.get("detail", "") if isinstance(body, dict) else str(body)
    text = str(detail).split("steps that can be restored:", 1)[-1]
    return {
        int(m.group(1)): m.group(2).split("/") for m in re.finditer(r"(\d+) \(([a-z/]+)\)", text)
    }


def _rmtree(p: Path) -> None:
    import shutil

    shutil.rmtree(p, ignore_errors=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="run this long after training starts, then report and exit "
        "(0: until Ctrl-C) [DEMO_SECONDS]",
    )
    p.add_argument(
        "--mtbf", type=float, default=None, help="mean time between failures, seconds [DEMO_MTBF]"
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the failure draw [DEMO_SEED]")
    p.add_argument(
        "--failure",
        action="append",
        default=[],
        metavar="COMPONENT",
        help="inject this component's failure (a row of the Llama 3 table, e.g. "
        "'Silent Data Corruption') instead of drawing one; repeat to cycle",
    )
    p.add_argument(
        "--repair",
        type=float,
        default=REPAIR_S,
        help="simulated repair time of an isolated node, seconds",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--agent-port", type=int, default=9470, help="first agent's local port")
    p.add_argument("--gpus", type=int, default=8, help="simulated GPUs per node")
    p.add_argument(
        "--collector",
        choices=("auto", "simulated", "nvml"),
        default="auto",
        help="the agents' collector: auto = nvml when NVML shows GPUs here (GPU "
        "faults are then made real as lost hosts: nothing can be injected into a "
        "real GPU), else simulated",
    )
    p.add_argument("--interval", type=float, default=1.0, help="agent report interval (s)")
    p.add_argument("--persist-every", type=int, default=10)
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.25,
        help="seconds each step waits, standing in for GPU compute",
    )
    p.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="relaunch cold (no warm standby incarnation): measures what the "
        "imports add to a restart",
    )
    p.add_argument(
        "--save-every", type=int, default=2, help="checkpoint every this many steps (memory tier)"
    )
    p.add_argument(
        "--prometheus",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="start Prometheus (Debian's `prometheus`, on a loopback port) scraping the "
        "agents, and let the node charts read from it [DEMO_PROMETHEUS=1]",
    )
    p.add_argument(
        "--prometheus-exe",
        default=None,
        metavar="PATH",
        help="the Prometheus binary (default: `prometheus` on PATH, else /usr/bin/prometheus)",
    )
    p.add_argument("--var-dir", type=Path, default=REPO / "var" / "demo")
    p.add_argument("--report", type=Path, default=REPO / "var" / "demo-report.json")
    args = p.parse_args(argv)
    # the environment is read after --help had its chance
    if args.seconds is None:
        args.seconds = env_number("DEMO_SECONDS", 0.0)
    if args.mtbf is None:
        args.mtbf = env_number("DEMO_MTBF", 60.0)
    if args.seed is None:
        args.seed = env_number("DEMO_SEED", 3, int)
    if args.prometheus is None:
        args.prometheus = env_flag("DEMO_PROMETHEUS")
    if args.prometheus:
        try:
            args.prometheus_exe = find_prometheus(args.prometheus_exe)
        except RuntimeError as exc:
            p.error(str(exc))
    if not (math.isfinite(args.seconds) and math.isfinite(args.mtbf)):
        p.error("DEMO_SECONDS and DEMO_MTBF must be finite numbers of seconds")
    if args.mtbf <= 0:
        p.error(f"DEMO_MTBF / --mtbf must be > 0 seconds, got {args.mtbf:g}")
    if args.seconds < 0:
        p.error(f"DEMO_SECONDS / --seconds must be ≥ 0, got {args.seconds:g}")
    try:
        faults.pick(faults.load_catalog(), args.failure)
    except faults.CatalogError as exc:
        p.error(str(exc))
    n = faults.failure_count(args.seconds, args.mtbf)
    if args.seconds and n and args.seconds - TAIL_S - WARMUP_S < 1:
        p.error(
            f"DEMO_SECONDS={args.seconds:g} leaves no room for {n} failure(s): the first "
            f"{WARMUP_S:g} s are warm-up and the last {TAIL_S:g} s are kept for recovery; "
            f"use DEMO_SECONDS ≥ {WARMUP_S + TAIL_S + 1:g} or a larger DEMO_MTBF"
        )
    if 0 < args.seconds < args.mtbf:
        print(
            f"note: DEMO_SECONDS={args.seconds:g} is shorter than DEMO_MTBF={args.mtbf:g}: no "
            "failure will be injected (⌊seconds / MTBF⌋ = 0)",
            file=sys.stderr,
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    ports = [args.port] + [args.agent_port + i for i in range(NODES)]
    busy = [p for p in ports if not port_free(p)]
    if busy:
        print(
            f"error: port(s) {busy} on 127.0.0.1 are in use (another demo running?); stop "
            "that process or pass --port / --agent-port",
            file=sys.stderr,
        )
        return 2
    demo = Demo(args)

    def on_signal(_sig: int, _frame: object) -> None:
        demo.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        return demo.run()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if demo.job is not None:
            demo.job.stop()
        demo.sup.stop()
        demo.cluster.stop()
        if demo.prometheus is not None:
            demo.prometheus.stop()

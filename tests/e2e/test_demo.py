"""`make demo` end to end: a short run (60 s, fixed seed) with one injected node failure.

Seed 1 draws a GPU SRAM fault (XID 95) on rank 0's node: the health engine must flag it,
the policy isolate it, the supervisor relaunch with the spare, the ranks restore (rank 0's
shards from a peer replica, the others from memory), the node come back after its repair,
and the report say all of that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import httpx
import pytest
from procs import REPO_ROOT, free_port, port_block, wait_for

from demo import faults

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEED, SECONDS = 1, 60


def test_short_demo_recovers_from_its_failure_and_reports_it(tmp_path):
    planned = list(
        faults.schedule(
            faults.load_catalog(),
            seconds=SECONDS,
            mtbf_s=60,
            seed=SEED,
            world_size=4,
            warmup_s=15,
            tail_s=25,
        )
    )
    assert [(p.kind.component, p.rank) for p in planned] == [("GPU SRAM Memory", 0)]
    port, agent_port = free_port(), port_block(5)
    report_path = tmp_path / "demo-report.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "demo.py"),
            "--port",
            str(port),
            "--agent-port",
            str(agent_port),
            "--var-dir",
            str(tmp_path / "demo"),
            "--report",
            str(report_path),
            "--collector",
            "simulated",
        ],
        env={**os.environ, "DEMO_SECONDS": str(SECONDS), "DEMO_MTBF": "60", "DEMO_SEED": str(SEED)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    page = None
    try:
        url = f"http://127.0.0.1:{port}"

        # while it runs: the dashboard serves the live report to the printed token
        def live_report():
            assert proc.poll() is None, "".join(lines)
            token = next(
                (ln.split(":", 1)[1].strip() for ln in lines if ln.strip().startswith("sign in")),
                None,
            )
            if not token or not report_path.exists():
                return None
            r = httpx.get(
                f"{url}/api/v1/demo/report", headers={"Authorization": f"Bearer {token}"}, timeout=5
            )
            return r.json() if r.status_code == 200 else None

        page = wait_for(live_report, timeout=120, interval=0.5, what="the live demo report")
        assert page is not None, "".join(lines)
        assert page["status"] == "running"
        assert proc.wait(timeout=240) == 0, "".join(lines[-80:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(5)
    out = "".join(lines)
    rep = json.loads(report_path.read_text())
    assert rep["status"] == "finished"
    assert rep["seed"] == SEED
    assert rep["duration_s"] >= SECONDS
    assert len(rep["failures"]) == 1, out
    f = rep["failures"][0]
    assert f["component"] == "GPU SRAM Memory"
    assert f["failure_class"] == "node"
    assert f["node"] == "gpu-node-01"
    assert f["rank"] == 0
    assert "XID 95" in f["injected"]
    assert f["recovered"], out
    assert f["isolated"], out  # by the policy, on the XID the agent reported
    assert f["replaced_by"] == "gpu-node-05"  # the spare
    assert f["detected_after_s"] is not None
    assert 0 <= f["detected_after_s"] < 15
    assert f["rank_tiers"]["0"] == "peer"  # its node is gone from the job: a replica
    assert {f["rank_tiers"][r] for r in ("1", "2", "3")} == {"memory"}
    assert f["restore_tier"] == "peer"
    assert rep["tiers_used"] == ["memory", "peer"]
    assert f["restored_step"] is not None
    assert f["steps_lost"] is not None
    assert f["steps_lost"] >= 0
    assert f["downtime_s"] > 0
    assert rep["loss_end"] < rep["loss_start"]
    assert 0 < rep["effective_training_time"] <= 1
    assert 0 < rep["baseline_persistent_only"] <= 1
    assert rep["baseline"]["interval_s"] > 0
    assert rep["steps"]["final"] > f["restored_step"]  # training went on after the restore
    # the repair released the node: it ends as a spare, nothing stays isolated
    assert rep["nodes"]["isolated"] == []
    assert "gpu-node-01" in rep["nodes"]["spare"]
    assert "gpu-node-01 repaired and released" in out
    assert "effective training" in out  # the printed report

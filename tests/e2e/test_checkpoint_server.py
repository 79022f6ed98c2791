"""Real training with a real server: the control plane sees every tier; a broken persistent
tier or a too-small memory budget never stops training and is reported."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
from procs import wait_for
from sqlalchemy import text
from test_checkpoint_training import FOUR_ON_TWO, SMALL
from training import Cluster, committed_steps, read_losses, run_in_thread, start_cluster

from tierwatch.server.db import make_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def cluster(tmp_path: Path):
    c = start_cluster(tmp_path / "cluster", with_server=True)
    yield c
    c.stop()


def job(c: Cluster, token: str, job_id: str) -> dict:
    assert c.server is not None
    r = httpx.get(
        f"{c.server.url}/api/v1/jobs/{job_id}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    r.raise_for_status()
    return r.json()


def args(job_id: str, steps: int, log: Path, *extra: str) -> list[str]:
    return ["--job-id", job_id, "--steps", str(steps), "--log-dir", str(log), *SMALL, *extra]


def sample_tiers(c: Cluster, token: str, job_id: str, procs: list, every_s: float) -> list:
    """``{tier: newest_step}`` of the job, read from the API every ``every_s`` seconds while
    any of ``procs`` runs (oldest first)."""
    out: list[dict[str, int | None]] = []
    stop = threading.Event()
    while not stop.wait(every_s) and any(p.running for p in procs):
        with contextlib.suppress(httpx.HTTPStatusError):  # 404 until the job is reported
            out.append({t: v["newest_step"] for t, v in job(c, token, job_id)["tiers"].items()})
    return out


def check_samples(samples: list[dict[str, int | None]]) -> None:
    """The ledger's newest committed steps, sampled during a run: a tier's figure is never
    null once the tier committed a step, and memory's is never below the tiers fed from it
    (docs/checkpointing.md "Ledger")."""
    seen: set[str] = set()
    for i, s in enumerate(samples):
        for tier, step in s.items():
            assert step is not None or tier not in seen, (i, tier, samples)
            if step is not None:
                seen.add(tier)
        for fed in ("peer", "persistent"):
            if s[fed] is not None:
                assert s["memory"] is not None, (i, fed, samples)
                assert s["memory"] >= s[fed], (i, fed, samples)


def test_server_shows_all_three_tiers_of_a_training_job(cluster: Cluster, tmp_path: Path) -> None:
    cluster.add_node("node-a")
    cluster.add_node("node-b")
    viewer = cluster.server.token("viewer")  # type: ignore[union-attr]
    log = tmp_path / "log"
    procs = cluster.launch(
        args("tiers", 12, log, "--persist-every", "5", "--latency-every", "3"),
        placement=FOUR_ON_TWO,
        log_dir=log,
    )
    # sampled while the job trains (a step every few tenths of a second, one agent report a
    # second: a batch carries a rank's commit and its eviction of the same step)
    sampler = run_in_thread(lambda: sample_tiers(cluster, viewer, "tiers", procs, 0.2))
    assert cluster.wait_ranks(procs, 240) == [0, 0, 0, 0]
    samples = sampler.join(30)

    def settled() -> dict | None:
        j = job(cluster, viewer, "tiers")
        t = j["tiers"]
        # persist_every 5 → steps 0, 5, 10; the run's last step (11) is persisted too
        ok = (
            j["step"] == 11
            and t["memory"]["newest_step"] == 11
            and t["peer"]["newest_step"] == 11
            and t["persistent"]["newest_step"] == 11
        )
        return j if ok else None

    j = wait_for(settled, timeout=60, what="memory, peer and persistent at 11 on the server")
    assert any(s["memory"] is not None for s in samples), samples
    check_samples(samples)
    assert j["world_size"] == 4
    assert j["layout"] == FOUR_ON_TWO
    assert j["tiers"]["memory"]["lag_steps"] == 0
    assert j["tiers"]["persistent"]["lag_steps"] == 0
    assert j["tiers"]["memory"]["last_blocking_s"] is not None
    assert j["tiers"]["persistent"]["advice"]["recommended_s"] > 0
    kinds = {(e["tier"], e["kind"]) for e in j["events"]}
    assert {
        ("memory", "committed"),
        ("peer", "committed"),
        ("persistent", "committed"),
        ("memory", "staged"),
    } <= kinds
    assert j["restores"][0]["message"] == "no complete step in any tier"
    # the dashboard's job page shows the tiers for a signed-in viewer
    with httpx.Client(base_url=cluster.server.url) as web:  # type: ignore[union-attr]
        form = web.get("/login").text
        csrf = re.search(r'name="csrf_token" value="([^"]+)"', form).group(1)  # type: ignore[union-attr]
        r = web.post(
            "/login",
            data={"token": viewer, "csrf_token": csrf, "next": "/jobs/tiers"},
            follow_redirects=True,
        )
        assert r.status_code == 200
        row = re.search(r'<tr data-row="newest_step">(.*?)</tr>', r.text).group(1)  # type: ignore[union-attr]
        cells = dict(re.findall(r'<td data-tier="(\w+)"[^>]*>([^<]*)</td>', row))
        assert cells == {"memory": "11", "peer": "11", "persistent": "11"}
        assert web.get("/").text.count("/jobs/tiers") >= 1  # the cluster page lists the job
    r = httpx.get(f"{cluster.server.url}/metrics")  # type: ignore[union-attr]
    assert 'tierwatch_checkpoint_lag_steps{job="tiers",tier="persistent"} 0.0' in r.text
    assert 'tierwatch_checkpoint_newest_step{job="tiers",tier="persistent"} 11.0' in r.text

    # every rank timed an all_reduce on the job's group every 3 saves and its agent sent it
    engine = make_engine(cluster.server.database_url)  # type: ignore[union-attr]

    def latency_ranks() -> set[int]:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT rank, latency_ms FROM latency_samples WHERE job_id = 'tiers'")
            ).all()
        return {r for r, ms in rows if ms >= 0}

    assert wait_for(
        lambda: latency_ranks() == {0, 1, 2, 3},
        timeout=30,
        what="collective latency of all 4 ranks on the server",
    )
    engine.dispose()


def _tiny_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.returncode == 0


@pytest.mark.parametrize("how", ["unwritable", "full"])
def test_broken_persistent_tier_never_stops_training(
    cluster: Cluster, tmp_path: Path, how: str
) -> None:
    if how == "unwritable":
        blocker = tmp_path / "not-a-dir"
        blocker.write_text("a regular file where the persistent folder should be\n")
        url = f"file://{blocker}/checkpoints"  # mkdir under a file: ENOTDIR, even for root
        mounted = None
    else:
        mounted = tmp_path / "tiny"
        if not _tiny_tmpfs(mounted):
            pytest.skip("mounting a 64 KiB tmpfs needs root with CAP_SYS_ADMIN")
        url = f"file://{mounted}"
    try:
        for name in ("node-a", "node-b"):
            cluster.add_node(name, extra_args=["--persistent-url", url])
        viewer = cluster.server.token("viewer")  # type: ignore[union-attr]
        log = tmp_path / "log"
        procs = cluster.launch(
            args("broken-persist", 10, log, "--persist-every", "2"),
            placement=["node-a", "node-b"],
            log_dir=log,
        )
        assert cluster.wait_ranks(procs, 240) == [0, 0]
        assert sorted(read_losses(log)) == list(range(10))

        def reported() -> dict | None:
            j = job(cluster, viewer, "broken-persist")
            failed = [e for e in j["failures"] if e["tier"] == "persistent"]
            t = j["tiers"]
            ok = failed and t["memory"]["newest_step"] == 9 and t["peer"]["newest_step"] == 9
            return j if ok else None

        try:
            j = wait_for(reported, timeout=60, what="persistent failure + memory/peer at step 9")
        except TimeoutError:
            j = job(cluster, viewer, "broken-persist")
            raise AssertionError(
                {t: v["newest_step"] for t, v in j["tiers"].items()},
                [(e["tier"], e["kind"], e["step"], e["message"][:80]) for e in j["failures"]],
            ) from None
        assert j["tiers"]["persistent"]["newest_step"] is None
        messages = " ".join(e["message"] for e in j["failures"])
        assert "distcp" in messages or "manifest" in messages, messages
    finally:
        if mounted is not None:
            with contextlib.suppress(Exception):
                subprocess.run(["umount", str(mounted)], check=False, capture_output=True)


def test_memory_budget_refuses_a_step_with_a_clear_error_and_training_goes_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    node = cluster.add_node("node-a", extra_args=["--memory-budget", "64KiB"])
    viewer = cluster.server.token("viewer")  # type: ignore[union-attr]
    log = tmp_path / "log"
    procs = cluster.launch(args("budget", 5, log), placement=["node-a"], log_dir=log)
    assert cluster.wait_ranks(procs, 120) == [0]
    assert sorted(read_losses(log)) == list(range(5))
    assert committed_steps(node, "budget", 0) == []

    def failed() -> list[dict]:
        j = job(cluster, viewer, "budget")
        return [e for e in j["failures"] if e["tier"] == "memory"]

    events = wait_for(failed, timeout=60, what="memory failure events")
    assert "memory budget exceeded" in events[0]["message"]
    assert "--memory-budget" in events[0]["message"]

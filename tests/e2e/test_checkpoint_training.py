"""Real training through TieredCheckpointer on a simulated cluster (agents as nodes).

Every test runs examples/train_gpt.py (a small GPT, DDP over gloo) as real rank processes on
loopback, with real tierwatch-agent processes hosting the memory, peer and persistent tiers.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import httpx
import pytest
from procs import wait_for
from training import (
    TINY_GPT,
    Cluster,
    committed_steps,
    read_losses,
    read_restores,
    start_cluster,
)

from tierwatch.agent.checkpoint.format.layout import parse_step_dirname, step_dirname
from tierwatch.agent.checkpoint.format.manifest import load_manifest, verify_file

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL = [*TINY_GPT, "--exact-resume"]
FOUR_ON_TWO = ["node-a", "node-a", "node-b", "node-b"]


@pytest.fixture
def cluster(tmp_path: Path):
    c = start_cluster(tmp_path / "cluster", with_server=False)
    yield c
    c.stop()


def train_args(job: str, steps: int, log_dir: Path, *extra: str) -> list[str]:
    return ["--job-id", job, "--steps", str(steps), "--log-dir", str(log_dir), *SMALL, *extra]


def restores(log_dir: Path, rank: int = 0) -> list[dict]:
    path = log_dir / f"restores-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_committed(node, job: str, rank: int, step: int, timeout: float = 180) -> int:
    return wait_for(
        lambda: (
            max(committed_steps(node, job, rank) or [-1]) >= step
            and max(committed_steps(node, job, rank))
        ),
        timeout=timeout,
        interval=0.05,
        what=f"{job} step {step} committed by rank {rank} on {node.name}",
    )


def wait_replicated(holder, src: str, job: str, step: int, timeout: float = 60) -> None:
    d = holder.memory_dir / "replicas" / src / job

    def done() -> bool:
        commits = d.glob("step-*/commit-*.json")
        return any(parse_step_dirname(p.parent.name) >= step for p in commits)

    wait_for(done, timeout=timeout, what=f"replicas of {src}'s {job} step ≥{step} on {holder.name}")


def complete_steps_are_valid(c: Cluster, job: str, world: int) -> list[int]:
    """Every step that has manifests of all ranks across the memory tiers verifies; returns
    those steps."""
    manifests: dict[int, dict[int, tuple[Path, object]]] = {}
    for node in c.nodes.values():
        for path in (node.memory_dir / "jobs" / job).glob("step-*/manifest-*.json"):
            m = load_manifest(path)
            manifests.setdefault(m.step, {})[m.rank] = (path.parent, m)
    complete = []
    for step, by_rank in sorted(manifests.items()):
        if len(by_rank) < world:
            continue
        for folder, m in by_rank.values():
            for entry in m.files:  # type: ignore[attr-defined]
                assert verify_file(folder / entry.name, entry) is None, (step, entry.name)
        complete.append(step)
    return complete


# -- bit-exact resume ----------------------------------------------------------------------
def test_resume_is_bit_exact(cluster: Cluster, tmp_path: Path) -> None:
    _a, b = cluster.add_node("node-a"), cluster.add_node("node-b")
    total = 16
    base_log, run_log = tmp_path / "base", tmp_path / "run"
    base = cluster.launch(
        train_args("exact-base", total, base_log, "--final"),
        placement=FOUR_ON_TWO,
        log_dir=base_log,
    )
    assert cluster.wait_ranks(base, 300) == [0, 0, 0, 0]

    first = cluster.launch(
        train_args("exact-run", total, run_log, "--final"), placement=FOUR_ON_TWO, log_dir=run_log
    )
    wait_committed(b, "exact-run", 3, total // 2 - 1)
    cluster.kill_ranks(first)  # kill -9 every rank mid-run
    assert not (run_log / "final-0.json").exists()
    second = cluster.launch(
        train_args("exact-run", total, run_log, "--final"), placement=FOUR_ON_TWO, log_dir=run_log
    )
    assert cluster.wait_ranks(second, 300) == [0, 0, 0, 0]

    resumed_from = read_restores(run_log)[-1]
    assert resumed_from is not None
    assert total // 2 - 1 <= resumed_from < total - 1
    rep = restores(run_log)[-1]
    assert rep["step"] == resumed_from
    # steps lost: from the ranks' progress files (written about once a second), so at most
    # the steps the killed run logged after the restored one, plus one: save() records its
    # step as trained before the script logs the step's line, and kill -9 may come between
    lines = [json.loads(x) for x in (run_log / "rank-0.jsonl").read_text().splitlines()]
    first_run_last = max(x["step"] for x in lines if x["restored_from"] is None)
    assert rep["steps_lost"] is not None
    assert 0 <= rep["steps_lost"] <= first_run_last + 1 - resumed_from
    assert rep["files_by_tier"].get("persistent", 0) == 0
    for rank in range(4):
        want, got = read_losses(base_log, rank), read_losses(run_log, rank)
        assert [want[s] for s in range(total)] == [got[s] for s in range(total)], rank
        assert json.loads((base_log / f"final-{rank}.json").read_text()) == json.loads(
            (run_log / f"final-{rank}.json").read_text()
        ), rank
    losses = read_losses(run_log)
    assert losses[total - 1] < losses[0]


# -- kill -9 during saves ------------------------------------------------------------------
@pytest.mark.parametrize("trials", [5, pytest.param(20, marks=pytest.mark.soak)])
def test_kill_during_save_never_restores_a_torn_step(
    cluster: Cluster, tmp_path: Path, trials: int
) -> None:
    """kill -9 of a rank at a random moment of back-to-back saves, ``trials`` times: every
    step with all manifests verifies, and each relaunch restores the newest complete step.
    ``make test`` runs 5 trials, ``make soak`` 20."""
    cluster.add_node("node-a")
    b = cluster.add_node("node-b")
    log = tmp_path / "log"
    rng = random.Random(20261201)
    job = "kill9"
    restored: list[int] = []
    for trial in range(trials):
        before = complete_steps_are_valid(cluster, job, 2)
        procs = cluster.launch(
            train_args(job, 100_000, log, "--persist-every", "1000"),
            placement=["node-a", "node-b"],
            log_dir=log,
        )
        floor = max(committed_steps(b, job, 1) or [-1]) + 1
        wait_committed(b, job, 1, floor)
        time.sleep(rng.uniform(0.0, 0.6))  # saves run back to back: a random moment
        procs[rng.randrange(2)].stop(9)
        cluster.kill_ranks(procs)
        # every step with all manifests verifies; a torn step has no complete manifest set
        assert complete_steps_are_valid(cluster, job, 2), f"trial {trial}: no complete step"
        if trial:
            rep = restores(log)[-1]
            # the restore took the newest step that was complete before the launch
            assert rep["ok"], rep
            assert rep["step"] == max(before), (trial, rep, before)
            restored.append(rep["step"])
    assert len(restored) == trials - 1
    assert restored == sorted(restored)


# -- node loss, all memory lost, agent restart ----------------------------------------------
def test_node_loss_restores_from_peer_then_all_memory_lost_from_persistent(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = cluster.add_node("node-a"), cluster.add_node("node-b")
    log = tmp_path / "log"
    job = "loss"
    procs = cluster.launch(
        train_args(job, 100_000, log, "--persist-every", "4"), placement=FOUR_ON_TWO, log_dir=log
    )
    wait_committed(b, job, 3, 9)
    wait_replicated(a, "node-b", job, 9)
    cluster.kill_ranks(procs)
    # node-b is lost: agent gone, memory gone; it comes back empty (a replacement)
    b.stop(9)
    b.wipe_memory()
    b.start()
    procs = cluster.launch(
        train_args(job, 100_000, log, "--persist-every", "4"), placement=FOUR_ON_TWO, log_dir=log
    )
    wait_for(lambda: len(restores(log, 2)) == 2, timeout=120, what="rank 2 restored")
    rep = restores(log, 2)[-1]
    assert rep["ok"]
    assert rep["step"] >= 9
    assert rep["files_by_tier"].get("peer", 0) >= 1
    assert rep["files_by_tier"].get("persistent", 0) == 0
    wait_committed(b, job, 3, rep["step"] + 3)
    cluster.kill_ranks(procs)

    # every node's memory is lost: the persistent tier brings the job back
    persisted = sorted(
        parse_step_dirname(p.parent.name)
        for p in (cluster.persistent_dir / job).glob("step-*/.metadata")
    )
    assert persisted
    for node in (a, b):
        node.stop(9)
        node.wipe_memory()
        node.start()
    procs = cluster.launch(
        train_args(job, persisted[-1] + 4, log, "--persist-every", "4"),
        placement=FOUR_ON_TWO,
        log_dir=log,
    )
    assert cluster.wait_ranks(procs, 300) == [0, 0, 0, 0]
    rep = restores(log, 0)[-1]
    assert rep["step"] in persisted
    assert set(rep["files_by_tier"]) == {"persistent"}
    losses = read_losses(log)
    assert losses[max(losses)] < losses[0]


def test_training_never_stops_while_its_agent_restarts(cluster: Cluster, tmp_path: Path) -> None:
    a, b = cluster.add_node("node-a"), cluster.add_node("node-b")
    log = tmp_path / "log"
    job = "agent-restart"
    procs = cluster.launch(
        train_args(job, 100_000, log, "--step-sleep", "0.05"),
        placement=["node-a", "node-b"],
        log_dir=log,
    )
    wait_committed(b, job, 1, 3)
    b.stop(9)
    down_at = max(committed_steps(b, job, 1))
    # the memory tier keeps committing with the agent gone
    wait_committed(b, job, 1, down_at + 5, timeout=60)
    b.start()
    after = wait_committed(b, job, 1, down_at + 8, timeout=60)
    # the restarted agent catches up: node-b's newest steps reach node-a's replicas
    wait_replicated(a, "node-b", job, after)
    assert all(p.running for p in procs)
    cluster.kill_ranks(procs)


def test_same_job_id_with_another_model_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    cluster.add_node("node-a")
    log = tmp_path / "log"
    procs = cluster.launch(train_args("reused", 3, log), placement=["node-a"], log_dir=log)
    assert cluster.wait_ranks(procs, 120) == [0]
    other = [*train_args("reused", 3, log)]
    other[other.index("--width") + 1] = "48"
    procs = cluster.launch(other, placement=["node-a"], log_dir=log)
    assert cluster.wait_ranks(procs, 120) != [0]
    out = procs[0].log_tail(6000)
    assert "ModelMismatchError" in out
    assert "different model" in out
    assert "ckpt gc --job reused" in out


@pytest.fixture
def cluster_with_server(tmp_path: Path):
    c = start_cluster(tmp_path / "cluster", with_server=True)
    yield c
    c.stop()


def test_restart_at_another_world_size_is_refused_not_started_from_scratch(
    cluster_with_server: Cluster, tmp_path: Path
) -> None:
    cluster = cluster_with_server
    cluster.add_node("node-a")
    cluster.add_node("node-b")
    log = tmp_path / "log"
    procs = cluster.launch(
        train_args("resized", 4, log, "--persist-every", "1"),
        placement=["node-a", "node-b"],
        log_dir=log,
    )
    assert cluster.wait_ranks(procs, 120) == [0, 0]
    persisted = cluster.persistent_dir / "resized" / step_dirname(3)

    def uploaded() -> bool:
        """The agents finish the last upload, and its retention (keep 3), after the ranks
        exit: steps 1-3 persisted, step 0 gone, nothing staged."""
        names = [p.name for p in cluster.persistent_dir.rglob("*") if p.is_file()]
        staged = [n for n in names if n.endswith(".staged") or n.startswith(".tmp-")]
        steps = sorted(parse_step_dirname(d.name) for d in persisted.parent.iterdir())
        return (persisted / ".metadata").exists() and not staged and steps == [1, 2, 3]

    wait_for(uploaded, timeout=60, what=f"{persisted} uploaded")
    before = sorted(p.name for p in cluster.persistent_dir.rglob("*") if p.is_file())
    job_file = cluster.nodes["node-a"].memory_dir / "jobs" / "resized" / "job.json"
    job_before = job_file.read_text()
    procs = cluster.launch(train_args("resized", 8, log), placement=["node-a"], log_dir=log)
    assert cluster.wait_ranks(procs, 120) != [0]
    out = procs[0].log_tail(6000)
    assert "holds steps saved at world_size 2 (newest step 3)" in out
    after = sorted(p.name for p in cluster.persistent_dir.rglob("*") if p.is_file())
    assert after == before  # nothing of the 2-rank job was overwritten
    assert job_file.read_text() == job_before

    # the server keeps the 2-rank job's world size and layout: the refused start's report
    # (sent before its refused restore's outcome, through the same agent) changed nothing
    assert cluster.server is not None
    viewer = {"Authorization": f"Bearer {cluster.server.token('viewer')}"}

    def refusal_seen() -> dict | None:
        r = httpx.get(f"{cluster.server.url}/api/v1/jobs/resized", headers=viewer, timeout=10)
        j = r.json() if r.status_code == 200 else {}
        refused = [x for x in j.get("restores", []) if not x["ok"] and x["world_size"] == 1]
        return j if refused else None

    j = wait_for(refusal_seen, timeout=60, what="the refused restore on the server")
    # the launcher registered the new run on node-a (a registration replaces the pinned
    # layout); the refused start's reports change nothing: the world size stays the 2-rank
    # job's, and no layout is pinned until a run's rank 0 saves
    assert (j["world_size"], j["layout"]) == (2, None)


def test_launcher_stops_the_job_when_a_rank_dies(cluster: Cluster, tmp_path: Path) -> None:
    import subprocess
    import sys

    from procs import REPO_ROOT, base_env

    a, b = cluster.add_node("node-a"), cluster.add_node("node-b")
    log = tmp_path / "log"
    launcher = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "examples" / "launch.py"),
            "--node",
            f"node-a={a.url}",
            "--node",
            f"node-b={b.url}",
            "--",
            str(REPO_ROOT / "examples" / "train_gpt.py"),
            *train_args("launched", 100_000, log),
        ],
        env=base_env(
            PYTHONPATH=str(REPO_ROOT),
            OMP_NUM_THREADS="1",
            TIERWATCH_JOB_CREDENTIAL=cluster.job_credential("launched", ["node-a", "node-b"]),
        ),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_committed(b, "launched", 1, 2)
        ranks = subprocess.run(
            ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        assert len(ranks) == 2
        subprocess.run(["kill", "-9", ranks[-1]], check=True)
        # 137 = 128 + SIGKILL; the surviving rank may abort first when gloo sees its peer go
        # (134 = 128 + SIGABRT): either way the launcher ends the job with a failure code
        assert launcher.wait(60) in (134, 137, 143)
        assert "stopping the others" in launcher.stderr.read()
        for pid in ranks:
            wait_for(
                lambda p=pid: (
                    not Path(f"/proc/{p}").exists()
                    or "Z" in Path(f"/proc/{p}/stat").read_text().split()[2]
                ),
                timeout=30,
                what=f"rank process {pid} gone",
            )
    finally:
        if launcher.poll() is None:
            launcher.kill()  # its ranks get SIGTERM (PR_SET_PDEATHSIG)


def test_ranks_do_not_outlive_a_killed_launcher(cluster: Cluster, tmp_path: Path) -> None:
    import subprocess
    import sys

    from procs import REPO_ROOT, base_env

    a = cluster.add_node("node-a")
    log = tmp_path / "log"
    launcher = subprocess.Popen(
        [
            sys.executable,
            str(REPO_ROOT / "examples" / "launch.py"),
            "--node",
            f"node-a={a.url}",
            "--ranks-per-node",
            "2",
            "--",
            str(REPO_ROOT / "examples" / "train_gpt.py"),
            *train_args("orphans", 100_000, log),
        ],
        env=base_env(
            PYTHONPATH=str(REPO_ROOT),
            OMP_NUM_THREADS="1",
            TIERWATCH_JOB_CREDENTIAL=cluster.job_credential("orphans", ["node-a"]),
        ),
    )
    wait_committed(a, "orphans", 1, 1)
    ranks = subprocess.run(
        ["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert len(ranks) == 2
    launcher.kill()
    launcher.wait(10)
    for pid in ranks:
        wait_for(
            lambda p=pid: (
                not Path(f"/proc/{p}").exists()
                or "Z" in Path(f"/proc/{p}/stat").read_text().split()[2]
            ),
            timeout=30,
            what=f"rank {pid} gone after its launcher was killed",
        )


def test_corrupt_file_in_each_tier_is_detected_and_another_source_used(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = cluster.add_node("node-a"), cluster.add_node("node-b")
    log = tmp_path / "log"
    job = "corrupt"
    args = train_args(job, 8, log, "--persist-every", "1")
    assert cluster.wait_ranks(
        cluster.launch(args, placement=["node-a", "node-b"], log_dir=log), 180
    ) == [0, 0]
    newest = 7
    wait_replicated(a, "node-b", job, newest)
    wait_for(
        lambda: (cluster.persistent_dir / job / step_dirname(newest) / ".metadata").exists(),
        timeout=60,
        what="persistent step 7",
    )
    shard = "__1_0.distcp"
    mem = b.memory_dir / "jobs" / job / step_dirname(newest) / shard
    rep_copy = a.memory_dir / "replicas" / "node-b" / job / step_dirname(newest) / shard
    per = cluster.persistent_dir / job / step_dirname(newest) / shard

    def forget_staged() -> None:  # a verified staged copy would be reused otherwise
        for node in (a, b):
            shutil.rmtree(node.memory_dir / "restore", ignore_errors=True)

    def flip(path: Path) -> None:
        forget_staged()
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))

    # 1. memory copy corrupted → the peer replica is used, same step
    flip(mem)
    procs = cluster.launch(
        train_args(job, 8, log, "--persist-every", "1"), placement=["node-a", "node-b"], log_dir=log
    )
    assert cluster.wait_ranks(procs, 180) == [0, 0]
    rep = restores(log, 1)[-1]
    assert rep["step"] == newest
    assert rep["sources"][shard].startswith("peer:")
    # 2. memory and peer copies bad (truncated to zero) → persistent, same step
    forget_staged()
    mem.write_bytes(b"")
    rep_copy.write_bytes(b"")
    procs = cluster.launch(
        train_args(job, 8, log, "--persist-every", "1"), placement=["node-a", "node-b"], log_dir=log
    )
    assert cluster.wait_ranks(procs, 180) == [0, 0]
    rep = restores(log, 1)[-1]
    assert rep["step"] == newest
    assert rep["sources"][shard].startswith("persistent:")
    # 3. every copy of step 7's shard bad → the ranks agree on an older step
    flip(per)
    procs = cluster.launch(
        train_args(job, 8, log, "--persist-every", "1"), placement=["node-a", "node-b"], log_dir=log
    )
    assert cluster.wait_ranks(procs, 180) == [0, 0]
    rep0, rep1 = restores(log, 0)[-1], restores(log, 1)[-1]
    assert rep0["step"] == rep1["step"] < newest
    # the staging errors name the bad file and where it was read from
    assert shard in rep1["message"]


def test_persistent_copy_loads_with_plain_dcp_at_another_world_size(
    cluster: Cluster, tmp_path: Path
) -> None:
    """DDP (replicated tensors) and FSDP2 (DTensor shards) jobs saved at world size 4 load
    with plain torch.distributed.checkpoint at world size 2, unsharded and FSDP2-sharded."""
    cluster.add_node("node-a")
    cluster.add_node("node-b")
    script = Path(__file__).with_name("dcp_plain_load.py")
    for job, extra in (("reshard-ddp", []), ("reshard-fsdp", ["--fsdp"])):
        log = tmp_path / job
        procs = cluster.launch(
            train_args(job, 5, log, "--persist-every", "1", "--final", *extra),
            placement=FOUR_ON_TWO,
            log_dir=log,
        )
        assert cluster.wait_ranks(procs, 240) == [0, 0, 0, 0]
        step_dir = cluster.persistent_dir / job / "step-4"
        wait_for(
            lambda d=step_dir: (d / ".metadata").exists(),
            timeout=60,
            what=f"persistent step 4 of {job}",
        )
        out = tmp_path / f"{job}-plain" / "out"
        procs = cluster.launch(
            [str(step_dir), str(out), *SMALL],
            placement=["node-a", "node-a"],
            log_dir=tmp_path / "plain-log",
            script=script,
        )
        assert cluster.wait_ranks(procs, 180) == [0, 0], procs[0].log_tail()
        final = json.loads((log / "final-0.json").read_text())
        for rank in range(2):
            got = json.loads(out.with_name(f"plain-{rank}.json").read_text())
            assert got["model"] == final["model"], (job, rank)
            assert got["fsdp_matches"] is True, (job, rank)


def test_agent_api_reports_steps_when_server_is_down(cluster: Cluster, tmp_path: Path) -> None:
    """The whole save/restore path works while the control plane is down: the agent keeps
    the server's public keys it fetched at start (job credentials are checked offline)."""
    a = cluster.add_node("node-a")
    assert cluster.receiver is not None
    cluster.receiver.stop()  # the stand-in server goes away before the job starts
    log = tmp_path / "log"
    procs = cluster.launch(train_args("no-server", 4, log), placement=["node-a"], log_dir=log)
    assert cluster.wait_ranks(procs, 120) == [0]
    r = httpx.get(
        f"{a.url}/v1/ckpt/jobs/no-server/available", params={"persistent": 0}, headers=a.auth
    )
    steps = {e["step"] for e in r.json()["entries"]}
    assert 3 in steps

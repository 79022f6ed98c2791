"""An operator rolls a running job back in-process to a chosen step (real ranks, real agents).

examples/train_gpt.py runs as two real rank processes (DDP over gloo) on two simulated
nodes. Rank 0 simulates silent data corruption after step 8 (``--sdc-at``); once step 10 is
committed, the operator asks for step 5. The restore request reaches each node's agent the
way the server sends it: through ``POST /api/v1/jobs/{job}/restore`` when this tree has the
server's restore API and the agent's command executor (subprocess agents), else by handing
the same ``Command`` to each agent's checkpoint service as the executor does (the agents then
run in the test process: the real AgentRuntime with its local API on a port).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from procs import wait_for
from training import (
    TINY_GPT,
    Cluster,
    Gate,
    committed_steps,
    read_log,
    restore_command,
    runs_of,
    start_cluster,
)

from tierwatch.agent.checkpoint.format.layout import parse_step_dirname, step_dirname
from tierwatch.agent.checkpoint.format.manifest import load_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMALL = [
    *TINY_GPT, "--exact-resume", "--keep-memory", "40", "--persist-every", "5",
    "--latency-every", "0",
]  # fmt: skip
PLACEMENT = ["node-a", "node-b"]
TOTAL = 30
SDC_AT = 8
TARGET = 5


class Operator:
    """Asks the server for restores, as an operator does, and reads their progress."""

    def __init__(self, cluster: Cluster) -> None:
        assert cluster.server is not None
        self.server = cluster.server
        self.headers = {"Authorization": f"Bearer {cluster.server.token('operator')}"}

    def restore(self, job: str, step: int) -> int:
        url = f"{self.server.url}/api/v1/jobs/{job}/restore"
        answers: list[str] = []

        def accepted() -> dict | None:  # the ledger learns of the step within a report
            r = httpx.post(
                url,
                json={"step": step, "reason": "SDC after step 8"},
                headers=self.headers,
                timeout=10,
            )
            answers.append(f"{r.status_code} {r.text[:300]}")
            return r.json() if r.status_code == 202 else None

        try:
            return int(
                wait_for(
                    accepted,
                    timeout=30,
                    interval=0.5,
                    what=f"restore of {job} step {step} accepted",
                )["id"]
            )
        except TimeoutError:
            raise AssertionError(
                f"the server refused the restore of {job} step {step}: "
                f"{answers[-1] if answers else 'no answer'}"
            ) from None

    def phases(self, request_id: int) -> set[tuple[int, str]]:
        """(rank, phase) the ranks reported for the request, as far as seen."""
        r = httpx.get(
            f"{self.server.url}/api/v1/restores/{request_id}", headers=self.headers, timeout=10
        ).json()
        return {(x["rank"], x["phase"]) for x in r["ranks"]}


@pytest.fixture
def cluster(tmp_path: Path):
    c = start_cluster(tmp_path / "cluster", with_server=True)
    for name in ("node-a", "node-b"):
        c.add_node(name)
    yield c
    c.stop()


def train_args(job: str, log_dir: Path, *extra: str) -> list[str]:
    return ["--job-id", job, "--steps", str(TOTAL), "--log-dir", str(log_dir), *SMALL, *extra]


def pending(cluster: Cluster, job: str) -> list[int]:
    return [
        r["request_id"]
        for n in cluster.nodes.values()
        for r in httpx.get(
            f"{n.url}/v1/ckpt/jobs/{job}/restore-requests", headers=n.auth, timeout=5
        ).json()["requests"]
    ]


def test_operator_rolls_a_running_job_back_and_the_ranks_agree(
    cluster: Cluster, tmp_path: Path
) -> None:
    op = Operator(cluster)
    base_log, log = tmp_path / "base", tmp_path / "run"
    base = cluster.launch(train_args("rb-base", base_log), placement=PLACEMENT, log_dir=base_log)
    job = "rb-sdc"
    gate = Gate(tmp_path / "gate")
    gate.open(11)  # steps 0 … 10 run, then the ranks wait at the gate
    procs = cluster.launch(
        train_args(job, log, "--sdc-at", str(SDC_AT), "--final", "--gate", str(gate.path)),
        placement=PLACEMENT,
        log_dir=log,
    )
    assert cluster.wait_ranks(base, 240) == [0, 0]
    clean = {r: {x["step"]: x["loss"] for x in read_log(base_log, r)} for r in (0, 1)}

    wait_for(
        lambda: max(committed_steps(cluster.nodes["node-b"], job, 1) or [-1]) >= 10,
        timeout=120,
        what="step 10 committed",
    )
    first = op.restore(job, TARGET)
    wait_for(
        lambda: pending(cluster, job) == [first, first],
        timeout=30,
        what="the restore request on both agents",
    )
    # one step at a time until the ranks (which read requests every 0.5 s) roll back
    gate.step_until(12, TOTAL, lambda: len(runs_of(read_log(log))) > 1, log_dir=log)
    gate.open(TOTAL)
    assert cluster.wait_ranks(procs, 240) == [0, 0], procs[0].log_tail()

    # every rank rolled back at the same step boundary, to the requested step
    at = []
    for rank in (0, 1):
        before, after = runs_of(read_log(log, rank))
        at.append(before[-1]["step"])
        assert after[0]["step"] == TARGET + 1
        assert {x["restored_from"] for x in after} == {TARGET}
        assert after[-1]["step"] == TOTAL - 1
        # the corrupted future differs from the clean run; after the rollback the losses
        # are the clean run's, bit for bit
        assert [x["loss"] for x in before][: SDC_AT + 1] == [
            clean[rank][s] for s in range(SDC_AT + 1)
        ]
        assert [x["loss"] for x in before[SDC_AT + 1 :]] != [
            clean[rank][s] for s in range(SDC_AT + 1, at[-1] + 1)
        ]
        assert [x["loss"] for x in after] == [clean[rank][s] for s in range(TARGET + 1, TOTAL)]
    assert at[0] == at[1] > SDC_AT
    for rank in (0, 1):
        reports = [json.loads(x) for x in (log / f"restores-{rank}.jsonl").read_text().splitlines()]
        rep = reports[-1]
        assert (rep["request_id"], rep["phase"], rep["step"], rep["ok"]) == (
            first,
            "loaded",
            TARGET,
            True,
        )
        assert rep["steps_lost"] == at[rank] - TARGET
        assert sum(rep["files_by_tier"].values()) >= 1
    wait_for(
        lambda: {(0, "loaded"), (1, "loaded")} <= op.phases(first),
        timeout=30,
        what="loaded reported for both ranks",
    )
    assert pending(cluster, job) == []  # retired on both agents

    # the diverged future is gone: every step above 5 that any tier holds is the new one
    holders = [
        p
        for n in cluster.nodes.values()
        for p in n.memory_dir.glob(f"**/{job}/step-*/manifest-*.json")
        if "restore" not in p.parts
    ]
    holders += list((cluster.persistent_dir / job).glob("step-*/manifest-*.json"))
    newer = [load_manifest(p) for p in holders if parse_step_dirname(p.parent.name) > TARGET]
    assert newer
    assert {tuple(m.fences) for m in newer} == {((first, TARGET),)}

    # the job is down; the operator asks for step 9, which both futures saved: the next
    # start loads the new (clean) step 9, not request 1's step again, and trains on
    second = op.restore(job, 9)
    final = json.loads((log / "final-0.json").read_text())
    procs = cluster.launch(train_args(job, log, "--final"), placement=PLACEMENT, log_dir=log)
    assert cluster.wait_ranks(procs, 240) == [0, 0], procs[0].log_tail()
    for rank in (0, 1):
        third = runs_of(read_log(log, rank))[-1]
        assert third[0]["step"] == 10
        assert {x["restored_from"] for x in third} == {9}
        assert [x["loss"] for x in third] == [clean[rank][s] for s in range(10, TOTAL)]
        rep = json.loads((log / f"restores-{rank}.jsonl").read_text().splitlines()[-1])
        assert (rep["request_id"], rep["phase"], rep["step"]) == (second, "loaded", 9)
    assert json.loads((log / "final-0.json").read_text()) == final
    wait_for(
        lambda: {(0, "loaded"), (1, "loaded")} <= op.phases(second),
        timeout=30,
        what="request 2 loaded on both ranks",
    )
    assert pending(cluster, job) == []


@pytest.fixture
def direct_cluster(tmp_path: Path):
    """Two nodes whose agents run in the test process, so a test can hand the restore
    command to one agent long before the other (the server sends it to both at once)."""
    c = start_cluster(tmp_path / "direct", with_server=False)
    for name in PLACEMENT:
        c.add_inprocess_node(name)
    yield c
    c.stop()


def test_a_requested_step_outlives_retention_until_every_rank_acts(
    direct_cluster: Cluster, tmp_path: Path
) -> None:
    """The request reaches node-b's agent while step S is the newest; node-a's agent gets it
    only after many more steps, which retention (keep 2 in memory and peers, persistent only
    every 1000 steps) would have used to evict S everywhere. S stays pinned in every tier
    (node-a's rank 0 decides retention for both ranks and knows node-b's pins through the
    save collective), so the rollback to S succeeds; afterwards retention removes S."""
    c = direct_cluster
    job, log, total = "rb-pinned", tmp_path / "pinned", 30
    gate = Gate(tmp_path / "gate")
    target = 2
    gate.open(target + 1)  # steps 0 … S run, then the ranks wait at the gate
    args = [
        "--job-id",
        job,
        "--steps",
        str(total),
        "--log-dir",
        str(log),
        *SMALL,
        # (the last of a repeated option wins) the default memory retention, and no
        # persistent copy of any step but 0
        "--keep-memory",
        "2",
        "--persist-every",
        "1000",
        "--gate",
        str(gate.path),
    ]
    procs = c.launch(args, placement=PLACEMENT, log_dir=log)
    a, b = c.nodes["node-a"], c.nodes["node-b"]

    def newest(node, rank: int) -> int:
        return max(committed_steps(node, job, rank) or [-1])

    wait_for(
        lambda: newest(b, 1) == target, timeout=60, interval=0.02, what=f"step {target} committed"
    )
    b.deliver_and_wait_read(
        restore_command(request_id=1, job_id=job, step=target, reason="pin test")
    )
    gate.open(target + 7)
    wait_for(
        lambda: newest(b, 1) >= target + 6 and newest(a, 0) >= target + 6,
        timeout=60,
        interval=0.1,
        what=f"step {target + 6} committed",
    )
    # retention kept the pinned step on both nodes, also where the agent has no request
    assert target in committed_steps(a, job, 0)
    assert target in committed_steps(b, job, 1)
    assert len(committed_steps(a, job, 0)) <= 4  # the newest 2, S, the persisted step 0
    a.deliver_and_wait_read(
        restore_command(request_id=1, job_id=job, step=target, reason="pin test")
    )
    gate.open(total)  # both ranks hold the request: they roll back at the next step
    assert c.wait_ranks(procs, 120) == [0, 0], procs[0].log_tail()

    for rank in (0, 1):
        before, after = runs_of(read_log(log, rank))
        assert before[-1]["step"] >= target + 7
        assert after[0]["step"] == target + 1
        assert {x["restored_from"] for x in after} == {target}
        assert after[-1]["step"] == total - 1
        rep = json.loads((log / f"restores-{rank}.jsonl").read_text().splitlines()[-1])
        assert (rep["request_id"], rep["phase"], rep["step"], rep["ok"]) == (
            1,
            "loaded",
            target,
            True,
        ), rep
    assert pending(c, job) == []
    # served: normal retention removed the step again
    assert target not in committed_steps(a, job, 0)
    assert target not in committed_steps(b, job, 1)
    for holder, src in ((a, "node-b"), (b, "node-a")):
        assert not (holder.memory_dir / "replicas" / src / job / step_dirname(target)).exists()

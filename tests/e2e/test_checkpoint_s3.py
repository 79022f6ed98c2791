"""The persistent tier on S3 with a real job: examples/train_gpt.py on 2 nodes × 2 ranks, two
real tierwatch-agent processes, and ``moto_server`` (a real S3 API) on loopback, reached
through s3fs with the agents' own S3 settings (``TIERWATCH_S3_ENDPOINT_URL``, region) and
dummy credentials from the environment (botocore's chain).

node-b's agent reaches S3 through a proxy the test can stall: its agent is killed with
SIGKILL in the middle of an upload, and the job then loses all its memory. Persister-level
checks (multipart, stale listings, a killed multipart upload) are in
tests/agent/checkpoint/tierstore/test_persister_s3.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from procs import wait_for
from s3_server import S3Bucket, ThrottledProxy
from training import TINY_GPT, read_losses, run_in_thread, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FOUR_ON_TWO = ["node-a", "node-a", "node-b", "node-b"]
JOB = "s3-e2e"
PREFIX = "ckpt"


def train_args(steps: int, log_dir: Path) -> list[str]:
    return [
        "--job-id", JOB, "--steps", str(steps), "--log-dir", str(log_dir), *TINY_GPT,
        "--exact-resume", "--persist-every", "2",
    ]  # fmt: skip


def committed_on_s3(bucket: S3Bucket) -> dict[int, set[str]]:
    """step → object names of the steps whose ``.metadata`` is on S3."""
    by_step: dict[int, set[str]] = {}
    for key in bucket.keys(f"{PREFIX}/{JOB}/"):
        m = re.fullmatch(rf"{PREFIX}/{JOB}/step-(\d+)/(.+)", key)
        if m:
            by_step.setdefault(int(m[1]), set()).add(m[2])
    return {s: names for s, names in by_step.items() if ".metadata" in names}


def test_two_nodes_on_s3_survive_an_agent_killed_mid_upload_and_the_loss_of_all_memory(
    tmp_path: Path, s3_bucket: S3Bucket, throttled_proxy: ThrottledProxy
) -> None:
    cluster = start_cluster(tmp_path / "cluster", with_server=False)
    try:
        url = ["--persistent-url", s3_bucket.url(PREFIX)]  # the last --persistent-url wins
        a = cluster.add_node("node-a", extra_args=url, env=s3_bucket.agent_env())
        b = cluster.add_node("node-b", extra_args=url, env=s3_bucket.agent_env(throttled_proxy.url))
        log1, log2 = tmp_path / "run1", tmp_path / "run2"
        ranks = cluster.launch(train_args(100_000, log1), placement=FOUR_ON_TWO, log_dir=log1)

        # 2 nodes × 2 ranks commit persistent steps: every rank's manifest, then .metadata
        wait_for(
            lambda: committed_on_s3(s3_bucket),
            timeout=120,
            what=f"a step committed on S3\n{a.proc.log_tail()}\n{b.proc.log_tail()}",
        )

        # node-b's link stalls at its first upload of a newer step; then its agent is killed
        newest = max(committed_on_s3(s3_bucket))
        puts = re.compile(rf"PUT /{s3_bucket.name}/{PREFIX}/{JOB}/step-(\d+)/")
        stalled_at: list[int] = []

        def newer_upload(line: str) -> bool:
            m = puts.match(line)
            if m and int(m[1]) > newest:
                stalled_at.append(int(m[1]))
                return True
            return False

        throttled_proxy.hold_on = newer_upload
        torn = wait_for(
            lambda: stalled_at and stalled_at[0],
            timeout=60,
            interval=0.02,
            what=f"node-b uploading a step after {newest}",
        )
        b.stop(9)
        throttled_proxy.drop()  # what the stalled link held never reaches S3
        throttled_proxy.hold_on = None
        # training goes on without node-b's agent (the memory tier needs none)
        wait_for(
            lambda: max(read_losses(log1), default=-1) > torn,
            timeout=60,
            what=f"rank 0 training past step {torn}",
        )
        cluster.kill_ranks(ranks)
        a.stop(9)
        committed = committed_on_s3(s3_bucket)
        assert torn not in committed, "the step node-b's agent was uploading got .metadata"
        restorable = max(committed)
        assert restorable < torn
        for names in committed.values():
            assert {f"manifest-{r}.json" for r in range(4)} <= names
            assert {n.split("_")[2] for n in names if n.endswith(".distcp")} == {"0", "1", "2", "3"}

        # .metadata was written last in every committed step (moto's log is in response order)
        log = s3_bucket.server.requests()
        for step in committed:
            folder = f"/{s3_bucket.name}/{PREFIX}/{JOB}/step-{step}/"
            writes = [
                (i, r.path[len(folder) :].split("?")[0])
                for i, r in enumerate(log)
                if r.method in {"PUT", "POST"} and r.path.startswith(folder)
            ]
            meta = [i for i, name in writes if name == ".metadata"]
            assert len(meta) == 1, (step, writes)
            assert all(i < meta[0] for i, name in writes if name != ".metadata"), (step, writes)

        # all memory is lost; the job comes back from S3, bit for bit
        for node in (a, b):
            node.wipe_memory()
        b_up = run_in_thread(b.start)  # both agents start at once
        a.start()
        b_up.join(60)
        ranks = cluster.launch(
            train_args(restorable + 3, log2), placement=FOUR_ON_TWO, log_dir=log2
        )
        assert cluster.wait_ranks(ranks, 180) == [0, 0, 0, 0]
        restore = read_restore_reports(log2)
        assert restore, "no restore report"
        assert restore[-1]["ok"], restore[-1]
        assert restore[-1]["step"] == restorable
        assert set(restore[-1]["files_by_tier"]) == {"persistent"}
        before, after = read_losses(log1), read_losses(log2)
        for step in range(restorable + 1, restorable + 3):
            assert after[step] == before[step], step  # bit-exact: the same loss, not close
    finally:
        cluster.stop()


def read_restore_reports(log_dir: Path, rank: int = 0) -> list[dict]:
    import json

    path = log_dir / f"restores-{rank}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

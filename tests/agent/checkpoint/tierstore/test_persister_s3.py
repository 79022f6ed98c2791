"""The persistent tier on S3, against a real S3 API (``moto_server`` on loopback, through
s3fs): uploads, freshness of listings, a killed upload, restore staging and the agent's S3
settings. No torch ranks here (tests/e2e/test_checkpoint_s3.py runs a real job)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import write_step
from procs import REPO_ROOT, wait_for
from pydantic import ValidationError
from s3_server import AWS_ENV, S3Bucket, ThrottledProxy

from tierwatch.agent.checkpoint.format.layout import METADATA, MemoryLayout, manifest_name
from tierwatch.agent.checkpoint.format.manifest import FileEntry, Manifest, xxh3_file
from tierwatch.agent.checkpoint.tierstore.persister import (
    STAGED_METADATA,
    PersistentError,
    PersistentTier,
)
from tierwatch.agent.checkpoint.tierstore.restore_staging import (
    RestoreStager,
    StageFile,
    StageRequest,
    StageSource,
)
from tierwatch.agent.config import AgentSettings

MiB = 1024**2
JOB = "s3job"


def file_entry(path: Path) -> FileEntry:
    size, digest = xxh3_file(path)
    return FileEntry(name=path.name, size=size, xxh3=digest)


def tier(bucket: S3Bucket, **options: object) -> PersistentTier:
    """A tier as one agent holds it (its own filesystem instance)."""
    return PersistentTier(bucket.url(), {**bucket.storage_options(), **options})


def persist(
    t: PersistentTier, memory: Path, manifests: dict[int, Manifest], step: int, *, commit: bool
) -> None:
    """Upload ranks' files of one step as their agent does: shards, ``.metadata`` staged,
    the manifest last; with ``commit``, rename ``.metadata`` into place."""
    d = MemoryLayout(memory).step_dir(JOB, step)
    for rank, m in manifests.items():
        for f in m.files:
            name = STAGED_METADATA if f.name == METADATA else f.name
            t.put_file(d / f.name, JOB, step, name, expect=f)
        t.put_file(d / manifest_name(rank), JOB, step, manifest_name(rank))
    if commit:
        t.commit_metadata(JOB, step)


def test_multipart_upload_is_parallel_verified_and_whole(
    tmp_path: Path, s3_bucket: S3Bucket
) -> None:
    t = PersistentTier(
        s3_bucket.url(), s3_bucket.storage_options(), part_size=5 * MiB, upload_concurrency=3
    )
    src = tmp_path / "big.distcp"
    src.write_bytes(os.urandom(12 * MiB + 123))
    before = len(s3_bucket.server.requests())
    seen: list[int] = []
    n = t.put_file(src, JOB, 1, "__0_0.distcp", expect=file_entry(src), progress=seen.append)
    assert n == src.stat().st_size == sum(seen)
    with t.open_read(JOB, 1, "__0_0.distcp") as f:
        assert f.read() == src.read_bytes()
    calls = [r for r in s3_bucket.server.requests()[before:] if s3_bucket.name in r.path]
    parts = [r for r in calls if r.method == "PUT" and "partNumber=" in r.path]
    assert len(parts) == 3  # 5 + 5 + 2 MiB
    assert any(r.method == "POST" and "uploads" in r.path for r in calls)
    assert not any(r.method == "PUT" and "makedirs" in r.path for r in calls)
    assert s3_bucket.multipart_uploads() == []


@pytest.mark.parametrize("size", [64 * 1024, 11 * MiB], ids=["put-object", "multipart"])
def test_a_file_that_does_not_match_its_manifest_leaves_nothing(
    tmp_path: Path, s3_bucket: S3Bucket, size: int
) -> None:
    t = PersistentTier(s3_bucket.url(), s3_bucket.storage_options(), part_size=5 * MiB)
    src = tmp_path / "shard"
    src.write_bytes(os.urandom(size))
    good = file_entry(src)
    bad = FileEntry(name=good.name, size=good.size, xxh3="0" * 16)
    with pytest.raises(PersistentError, match="the manifest says"):
        t.put_file(src, JOB, 1, "__0_0.distcp", expect=bad)
    assert s3_bucket.keys() == []
    assert s3_bucket.multipart_uploads() == []  # aborted, no parts left behind


@pytest.mark.parametrize(
    "extra", [{}, {"use_listings_cache": True}], ids=["default", "listings-cache-on"]
)
def test_a_listing_made_before_another_agents_upload_does_not_hide_it(
    tmp_path: Path, s3_bucket: S3Bucket, extra: dict[str, object]
) -> None:
    """Agent A answers availability (lists the job, the step folder, ``.metadata``) before
    agent B uploads; A's next answers must see B's files. s3fs's directory cache never
    expires by default, so without the fix A keeps answering from its first listing."""
    a, b = tier(s3_bucket, **extra), tier(s3_bucket)
    layout = ["node-a", "node-b"]
    mem_a, mem_b = tmp_path / "a", tmp_path / "b"
    one = write_step(mem_a, job_id=JOB, step=1, node="node-a", layout=layout, persist=True)
    one |= write_step(mem_b, job_id=JOB, step=1, node="node-b", layout=layout, persist=True)
    persist(b, mem_b, {1: one[1]}, 1, commit=False)
    persist(b, mem_a, {0: one[0]}, 1, commit=True)
    # A answers once: step 1 only, step 2 has no folder, no .metadata, no manifests
    assert a.steps(JOB) == [1]
    assert a.names(JOB, 2) == []
    assert not a.has_metadata(JOB, 2)
    assert a.manifest_ranks(JOB, 2) == set()
    # B uploads rank 1's files of step 2 first (A, rank 0's agent, waits for them) ...
    two_b = write_step(mem_b, job_id=JOB, step=2, node="node-b", layout=layout, persist=True)
    persist(b, mem_b, two_b, 2, commit=False)
    assert a.manifest_ranks(JOB, 2) == {1}
    assert a.steps(JOB) == [1, 2]
    # ... then A's own files, and .metadata goes in; a third agent's commit is seen too
    two_a = write_step(mem_a, job_id=JOB, step=2, node="node-a", layout=layout, persist=True)
    persist(b, mem_a, two_a, 2, commit=True)
    assert a.has_metadata(JOB, 2)
    assert {m.rank for m in a.manifests(JOB, 2)} == {0, 1}
    # and a step removed by another agent's retention is gone for A too
    b.delete_step(JOB, 1)
    assert a.steps(JOB) == [2]
    assert not a.has_metadata(JOB, 1)


_UPLOAD = """
import sys
from pathlib import Path
from tierwatch.agent.checkpoint.tierstore.persister import PersistentTier
url, endpoint, src = sys.argv[1:4]
t = PersistentTier(url, {"endpoint_url": endpoint, "client_kwargs": {"region_name": "us-east-1"}},
                   part_size=5 * 1024**2, upload_concurrency=1)
t.put_file(Path(src), "s3job", 2, "__0_0.distcp")
"""


def test_kill_9_mid_multipart_upload_leaves_no_object_and_the_previous_step_restorable(
    tmp_path: Path, s3_bucket: S3Bucket, throttled_proxy: ThrottledProxy
) -> None:
    t = tier(s3_bucket)
    mem = tmp_path / "mem"
    one = write_step(mem, job_id=JOB, step=1, node="node-a", layout=["node-a"], persist=True)
    persist(t, mem, one, 1, commit=True)
    big = tmp_path / "big"
    big.write_bytes(os.urandom(12 * MiB))
    throttled_proxy.rate = 4 * MiB  # ~3 s for the whole file: it is killed after one part
    proc = subprocess.Popen(
        [sys.executable, "-c", _UPLOAD, s3_bucket.url(), throttled_proxy.url, str(big)],
        env={**os.environ, **AWS_ENV, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        c = s3_bucket.server.client()

        def parts() -> int:
            ups = s3_bucket.multipart_uploads()
            if not ups:
                return 0
            got = c.list_parts(
                Bucket=s3_bucket.name, Key=ups[0]["Key"], UploadId=ups[0]["UploadId"]
            )
            return len(got.get("Parts", []))

        wait_for(lambda: parts() >= 1, timeout=30, interval=0.05, what="a part uploaded")
        assert proc.poll() is None, "the upload finished before the kill"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert f"ckpt/{JOB}/step-2/__0_0.distcp" not in s3_bucket.keys()
    assert t.names(JOB, 2) == []
    assert t.steps(JOB) == [1]
    assert t.has_metadata(JOB, 1)
    # the previous step stages back bit for bit from S3
    stager = RestoreStager(
        MemoryLayout(tmp_path / "restore-node"),
        node="node-r",
        peer=None,
        emit=lambda _e: None,
        persistent=t,
    )
    files = [f for m in one.values() for f in m.files]
    src = StageSource(tier="persistent", holder="persistent", url=t.step_url(JOB, 1))
    out = stager.stage(
        JOB,
        StageRequest(
            step=1,
            files=[StageFile(name=f.name, size=f.size, xxh3=f.xxh3, sources=[src]) for f in files],
        ),
    )
    assert out["ok"], out
    d = MemoryLayout(mem).step_dir(JOB, 1)
    for f in files:
        assert (Path(out["dir"]) / f.name).read_bytes() == (d / f.name).read_bytes()


def test_problems_name_what_to_fix(s3_bucket: S3Bucket) -> None:
    missing = PersistentTier(f"s3://no-such-{s3_bucket.name}/ckpt", s3_bucket.storage_options())
    problem = missing.write_problem()
    assert problem is not None
    assert "create the bucket" in problem
    assert tier(s3_bucket).write_problem() is None
    with pytest.raises(PersistentError, match="unknown s3 storage option.*'endpoint'"):
        PersistentTier(s3_bucket.url(), {"endpoint": "http://127.0.0.1:1"})


def test_a_missing_bucket_is_an_error_not_a_job_without_steps(s3_bucket: S3Bucket) -> None:
    """On S3 a missing bucket lists like a missing folder; read as "no steps", a restore with
    all memory lost would start the job from scratch."""
    assert tier(s3_bucket).steps("job-new") == []  # the bucket exists: the job has no steps
    missing = PersistentTier(f"s3://no-such-{s3_bucket.name}/ckpt", s3_bucket.storage_options())
    with pytest.raises(PersistentError, match="does not exist.*create the bucket"):
        missing.steps("job-1")


def test_agent_s3_settings_become_storage_options(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("TIERWATCH_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("TIERWATCH_PERSISTENT_URL", "s3://bucket/prefix")
    monkeypatch.setenv("TIERWATCH_S3_ENDPOINT_URL", "http://minio.example:9000/")
    monkeypatch.setenv("TIERWATCH_S3_REGION", "eu-west-1")
    monkeypatch.setenv(
        "TIERWATCH_PERSISTENT_OPTIONS", '{"config_kwargs": {"retries": {"max_attempts": 9}}}'
    )
    monkeypatch.setenv("TIERWATCH_S3_PART_SIZE", "32MiB")
    s = AgentSettings()
    assert s.persistent_storage_options() == {
        "endpoint_url": "http://minio.example:9000",
        "client_kwargs": {"region_name": "eu-west-1"},
        "config_kwargs": {"retries": {"max_attempts": 9}},
    }
    assert s.s3_part_size == 32 * MiB
    assert AgentSettings(s3_profile="train").persistent_storage_options()["profile"] == "train"


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({"persistent_options": "{not json"}, "is not valid JSON"),
        ({"persistent_options": "[1, 2]"}, "must be a JSON object"),
        ({"persistent_options": '{"endpoint": "http://x:1"}'}, "unknown s3 storage option"),
        ({"persistent_options": '{"endpoint_url": "minio:9000"}'}, "http:// or https://"),
        ({"s3_endpoint_url": "minio:9000"}, "http:// or https:// base URL"),
        ({"s3_region": "EU West 1"}, "region name such as"),
        ({"s3_part_size": "1MiB"}, "between 5MiB and 5GiB"),
        (
            {
                "persistent_options": '{"endpoint_url": "http://a:1"}',
                "s3_endpoint_url": "http://b:1",
            },
            "set one of them",
        ),
        (
            {"persistent_url": "file:///tmp/x", "s3_endpoint_url": "http://b:1"},
            "only work with an s3:// persistent URL",
        ),
    ],
)
def test_bad_s3_settings_say_what_to_fix(
    monkeypatch: pytest.MonkeyPatch, kw: dict[str, str], says: str
) -> None:
    for k in list(os.environ):
        if k.startswith("TIERWATCH_"):
            monkeypatch.delenv(k)
    kw = {"persistent_url": "s3://bucket/prefix", **kw}
    with pytest.raises(ValidationError, match=says):
        AgentSettings(**kw)  # type: ignore[arg-type]

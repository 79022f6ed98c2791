"""Pure parts of the agent's checkpoint store: sizes, settings, placement, budget accounting."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest
import xxhash
from procs import BIN, base_env
from pydantic import ValidationError

from tierwatch.agent.checkpoint.tierstore.replicator import peer_targets
from tierwatch.agent.checkpoint.tierstore.store import MemoryStore, StoreError
from tierwatch.agent.config import AgentSettings, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("123", 123),
        ("64KiB", 65536),
        ("8GiB", 8 * 1024**3),
        ("1.5G", 1_500_000_000),
        ("2 MB", 2_000_000),
        ("512mib", 512 * 1024**2),
        (4096, 4096),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "8 GiBs", "lots", "1e9", -5, "1" * 400])
def test_parse_bytes_refuses(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_checkpoint_settings_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERWATCH_MEMORY_BUDGET", "8GiB")
    monkeypatch.setenv("TIERWATCH_REPLICATION", "2")
    monkeypatch.setenv("TIERWATCH_PERSISTENT_URL", str(tmp_path / "p"))
    s = AgentSettings(node="gpu-1")
    assert s.memory_budget == 8 * 1024**3
    assert s.replication == 2
    assert s.resolved_persistent_url() == f"file://{tmp_path / 'p'}"
    assert str(s.resolved_memory_dir()) == "/dev/shm/tierwatch/gpu-1"
    assert s.ckpt_scan_interval == 2.0
    monkeypatch.delenv("TIERWATCH_MEMORY_BUDGET")
    s = AgentSettings(node="gpu-1", memory_dir=tmp_path)
    st = os.statvfs(tmp_path)
    assert s.resolved_memory_budget() == st.f_frsize * st.f_blocks // 2
    with pytest.raises(ValidationError, match="advertise_url"):
        AgentSettings(node="gpu-1", advertise_url="gpu-1:9470")
    with pytest.raises(ValidationError, match="8GiB"):
        AgentSettings(node="gpu-1", memory_budget="much")


@pytest.mark.parametrize(
    "budget", ["eight gigs", "0", "0B", "-1", "-8GiB", "0.1", "9000000PiB", "1" * 400]
)
def test_run_refuses_a_bad_memory_budget(budget):
    out = subprocess.run(
        [
            str(BIN / "tierwatch-agent"),
            "run",
            "--node",
            "n",
            "--server",
            "http://x:1",
            "--token",
            "t",
            "--memory-budget",
            budget,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=base_env(),
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr  # one line, no traceback
    assert "--memory-budget" in lines[0]
    assert "Value error" not in lines[0]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("budget", [0, "0", -1, "-1", 2**62 + 1, "5EiB", "8 GiBs", None.__class__])
def test_memory_budget_must_be_positive_and_sane(budget):
    with pytest.raises(ValidationError, match="--memory-budget") as info:
        AgentSettings(node="gpu-1", memory_budget=budget)
    assert len(info.value.errors()) == 1


def test_memory_budget_accepts_sizes_up_to_2_62():
    assert AgentSettings(node="gpu-1", memory_budget=2**62).memory_budget == 2**62
    assert AgentSettings(node="gpu-1", memory_budget="1").memory_budget == 1
    assert AgentSettings(node="gpu-1", memory_budget="8GiB").memory_budget == 8 * 1024**3


@pytest.mark.parametrize(
    ("layout", "rank", "replication", "expected"),
    [
        (["a", "a", "b", "b"], 0, 1, ["b"]),
        (["a", "a", "b", "b"], 1, 1, ["b"]),
        (["a", "a", "b", "b"], 3, 1, ["a"]),
        (["a", "b", "c", "d"], 2, 2, ["d", "a"]),
        (["a", "a", "b", "b", "c", "c"], 5, 2, ["a", "b"]),
        (["a", "b"], 0, 5, ["b"]),
        (["a", "a"], 1, 1, []),
        (["a"], 0, 1, []),
    ],
)
def test_peer_targets(layout, rank, replication, expected):
    assert peer_targets(layout, rank, replication) == expected


def test_budget_counts_hard_links_once_and_reserves_uploads(tmp_path):
    store = MemoryStore(tmp_path / "mem", node="node-a", budget_bytes=10_000)
    f = tmp_path / "mem" / "jobs" / "j" / "step-1" / "__0_0.distcp"
    f.parent.mkdir(parents=True)
    f.write_bytes(b"x" * 4000)
    restore = tmp_path / "mem" / "restore" / "j" / "step-1"
    restore.mkdir(parents=True)
    os.link(f, restore / f.name)
    assert store.used_bytes() == 4000
    data = b"y" * 5000
    digest = xxhash.xxh3_64(data).hexdigest()
    up = store.begin_replica(
        src_node="node-b", job_id="j", step=1, name="__1_0.distcp", xxh3=digest, size=len(data)
    )
    assert store.used_bytes() == 9000  # the announced size is reserved
    with pytest.raises(StoreError) as exc:
        store.begin_replica(
            src_node="node-b", job_id="j", step=1, name="__2_0.distcp", xxh3=digest, size=len(data)
        )
    assert exc.value.status == 507
    assert "9000 of 10000 bytes used" in exc.value.message
    up.write(data)
    got = up.finish()
    assert got.size == 5000
    assert store.used_bytes() == 9000
    # a body longer than announced is cut off at the announced size, and nothing is left
    up = store.begin_replica(
        src_node="node-b", job_id="j", step=2, name="__1_0.distcp", xxh3=digest, size=1000
    )
    up.write(b"z" * 600)
    with pytest.raises(StoreError) as exc:
        up.write(b"z" * 600)
    assert exc.value.status == 413
    assert "more than the 1000 bytes its Content-Length announced" in exc.value.message
    assert not (tmp_path / "mem" / "replicas" / "node-b" / "j" / "step-2").exists()
    assert store.used_bytes() == 9000


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _worker(tmp_path, events):
    from tierwatch.agent.checkpoint.tierstore.persister import PersistentTier
    from tierwatch.agent.checkpoint.tierstore.worker import TierWorker

    store = MemoryStore(tmp_path / "mem", node="node-a", budget_bytes=2**30)
    return TierWorker(
        store,
        PersistentTier(f"file://{tmp_path / 'pers'}"),
        emit=events.append,
        peer=None,
        replication=1,
        scan_interval_s=0.1,
    )


def test_commit_marker_removed_while_scanning_is_not_a_warning(tmp_path, monkeypatch):
    from ckpt_helpers import write_step

    from tierwatch.agent.checkpoint.tierstore import worker as worker_mod

    events: list = []
    w = _worker(tmp_path, events)
    write_step(w.store.root, job_id="job-1", step=3, node="node-a", layout=["node-a"])
    real = worker_mod.load_commit

    def racing(path):  # the trainer's retention removes the step between listing and reading
        path.unlink()
        return real(path)

    monkeypatch.setattr(worker_mod, "load_commit", racing)
    records = _Records()
    logger = logging.getLogger("tierwatch.agent.checkpoint.tierstore.worker")
    logger.addHandler(records)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        assert w.local_commits() == {}
    finally:
        logger.removeHandler(records)
        logger.setLevel(old_level)
    assert not events
    assert not [r for r in records.records if r.levelno >= logging.WARNING]
    assert [
        r for r in records.records if r.levelno == logging.DEBUG and "vanished" in r.getMessage()
    ]


def test_unparsable_commit_marker_is_still_a_warning(tmp_path):
    from ckpt_helpers import write_step

    events: list = []
    w = _worker(tmp_path, events)
    write_step(w.store.root, job_id="job-1", step=3, node="node-a", layout=["node-a"])
    (w.store.root / "jobs" / "job-1" / "step-3" / "commit-0.json").write_text("{not json")
    records = _Records()
    logger = logging.getLogger("tierwatch.agent.checkpoint.tierstore.worker")
    logger.addHandler(records)
    try:
        assert w.local_commits() == {}
    finally:
        logger.removeHandler(records)
    warnings = [r for r in records.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "unreadable commit marker" in warnings[0].getMessage()
    assert len(events) == 1

"""Backpressure between the tiers (docs/checkpointing.md, "Backpressure").

- a step the agent replicates or uploads stays in memory until that work is done: the agent
  pins it (``jobs/<job>/.agent-pins.json``, under ``.agent-pins.lock``) and the ranks' memory
  retention keeps what is pinned;
- the agent replicates and uploads one step for all its local ranks;
- a tier that cannot keep up finishes its step, then skips on purpose to the newest one and
  says so (a ``failed`` event with the lag);
- persistent retention counts completed steps (``.metadata``), and removes partial folders
  older than the newest complete step.

A real :class:`CheckpointService` in this process (memory store, tier worker, persistent tier);
the ranks are played by :class:`Ranks`, which writes steps as a trainer does
(``ckpt_helpers.write_step``) and evicts memory steps with the trainer's own rules
(``decide_commit``, ``memory_evictions``, ``RankFiles``) under the agent's pins.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import fsspec
import pytest
from agent_helpers import AUTHORITY, TOKEN, wait_until
from ckpt_helpers import keys_with_credentials, write_step
from fsspec.implementations.local import LocalFileSystem

from tierwatch.agent.checkpoint.format import inflight
from tierwatch.agent.checkpoint.format.inflight import (
    held_steps,
    read_agent_pins,
    write_agent_pins,
)
from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    MemoryLayout,
    commit_name,
    manifest_name,
    parse_step_dirname,
    shard_name,
    step_dirname,
)
from tierwatch.agent.checkpoint.format.manifest import load_commit, sign_commit
from tierwatch.agent.checkpoint.tierstore.api import CheckpointService
from tierwatch.agent.checkpoint.tierstore.worker import next_transfer, persistent_evictions
from tierwatch.agent.checkpoint.training.commit_decision import (
    History,
    decide_commit,
    memory_evictions,
)
from tierwatch.agent.checkpoint.training.rank_files import RankFiles
from tierwatch.agent.config import AgentSettings
from tierwatch.agent.protocol import CheckpointEvent, utcnow

JOB = "bp-job"
SKIP = "skipped on purpose"


# -- the slow persistent tier ----------------------------------------------------------------
class SlowFS(LocalFileSystem):
    """A local folder behind the ``slowfile://`` protocol whose writes go at ``rate`` bytes/s
    (class attribute), appear whole (written aside, renamed on close, as an object store
    shows an object), and whose every step deletion is checked: :attr:`violations` records a
    deletion of the newest complete step (one with ``.metadata``) of its job."""

    protocol = ("slowfile",)
    root_marker = "/"
    rate = 1e12
    violations: list[str] = []  # noqa: RUF012 - shared by every instance of one test
    deleted: list[str] = []  # noqa: RUF012

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        if "w" in mode:
            return _SlowWriter(path, self.rate)
        return super()._open(path, mode, block_size, **kwargs)

    def rm(self, path: Any, recursive: bool = False, maxdepth: Any = None) -> None:
        for p in path if isinstance(path, list) else [path]:
            p = Path(self._strip_protocol(p))
            # retention removes .metadata first, then the folder: check at the first one
            step_dir = p.parent if p.name == METADATA else p
            step = parse_step_dirname(step_dir.name)
            if step is None or not (step_dir / METADATA).exists():
                continue
            complete = [
                s
                for q in step_dir.parent.iterdir()
                if (s := parse_step_dirname(q.name)) is not None and (q / METADATA).exists()
            ]
            if step == max(complete):
                SlowFS.violations.append(str(step_dir))
            SlowFS.deleted.append(str(step_dir))
        super().rm(path, recursive=recursive, maxdepth=maxdepth)


class _SlowWriter(io.RawIOBase):
    def __init__(self, path: str, rate: float) -> None:
        self.path = path
        self.rate = rate
        tmp_dir = Path(path).parents[2] / ".slow-tmp"  # <root>/<job>/step-N/name
        tmp_dir.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp_dir / uuid.uuid4().hex
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        time.sleep(len(data) / self.rate)
        return self.f.write(data)

    def close(self) -> None:
        if not self.closed:
            self.f.close()
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.tmp, self.path)
        super().close()


@pytest.fixture
def slowfs() -> Iterator[type[SlowFS]]:
    fsspec.register_implementation("slowfile", SlowFS, clobber=True)
    SlowFS.rate = 1e12
    SlowFS.violations = []
    SlowFS.deleted = []
    yield SlowFS
    SlowFS.rate = 1e12


# -- the agent and the ranks --------------------------------------------------------------
def service(
    tmp_path: Path, *, url: str | None = None, replication: int = 0
) -> tuple[CheckpointService, list[CheckpointEvent]]:
    events: list[CheckpointEvent] = []
    settings = AgentSettings(
        node="node-a",
        server="http://127.0.0.1:9",
        token=TOKEN,
        spool_dir=tmp_path / "spool",
        memory_dir=tmp_path / "memory",
        state_dir=tmp_path / "state",
        persistent_url=url or f"file://{tmp_path / 'persistent'}",
        replication=replication,
        memory_budget=1 << 30,
        ckpt_scan_interval=0.02,
    )
    keys = keys_with_credentials(tmp_path / "keys", JOB)
    return CheckpointService(settings, emit=events.append, keys=keys), events


@dataclass
class Ranks:
    """This node's ranks of a job: write steps and evict memory steps as the trainer does."""

    memory_dir: Path
    layout: list[str]
    persist_every: int
    keep: dict[str, int]
    history: History = field(default_factory=History)

    def save(self, step: int, shard_bytes: int = 4096) -> None:
        decision, self.history = decide_commit(
            step,
            [None] * len(self.layout),
            self.history,
            persist_every=self.persist_every,
            keep=self.keep,
        )
        write_step(
            self.memory_dir,
            job_id=JOB,
            step=step,
            node="node-a",
            layout=self.layout,
            persist=decision.persist,
            retain=decision.retain,
            shard_bytes=shard_bytes,
            seed=step,
        )
        ml = MemoryLayout(self.memory_dir)
        for rank in (r for r, n in enumerate(self.layout) if n == "node-a"):
            files = RankFiles(ml, JOB, rank)
            steps = ml.steps(JOB)
            with held_steps(ml.job_dir(JOB)) as held:  # as TieredCheckpointer._retain_memory
                for old in memory_evictions(
                    steps,
                    retained=decision.retain["memory"],
                    newest=step,
                    pinned=held,
                    uploading=files.pending_upload(steps),
                ):
                    files.remove(old)


def persistent_steps(root: Path) -> tuple[list[int], list[int]]:
    """(complete steps, partial steps) in ``root/<JOB>``."""
    d = root / JOB
    if not d.is_dir():
        return [], []
    steps = sorted(s for p in d.iterdir() if (s := parse_step_dirname(p.name)) is not None)
    complete = [s for s in steps if (d / step_dirname(s) / METADATA).exists()]
    return complete, [s for s in steps if s not in complete]


# -- pure rules ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("steps", "done", "last_done", "seen", "target", "skipped"),
    [
        ([], set(), None, [], None, []),
        ([10], set(), None, [], 10, []),
        ([10], {10}, 10, [], None, []),  # nothing new
        ([10, 20], {10}, 10, [], 20, []),  # kept up: the next step, nothing skipped
        ([10, 40], {10}, 10, [20, 30], 40, [20, 30]),  # 20, 30 came and went meanwhile
        ([40], set(), 10, [20, 30, 40], 40, [20, 30]),  # memory dropped them already
        ([30, 40], {30}, 30, [20], 40, []),  # a step seen before the last done is not a skip
        ([20, 30], set(), None, [], 30, [20]),  # after a start: older steps are skipped
        ([20, 30], {20}, None, [], 30, []),
    ],
)
def test_next_transfer_skips_to_the_newest_step(
    steps, done, last_done, seen, target, skipped
) -> None:
    assert next_transfer(steps, done, last_done=last_done, seen=seen) == (target, skipped)


@pytest.mark.parametrize(
    ("steps", "complete", "newest", "keep", "count", "pinned", "evicted"),
    [
        # decided [20, 30] but 20 never completed: the older complete 10 stays, 20 goes
        ([10, 20, 30], {10, 30}, 30, [20, 30], 2, set(), [20]),
        ([10, 20, 30], {10, 20, 30}, 30, [20, 30], 2, set(), [10]),
        ([10, 20, 30, 40], {10, 20, 30, 40}, 40, [30, 40], 2, {10}, [20]),  # pinned 10
        # a partial folder above the newest complete step may be an upload in flight
        ([10, 20, 30], {10, 20}, 20, [10, 20], 2, set(), []),
        ([10, 20, 30, 40], {10, 40}, 40, [30, 40], 1, set(), [10, 20, 30]),
        # the step just committed is never removed, whatever the decision says
        ([5, 6], {5, 6}, 6, [5], 1, set(), []),
    ],
)
def test_persistent_evictions_count_completed_steps(
    steps, complete, newest, keep, count, pinned, evicted
) -> None:
    got = persistent_evictions(
        steps, complete, newest=newest, keep=keep, keep_count=count, pinned=pinned
    )
    assert got == evicted


def test_expired_or_unreadable_agent_pins_pin_nothing(tmp_path) -> None:
    job_dir = tmp_path / "jobs" / JOB
    job_dir.mkdir(parents=True)
    assert read_agent_pins(job_dir) == {}
    write_agent_pins(job_dir, node="node-a", steps={7: ["peer"]}, lease_s=30.0)
    assert read_agent_pins(job_dir) == {7: ["peer"]}
    later = utcnow() + timedelta(seconds=31)
    assert read_agent_pins(job_dir, now=later) == {}  # the agent died: its lease ran out
    with held_steps(job_dir) as held:
        assert held == {7}
    (job_dir / ".agent-pins.json").write_text("{not json")
    assert read_agent_pins(job_dir) == {}


def test_a_lock_that_cannot_be_taken_never_stops_the_ranks_eviction(tmp_path, monkeypatch) -> None:
    """A file system without flock: the ranks still read the pins (unlocked, logged)."""
    job_dir = tmp_path / "jobs" / JOB
    job_dir.mkdir(parents=True)
    write_agent_pins(job_dir, node="node-a", steps={3: ["persistent"]}, lease_s=30.0)

    def no_flock(_fd: int, _op: int) -> None:
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(inflight.fcntl, "flock", no_flock)
    with held_steps(job_dir) as held:
        assert held == {3}
    with held_steps(tmp_path / "jobs" / "no-such-job") as held:
        assert held == set()


# -- one step for all local ranks, pinned while in flight ------------------------------------
class FakePeer:
    """Records pushes; blocks each one while :attr:`gate` is clear."""

    def __init__(self) -> None:
        self.pushes: list[tuple[int, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.inside = threading.Event()

    def url_of(self, node: str) -> str:
        return "http://127.0.0.1:9"  # never dialled: push_file records instead

    def push_file(self, **kw: Any) -> None:
        self.inside.set()
        assert self.gate.wait(10)
        self.pushes.append((kw["step"], kw["name"]))

    def close(self) -> None:
        pass


LAYOUT4 = ["node-a", "node-a", "node-b", "node-b"]


def write4(svc: CheckpointService, step: int) -> None:
    write_step(
        svc.store.root,
        job_id=JOB,
        step=step,
        node="node-a",
        layout=LAYOUT4,
        peer_urls={"node-a": "http://127.0.0.1:9", "node-b": "http://127.0.0.1:9"},
        retain={"memory": [step], "peer": [step], "persistent": []},
        shard_bytes=1024,
        seed=step,
    )


def test_agent_replicates_one_step_for_all_local_ranks(tmp_path) -> None:
    svc, events = service(tmp_path, replication=1)
    peer = FakePeer()
    svc.worker._peer = peer  # type: ignore[assignment]
    write4(svc, 7)
    write4(svc, 8)
    step8 = svc.store.layout.step_dir(JOB, 8)
    marker = (step8 / commit_name(1)).read_bytes()
    (step8 / commit_name(1)).unlink()  # rank 1 has not written its marker of step 8 yet
    svc.worker.peer_pass()
    assert {s for s, _ in peer.pushes} == {7}  # not rank 0's 8 with rank 1's 7
    assert {n for _, n in peer.pushes} >= {commit_name(0), commit_name(1)}
    peer.pushes.clear()
    (step8 / commit_name(1)).write_bytes(marker)
    svc.worker.peer_pass()
    assert {s for s, _ in peer.pushes} == {8}
    assert {n for _, n in peer.pushes} >= {commit_name(0), commit_name(1)}
    assert not [e for e in events if e.kind == "failed"], events


def test_a_step_in_flight_stays_in_memory_until_the_transfer_ends(tmp_path) -> None:
    svc, _events = service(tmp_path, replication=1)
    peer = FakePeer()
    peer.gate.clear()
    svc.worker._peer = peer  # type: ignore[assignment]
    job_dir = svc.store.layout.job_dir(JOB)
    write4(svc, 7)
    worker = threading.Thread(target=svc.worker.peer_pass)
    worker.start()
    try:
        assert peer.inside.wait(10)
        assert read_agent_pins(job_dir) == {7: ["peer"]}
        # the ranks commit 8 and 9 meanwhile (keep_memory 1): step 7 stays, it is pinned
        with held_steps(job_dir) as held:
            assert memory_evictions([7, 8, 9], retained=[9], newest=9, pinned=held) == [8]
    finally:
        peer.gate.set()
        worker.join(10)
    assert read_agent_pins(job_dir) == {}
    assert not (job_dir / ".agent-pins.json").exists()
    with held_steps(job_dir) as held:
        assert memory_evictions([7, 8, 9], retained=[9], newest=9, pinned=held) == [7, 8]


def test_a_job_on_one_node_pins_nothing_and_skips_nothing_for_the_peer_tier(tmp_path) -> None:
    svc, events = service(tmp_path, replication=1)
    for step in range(1, 7):
        write_step(svc.store.root, job_id=JOB, step=step, node="node-a", layout=["node-a"])
        if step % 2:  # two steps committed between passes
            svc.worker.peer_pass()
            assert not (svc.store.layout.job_dir(JOB) / ".agent-pins.json").exists()
    assert [e.message for e in events] == ["job runs on one node: no peer tier"]


def test_a_step_evicted_before_the_agent_pins_it_is_not_read(tmp_path) -> None:
    svc, events = service(tmp_path, replication=1)
    write4(svc, 7)
    with svc.store.pin_transfer(JOB, 7, "peer", [0, 1]) as ok:
        assert ok
        assert read_agent_pins(svc.store.layout.job_dir(JOB)) == {7: ["peer"]}
    RankFiles(svc.store.layout, JOB, 1).remove(7)  # rank 1 evicted its files of step 7
    with svc.store.pin_transfer(JOB, 7, "peer", [0, 1]) as ok:
        assert not ok
    assert read_agent_pins(svc.store.layout.job_dir(JOB)) == {}
    assert not events


def test_a_skip_is_one_failed_event_with_the_lag(tmp_path) -> None:
    svc, events = service(tmp_path)
    t0 = utcnow()
    for step in (0, 2, 4):  # persist steps committed 1 s apart
        write_step(
            svc.store.root, job_id=JOB, step=step, node="node-a", layout=["node-a"], persist=True
        )
        path = svc.store.layout.step_dir(JOB, step) / commit_name(0)
        marker = load_commit(path).model_copy(
            update={"created_at": (t0 + timedelta(seconds=step / 2)).isoformat()}
        )  # (signed again, as the rank with the job's credential writes it)
        path.write_text(sign_commit(marker, AUTHORITY.manifest_key(JOB)).model_dump_json())
        if step != 2:  # step 2 comes and goes while step 0 uploads
            svc.worker.persistent_pass()
    skips = [e for e in events if e.kind == "failed"]
    assert len(skips) == 1, skips
    e = skips[0]
    assert (e.step, e.tier, e.rank) == (2, "persistent", None)
    assert "step(s) 2 skipped on purpose" in e.message
    assert "steps for it came every 1.0 s" in e.message
    assert "the upload of step 4 comes next; lag 4 steps (2.0 s of training)" in e.message
    assert persistent_steps(tmp_path / "persistent")[0] == [4]  # keep_persistent: [4]


# -- retention by completed steps --------------------------------------------------------
def test_persistent_retention_counts_completed_steps_and_removes_partial_ones(tmp_path) -> None:
    """node-b's agent skipped step 20 (it could not keep up): the decision kept [20, 30], but
    only 10 and 30 are complete; both stay, and 20's partial folder goes."""
    svc, events = service(tmp_path)
    pdir = tmp_path / "persistent" / JOB
    b_mem = tmp_path / "node-b-memory"
    layout = ["node-a", "node-b"]
    for step, keep, b_uploads in ((10, [10], True), (20, [10, 20], False), (30, [20, 30], True)):
        retain = {"memory": [step], "peer": [], "persistent": keep}
        for node, mem in (("node-a", svc.store.root), ("node-b", b_mem)):
            write_step(
                mem,
                job_id=JOB,
                step=step,
                node=node,
                layout=layout,
                persist=True,
                retain=retain,
                seed=step,
                shard_bytes=2048,
            )
        if b_uploads:  # node-b's agent uploads rank 1's files
            dest = pdir / step_dirname(step)
            dest.mkdir(parents=True, exist_ok=True)
            for name in (shard_name(1), manifest_name(1)):
                shutil.copy(MemoryLayout(b_mem).step_dir(JOB, step) / name, dest / name)
        svc.worker.persistent_pass()
    assert persistent_steps(tmp_path / "persistent") == ([10, 30], [])
    evicted = [e for e in events if e.kind == "evicted" and e.tier == "persistent"]
    assert [e.step for e in evicted] == [20]
    assert "partial" in evicted[0].message


# -- a persistent tier slower than the saves ------------------------------------------------
def test_throttled_persistent_tier_still_commits_and_keeps_its_newest_step(
    tmp_path, slowfs
) -> None:
    """Saves every ~20 ms, every 2nd persisted, two local ranks, keep_memory 1; the tier
    writes 512 KiB/s, so one step's upload (2 × 64 KiB) takes ~0.25 s: about six persist
    steps come and go while one uploads."""
    slowfs.rate = 512 * 1024
    root = tmp_path / "slow"
    svc, events = service(tmp_path, url=f"slowfile://{root}")
    ranks = Ranks(
        svc.store.root,
        ["node-a", "node-a"],
        persist_every=2,
        keep={"memory": 1, "peer": 1, "persistent": 2},
    )
    svc.worker.start()
    try:
        last = 0
        for step in range(60):
            ranks.save(step, shard_bytes=64 * 1024)
            svc.worker.notify(JOB, step)
            last = step
            time.sleep(0.02)  # the training step
        newest_persist = ranks.history.persisted[-1]
        wait_until(
            lambda: newest_persist in persistent_steps(root)[0],
            timeout=20,
            what=f"step {newest_persist} (the newest persist step) complete on the tier",
        )
    finally:
        svc.worker.stop()
    committed = sorted(
        e.step
        for e in events
        if e.tier == "persistent" and e.kind == "committed" and e.rank is None
    )
    assert len(committed) >= 3, committed
    assert committed[-1] == newest_persist
    assert not slowfs.violations  # the newest complete step was never deleted
    complete, partial = persistent_steps(root)
    assert complete[-1] == newest_persist, (complete, partial)
    assert len(complete) <= 2, (complete, partial)
    assert all(s > complete[-1] for s in partial), partial
    skips = [e for e in events if e.kind == "failed" and SKIP in e.message]
    assert skips, [e.message for e in events if e.kind == "failed"]
    assert "lag" in skips[0].message
    assert skips[0].tier == "persistent"
    # nothing else failed: the ranks never evicted a step under the agent's upload
    others = [e.message for e in events if e.kind == "failed" and SKIP not in e.message]
    assert not others, others
    # nothing in transfer any more: the next save leaves only itself in memory (keep_memory 1;
    # it is the newest persist step, the one before it was uploaded)
    ranks.save(last + 1)
    assert MemoryLayout(svc.store.root).steps(JOB) == [last + 1]

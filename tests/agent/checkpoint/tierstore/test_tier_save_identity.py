"""Save identity on the agent's tiers: one save per step number in a step folder.

docs/checkpointing.md "Save identity": a step number saved again (a restart from an older
step, a rollback) is another save; a tier never takes its files into a folder that holds a
committed save of that step, nor a late transfer from an abandoned timeline, and commits a
step only when every manifest is of one save. Two ranks are simulated by writing their
files as the trainer does (``write_step``) and stamping a save id on them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import xxhash
from ckpt_helpers import write_step

from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    MemoryLayout,
    commit_name,
    manifest_name,
    shard_name,
)
from tierwatch.agent.checkpoint.format.manifest import Manifest, load_commit
from tierwatch.agent.checkpoint.format.rollback import Timeline
from tierwatch.agent.checkpoint.tierstore.persister import PersistentTier
from tierwatch.agent.checkpoint.tierstore.store import MemoryStore, StoreError
from tierwatch.agent.checkpoint.tierstore.worker import TierWorker
from tierwatch.agent.fsutil import atomic_write_json

JOB = "save-id-job"
S5 = "01900000005a" + "5" * 20  # step 5: the older good step
OLD = "0190000000aa" + "a" * 20  # the first save of step 6 (or 7)
NEW = "0190000000bb" + "b" * 20  # step 6 saved again


def stamp(
    memory_dir: Path,
    step: int,
    manifests: dict[int, Any],
    save_id: str,
    fences: Iterable[tuple[int, int]] = (),
) -> None:
    """Give the ranks' files of one step (written by ``write_step``) a save id and fences,
    as the trainer writes them."""
    d = MemoryLayout(memory_dir).step_dir(JOB, step)
    ids = {"save_id": save_id} if "save_id" in Manifest.model_fields else {}  # before: none
    for r, m in manifests.items():
        stamped = Manifest.model_validate(
            {**m.model_dump(mode="json"), **ids, "fences": list(fences)}
        )
        atomic_write_json(d / manifest_name(r), stamped)
        if (d / commit_name(r)).exists():
            marker = load_commit(d / commit_name(r)).model_dump(mode="json")
            atomic_write_json(d / commit_name(r), {**marker, **ids})


def tree(root: Path) -> dict[str, str]:
    """Relative path → xxh3 of every file under ``root``."""
    return {
        str(p.relative_to(root)): xxhash.xxh3_64_hexdigest(p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def make_worker(tmp_path: Path, events: list) -> TierWorker:
    store = MemoryStore(tmp_path / "mem", node="node-a", budget_bytes=2**30)
    return TierWorker(
        store,
        PersistentTier(f"file://{tmp_path / 'pers'}"),
        emit=events.append,
        peer=None,
        replication=0,
        scan_interval_s=0.1,
    )


def committed_save(
    tmp_path: Path, step: int, save_id: str, *, layout: list[str], seed: int, **kw: Any
) -> Path:
    """A save of ``step`` by every rank of ``layout``, committed on the persistent tier (as
    the agents upload it: every rank's files, manifests, ``.metadata`` last)."""
    src = tmp_path / f"src-{step}-{save_id[:12]}"
    for node in dict.fromkeys(layout):
        ms = write_step(
            src, job_id=JOB, step=step, node=node, layout=layout, seed=seed, commit=False
        )
        stamp(src, step, ms, save_id, **kw)
    dest = tmp_path / "pers" / JOB / f"step-{step}"
    shutil.copytree(MemoryLayout(src).step_dir(JOB, step), dest)
    return dest


def persistent_failures(events: list) -> list[str]:
    return [e.message for e in events if e.tier == "persistent" and e.kind == "failed"]


# -- persistent tier --------------------------------------------------------------------
def test_a_late_upload_from_the_abandoned_timeline_after_a_rollback_is_not_written(tmp_path):
    """Rollback 3 went back to step 5; the new timeline's step 6 is committed on the
    persistent tier. This node's upload of the old timeline's step 6 comes late: nothing of
    it is written there, and step 5 stays."""
    events: list = []
    w = make_worker(tmp_path, events)
    layout = ["node-a", "node-a"]
    committed_save(tmp_path, 5, S5, layout=layout, seed=5)
    committed_save(tmp_path, 6, NEW, layout=layout, seed=66, fences=[(3, 5)])
    before = tree(tmp_path / "pers")
    old = write_step(
        w.store.root, job_id=JOB, step=6, node="node-a", layout=layout, seed=6, persist=True
    )
    stamp(w.store.root, 6, old, OLD)
    w.persistent_pass()
    w.persistent_pass()
    assert tree(tmp_path / "pers") == before
    failures = persistent_failures(events)
    assert len(failures) == 2, failures  # one per rank, reported once
    assert all("abandoned timeline" in f and "restore request 3" in f for f in failures)


def test_a_late_upload_into_a_step_the_rollback_evicted_is_refused_by_the_timeline(tmp_path):
    """The rollback removed the persistent step 6; the old timeline's upload of it comes
    before the new save's: this node's ``timeline.json`` (the fence its ranks recorded)
    refuses it, so it never re-creates a dead step-6 folder under the new save."""
    events: list = []
    w = make_worker(tmp_path, events)
    layout = ["node-a"]
    committed_save(tmp_path, 5, S5, layout=layout, seed=5)
    old = write_step(
        w.store.root, job_id=JOB, step=6, node="node-a", layout=layout, seed=6, persist=True
    )
    stamp(w.store.root, 6, old, OLD)
    Timeline(served=3, fences=[(3, 5)]).write(w.store.layout.timeline_file(JOB))
    w.persistent_pass()
    assert not (tmp_path / "pers" / JOB / "step-6").exists()
    assert (tmp_path / "pers" / JOB / "step-5" / METADATA).exists()
    assert any("abandoned timeline" in f for f in persistent_failures(events))


def test_a_step_number_saved_again_is_not_written_under_its_committed_metadata(tmp_path):
    """A restart from step 5 saves step 6 again (no rollback: the same timeline). The
    persistent tier keeps the first save of step 6, whole, and step 5."""
    events: list = []
    w = make_worker(tmp_path, events)
    layout = ["node-a", "node-a"]
    committed_save(tmp_path, 5, S5, layout=layout, seed=5)
    committed_save(tmp_path, 6, OLD, layout=layout, seed=6)
    before = tree(tmp_path / "pers")
    again = write_step(
        w.store.root, job_id=JOB, step=6, node="node-a", layout=layout, seed=66, persist=True
    )
    stamp(w.store.root, 6, again, NEW)
    w.persistent_pass()
    assert tree(tmp_path / "pers") == before
    failures = persistent_failures(events)
    assert failures
    assert all("committed from save 0190000000aa…" in f for f in failures)


def test_metadata_is_committed_only_once_every_manifest_is_of_its_save(tmp_path):
    """Rank 1 (node-b) of the first save of step 6 reached the persistent folder; node-a
    uploads rank 0 of the new save: ``.metadata`` waits until rank 1's new manifest is there
    too, never commits a mix."""
    events: list = []
    w = make_worker(tmp_path, events)
    layout = ["node-a", "node-b"]
    pers = tmp_path / "pers" / JOB / "step-6"
    src_b = tmp_path / "node-b"
    old_b = write_step(src_b, job_id=JOB, step=6, node="node-b", layout=layout, seed=6)
    stamp(src_b, 6, old_b, OLD)
    pers.mkdir(parents=True)
    b_dir = MemoryLayout(src_b).step_dir(JOB, 6)
    for name in (shard_name(1), manifest_name(1)):
        shutil.copy(b_dir / name, pers / name)
    new_a = write_step(
        w.store.root, job_id=JOB, step=6, node="node-a", layout=layout, seed=66, persist=True
    )
    stamp(w.store.root, 6, new_a, NEW)
    w.persistent_pass()
    w.persistent_pass()
    assert (pers / ".metadata.staged").exists()
    assert not (pers / METADATA).exists()
    # node-b's upload of the new save's rank 1 arrives
    new_b = write_step(src_b, job_id=JOB, step=6, node="node-b", layout=layout, seed=67)
    stamp(src_b, 6, new_b, NEW)
    for name in (shard_name(1), manifest_name(1)):
        shutil.copy(b_dir / name, pers / name)
    w.persistent_pass()
    assert (pers / METADATA).exists()


# -- peer tier --------------------------------------------------------------------------
def push(store: MemoryStore, src: Path, step: int, names: Iterable[str]) -> None:
    d = MemoryLayout(src).step_dir(JOB, step)
    for name in names:
        data = (d / name).read_bytes()
        store.receive_replica(
            src_node="node-b",
            job_id=JOB,
            step=step,
            name=name,
            chunks=[data],
            xxh3=xxhash.xxh3_64_hexdigest(data),
            size=len(data),
        )


RANK1 = [shard_name(1), manifest_name(1), commit_name(1)]
LAYOUT = ["node-a", "node-b"]
KEEP_5_6 = {"memory": [5, 6], "peer": [5, 6], "persistent": [5, 6]}


def test_a_replica_of_a_step_number_saved_again_never_mixes_two_saves(tmp_path):
    """The holder keeps node-b's committed save of step 6; the other save of step 6 (a
    restart from step 5, or the old timeline's late replication after a rollback) is
    refused file by file, and step 5's replica stays."""
    holder = MemoryStore(tmp_path / "holder", node="node-a", budget_bytes=2**30)
    first, second = tmp_path / "first", tmp_path / "second"
    m5 = write_step(first, job_id=JOB, step=5, node="node-b", layout=LAYOUT, seed=5)
    stamp(first, 5, m5, S5)
    push(holder, first, 5, RANK1)
    m6 = write_step(
        first, job_id=JOB, step=6, node="node-b", layout=LAYOUT, seed=6, retain=KEEP_5_6
    )
    stamp(first, 6, m6, NEW)
    push(holder, first, 6, RANK1)
    replicas = holder.layout.replica_job_dir("node-b", JOB)
    before = tree(replicas)
    other = write_step(
        second, job_id=JOB, step=6, node="node-b", layout=LAYOUT, seed=66, retain=KEEP_5_6
    )
    stamp(second, 6, other, OLD)
    for name in RANK1:
        with pytest.raises(StoreError) as err:
            push(holder, second, 6, [name])
        assert err.value.status == 409
        assert "save 0190000000bb" in err.value.message  # the committed save is named
    assert tree(replicas) == before
    push(holder, first, 6, RANK1)  # the committed save pushed again (a retry) is taken
    assert tree(replicas) == before


def test_a_late_commit_marker_from_the_abandoned_timeline_evicts_nothing(tmp_path):
    """Rollback 3 went back to step 5 (the holder's ranks recorded the fence); node-b's
    replication of the old timeline's step 7 arrives late. Its manifest and commit marker
    are refused, so its retention (steps 6, 7) never evicts step 5's replica."""
    holder = MemoryStore(tmp_path / "holder", node="node-a", budget_bytes=2**30)
    src = tmp_path / "node-b"
    m5 = write_step(src, job_id=JOB, step=5, node="node-b", layout=LAYOUT, seed=5)
    stamp(src, 5, m5, S5)
    push(holder, src, 5, RANK1)
    holder.layout.job_dir(JOB).mkdir(parents=True)  # the holder runs ranks of the job too
    Timeline(served=3, fences=[(3, 5)]).write(holder.layout.timeline_file(JOB))
    m7 = write_step(
        src,
        job_id=JOB,
        step=7,
        node="node-b",
        layout=LAYOUT,
        seed=7,
        retain={"memory": [6, 7], "peer": [6, 7], "persistent": [7]},
    )
    stamp(src, 7, m7, OLD)
    push(holder, src, 7, [shard_name(1)])  # a shard alone cannot be told apart
    messages = []
    for name in (manifest_name(1), commit_name(1)):
        with pytest.raises(StoreError) as err:
            push(holder, src, 7, [name])
        assert err.value.status == 409
        messages.append(err.value.message)
    assert "abandoned timeline" in messages[0]
    assert "no manifest of rank 1" in messages[1]
    step5 = holder.layout.replica_step_dir("node-b", JOB, 5)
    assert sorted(p.name for p in step5.iterdir()) == sorted(RANK1)

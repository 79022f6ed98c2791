"""A local user without a job's credential cannot plant a step that the agent acts on.

The memory folder is writable by every trainer on the node. Before commit markers were
signed, anyone could write a complete, self-consistent "newer" step of another job (files,
manifests that list their real sizes and checksums, a commit marker that says ``persist``
and ``retain: {"persistent": [<that step>]}``): the agent persisted it, and persistent
retention then deleted the job's good steps, leaving only one that no rank could restore
(restore checks the signature). Against a real agent process, reporting to a stand-in
server that serves each job's manifest key to the job's agents.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
from agent_helpers import AUTHORITY, wait_until
from ckpt_helpers import ckpt_events, wait_event, wait_more_batches, write_step

from tierwatch.agent.checkpoint.format.layout import METADATA, commit_name, step_dirname
from tierwatch.agent.checkpoint.format.manifest import CommitMarker, sign_commit

VICTIM = "victim-job"
LAYOUT = ["node-a"]


def complete(persistent_dir: Path, job_id: str = VICTIM) -> list[int]:
    """Steps of the job on the persistent tier that have their ``.metadata`` (complete)."""
    d = persistent_dir / job_id
    if not d.is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in d.iterdir() if (p / METADATA).is_file())


def until(agent, condition, what: str) -> None:  # type: ignore[no-untyped-def]
    wait_until(condition, timeout=30, what=f"{what}\n{agent.log_tail()}")


def save(agent, step: int, keep: list[int], *, key: bytes | None | str = "job") -> None:  # type: ignore[no-untyped-def]
    write_step(
        agent.memory_dir,
        job_id=VICTIM,
        step=step,
        node="node-a",
        layout=LAYOUT,
        persist=True,
        retain={"memory": [step], "peer": [], "persistent": keep},
        key=key,
    )


def test_planted_steps_are_not_persisted_and_cannot_push_good_steps_out(
    make_agent, receiver, persistent_dir
):
    a = make_agent("node-a", replication=0).start()
    save(a, 10, [10])
    until(a, lambda: complete(persistent_dir) == [10], "step 10 persisted")
    save(a, 20, [10, 20])  # (one at a time: a tier that lags skips to the newest step)
    until(a, lambda: complete(persistent_dir) == [10, 20], "steps 10 and 20 persisted")

    # Another local user: an unsigned step, and one signed with a key of its own choosing.
    # Each keeps only itself: acted on, retention would delete 10 and 20.
    save(a, 30, [30], key=None)
    save(a, 40, [40], key=os.urandom(32))
    wait_event(receiver, job_id=VICTIM, step=30, kind="failed", contains="is unsigned", agent=a)
    forged = wait_event(
        receiver,
        job_id=VICTIM,
        step=40,
        kind="failed",
        contains="signature does not match the job's manifest key",
        agent=a,
    )
    assert "commit-0.json" in forged.message
    assert "not persisted" in forged.message
    wait_more_batches(receiver, "node-a", 4)  # several more scans of the memory folder

    assert complete(persistent_dir) == [10, 20]
    assert not (persistent_dir / VICTIM / step_dirname(30)).exists()
    assert not (persistent_dir / VICTIM / step_dirname(40)).exists()
    assert not ckpt_events(receiver, job_id=VICTIM, step=30, kind="persisted")

    # The job's own next step still goes through, and its retention applies as decided.
    save(a, 50, [20, 50])
    until(a, lambda: complete(persistent_dir) == [20, 50], "step 50 persisted, 10 retired")


def test_a_changed_retention_list_is_refused(make_agent, receiver, persistent_dir):
    """A local user edits the job's own signed commit marker to keep nothing older."""
    a = make_agent("node-a", replication=0).start()
    save(a, 10, [10])
    until(a, lambda: complete(persistent_dir) == [10], "step 10 persisted")
    write_step(  # the rank's files and signed manifest, as the job wrote them
        a.memory_dir, job_id=VICTIM, step=20, node="node-a", layout=LAYOUT, commit=False
    )
    marker = sign_commit(
        CommitMarker(
            job_id=VICTIM,
            step=20,
            rank=0,
            world_size=1,
            persist=True,
            retain={"memory": [20], "peer": [], "persistent": [10, 20]},
            layout=LAYOUT,
        ),
        AUTHORITY.manifest_key(VICTIM),
    ).model_dump(mode="json")
    marker["retain"]["persistent"] = [20]  # edited; the signature stays the rank's
    (a.step_dir(VICTIM, 20) / commit_name(0)).write_text(json.dumps(marker))
    wait_event(
        receiver,
        job_id=VICTIM,
        step=20,
        kind="failed",
        contains="signature does not match",
        agent=a,
    )
    wait_more_batches(receiver, "node-a", 3)
    assert complete(persistent_dir) == [10]


def test_steps_wait_for_the_key_then_persist_once_a_rank_sends_its_credential(
    make_agent, receiver, persistent_dir
):
    """The server's registry does not know the job (it answers 404): the agent has no key,
    so the step waits, unsigned or not; a rank's credential (every local call carries it)
    gives the agent the key, and the step is persisted."""
    receiver.open_jobs = False
    a = make_agent("node-a", replication=0).start()
    save(a, 7, [7])
    wait_event(
        receiver, job_id=VICTIM, step=7, kind="failed", contains="no manifest key yet", agent=a
    )
    wait_more_batches(receiver, "node-a", 3)
    assert complete(persistent_dir) == []

    r = httpx.post(
        f"{a.url}/v1/ckpt/notify",
        json={"job_id": VICTIM, "step": 7},
        headers=AUTHORITY.job_auth(VICTIM),
        timeout=5,
    )
    assert r.status_code == 200, r.text
    until(a, lambda: complete(persistent_dir) == [7], "step 7 persisted")

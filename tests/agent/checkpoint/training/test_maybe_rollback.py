"""Rollback to an operator-chosen step: the agreement rules (pure) and maybe_rollback in one
training process whose node agent is a real AgentRuntime (in this process)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from agent_helpers import AUTHORITY
from procs import wait_for
from torch import nn
from training import restore_command, start_cluster

from tierwatch import RNGState, TieredCheckpointer
from tierwatch.agent.checkpoint.format import agreement
from tierwatch.agent.checkpoint.format.manifest import FileEntry, Manifest, load_manifest
from tierwatch.agent.checkpoint.format.rollback import RestoreRequest, Timeline
from tierwatch.agent.checkpoint.training.rollback import (
    RollbackServer,
    newest_unserved,
    pick_request,
)


# -- pure: fences, timelines and which request the ranks agree on ---------------------------
def manifest(
    step: int, rank: int, *, fences: list[tuple[int, int]] | None = None, digest: str = "0" * 16
) -> Manifest:
    files = [FileEntry(name=f"__{rank}_0.distcp", size=10, xxh3=digest)]
    if rank == 0:
        files.append(FileEntry(name=".metadata", size=5, xxh3="1" * 16))
    return Manifest(
        job_id="j",
        step=step,
        rank=rank,
        world_size=2,
        node=f"n{rank}",
        files=files,
        signature="sig",
        fences=fences or [],
    )


def answer(*entries: tuple[str, Manifest]) -> dict:
    return {
        "entries": [
            {
                "tier": t,
                "holder": m.node,
                "url": "",
                "step": m.step,
                "rank": m.rank,
                "manifest": m.model_dump(mode="json"),
            }
            for t, m in entries
        ]
    }


def test_steps_above_a_fence_of_an_older_timeline_are_dead() -> None:
    old = [manifest(s, r) for s in (50, 55, 60) for r in (0, 1)]
    # request 7 rolled back to 50; the new timeline saved 55 again (rank 0 only so far)
    new55 = manifest(55, 0, fences=[(7, 50)], digest="a" * 16)
    views = agreement.merge_available(
        [answer(*[("persistent", m) for m in old]), answer(("memory", new55))]
    )
    # 60 is dead; so is the old 55: rank 1 has no 55 of timeline 7 yet, nothing mixes
    assert agreement.restorable_steps(views, 2) == [50]
    assert agreement.restorable(views[55], 2) == "no manifest of rank(s) [1]"
    assert views[55].manifests[0].timeline == 7  # the newer copy wins over the old one
    assert [s.tier for s in views[55].sources[0]] == ["memory"]
    # rank 1's new copy arrives: 55 of timeline 7 is whole
    views = agreement.merge_available(
        [
            answer(*[("persistent", m) for m in old]),
            answer(("memory", new55), ("peer", manifest(55, 1, fences=[(7, 50)], digest="b" * 16))),
        ]
    )
    assert agreement.choose_step(views, 2)[0] == 55
    # the ranks' own fence file alone (no new step saved yet) also kills the old future
    plain = agreement.merge_available([answer(*[("memory", m) for m in old])], fences=[(7, 50)])
    assert sorted(plain) == [50]
    # a later rollback (9 → 52) on the new timeline keeps 50 (an ancestor), kills 55
    nested = agreement.merge_available(
        [answer(("memory", manifest(50, 0)), ("memory", manifest(50, 1)), ("memory", new55))],
        fences=[(9, 52)],
    )
    assert sorted(nested) == [50]
    # never one step from two timelines (a fence that is not known anywhere)
    mixed = agreement.StepView(55, manifests={0: new55, 1: manifest(55, 1)})
    assert "different timelines" in (agreement.restorable(mixed, 2) or "")


def test_tier_filter_keeps_only_that_tiers_copies() -> None:
    a = [manifest(4, 0), manifest(4, 1)]
    views = agreement.merge_available(
        [answer(("memory", a[0]), ("persistent", a[0]), ("persistent", a[1]))], tier="memory"
    )
    assert agreement.restorable_steps(views, 2) == []
    views = agreement.merge_available(
        [answer(("memory", a[0]), ("persistent", a[0]), ("persistent", a[1]))], tier="persistent"
    )
    assert agreement.restorable_steps(views, 2) == [4]
    assert {s.tier for ss in views[4].sources.values() for s in ss} == {"persistent"}


def req(request_id: int, step: int = 3) -> RestoreRequest:
    return RestoreRequest(request_id=request_id, job_id="j", step=step)


def test_ranks_agree_on_the_newest_request_every_rank_knows() -> None:
    # rank 0's agent has requests 4 and 5, rank 1's only 4: MIN of the newest → 4
    per_rank = [[req(4), req(5)], [req(4)]]
    newest = [newest_unserved(r, served=0) for r in per_rank]
    assert newest == [5, 4]
    agreed = min(newest)
    assert pick_request([None, *per_rank[1]], agreed) == req(4)
    assert pick_request([None, None], agreed) is None
    # a rank whose agent has none yet holds everyone back
    assert min(newest_unserved(r, served=0) for r in [[req(4)], []]) == 0
    # served requests never count again
    assert newest_unserved([req(4), req(5)], served=5) == 0


class _NoCollectives:
    """A distributed checkpointer's collectives that count the calls maybe_rollback makes."""

    def __init__(self) -> None:
        self.calls = 0

    def min_over_ranks(self, value: int) -> int:
        self.calls += 1
        return value


class _Ckpt:
    distributed = True

    def __init__(self) -> None:
        self.collectives = _NoCollectives()


class _Poller:
    def __init__(self, requests: list[RestoreRequest]) -> None:
        self.requests = requests

    def snapshot(self) -> list[RestoreRequest]:
        return list(self.requests)


def _rank_server(every: int | None = None) -> tuple[RollbackServer, list[int]]:
    """A distributed rank's RollbackServer whose serving is recorded, not carried out."""
    server = RollbackServer(_Ckpt(), _Poller([]), Timeline(), every=every)  # type: ignore[arg-type]
    served: list[int] = []

    def serve(state, request_id, pending, *, last_done):  # noqa: ARG001 - the real signature
        served.append(request_id)
        return 7

    server._serve = serve  # type: ignore[method-assign]
    return server, served


def test_maybe_rollback_adds_no_collective_and_every_rank_acts_at_the_same_call() -> None:
    """The agreed request rides on the saves' first exchange: no all_reduce per step, and
    ranks that joined the saves at different moments (one called wait() early) still act at
    the same maybe_rollback call, the first one after the next save."""
    a, served_a = _rank_server()
    b, served_b = _rank_server()
    state: dict = {}
    # saves 1..3 agreed on nothing; save 4's exchange found request 9 on every rank
    for rank in (a, b):
        for index in (1, 2, 3):
            rank.offer(index, 0)
    for saves in (1, 2, 3, 4):
        if saves == 4:
            a.offer(4, 9)  # rank a joined save 4 at once (wait()), rank b not yet
        assert a.maybe_rollback(state, last_done=saves, saves=saves) is None
        assert b.maybe_rollback(state, last_done=saves, saves=saves) is None
    # save 5: rank b joins save 4 in it (its next save() call); a already had
    b.offer(4, 9)
    a.offer(5, 9)  # and rank a joined save 5 early too: it must not act on it alone
    assert a.maybe_rollback(state, last_done=5, saves=5) == 7
    assert b.maybe_rollback(state, last_done=5, saves=5) == 7
    assert served_a == served_b == [9]
    assert a.ckpt.collectives.calls == b.ckpt.collectives.calls == 0


def test_rollback_every_adds_the_explicit_check_on_every_kth_call() -> None:
    server, served = _rank_server(every=3)
    server.poller.requests = [req(2)]
    results = [server.maybe_rollback({}, last_done=s, saves=0) for s in range(1, 4)]
    assert results == [None, None, 7]  # no save yet: only the 3rd call's all_reduce sees it
    assert server.collective_checks == server.ckpt.collectives.calls == 1
    assert served == [2]


def test_an_offer_below_the_served_request_is_not_served_again() -> None:
    server, served = _rank_server()
    server.timeline = Timeline(served=9)
    server.offer(1, 9)
    assert server.maybe_rollback({}, last_done=3, saves=2) is None
    assert served == []


def test_timeline_merge_and_after(tmp_path) -> None:
    t = Timeline().after(4, loaded_step=10).after(6, loaded_step=None)
    assert t.served == 6
    assert t.fences == [(4, 10)]
    assert t.timeline == 4
    t.write(tmp_path / "timeline.json")
    assert Timeline.read(tmp_path / "timeline.json") == t
    assert Timeline.read(tmp_path / "missing.json") == Timeline()
    (tmp_path / "bad.json").write_text("{not json")
    assert Timeline.read(tmp_path / "bad.json") == Timeline()
    merged = Timeline.merge([t, Timeline(served=8, fences=[(8, 3)])])
    assert merged == Timeline(served=8, fences=[(4, 10), (8, 3)])


# -- one process, a real agent ----------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def make_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    return {"model": model, "optim": optim, "sched": sched, "rng": RNGState()}


def train_step(state: dict) -> float:
    loss = state["model"](torch.randn(4, 8)).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["sched"].step()
    return loss.item()


def weights(state: dict) -> dict:
    return {k: v.clone() for k, v in state["model"].state_dict().items()}


@pytest.fixture
def node(tmp_path):
    cluster = start_cluster(tmp_path / "cluster", with_server=False)
    node = cluster.add_inprocess_node("rb-node")
    yield node
    cluster.stop()


def pending(node, job: str) -> list[int]:
    r = httpx.get(
        f"{node.url}/v1/ckpt/jobs/{job}/restore-requests",
        headers=AUTHORITY.job_auth(job),
        timeout=5,
    )
    return [x["request_id"] for x in r.json()["requests"]]


@pytest.mark.e2e
def test_maybe_rollback_in_one_process(node) -> None:
    job = "rb-single"
    state = make_state()
    ckpt = TieredCheckpointer(
        job,
        node.url,
        latency_every=0,
        keep_memory=20,
        request_poll_s=0.05,
        job_credential=AUTHORITY.job_credential(job),
    )
    assert ckpt.maybe_rollback(state) is None  # nothing asked: nothing happens
    losses, at = {}, {}
    for step in range(8):
        losses[step] = train_step(state)
        ckpt.save(step, state)
        at[step] = weights(state)
        assert ckpt.maybe_rollback(state, step=step) is None
    ckpt.wait()

    node.deliver(restore_command(request_id=1, job_id=job, step=3))
    assert pending(node, job) == [1]
    wait_for(lambda: ckpt._poller.snapshot(), timeout=10, what="the poller sees request 1")
    assert ckpt.maybe_rollback(state, step=7) == 3
    assert all(torch.equal(weights(state)[k], at[3][k]) for k in at[3])
    assert state["sched"].last_epoch == 4
    report = ckpt.last_restore
    assert report is not None
    assert (report.request_id, report.phase, report.step, report.steps_lost) == (1, "loaded", 3, 4)
    assert pending(node, job) == []  # retired
    # the diverged future is gone from memory and fenced off
    assert ckpt.layout.steps(job) == [0, 1, 2, 3]
    timeline = json.loads(ckpt.layout.timeline_file(job).read_text())
    assert (timeline["served"], timeline["fences"]) == (1, [[1, 3]])

    # training continues after step 3 and saves step 4 again, on the new timeline
    for step in range(4, 6):
        train_step(state)
        ckpt.save(step, state)
        assert ckpt.maybe_rollback(state, step=step) is None  # served once only
    ckpt.wait()
    m = load_manifest(ckpt.layout.step_dir(job, 4) / "manifest-0.json")
    assert m.fences == [(1, 3)]

    # a tier that does not hold the step: failed, retired, the state untouched
    before = weights(state)
    node.deliver(restore_command(request_id=2, job_id=job, step=4, tier="peer"))
    wait_for(
        lambda: any(r.request_id == 2 for r in ckpt._poller.snapshot()),
        timeout=10,
        what="the poller sees request 2",
    )
    assert ckpt.maybe_rollback(state, step=5) is None
    assert ckpt.last_restore.phase == "failed"
    assert "peer tier" in ckpt.last_restore.message
    assert all(torch.equal(weights(state)[k], before[k]) for k in before)
    assert pending(node, job) == []
    ckpt.close()

    # a request that arrives while the job is down is served at its next start, once
    node.deliver(restore_command(request_id=3, job_id=job, step=4))
    again = TieredCheckpointer(
        job, node.url, latency_every=0, keep_memory=20, job_credential=AUTHORITY.job_credential(job)
    )
    fresh = make_state(seed=5)
    assert again.restore(fresh) == 4
    assert again.last_restore.request_id == 3
    assert again.layout.steps(job) == [0, 1, 2, 3, 4]
    again.close()
    third = TieredCheckpointer(
        job, node.url, latency_every=0, keep_memory=20, job_credential=AUTHORITY.job_credential(job)
    )
    assert third.restore(make_state(seed=6)) == 4
    assert third.last_restore.request_id is None  # a plain restore of the newest step
    third.close()
    # the reports are in the agent's next batches (the spool: no server here)
    phases = {(r["request_id"], r["phase"]) for r in node.spooled_restores()}
    wait_for(
        lambda: (
            {(1, "staging"), (1, "loaded"), (2, "failed"), (3, "loaded")}
            <= {(r["request_id"], r["phase"]) for r in node.spooled_restores()}
        ),
        timeout=10,
        what=f"restore reports in the agent's batches (so far {phases})",
    )


def restore_command_until(*, request_id: int, job_id: str, step: int, expires_in_s: float):
    """A restore command the server gives up on after ``expires_in_s`` (its ``not_after``)."""
    from datetime import timedelta

    from tierwatch.agent.protocol import Command, utcnow

    return Command(
        id=f"cmd-{request_id}",
        kind="restore",
        args={
            "request_id": request_id,
            "job_id": job_id,
            "step": step,
            "tier": None,
            "reason": "pin test",
            "actor": "pytest",
            "not_after": (utcnow() + timedelta(seconds=expires_in_s)).isoformat(),
        },
    )


@pytest.mark.e2e
def test_memory_retention_keeps_a_pinned_step_until_served_or_expired(node) -> None:
    job = "rb-pinned"
    state = make_state()
    # persist_every large: only step 0 goes to the persistent tier (it may stay in memory
    # until uploaded, so the checks below leave it out)
    ckpt = TieredCheckpointer(
        job,
        node.url,
        latency_every=0,
        keep_memory=2,
        keep_peer=2,
        persist_every=1000,
        request_poll_s=0.05,
        job_credential=AUTHORITY.job_credential(job),
    )

    def save(steps: range) -> list[int]:
        for step in steps:
            train_step(state)
            ckpt.save(step, state)
            assert ckpt.wait()
        return [s for s in ckpt.layout.steps(job) if s != 0]

    def retain(step: int) -> dict:
        marker = ckpt.layout.step_dir(job, step) / "commit-0.json"
        return json.loads(marker.read_text())["retain"]

    assert save(range(3)) == [1, 2]
    node.deliver(restore_command(request_id=1, job_id=job, step=1))
    wait_for(lambda: ckpt.pinned_steps() == {1: [1]}, timeout=10, what="step 1 pinned")
    assert save(range(3, 7)) == [1, 5, 6]  # keep_memory 2, and the pinned step 1
    assert retain(6) == {"memory": [1, 5, 6], "peer": [1, 5, 6], "persistent": [0, 1]}

    # served (the ranks retire it): the next retention removes step 1
    assert httpx.delete(
        f"{node.url}/v1/ckpt/jobs/{job}/restore-requests/1",
        headers=AUTHORITY.job_auth(job),
        timeout=5,
    ).json() == {"retired": [1]}
    wait_for(lambda: ckpt.pinned_steps() == {}, timeout=10, what="the pin released")
    assert save(range(7, 8)) == [6, 7]
    assert retain(7)["memory"] == [6, 7]

    # a request the server gives up on pins its step only until then
    # (long enough that two saves on loaded cores end before it expires)
    node.deliver(restore_command_until(request_id=2, job_id=job, step=7, expires_in_s=6.0))
    wait_for(lambda: ckpt.pinned_steps() == {7: [2]}, timeout=10, what="step 7 pinned")
    assert save(range(8, 10)) == [7, 8, 9]
    wait_for(lambda: ckpt.pinned_steps() == {}, timeout=20, what="request 2 to expire")
    assert save(range(10, 11)) == [9, 10]
    assert ckpt.maybe_rollback(state, step=10) is None  # nothing pending: no rollback
    ckpt.close()

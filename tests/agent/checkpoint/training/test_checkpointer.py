"""TieredCheckpointer's contract in one training process, with a real agent as its node."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from agent_helpers import AUTHORITY
from procs import wait_for
from torch import nn
from training import start_cluster

from tierwatch import CheckpointError, ResumableDistributedSampler, RNGState, TieredCheckpointer
from tierwatch.agent.checkpoint.format.layout import step_dirname
from tierwatch.agent.checkpoint.training.errors import ModelMismatchError

pytestmark = pytest.mark.e2e


class Net(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x))


def make_state(width: int = 16, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = Net(width)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return {
        "model": model,
        "optim": optim,
        "sched": sched,
        "rng": RNGState(),
        "data": ResumableDistributedSampler(64, num_replicas=1, rank=0),
        "epoch": 0,
    }


def train_step(state: dict) -> None:
    x = torch.randn(8, state["model"].lin.in_features)
    loss = state["model"](x).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["sched"].step()


def snapshot(state: dict) -> dict:
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "optim": json.dumps(state["optim"].state_dict()["param_groups"]),
        "exp_avg": [s["exp_avg"].clone() for s in state["optim"].state.values()],
        "sched": state["sched"].state_dict(),
        "epoch": state["epoch"],
        "rng": torch.get_rng_state().clone(),
    }


def same(a: dict, b: dict) -> bool:
    return (
        all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and a["optim"] == b["optim"]
        and all(torch.equal(x, y) for x, y in zip(a["exp_avg"], b["exp_avg"], strict=True))
        and a["sched"] == b["sched"]
        and a["epoch"] == b["epoch"]
        and torch.equal(a["rng"], b["rng"])
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory):
    cluster = start_cluster(tmp_path_factory.mktemp("ckpt-unit"), with_server=False)
    node = cluster.add_node("unit-node")
    yield node
    cluster.stop()


def test_snapshot_is_the_state_at_save_even_when_training_goes_on(node) -> None:
    state = make_state()
    ckpt = TieredCheckpointer(
        "unit-snapshot",
        node.url,
        latency_every=0,
        job_credential=AUTHORITY.job_credential("unit-snapshot"),
    )
    assert ckpt.restore(state) is None
    for step in range(3):
        train_step(state)
        state["epoch"] = step
        ckpt.save(step, state)
    saved = snapshot(state)
    # the next step mutates parameters right away: the optimizer pre-hook waits for the
    # background copy, so the saved step still holds the values above
    train_step(state)
    state["epoch"] = 99
    state["model"].bn.running_mean.add_(5.0)  # a buffer changed after save(): not saved
    assert ckpt.wait() is True
    ckpt.close()

    fresh = make_state(seed=1)
    again = TieredCheckpointer(
        "unit-snapshot",
        node.url,
        latency_every=0,
        job_credential=AUTHORITY.job_credential("unit-snapshot"),
    )
    assert again.restore(fresh) == 2
    assert same(snapshot(fresh), saved)
    train_step(fresh)
    again.save(3, fresh)
    allocations = again._stager.allocations
    for step in (4, 5):
        train_step(fresh)
        again.save(step, fresh)
    assert again._stager.allocations == allocations  # buffers reused: nothing new per save
    assert again.restore(make_state(seed=2), step=4) == 4
    again.close()


def test_saves_cache_the_dcp_plan_under_the_checkpointers_own_key(node) -> None:
    """DCP plan caching: after the first save the plan is cached under a key of this
    checkpointer (never torch's shared default), a later save of the same state reuses it,
    and close() drops it; the saves restore bit-exactly."""
    from torch.distributed.checkpoint.planner import SavePlanner

    from tierwatch.agent.checkpoint.training import planner

    job = "unit-plan-cache"
    state = make_state()
    ckpt = TieredCheckpointer(
        job, node.url, latency_every=0, job_credential=AUTHORITY.job_credential(job)
    )
    key = ckpt.plan_cache_key
    assert key.startswith(f"tierwatch:{job}:")
    assert not planner.cached(key)
    compared = []
    real_compare = planner.DefaultSavePlanner.create_local_plan

    def create_local_plan(self):  # records whether a cached plan was there to compare with
        compared.append(self._cached_plans_key in SavePlanner._cached_save_plan)
        return real_compare(self)

    planner.DefaultSavePlanner.create_local_plan = create_local_plan  # type: ignore[method-assign]
    try:
        for step in range(3):
            train_step(state)
            ckpt.save(step, state)
            assert ckpt.wait() is True
    finally:
        planner.DefaultSavePlanner.create_local_plan = real_compare  # type: ignore[method-assign]
    saved = snapshot(state)
    assert compared == [False, True, True]  # the first save planned, the others compared
    assert planner.cached(key)
    assert "DefaultSavePlanner" not in SavePlanner._cached_global_plan
    ckpt.close()
    assert not planner.cached(key)

    fresh = make_state(seed=3)
    again = TieredCheckpointer(
        job, node.url, latency_every=0, job_credential=AUTHORITY.job_credential(job)
    )
    assert again.restore(fresh) == 2
    assert same(snapshot(fresh), saved)
    again.close()


def test_at_most_one_save_in_flight(node) -> None:
    state = make_state()
    ckpt = TieredCheckpointer(
        "unit-inflight",
        node.url,
        latency_every=0,
        job_credential=AUTHORITY.job_credential("unit-inflight"),
    )
    steps_dir = Path(ckpt.layout.job_dir("unit-inflight"))
    for step in range(4):
        train_step(state)
        ckpt.save(step, state)
        if step:  # when save(N) returns, step N-1 is committed in the memory tier
            assert (steps_dir / step_dirname(step - 1) / "commit-0.json").exists()
    # retention keeps the newest two memory steps, and the persist step (0) until the
    # agent has uploaded it
    persisted = node.memory_dir.parent.parent.parent / "persistent" / "unit-inflight"
    wait_for(
        lambda: (persisted / "step-0" / ".metadata").exists(),
        timeout=30,
        what="step 0 on the persistent tier",
    )
    train_step(state)
    ckpt.save(4, state)
    ckpt.close()
    assert sorted(p.name for p in steps_dir.glob("step-*")) == ["step-3", "step-4"]


def test_without_an_optimizer_staging_is_synchronous(node) -> None:
    w = torch.zeros(4)
    ckpt = TieredCheckpointer(
        "unit-sync", node.url, latency_every=0, job_credential=AUTHORITY.job_credential("unit-sync")
    )
    ckpt.save(0, {"w": w})
    assert ckpt._inflight is not None
    assert ckpt._inflight.pending.pairs == []
    w.add_(1.0)  # changed after save() returned
    ckpt.close()
    loaded = {"w": torch.full((4,), 7.0)}
    again = TieredCheckpointer(
        "unit-sync", node.url, latency_every=0, job_credential=AUTHORITY.job_credential("unit-sync")
    )
    assert again.restore(loaded) == 0
    assert torch.equal(loaded["w"], torch.zeros(4))
    again.close()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda c, s: c.save(-1, s), "step must be an integer"),
        (lambda c, s: c.save(1.5, s), "step must be an integer"),
        (lambda c, s: c.save(c._last_step + 1, {}), "non-empty dict"),
        (lambda c, s: c.save(c._last_step + 1, {"a.b": 1}), "without '.'"),
        (lambda c, s: c.save(c._last_step + 1, {"optim": s["optim"]}), "belong to no nn.Module"),
        (lambda c, s: c.restore(s, step=12345), "cannot be restored"),
        (lambda c, s: c.restore(s, step=-3), "integer ≥ 0"),
    ],
)
def test_bad_calls_raise_clear_errors_and_lose_nothing(node, call, message) -> None:
    state = make_state()
    ckpt = TieredCheckpointer(
        "unit-bad", node.url, latency_every=0, job_credential=AUTHORITY.job_credential("unit-bad")
    )
    ckpt.restore(state)
    train_step(state)
    ckpt.save(0 if ckpt._last_step is None else ckpt._last_step + 1, state)
    good = ckpt._last_step
    with pytest.raises(CheckpointError, match=message):
        call(ckpt, state)
    with pytest.raises(CheckpointError, match="not after the previous"):
        ckpt.save(good, state)
    ckpt.close()
    again = TieredCheckpointer(
        "unit-bad", node.url, latency_every=0, job_credential=AUTHORITY.job_credential("unit-bad")
    )
    assert again.restore(make_state(seed=3)) == good  # the stored step is intact
    again.close()


@pytest.mark.parametrize("job_id", ["", "../escape", "a/b", "x" * 129, ".hidden"])
def test_bad_job_ids_are_refused(node, job_id) -> None:
    with pytest.raises(CheckpointError, match="job_id"):
        TieredCheckpointer(job_id, node.url, job_credential=AUTHORITY.job_credential(job_id))


def test_no_agent_and_no_memory_dir_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TIERWATCH_MEMORY_DIR", raising=False)
    with pytest.raises(CheckpointError, match="memory_dir"):
        TieredCheckpointer(
            "unit-noagent",
            "http://127.0.0.1:9",
            job_credential=AUTHORITY.job_credential("unit-noagent"),
        )
    # with a memory folder the memory tier works without the agent
    ckpt = TieredCheckpointer(
        "unit-noagent",
        "http://127.0.0.1:9",
        memory_dir=tmp_path,
        latency_every=0,
        job_credential=AUTHORITY.job_credential("unit-noagent"),
    )
    ckpt.save(0, {"w": torch.ones(2)})
    assert ckpt.wait() is True
    ckpt.close(timeout_s=2)
    assert (tmp_path / "jobs" / "unit-noagent" / "step-0" / "commit-0.json").exists()


def test_a_failed_write_is_reported_and_training_goes_on(node) -> None:
    """DCP raises CheckpointException (a BaseException) when it cannot write; the step is
    not committed, and the next optimizer step and saves go on."""
    state = make_state()
    ckpt = TieredCheckpointer(
        "unit-failwrite",
        node.url,
        latency_every=0,
        job_credential=AUTHORITY.job_credential("unit-failwrite"),
    )
    train_step(state)
    ckpt.save(0, state)
    assert ckpt.wait() is True
    blocker = ckpt.layout.tmp_step_dir("unit-failwrite", 1, 0)
    blocker.write_text("a file where the temporary folder must go\n")  # mkdir fails
    train_step(state)
    ckpt.save(1, state)
    job = ckpt._inflight
    train_step(state)  # the optimizer pre-hook must not wait forever
    assert ckpt.wait() is False
    assert job is not None
    assert job.error is not None
    assert "not committed" in job.error or "write failed" in job.error
    assert "Traceback" not in job.error  # one line per cause
    blocker.unlink()
    ckpt.save(2, state)
    assert ckpt.wait() is True
    ckpt.close()
    steps = sorted(p.name for p in ckpt.job_dir.glob("step-*/commit-0.json"))
    assert not (ckpt.job_dir / "step-1" / "commit-0.json").exists()
    assert (ckpt.job_dir / "step-2" / "commit-0.json").exists(), steps


def test_saving_another_model_under_a_used_job_id_is_refused(node) -> None:
    state = make_state(width=16)
    ckpt = TieredCheckpointer(
        "unit-foreign",
        node.url,
        latency_every=0,
        job_credential=AUTHORITY.job_credential("unit-foreign"),
    )
    train_step(state)
    ckpt.save(0, state)
    ckpt.close()
    other = make_state(width=32)
    again = TieredCheckpointer(
        "unit-foreign",
        node.url,
        latency_every=0,
        job_credential=AUTHORITY.job_credential("unit-foreign"),
    )
    with pytest.raises(CheckpointError, match="different model") as err:
        again.save(5, other)
    assert "ckpt gc --job unit-foreign" in str(err.value)
    again.close()
    assert (again.job_dir / "step-0" / "commit-0.json").exists()  # nothing evicted


def test_steps_lost_counts_to_the_last_step_trained_not_to_a_planted_step(node) -> None:
    """A step folder planted in the memory tier (a manifest claiming step 999, its files
    missing) is tried and refused by the restore, and never enters ``steps_lost``: that
    counts from the restored step to the newest step the rank's progress file records."""
    state = make_state()
    ckpt = TieredCheckpointer(
        "unit-lost", node.url, latency_every=0, job_credential=AUTHORITY.job_credential("unit-lost")
    )
    for step in range(4):
        train_step(state)
        ckpt.save(step, state)
    assert ckpt.wait() is True
    ckpt.close()
    planted = ckpt.job_dir / step_dirname(999)
    planted.mkdir()
    manifest = json.loads((ckpt.job_dir / step_dirname(3) / "manifest-0.json").read_text())
    manifest["step"] = 999
    (planted / "manifest-0.json").write_text(json.dumps(manifest))
    assert json.loads(ckpt.progress_file.read_text())["step"] == 3

    again = TieredCheckpointer(
        "unit-lost", node.url, latency_every=0, job_credential=AUTHORITY.job_credential("unit-lost")
    )
    assert again.restore(make_state(seed=1)) == 3
    report = again.last_restore
    assert report is not None
    assert (report.step, report.steps_lost) == (3, 0)
    again.close()


def test_the_report_sent_at_start_is_marked_starting() -> None:
    """Rank 0's layout report at start may still be refused (another world size or model):
    it goes out with ``starting`` set, so the server never lets it rewrite a known job."""
    from tierwatch.agent.checkpoint.training.client import EventSender
    from tierwatch.agent.protocol import JobProgress, utcnow

    class Agent:
        closed = False

        def __init__(self) -> None:
            self.progress: list[dict] = []

        def post_events(self, *, events: list, progress: list, restores: list) -> None:
            self.progress += progress

    agent = Agent()
    sender = EventSender(agent, period_s=3600)  # type: ignore[arg-type]
    report = JobProgress(job_id="j", rank=0, world_size=2, step=0, ts=utcnow(), layout=["a", "b"])
    sender.progress(report, completed=False)
    sender.progress(report.model_copy(update={"step": 1, "layout": None}))
    assert sender.close(timeout_s=2) is True
    assert [(p["step"], p["starting"]) for p in agent.progress] == [(0, True), (1, False)]


def test_a_refused_restore_hands_its_report_to_the_agent_before_raising(node) -> None:
    """The process usually exits right after a refused restore, and the event sender's
    daemon thread with it: the refusal is delivered before the error propagates."""
    from tierwatch.agent.checkpoint.training.client import EventSender

    state = make_state(width=16)
    ckpt = TieredCheckpointer(
        "unit-refused",
        node.url,
        latency_every=0,
        job_credential=AUTHORITY.job_credential("unit-refused"),
    )
    train_step(state)
    ckpt.save(0, state)
    ckpt.close()

    class Agent:
        closed = False

        def __init__(self) -> None:
            self.restores: list[dict] = []

        def post_events(self, *, events: list, progress: list, restores: list) -> None:
            self.restores += restores

    again = TieredCheckpointer(
        "unit-refused",
        node.url,
        latency_every=0,
        job_credential=AUTHORITY.job_credential("unit-refused"),
    )
    agent = Agent()
    sender = EventSender(agent, period_s=3600)  # type: ignore[arg-type]
    sender._stop.set()  # no background delivery: only an explicit flush sends
    sender._wake.set()
    sender._thread.join(5)
    again.events = sender
    with pytest.raises(ModelMismatchError):
        again.restore(make_state(width=32))
    assert [(r["ok"], r["step"]) for r in agent.restores] == [(False, None)]
    again.close()


def test_a_sender_that_outlives_its_closed_client_ends_quietly() -> None:
    """``close()`` waits for the sender thread a bounded time; a send still running when the
    client closes is an undelivered batch (AgentUnavailable), not a crash in the thread."""
    from tierwatch.agent.checkpoint.training.client import AgentClient, AgentUnavailable
    from tierwatch.agent.protocol import JobProgress, utcnow

    client = AgentClient("http://127.0.0.1:9")
    client.close()
    with pytest.raises(AgentUnavailable, match="is closed"):
        client.post_events(events=[], progress=[], restores=[])
    from tierwatch.agent.checkpoint.training.client import EventSender

    sender = EventSender(client, period_s=0.01)
    sender.progress(JobProgress(job_id="j", rank=0, world_size=1, step=0, ts=utcnow()))
    wait_for(lambda: sender.failures > 0, timeout=10, what="a failed send")
    assert "is closed" in (sender.last_error or "")
    # a closed client never delivers again: the thread ends instead of retrying forever
    wait_for(lambda: not sender._thread.is_alive(), timeout=10, what="the sender thread to end")
    failures = sender.failures
    assert sender.pending() == 1
    assert sender.close(timeout_s=0.5) is False  # undelivered, and said so
    assert sender.failures == failures + 1  # one last try, not a 0.5 s retry loop


def test_availability_with_the_persistent_tier_waits_for_a_slow_listing() -> None:
    """The agent lists the persistent tier for ``available``; an object store that retries
    takes longer than a quick call's timeout, and the rank must get the agent's answer (with
    its cause), not "agent unreachable"."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tierwatch.agent.checkpoint.training.client import AgentClient, AgentUnavailable

    class SlowAgent(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            threading.Event().wait(1.0)  # the agent's listing of a slow object store
            body = b'{"entries": [], "errors": ["persistent: cannot reach the endpoint"]}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowAgent)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    client = AgentClient(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=0.3)
    try:
        answer = client.available("j", persistent=True)
        assert answer["errors"] == ["persistent: cannot reach the endpoint"]
        with pytest.raises(AgentUnavailable, match="unreachable"):  # quick calls stay quick
            client.available("j", persistent=False)
    finally:
        client.close()
        server.shutdown()
        server.server_close()


def test_a_flush_waits_for_the_send_in_flight() -> None:
    """The background thread may have taken the queued report and still be posting it when
    the rank flushes (a refused restore flushes, then the process exits): the flush must
    wait for that post, not find the queue empty and say "delivered"."""
    import threading

    from tierwatch.agent.checkpoint.training.client import EventSender
    from tierwatch.agent.protocol import RestoreReport, utcnow

    posting, release = threading.Event(), threading.Event()

    class SlowAgent:
        closed = False

        def __init__(self) -> None:
            self.restores: list[dict] = []

        def post_events(self, *, events: list, progress: list, restores: list) -> None:
            posting.set()
            release.wait(10)
            self.restores += restores

    agent = SlowAgent()
    sender = EventSender(agent, period_s=0.01)  # type: ignore[arg-type]
    sender.restore(
        RestoreReport(job_id="j", rank=0, world_size=1, ts=utcnow(), seconds=0.1, ok=False)
    )
    assert posting.wait(5)  # the background thread took it and is posting
    result: dict[str, bool] = {}
    flusher = threading.Thread(target=lambda: result.update(ok=sender.flush(5)))
    flusher.start()
    flusher.join(0.5)
    assert flusher.is_alive(), "the flush returned while the report was still in flight"
    release.set()
    flusher.join(5)
    assert result == {"ok": True}
    assert len(agent.restores) == 1
    sender.close(1)

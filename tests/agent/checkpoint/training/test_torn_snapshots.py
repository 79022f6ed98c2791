"""A tensor changed outside the hooked optimizer step tears a snapshot: the step is refused.

Real torch training through TieredCheckpointer, with a memory folder and no agent (the
memory tier works without one). The writer thread is held at a gate so that the in-place
change is sure to land before the snapshot copy, as it can in a real job (EMA, an optimizer
left out of ``state``, an eval weight swap).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tierwatch import TieredCheckpointer
from tierwatch.agent.checkpoint.format.layout import commit_name, manifest_name, step_dirname
from tierwatch.agent.checkpoint.training import snapshot
from tierwatch.agent.protocol import CheckpointEvent

NO_AGENT = "http://127.0.0.1:9"


def make_state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    return {"model": model, "optim": optim}


def train_step(state: dict) -> None:
    loss = state["model"](torch.randn(4, 8)).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()


class Gate:
    """Holds the writer thread before its snapshot copy until the test opens it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()
        original = snapshot.PendingCopies.run

        def gated(pending, *args, **kwargs):
            self.reached.set()
            assert self.opened.wait(10), "the test never opened the gate"
            return original(pending, *args, **kwargs)

        monkeypatch.setattr(snapshot.PendingCopies, "run", gated)

    def hold(self) -> None:
        self.opened.clear()
        self.reached.clear()

    def release_after_reached(self) -> None:
        assert self.reached.wait(10), "the writer never reached its copy"
        self.opened.set()


@pytest.fixture
def ckpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("TIERWATCH_MEMORY_DIR", raising=False)
    c = TieredCheckpointer(
        "torn", NO_AGENT, memory_dir=tmp_path, latency_every=0, request_poll_s=60.0
    )
    events: list[CheckpointEvent] = []
    forward = c.events.event

    def record(event: CheckpointEvent) -> None:
        events.append(event)
        forward(event)

    monkeypatch.setattr(c.events, "event", record)
    c.recorded = events  # type: ignore[attr-defined]
    yield c
    c.close(timeout_s=0.5)


def committed(c: TieredCheckpointer, step: int) -> bool:
    return (c.job_dir / step_dirname(step) / commit_name(0)).exists()


def test_a_tensor_changed_in_place_after_save_fails_that_step_and_training_goes_on(
    ckpt, monkeypatch
) -> None:
    state = make_state()
    gate = Gate(monkeypatch)
    gate.opened.set()
    train_step(state)
    ckpt.save(0, state)
    assert ckpt.wait() is True  # a normal step commits

    train_step(state)
    gate.hold()
    ckpt.save(1, state)
    # an EMA-like in-place update outside the hooked optimizer.step(), before the copy
    with torch.no_grad():
        state["model"][2].weight.mul_(0.5)
    gate.release_after_reached()
    assert ckpt.wait() is False
    assert not committed(ckpt, 1)
    failed = [e for e in ckpt.recorded if e.step == 1 and e.kind == "failed"]
    assert failed, ckpt.recorded
    assert "model.2.weight" in (failed[0].message or "")
    assert not any(e.step == 1 and e.kind == "committed" for e in ckpt.recorded)

    # training goes on and the next save works
    gate.opened.set()
    train_step(state)
    ckpt.save(2, state)
    saved = {k: v.clone() for k, v in state["model"].state_dict().items()}
    train_step(state)
    assert ckpt.wait() is True
    assert committed(ckpt, 2)
    ckpt.close(timeout_s=0.5)

    # nothing of the torn step is on disk (no manifest, no shard: not restorable), and the
    # memory tier's step 2 (a plain DCP folder) holds the state save(2) saw
    torn_dir = ckpt.job_dir / step_dirname(1)
    assert not (torn_dir / manifest_name(0)).exists()
    assert not list(torn_dir.glob("*.distcp"))
    loaded = {"model": {k: torch.zeros_like(v) for k, v in saved.items()}}
    dcp.load(loaded, checkpoint_id=ckpt.job_dir / step_dirname(2), no_dist=True)
    for k, v in loaded["model"].items():
        assert torch.equal(v, saved[k]), k

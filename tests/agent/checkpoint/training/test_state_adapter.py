"""StateAdapter (single process, real torch) and RankFiles (plain files)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tierwatch.agent.checkpoint.format.layout import (
    METADATA,
    MemoryLayout,
    commit_name,
    manifest_name,
    shard_name,
    tier_progress_name,
)
from tierwatch.agent.checkpoint.training.errors import CheckpointError
from tierwatch.agent.checkpoint.training.rank_files import RankFiles
from tierwatch.agent.checkpoint.training.state_adapter import StateAdapter


def make_state() -> dict:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    return {"model": model, "optim": optim, "epoch": 4}


def test_live_state_then_load_round_trip() -> None:
    state = make_state()
    adapter = StateAdapter(state)
    live = adapter.live()
    assert set(live.state_dict) == {"model", "optim", "epoch"}
    assert live.optim_keys == {"optim"}
    assert len(live.param_ptrs) == 2
    saved = {k: v.clone() for k, v in live.state_dict["model"].items()}
    with torch.no_grad():
        state["model"].weight.add_(1.0)
    loaded = adapter.live().state_dict
    loaded["model"] = saved
    loaded["epoch"] = 9
    adapter.load(loaded)
    assert torch.equal(state["model"].weight, saved["weight"])
    assert state["epoch"] == 9


def test_signature_follows_shapes_not_values() -> None:
    a, b = make_state(), make_state()
    with torch.no_grad():
        b["model"].weight.add_(1.0)
    sig = StateAdapter(a).signature(StateAdapter(a).live().state_dict)
    assert sig == StateAdapter(b).signature(StateAdapter(b).live().state_dict)
    c = {"model": nn.Linear(3, 4)}
    assert StateAdapter(c).signature(StateAdapter(c).live().state_dict) != sig


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({}, "non-empty dict"),
        ({"a.b": 1}, "without '.'"),
        ({"optim": make_state()["optim"]}, "belong to no nn.Module"),
    ],
)
def test_bad_states_are_refused(state, message) -> None:
    with pytest.raises(CheckpointError, match=message):
        StateAdapter(state).live()


def test_rank_files_touch_only_their_rank(tmp_path) -> None:
    layout = MemoryLayout(tmp_path)
    step_dir = layout.step_dir("j", 3)
    step_dir.mkdir(parents=True)
    for r in (0, 1):
        for name in (shard_name(r), manifest_name(r), commit_name(r), tier_progress_name(r)):
            (step_dir / name).write_text("{}")
    (step_dir / METADATA).write_text("x")
    (step_dir / commit_name(1)).write_text(json.dumps({"persist": True}))
    one = RankFiles(layout, "j", 1)
    assert one.pending_upload([3]) == 3  # persist, .tier-1.json says nothing uploaded
    (step_dir / tier_progress_name(1)).write_text(json.dumps({"persistent": {"uploaded": True}}))
    assert one.pending_upload([3]) is None
    assert one.remove(3)
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        [shard_name(0), manifest_name(0), commit_name(0), tier_progress_name(0), METADATA]
    )
    assert not one.remove(3)
    assert RankFiles(layout, "j", 0).remove(3)
    assert not step_dir.exists()

"""RNGState, ResumableDistributedSampler and the SnapshotStager (single process, real torch)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tierwatch.agent.checkpoint.training.snapshot import SnapshotStager
from tierwatch.agent.checkpoint.training.state import ResumableDistributedSampler, RNGState


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_rng_state_round_trip_keyed_by_rank() -> None:
    rng = RNGState(rank=3)
    saved = rng.state_dict()
    assert list(saved) == ["rank_3"]
    first = draws()
    rng.load_state_dict(saved)
    assert draws() == first
    with pytest.raises(KeyError, match="rank 5"):
        RNGState(rank=5).load_state_dict(saved)


def test_sampler_resumes_mid_epoch_in_the_same_order() -> None:
    full = ResumableDistributedSampler(50, num_replicas=2, rank=1, seed=7)
    order = list(full)
    s = ResumableDistributedSampler(50, num_replicas=2, rank=1, seed=7)
    it = iter(s)
    head = [next(it) for _ in range(10)]
    saved = s.state_dict()
    assert saved == {
        "rank_1": {"epoch": 0, "position": 10, "seed": 7, "num_replicas": 2, "shuffle": True}
    }
    resumed = ResumableDistributedSampler(50, num_replicas=2, rank=1, seed=7)
    resumed.load_state_dict(saved)
    assert head + list(resumed) == order
    assert resumed.epoch == 1
    assert resumed.position == 0


def test_sampler_refuses_a_different_order() -> None:
    saved = ResumableDistributedSampler(50, num_replicas=2, rank=0, seed=7).state_dict()
    with pytest.raises(ValueError, match="seed=7"):
        ResumableDistributedSampler(50, num_replicas=2, rank=0, seed=8).load_state_dict(saved)
    with pytest.raises(KeyError, match="rank 1"):
        ResumableDistributedSampler(50, num_replicas=2, rank=1, seed=7).load_state_dict(saved)
    with pytest.raises(ValueError, match="position"):
        ResumableDistributedSampler(50, num_replicas=2, rank=0).set_position(99)


def test_stager_reuses_buffers_and_defers_lazy_copies() -> None:
    w = torch.randn(4, 4)
    b = torch.randn(4)
    state = {"model": {"w": w, "b": b}, "n": 3, "nested": [{"x": torch.ones(2)}]}
    stager = SnapshotStager()
    staged, pending = stager.stage(state, lambda path, t: path[-1] == "w")
    assert stager.allocations == 3
    assert staged["n"] == 3
    assert torch.equal(staged["model"]["b"], b)
    assert len(pending.pairs) == 1
    assert pending.nbytes == 64
    w.add_(1.0)  # the lazy copy sees the value at the time it runs
    pending.run()
    assert torch.equal(staged["model"]["w"], w)
    b_before = staged["model"]["b"].clone()
    b.add_(1.0)  # eager copy is a snapshot
    assert torch.equal(staged["model"]["b"], b_before)

    buf = staged["model"]["w"]
    staged2, _ = stager.stage(state, lambda path, t: False)
    assert stager.allocations == 3  # no new buffers for the same shapes
    assert staged2["model"]["w"] is buf
    assert torch.equal(buf, w)
    state["model"]["w"] = torch.randn(8, 4)  # shape change: one new buffer
    stager.stage(state, lambda path, t: False)
    assert stager.allocations == 4

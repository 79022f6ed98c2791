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


def tensors_only(value: object) -> bool:
    if isinstance(value, dict):
        return all(tensors_only(v) for v in value.values())
    if isinstance(value, list):
        return all(tensors_only(v) for v in value)
    return isinstance(value, torch.Tensor)


def test_rng_state_is_tensors_and_round_trips_bit_exact() -> None:
    random.seed(5)
    random.gauss(0.0, 1.0)  # a cached gaussian in Python's state
    np.random.seed(6)
    np.random.standard_normal()  # and in NumPy's
    rng = RNGState(rank=0)
    saved = rng.state_dict()
    assert tensors_only(saved)  # nothing for DCP to pickle
    py, npy, tch = random.getstate(), np.random.get_state(), torch.get_rng_state()
    expected = (random.gauss(0, 1), np.random.standard_normal(), draws())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    rng.load_state_dict({k: {n: v.clone() for n, v in s.items()} for k, s in saved.items()})
    assert random.getstate() == py
    got = np.random.get_state()
    assert (got[0], got[2:]) == (npy[0], npy[2:])
    assert np.array_equal(got[1], npy[1])
    assert torch.equal(torch.get_rng_state(), tch)
    assert (random.gauss(0, 1), np.random.standard_normal(), draws()) == expected


def test_rng_state_in_the_old_pickled_format_is_refused() -> None:
    import pickle

    old = {
        "rank_0": {
            "python": pickle.dumps(random.getstate()),
            "numpy": pickle.dumps(np.random.get_state()),
            "torch": torch.get_rng_state(),
        }
    }
    with pytest.raises(ValueError, match="old pickled format"):
        RNGState(rank=0).load_state_dict(old)


def test_state_module_does_not_import_pickle() -> None:
    import ast
    import inspect

    from tierwatch.agent.checkpoint.training import state

    tree = ast.parse(inspect.getsource(state))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported = {name.split(".")[0] for name in imported}
    assert not imported & {"pickle", "cPickle", "_pickle", "dill", "cloudpickle"}


def test_sampler_resumes_mid_epoch_in_the_same_order() -> None:
    full = ResumableDistributedSampler(50, num_replicas=2, rank=1, seed=7)
    order = list(full)
    s = ResumableDistributedSampler(50, num_replicas=2, rank=1, seed=7)
    it = iter(s)
    head = [next(it) for _ in range(10)]
    saved = s.state_dict()
    assert tensors_only(saved)  # nothing for DCP to pickle
    assert {k: int(v) for k, v in saved["rank_1"].items()} == {
        "epoch": 0,
        "position": 10,
        "seed": 7,
        "num_replicas": 2,
        "shuffle": 1,
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

"""The latency probe's device and timing (agent/checkpoint/training/collectives.py).

A real gloo group of world size 1 in this process (a HashStore, no ports). The NCCL branch
cannot run without a GPU, so its tests replace torch's own interfaces the probe reads
(``dist.get_backend``, the group's ``bound_device_id``, ``torch.cuda.*``, ``dist.all_reduce``)
and record which device the all_reduce got and whether the whole device was synchronised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tierwatch.agent.checkpoint.training.collectives import CheckpointCollectives


@pytest.fixture
def gloo_world() -> Iterator[None]:
    """``torch.distributed`` initialised in this process: gloo, rank 0 of 1 (per test, so a
    test without it sees torch.distributed down)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class FakeCuda:
    """What the probe did on the (stand-in) GPU."""

    all_reduce_devices: list[torch.device] = field(default_factory=list)
    async_ops: list[bool] = field(default_factory=list)
    device_syncs: int = 0
    event_syncs: int = 0


class _FakeCudaTensor:
    def __init__(self, device: torch.device) -> None:
        self.device = device


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch, gloo_world: None) -> FakeCuda:
    """An NCCL training group on a 2-GPU node where ``set_device`` was never called
    (``current_device()`` is 0) and torchrun set ``LOCAL_RANK=1``."""
    rec = FakeCuda()
    real_zeros = torch.zeros

    def zeros(*size: Any, device: Any = None, **kw: Any) -> Any:
        d = torch.device(device) if device is not None else torch.device("cpu")
        return _FakeCudaTensor(d) if d.type == "cuda" else real_zeros(*size, device=d, **kw)

    def all_reduce(tensor: Any, group: Any = None, async_op: bool = False, **kw: Any) -> Any:
        rec.all_reduce_devices.append(tensor.device)
        rec.async_ops.append(async_op)
        return SimpleNamespace(wait=lambda: True) if async_op else None

    def synchronize(device: Any = None) -> None:
        rec.device_syncs += 1

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self, stream: Any = None) -> None:
            self.t = 0.25 * len(rec.all_reduce_devices)

        def synchronize(self) -> None:
            rec.event_syncs += 1

        def elapsed_time(self, other: Event) -> float:
            return other.t - self.t

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", Event)
    return rec


def test_not_distributed_has_no_latency() -> None:
    assert not dist.is_initialized()
    c = CheckpointCollectives(timeout_s=30)
    with pytest.raises(RuntimeError, match="without torch.distributed"):
        c.latency_ms()


def test_probe_device_rules() -> None:
    from tierwatch.agent.checkpoint.training.collectives import probe_device

    cuda = torch.device
    cases = [
        # backend, bound, current, count, LOCAL_RANK, expected
        ("gloo", None, None, 0, "3", cuda("cpu")),
        ("gloo", None, 0, 8, "3", cuda("cpu")),  # gloo with GPUs: the probe stays on the CPU
        ("nccl", cuda("cuda", 5), 0, 8, "3", cuda("cuda", 5)),  # init(device_id=5)
        ("cpu:gloo,cuda:nccl", cuda("cuda", 2), 0, 8, "2", cuda("cuda", 2)),
        ("nccl", None, 4, 8, "3", cuda("cuda", 4)),  # set_device(4) without device_id
        ("nccl", None, 0, 8, "3", cuda("cuda", 3)),  # never set: LOCAL_RANK, not cuda:0
        ("nccl", None, 0, 1, "3", cuda("cuda", 0)),  # one visible GPU per process
        ("nccl", None, 0, 8, None, cuda("cuda", 0)),
    ]
    for backend, bound, current, count, local_rank, expected in cases:
        env = {} if local_rank is None else {"LOCAL_RANK": local_rank}
        got = probe_device(
            backend=backend,
            bound_device=bound,
            current_device=current,
            device_count=count,
            env=env,
        )
        assert got == expected, (backend, bound, current, count, local_rank)
    with pytest.raises(RuntimeError, match="no CUDA device"):
        probe_device(backend="nccl", bound_device=None, current_device=None, device_count=0, env={})


def test_gloo_probe_times_a_cpu_all_reduce(gloo_world: None) -> None:
    c = CheckpointCollectives(timeout_s=30)
    assert c.latency_ms() >= 0.0
    assert c.latency_device() == torch.device("cpu")


def test_nccl_probe_uses_local_rank_without_a_device_wide_sync(fake_cuda: FakeCuda) -> None:
    c = CheckpointCollectives(timeout_s=30)
    ms = c.latency_ms()
    assert fake_cuda.all_reduce_devices == [torch.device("cuda", 1)]  # not cuda:0
    assert fake_cuda.async_ops == [True]
    assert fake_cuda.device_syncs == 0  # no torch.cuda.synchronize
    assert fake_cuda.event_syncs == 1  # the host waits for the end event only
    assert ms == pytest.approx(0.25)  # CUDA event time, not host wall time


def test_nccl_probe_uses_the_groups_bound_device(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # neither LOCAL_RANK nor current_device() says 1
    group = SimpleNamespace(bound_device_id=torch.device("cuda", 1))  # init(device_id=1)
    c = CheckpointCollectives(timeout_s=30, train_group=group)
    c.latency_ms()
    c.latency_ms()
    assert fake_cuda.all_reduce_devices == [torch.device("cuda", 1)] * 2
    assert fake_cuda.device_syncs == 0


def test_an_exception_in_a_phase_is_the_ranks_outcome_and_names_rank_and_node(
    gloo_world: None,
) -> None:
    from tierwatch.agent.checkpoint.training.collectives import RankOutcome, values_or_raise
    from tierwatch.agent.checkpoint.training.errors import CheckpointError

    c = CheckpointCollectives(timeout_s=2)
    assert c.heartbeat_s == pytest.approx(0.5)  # timeout_s / 4, so a heartbeat never times out

    def fetch() -> int:
        raise RuntimeError("GetObject 503\nthe traceback's other lines")

    outcomes = c.gather_outcomes(fetch, what="staging")
    assert outcomes == [RankOutcome(0, error="RuntimeError: GetObject 503")]
    with pytest.raises(CheckpointError, match=r"staging failed on rank 0 \(node-a\): Runtime"):
        values_or_raise(outcomes, what="staging", nodes=["node-a"])
    assert values_or_raise(c.gather_outcomes(lambda: 7, what="staging"), what="x") == [7]

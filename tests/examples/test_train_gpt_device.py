"""examples/train_gpt.py --device: the rank's GPU and the process group bound to it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_gpt  # noqa: E402


def test_training_device_is_cuda_local_rank() -> None:
    assert train_gpt.training_device("cuda", {"LOCAL_RANK": "3"}) == torch.device("cuda", 3)
    assert train_gpt.training_device("cuda", {}) == torch.device("cuda", 0)
    assert train_gpt.training_device("cpu", {"LOCAL_RANK": "3"}) == torch.device("cpu")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        train_gpt.training_device("cuda", {"LOCAL_RANK": "x"})
    with pytest.raises(ValueError, match="--device"):
        train_gpt.training_device("mps", {})


def test_init_kwargs_bind_nccl_to_the_ranks_gpu() -> None:
    cuda3 = torch.device("cuda", 3)
    assert train_gpt.init_kwargs(cuda3) == {"backend": "nccl", "device_id": cuda3}
    assert train_gpt.init_kwargs(torch.device("cpu")) == {"backend": "gloo"}


def test_init_distributed_sets_the_device_before_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(
        train_gpt.dist, "init_process_group", lambda **kw: calls.append(("init", kw))
    )
    cuda1 = torch.device("cuda", 1)
    train_gpt.init_distributed(cuda1)
    assert calls == [("set_device", cuda1), ("init", {"backend": "nccl", "device_id": cuda1})]
    calls.clear()
    train_gpt.init_distributed(torch.device("cpu"))
    assert calls == [("init", {"backend": "gloo"})]

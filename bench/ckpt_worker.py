"""One rank of the checkpoint benchmark's multi-node part (see bench/checkpoint.py).

Modes (``--mode``):

- ``train``: build the model, run ``--steps`` AdamW steps saving each through
  TieredCheckpointer (``persist_every`` = ``--persist-every``), wait, exit.
- ``restore``: build the same model with fresh weights and a fresh optimizer, restore, and
  write the RestoreReport (step, seconds, files per tier) to ``--out``.

Started once per rank with the torch.distributed environment and TIERWATCH_AGENT_URL.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from tierwatch import TieredCheckpointer


def build(width: int, layers: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A stack of ``layers`` square Linear layers of ``width`` and its AdamW optimizer."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: nn.Module, optim: torch.optim.Optimizer, batch: int, width: int) -> None:
    """One forward/backward/AdamW step on random data."""
    x = torch.randn(batch, width)
    loss = model(x).pow(2).mean()
    optim.zero_grad(set_to_none=True)
    loss.backward()
    optim.step()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["train", "restore"], required=True)
    p.add_argument("--job-id", default="bench")
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--persist-every", type=int, default=1000)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
    dist.init_process_group("gloo")
    model, optim = build(args.width, args.layers, seed=1 if args.mode == "train" else 2)
    state = {"model": model, "optim": optim}
    ckpt = TieredCheckpointer(args.job_id, persist_every=args.persist_every, latency_every=0)
    if args.mode == "train":
        for s in range(args.steps):
            step(model, optim, args.batch, args.width)
            ckpt.save(s, state)
        ckpt.wait()
    else:
        t0 = time.monotonic()
        got = ckpt.restore(state)
        seconds = time.monotonic() - t0
        report = ckpt.last_restore.model_dump(mode="json")
        report["wall_s"] = seconds
        report["loaded"] = got
        if args.out:
            args.out.write_text(json.dumps(report))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

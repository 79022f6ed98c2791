"""Train a small character-level GPT with tierwatch's TieredCheckpointer.

The corpus is text every machine with Python has: the standard library's own ``.py`` files
(read in sorted order, as bytes, so the vocabulary is the 256 byte values). The model is a
GPT-style decoder (token + position embeddings, pre-norm blocks with causal self-attention
and an MLP). Training is data parallel (DDP) over torch.distributed (gloo on CPU, NCCL when
``--device cuda``), with AdamW and a linear-warmup + cosine learning-rate schedule. Every
step is checkpointed through the node's tierwatch agent (memory tier every save, peer
replicas by the agents, persistent every ``--persist-every`` steps), and a restarted job
resumes from the newest complete step in the fastest tier. An operator's restore request
(``POST /api/v1/jobs/{job_id}/restore``) rolls the running job back in-process: every step
ends with ``ckpt.maybe_rollback``, and training continues after the restored step.

Launch one process per rank with the usual torch.distributed environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; ``torchrun`` sets them, so does
``examples/launch.py``) and ``TIERWATCH_AGENT_URL`` pointing at the node's agent::

    TIERWATCH_AGENT_URL=http://127.0.0.1:9470 torchrun --nproc-per-node 2 \\
        examples/train_gpt.py --job-id gpt-small --steps 200

Each rank appends ``{"step", "loss", "lr", "rank", "restored_from", "step_s", "compute_s",
"save_s", "t"}`` lines to ``--log-dir/rank-<r>.jsonl`` (``restored_from``: the step the run
started from, or after a rollback the step it rolled back to; ``compute_s``: seconds of the
step before ``save``, ``save_s``: seconds the training thread spent in ``save``, ``t``: Unix
time at the step's end) and each restore's report to ``restores-<r>.jsonl``;
with ``--final`` rank 0 writes digests of the final model, optimizer, scheduler, RNG and
sampler state there (used by the bit-exact resume test).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import sys
import sysconfig
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F  # noqa: N812
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: N817

from tierwatch import ResumableDistributedSampler, RNGState, TieredCheckpointer


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's ``.py`` files, concatenated in sorted order, as uint8 tokens.

    Raises:
        RuntimeError: the standard library folder holds too little text.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 10_000:
        raise RuntimeError(f"only {len(blob)} bytes of text under {root}")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention + MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A small decoder-only language model over bytes.

    Args:
        vocab: vocabulary size (256 for bytes).
        block: context length (tokens).
        d: embedding width; heads: attention heads; layers: transformer blocks.
    """

    def __init__(
        self, vocab: int = 256, block: int = 64, d: int = 128, heads: int = 4, layers: int = 2
    ) -> None:
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer(
            "mask", torch.triu(torch.ones(block, block, dtype=torch.bool), 1), persistent=False
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def lr_lambda(warmup: int, total: int):  # noqa: ANN201 - a LambdaLR factor
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to 0.1 at ``total``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def digest(obj: object) -> str:
    """sha256 of every tensor and value in a (nested) state dict, in key order."""
    h = hashlib.sha256()

    def walk(v: object) -> None:
        if isinstance(v, dict):
            for k in sorted(v, key=str):
                h.update(str(k).encode())
                walk(v[k])
        elif isinstance(v, list | tuple):
            for x in v:
                walk(x)
        elif isinstance(v, torch.Tensor):
            if hasattr(v, "full_tensor"):  # a DTensor shard: digest the whole tensor
                v = v.full_tensor()
            h.update(v.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(repr(v).encode())

    walk(obj)
    return h.hexdigest()


def wait_for_go(path: str) -> None:
    """A standby rank (``examples/launch.py --standby``): its libraries are imported; wait
    until the supervisor's go file names the nodes, then take this rank's node
    (``nodes[RANK // LOCAL_WORLD_SIZE]``) as ``TIERWATCH_NODE`` / ``TIERWATCH_AGENT_URL``, and
    the job credential the supervisor registered for them as ``TIERWATCH_JOB_CREDENTIAL``.

    Raises:
        SystemExit: the go file does not name this rank's node.
    """
    while not os.path.exists(path):
        time.sleep(0.02)
    with open(path) as f:
        go = json.load(f)
    nodes = go.get("nodes", [])
    if go.get("credential"):  # the job registered on these nodes: its credential
        os.environ["TIERWATCH_JOB_CREDENTIAL"] = go["credential"]
    index = int(os.environ["RANK"]) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if index >= len(nodes):
        raise SystemExit(
            f"{path} names {len(nodes)} nodes; rank {os.environ['RANK']} needs node {index}"
        )
    os.environ["TIERWATCH_NODE"], os.environ["TIERWATCH_AGENT_URL"] = nodes[index]


def wait_gate(path: Path, step: int) -> None:
    """``--gate FILE``: block until FILE holds an integer greater than ``step``.

    Whoever drives the run (a test, a demo) opens steps by writing the number of steps that
    may run, atomically (write a temporary file, then rename it over FILE). A missing or
    half-written file keeps the gate shut. Steps below the number, including those repeated
    after a rollback, run at once.
    """
    while True:
        try:
            if int(path.read_text()) > step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.005)


def training_device(device: str, env: Mapping[str, str]) -> torch.device:
    """The device this rank trains on: ``cuda:<LOCAL_RANK>`` for ``--device cuda`` (torchrun's
    ``LOCAL_RANK``, default 0), else the CPU.

    Raises:
        ValueError: ``device`` is neither ``cpu`` nor ``cuda``, or LOCAL_RANK is no integer.
    """
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"--device must be cpu or cuda, not {device!r}")
    local_rank = env.get("LOCAL_RANK", "0")
    if not local_rank.isdigit():
        raise ValueError(f"LOCAL_RANK must be a non-negative integer, not {local_rank!r}")
    return torch.device("cuda", int(local_rank))


def init_kwargs(device: torch.device) -> dict[str, Any]:
    """``torch.distributed.init_process_group`` arguments for a rank training on ``device``.

    On CUDA: NCCL, bound to this rank's GPU with ``device_id`` (torch 2.13
    ``distributed_c10d.init_process_group``: the group's ``bound_device_id``, which NCCL's
    communicator, ``barrier()`` and tierwatch's latency probe use instead of guessing a GPU
    from ``torch.cuda.current_device()``). On the CPU: gloo.
    """
    if device.type == "cuda":
        return {"backend": "nccl", "device_id": device}
    return {"backend": "gloo"}


def init_distributed(device: torch.device) -> None:
    """Select this rank's GPU (``torch.cuda.set_device``) and then initialise the default
    process group with :func:`init_kwargs` (the env:// rendezvous: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT).

    Raises:
        RuntimeError: from torch when the GPU does not exist or the rendezvous fails.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work: no stray context on cuda:0
    dist.init_process_group(**init_kwargs(device))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job-id", default="gpt-small")
    p.add_argument("--steps", type=int, default=200, help="total training steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--persist-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument(
        "--keep-memory", type=int, default=2, help="newest committed steps the memory tier keeps"
    )
    p.add_argument(
        "--sdc-at",
        type=int,
        default=None,
        metavar="STEP",
        help="simulate silent data corruption: once per process, after STEP, "
        "rank 0 perturbs a weight (the steps after it are a diverged future to "
        "roll back from)",
    )
    p.add_argument(
        "--sdc-signal",
        action="store_true",
        help="simulate silent data corruption when rank 0 gets SIGUSR1: it perturbs "
        'a weight after its current step and logs {"event": "sdc", "step"}',
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="extra seconds per step (to slow a demo down)"
    )
    p.add_argument(
        "--gate",
        type=Path,
        default=None,
        metavar="FILE",
        help="run step N only once FILE holds a number > N (a test paces the run)",
    )
    p.add_argument("--log-dir", type=Path, default=Path("var/train"))
    p.add_argument("--final", action="store_true", help="write final state digests")
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: this rank trains on cuda:<LOCAL_RANK> (set_device + NCCL with device_id)",
    )
    p.add_argument(
        "--latency-every",
        type=int,
        default=50,
        help="time a small all_reduce every this many saves (collective latency)",
    )
    p.add_argument(
        "--exact-resume",
        action="store_true",
        help="one DDP gradient bucket per parameter, so a resumed run is bit-exact",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard parameters and optimizer state with FSDP2 (fully_shard) "
        "instead of DDP; the checkpoint then holds DTensor shards",
    )
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    if os.environ.get("TIERWATCH_GO_FILE"):
        wait_for_go(os.environ["TIERWATCH_GO_FILE"])
    distributed = "RANK" in os.environ
    device = training_device(args.device, os.environ)
    if distributed:
        init_distributed(device)
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    data = load_corpus(args.corpus_bytes)
    windows = (len(data) - 1) // args.block - 1
    torch.manual_seed(args.seed)  # same initial weights on every rank
    model = GPT(block=args.block, d=args.width, layers=args.layers).to(device)
    if args.fsdp and distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ddp = model
    else:
        # DDP sums gradients bucket by bucket and rebuilds its buckets after a process's
        # first step; the position of a gradient inside a bucket sets the order in which the
        # ring all_reduce adds the ranks' values. A resumed process's first step therefore
        # rounds differently from the uninterrupted run's, unless every parameter has its
        # own bucket (--exact-resume), which keeps resumed runs bit-exact.
        buckets = {"bucket_cap_mb_list": [1e-6]} if args.exact_resume else {}
        ddp = DDP(model, **buckets) if distributed else model
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(args.warmup, args.steps))
    sampler = ResumableDistributedSampler(windows, shuffle=True, seed=args.seed)
    torch.manual_seed(args.seed + rank)  # per-rank streams (they draw the sequence shifts)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    rng = RNGState()
    state = {"model": model, "optim": optim, "sched": sched, "rng": rng, "data": sampler}

    ckpt = TieredCheckpointer(
        args.job_id,
        persist_every=args.persist_every,
        keep_memory=args.keep_memory,
        latency_every=args.latency_every,
    )
    last = ckpt.restore(state)
    start = 0 if last is None else last + 1
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.log_dir / f"rank-{rank}.jsonl", "a")  # noqa: SIM115 - closed below

    logged = None

    def log_restore() -> None:
        nonlocal logged
        report = getattr(ckpt, "last_restore", None)
        if report is not None and report is not logged:
            logged = report
            with open(args.log_dir / f"restores-{rank}.jsonl", "a") as f:
                f.write(report.model_dump_json() + "\n")

    log_restore()
    if rank == 0:
        print(
            f"[train] job={args.job_id} world_size={world} windows={windows} "
            f"restored_from={last} start={start}",
            flush=True,
        )

    it = iter(sampler)

    def next_batch() -> torch.Tensor:
        nonlocal it
        rows = []
        while len(rows) < args.batch_size:
            try:
                i = next(it)
            except StopIteration:
                it = iter(sampler)  # the sampler moved to the next epoch
                continue
            # A random shift per sequence, drawn from this rank's torch, Python and NumPy
            # generators: the data depends on all the per-rank RNG state a resume restores.
            shift = (
                int(torch.randint(0, args.block, (1,)))
                + random.randrange(args.block)
                + int(np.random.randint(args.block))
            )
            off = i * args.block + shift % args.block
            rows.append(data[off : off + args.block + 1])
        return torch.stack(rows).to(device)

    step = start
    corrupted = False
    sdc_requested: list[int] = []  # SIGUSR1 arrivals (--sdc-signal)
    if args.sdc_signal and rank == 0:
        signal.signal(signal.SIGUSR1, lambda *_: sdc_requested.append(1))
    while step < args.steps:
        if args.gate is not None:
            wait_gate(args.gate, step)
        t0 = time.monotonic()
        batch = next_batch()
        logits = ddp(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        if step == args.sdc_at and rank == 0 and not corrupted:
            corrupted = True
            with torch.no_grad():  # an exponent bit flip in one weight of the final norm
                model.ln.weight.view(-1)[0] *= 64.0
            print(f"[train] simulated silent data corruption after step {step}", flush=True)
        if sdc_requested:
            sdc_requested.clear()
            with torch.no_grad():  # the same bit flip, now, at an operator's signal
                model.ln.weight.view(-1)[0] *= 64.0
            log.write(
                json.dumps({"event": "sdc", "step": step, "rank": rank, "t": time.time()}) + "\n"
            )
            print(f"[train] simulated silent data corruption after step {step}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        compute_s = time.monotonic() - t0
        last_step = step == args.steps - 1
        if (step + 1) % args.save_every == 0 or last_step:
            ckpt.save(step, state, persist=last_step or None)  # the final step persists too
        step_s = time.monotonic() - t0
        log.write(
            json.dumps(
                {
                    "step": step,
                    "loss": loss.item(),
                    "lr": sched.get_last_lr()[0],
                    "rank": rank,
                    "restored_from": last,
                    "step_s": round(step_s, 4),
                    "compute_s": round(compute_s, 4),
                    "save_s": round(step_s - compute_s, 4),
                    "t": round(time.time(), 4),
                }
            )
            + "\n"
        )
        log.flush()
        if rank == 0 and step % 20 == 0:
            print(f"[train] step {step} loss {loss.item():.4f}", flush=True)
        # an operator's restore request: every rank rolls back here, at the same step
        rolled = ckpt.maybe_rollback(state, step=step)
        if rolled is None:
            log_restore()  # a request that could not be served (its report says why)
            step += 1
            continue
        log_restore()
        if rank == 0:
            report = ckpt.last_restore
            print(
                f"[train] rolled back from step {step} to step {rolled} (restore request "
                f"{report.request_id if report else '?'}); continuing at {rolled + 1}",
                flush=True,
            )
        last = rolled
        it = iter(sampler)  # the sampler's position was restored: iterate from there
        step = rolled + 1

    ckpt.wait()
    if start < args.steps:
        ckpt.finish()  # all steps done: `tierwatch-agent ckpt gc --finished` may free memory
    if args.final:
        final = {
            "model": digest(model.state_dict()),
            "optim": digest(optim.state_dict()),
            "sched": digest(sched.state_dict()),
            "rng": digest(rng.state_dict()),
            "data": digest(sampler.state_dict()),
            "step": args.steps - 1,
        }
        (args.log_dir / f"final-{rank}.json").write_text(json.dumps(final))
    ckpt.close()
    log.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

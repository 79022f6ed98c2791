"""Load a tierwatch persistent step with plain torch.distributed.checkpoint (no tierwatch).

Usage (one process per rank, torch.distributed environment set)::

    dcp_plain_load.py STEP_DIR OUT_PREFIX [train_gpt model args...]

Loads ``{"model": model.state_dict()}`` twice at this world size: into an unsharded model
and into an FSDP2-sharded one (DTensor parameters), and writes
``<OUT_PREFIX parent>/plain-<rank>.json`` with the digest of the loaded model and whether
both loads agree.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from examples.train_gpt import GPT, digest  # the repo root is on the ranks' PYTHONPATH


def main() -> int:
    step_dir, out = sys.argv[1], Path(sys.argv[2])
    opts = dict(zip(sys.argv[3::2], sys.argv[4::2], strict=False))
    kw = {
        "block": int(opts.get("--block", 64)),
        "d": int(opts.get("--width", 128)),
        "layers": int(opts.get("--layers", 2)),
    }
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plain = GPT(**kw)
    sd = {"model": plain.state_dict()}
    dcp.load(sd, checkpoint_id=step_dir)
    plain.load_state_dict(sd["model"])
    plain_digest = digest(plain.state_dict())

    torch.manual_seed(99)  # different initial weights: the load must overwrite them
    sharded = GPT(**kw)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in sharded.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    ssd = {"model": sharded.state_dict()}
    dcp.load(ssd, checkpoint_id=step_dir)
    sharded.load_state_dict(ssd["model"])
    sharded_digest = digest(sharded.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(f"plain-{rank}.json").write_text(
        json.dumps({"model": plain_digest, "fsdp_matches": sharded_digest == plain_digest})
    )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's C++ threads racing static destructors at exit have
    # aborted this script ("terminate called without an active exception") after its work
    # was done and written.
    os._exit(code)

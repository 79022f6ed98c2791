"""One rank of test_collective_failures.py: failures on rank 1 before a checkpoint collective.

``python collective_failure_rank.py MODE OUT_DIR`` under torch.distributed's env:// variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; world size 2, gloo). Each rank writes what it
saw to ``OUT_DIR/<mode>-<rank>.json``.

- ``save`` (no agent; the memory tier works without one), ``timeout_s=120``: step 0 fails in
  rank 1's snapshot copy (a stand-in CUDA error), step 1 in rank 1's write (the manifest),
  step 2 in rank 1's staging inside ``save()``, step 3 in rank 0's commit decision; step 4
  commits. Per step: committed, the
  seconds ``wait()`` took, the ``failed`` events' messages.
- ``restore`` (an agent, ``TIERWATCH_AGENT_URL``): step 0 is saved; a checkpointer with
  ``timeout_s=3`` restores it while rank 1's fetch of the step's files takes 6 s (a
  throttled ``AgentClient.stage``, the call that fetches); a checkpointer with
  ``timeout_s=120`` restores while rank 1's fetch raises. Per phase: the step loaded or the
  error, the seconds, whether the weights are the saved ones, the restore report's message.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tierwatch import CheckpointError, TieredCheckpointer
from tierwatch.agent.checkpoint.training import checkpointer as checkpointer_module
from tierwatch.agent.checkpoint.training import snapshot

NO_AGENT = "http://127.0.0.1:9"
SLOW_FETCH_S = 6.0


def make_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.05)}


def train_step(state: dict[str, Any]) -> None:
    loss = state["model"](torch.randn(4, 8)).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()


def recorded_events(ckpt: TieredCheckpointer) -> list[Any]:
    events: list[Any] = []
    forward = ckpt.events.event

    def record(event: Any) -> None:
        events.append(event)
        forward(event)

    ckpt.events.event = record  # type: ignore[method-assign]
    return events


def run_save(rank: int, out: Path) -> dict[str, Any]:
    ckpt = TieredCheckpointer(
        "cf-save",
        NO_AGENT,
        memory_dir=out / "memory",
        timeout_s=120,
        latency_every=0,
        request_poll_s=60.0,
    )
    events = recorded_events(ckpt)
    state = make_state(0)
    failing: dict[str, int] = {"copy": 0, "write": 1, "staging": 2, "decision": 3}
    step_now = {"step": -1}

    real_run = snapshot.PendingCopies.run
    real_manifest = checkpointer_module.make_manifest
    real_stage = ckpt._stager.stage
    real_decide = checkpointer_module.decide_commit

    def copy(pending: Any, *args: Any, **kwargs: Any) -> Any:
        if rank == 1 and step_now["step"] == failing["copy"]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (rank 1)")
        return real_run(pending, *args, **kwargs)

    def manifest(*args: Any, **kwargs: Any) -> Any:
        if rank == 1 and kwargs.get("step") == failing["write"]:
            raise OSError(28, "No space left on device (rank 1's manifest)")
        return real_manifest(*args, **kwargs)

    def stage(*args: Any, **kwargs: Any) -> Any:
        if rank == 1 and step_now["step"] == failing["staging"]:
            raise RuntimeError("CUDA error: misaligned address (rank 1's staging)")
        return real_stage(*args, **kwargs)

    def decide(step: int, *args: Any, **kwargs: Any) -> Any:
        if step == failing["decision"]:
            raise KeyError("keep['memory'] (rank 0's decision)")
        return real_decide(step, *args, **kwargs)

    snapshot.PendingCopies.run = copy  # type: ignore[method-assign]
    checkpointer_module.make_manifest = manifest  # type: ignore[assignment]
    ckpt._stager.stage = stage  # type: ignore[method-assign]
    checkpointer_module.decide_commit = decide  # type: ignore[assignment]

    steps: dict[str, Any] = {}
    for step in range(5):
        step_now["step"] = step
        train_step(state)
        raised = None
        try:
            ckpt.save(step, state)
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            raised = f"{type(exc).__name__}: {exc}"
        t0 = time.monotonic()
        committed = ckpt.wait()
        steps[str(step)] = {
            "committed": committed,
            "raised": raised,
            "wait_s": time.monotonic() - t0,
            "failed": [e.message for e in events if e.step == step and e.kind == "failed"],
        }
    ckpt.close(timeout_s=0.5)  # its events go nowhere (no agent): do not wait for them
    return {"steps": steps}


def run_restore(rank: int) -> dict[str, Any]:
    saver = TieredCheckpointer("cf-restore", timeout_s=120, latency_every=0, request_poll_s=60.0)
    state = make_state(0)
    assert saver.restore(state) is None
    train_step(state)
    saver.save(0, state)
    saved = {k: v.clone() for k, v in state["model"].state_dict().items()}
    assert saver.wait() is True
    saver.close(timeout_s=2.0)

    def restore_with(timeout_s: float, fetch: Any) -> dict[str, Any]:
        ckpt = TieredCheckpointer(
            "cf-restore", timeout_s=timeout_s, latency_every=0, request_poll_s=60.0
        )
        real = ckpt.client.stage

        def stage(job_id: str, step: int, files: list[dict[str, Any]]) -> dict[str, Any]:
            if rank == 1 and any(f["name"].endswith(".distcp") for f in files):
                fetch()  # the fetch of the step's shards, on rank 1 only
            return real(job_id, step, files)

        ckpt.client.stage = stage  # type: ignore[method-assign]
        fresh = make_state(1)
        t0 = time.monotonic()
        try:
            loaded: int | None = ckpt.restore(fresh)
            error = None
        except CheckpointError as exc:
            loaded, error = None, str(exc)
        seconds = time.monotonic() - t0
        report = ckpt.last_restore
        ckpt.close(timeout_s=2.0)
        return {
            "loaded": loaded,
            "error": error,
            "seconds": seconds,
            "same": all(torch.equal(v, saved[k]) for k, v in fresh["model"].state_dict().items()),
            "report": None if report is None else report.message,
        }

    def failed_fetch() -> None:
        raise RuntimeError("persistent fetch failed: s3 GetObject 503 (rank 1)")

    return {
        "slow": restore_with(3.0, lambda: time.sleep(SLOW_FETCH_S)),
        "failing": restore_with(120.0, failed_fetch),
    }


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = run_save(rank, out) if mode == "save" else run_restore(rank)
    (out / f"{mode}-{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

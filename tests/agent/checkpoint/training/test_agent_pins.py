"""The ranks' memory retention keeps the steps the node's agent pins while it replicates or
uploads them (docs/checkpointing.md, "Backpressure"): one training process, no agent (the
test writes the agent's pin file itself)."""

from __future__ import annotations

from datetime import timedelta

import torch
from agent_helpers import AUTHORITY

from tierwatch import TieredCheckpointer
from tierwatch.agent.checkpoint.format.inflight import write_agent_pins
from tierwatch.agent.protocol import utcnow

JOB = "unit-agent-pins"


def test_memory_retention_keeps_the_steps_the_agent_pins(tmp_path) -> None:
    ckpt = TieredCheckpointer(
        JOB,
        "http://127.0.0.1:9",
        memory_dir=tmp_path,
        latency_every=0,
        keep_memory=1,
        persist_every=1000,
        job_credential=AUTHORITY.job_credential(JOB),
    )
    job_dir = ckpt.layout.job_dir(JOB)
    state = {"w": torch.ones(4)}

    def save(step: int) -> list[int]:
        state["w"] += 1
        ckpt.save(step, state)
        assert ckpt.wait() is True
        return ckpt.layout.steps(JOB)

    try:
        # step 0 is the first persist step: kept until an agent uploads it (none here)
        assert save(0) == [0]
        assert save(1) == [0, 1]
        write_agent_pins(job_dir, node="unit", steps={1: ["peer"]}, lease_s=60)
        assert save(2) == [0, 1, 2]  # keep_memory 1, but the agent is reading step 1
        assert save(3) == [0, 1, 3]
        write_agent_pins(job_dir, node="unit", steps={}, lease_s=60)  # the transfer ended
        assert save(4) == [0, 4]
        # an agent that died mid-transfer pins nothing once its lease ran out
        write_agent_pins(
            job_dir,
            node="unit",
            steps={4: ["persistent"]},
            lease_s=60,
            now=utcnow() - timedelta(seconds=61),
        )
        assert save(5) == [0, 5]
    finally:
        ckpt.close(timeout_s=2)

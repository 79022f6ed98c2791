"""TieredCheckpointer with a real agent: a step number saved again is a new save.

docs/checkpointing.md "Save identity": rank 0's save id goes into every rank's manifest and
commit marker; after a restart from an older step, saving the same step number again
replaces this rank's memory files of the old save, the persistent tier keeps its committed
first save whole, and a restore loads one save, never a mix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash
from agent_helpers import AUTHORITY
from procs import wait_for
from torch import nn
from training import start_cluster

from tierwatch import TieredCheckpointer
from tierwatch.agent.checkpoint.format.layout import METADATA
from tierwatch.agent.checkpoint.format.manifest import load_commit, load_manifest

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    cluster = start_cluster(tmp_path_factory.mktemp("ckpt-save-id"), with_server=False)
    cluster.add_node("save-id-node")
    yield cluster
    cluster.stop()


def make_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(8, 8)
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)}


def train_step(state: dict, seed: int) -> None:
    torch.manual_seed(seed)
    loss = state["model"](torch.randn(4, 8)).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()


def tree(root: Path) -> dict[str, str]:
    return {p.name: xxhash.xxh3_64_hexdigest(p.read_bytes()) for p in sorted(root.iterdir())}


def tier_progress(step_dir: Path) -> dict:
    try:
        return json.loads((step_dir / ".tier-0.json").read_text())
    except (OSError, ValueError):
        return {}


def test_restart_from_an_older_step_saves_that_step_number_as_a_new_save(cluster) -> None:
    url = cluster.nodes["save-id-node"].url
    job = "save-id-restart"
    kw = {"latency_every": 0, "persist_every": 1, "keep_persistent": 5}
    persistent = cluster.persistent_dir / job

    state = make_state(0)
    ckpt = TieredCheckpointer(job, url, **kw, job_credential=AUTHORITY.job_credential(job))
    for step in range(3):
        train_step(state, step)
        ckpt.save(step, state)
    assert ckpt.wait() is True
    first = load_manifest(ckpt.job_dir / "step-2" / "manifest-0.json")
    wait_for(
        lambda: (persistent / "step-2" / METADATA).exists(),
        timeout=30,
        what="step 2 on the persistent tier",
    )
    ckpt.close()
    before = tree(persistent / "step-2")
    older = {p.name for p in persistent.iterdir()}  # the agent skips a superseded upload

    # restart from step 1 and train another way: step 2 is saved again
    again = TieredCheckpointer(job, url, **kw, job_credential=AUTHORITY.job_credential(job))
    resumed = make_state(1)
    assert again.restore(resumed, step=1) == 1
    train_step(resumed, 100)
    again.save(2, resumed)
    assert again.wait() is True
    expected = {k: v.clone() for k, v in resumed["model"].state_dict().items()}
    # the agent does not write the new save under the committed .metadata of the first
    done = wait_for(
        lambda: tier_progress(again.job_dir / "step-2").get("persistent"),
        timeout=30,
        what="the agent's persistent verdict on the second save of step 2",
    )
    assert tree(persistent / "step-2") == before
    assert "committed from save" in done.get("conflict", ""), done
    assert older <= {p.name for p in persistent.iterdir()}  # no older step deleted
    assert (again.job_dir / "step-1" / "commit-0.json").exists()  # the older good step
    second = load_manifest(again.job_dir / "step-2" / "manifest-0.json")
    assert len(first.save_id) == 32
    assert load_commit(again.job_dir / "step-2" / "commit-0.json").save_id == second.save_id
    assert second.save_id > first.save_id  # a new save; ids sort by when rank 0 made them
    again.close()

    # a restore loads the newest save of step 2 (memory), whole
    third = TieredCheckpointer(job, url, **kw, job_credential=AUTHORITY.job_credential(job))
    loaded = make_state(2)
    assert third.restore(loaded) == 2
    got = loaded["model"].state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    third.close()

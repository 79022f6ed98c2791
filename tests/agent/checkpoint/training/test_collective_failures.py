"""A failure or a slow fetch on one rank, around the checkpointer's gloo collectives.

Two real rank processes (gloo, forked warm: ``collective_failure_rank.py``) and one real
agent. A rank that fails before a collective must still enter it with its failure, so the
other rank learns the cause at once instead of waiting ``timeout_s`` (120 s here: the ranks
must be done long before that). A rank whose fetch outlasts ``timeout_s`` (3 s here; the
fetch takes 6 s) must not make the other rank's collectives time out.
docs/checkpointing.md "Collective failures".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from training import Cluster, start_cluster

pytestmark = pytest.mark.e2e

RANK_SCRIPT = Path(__file__).with_name("collective_failure_rank.py")
NODE = "cf-node"
# far below the save test's timeout_s (120 s): a rank left waiting in a collective would
# still be waiting when this runs out
WAIT_S = 45


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cluster = start_cluster(tmp_path_factory.mktemp("collective-failures"), with_server=False)
    cluster.add_node(NODE)
    yield cluster
    cluster.stop()


def run_ranks(cluster: Cluster, mode: str, out: Path) -> list[dict[str, Any]]:
    """Run both ranks of ``mode`` to their end; what each rank wrote."""
    out.mkdir(parents=True, exist_ok=True)
    procs = cluster.launch(
        [mode, str(out)],
        placement=[NODE, NODE],
        log_dir=out / "log",
        script=RANK_SCRIPT,
        job_id="cf-save" if mode == "save" else "cf-restore",
    )
    codes = cluster.wait_ranks(procs, WAIT_S)
    assert codes == [0, 0], "\n".join(p.log_tail(3000) for p in procs)
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="module")
def saves(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return [r["steps"] for r in run_ranks(cluster, "save", tmp_path_factory.mktemp("saves"))]


@pytest.fixture(scope="module")
def restores(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(cluster, "restore", tmp_path_factory.mktemp("restores"))


@pytest.mark.parametrize(
    ("step", "failing", "cause"),
    [
        ("0", 1, "CUDA error: an illegal memory access"),  # rank 1's snapshot copy
        ("1", 1, "No space left on device"),  # rank 1's write (its manifest)
        ("2", 1, "CUDA error: misaligned address"),  # rank 1's staging inside save()
        ("3", 0, "commit decision failed: KeyError"),  # rank 0's decision (before broadcast)
    ],
    ids=["copy", "write", "staging", "decision"],
)
def test_a_failure_on_one_rank_reaches_the_other_with_its_cause(
    saves: list[dict[str, Any]], step: str, failing: int, cause: str
) -> None:
    for result in saves:
        assert result[step]["committed"] is False
    other = saves[1 - failing][step]["failed"]
    assert any(f"rank {failing}" in m and cause in m for m in other), other
    assert any(cause in m for m in saves[failing][step]["failed"]), saves[failing][step]


def test_the_ranks_save_again_after_a_failure_on_one_rank(saves: list[dict[str, Any]]) -> None:
    r0, r1 = saves
    assert "misaligned address" in (r1["2"]["raised"] or "")  # save() raised where it failed
    assert r0["2"]["raised"] is None
    assert r0["4"]["committed"] is True
    assert r1["4"]["committed"] is True


def test_a_fetch_longer_than_the_collective_timeout_still_restores(
    restores: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(restores):
        slow = result["slow"]
        assert slow["error"] is None, (rank, slow)
        assert slow["loaded"] == 0, (rank, slow)
        assert slow["same"] is True, rank
    # the stand-in fetch on rank 1 took 6 s, twice the checkpointer's timeout_s of 3 s
    assert restores[1]["slow"]["seconds"] >= 6.0


def test_a_failed_fetch_on_rank_1_fails_every_ranks_restore_with_its_cause(
    restores: list[dict[str, Any]],
) -> None:
    cause = "s3 GetObject 503"
    for rank, result in enumerate(restores):
        failing = result["failing"]
        assert failing["loaded"] is None, (rank, failing)
        assert "rank 1" in failing["error"], (rank, failing)
        assert cause in failing["error"], (rank, failing)
        assert cause in (failing["report"] or ""), (rank, failing)

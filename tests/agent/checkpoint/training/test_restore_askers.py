"""Who asks the agents what they hold at a restore (pure): one rank per node, and the
persistent tier listed by two nodes only."""

from __future__ import annotations

import pytest

from tierwatch.agent.checkpoint.training.restore import PERSISTENT_LISTERS, askers


def test_one_rank_per_node_asks_and_two_list_the_persistent_tier() -> None:
    nodes = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert askers(nodes) == {0: True, 2: True, 4: False, 6: False}
    assert PERSISTENT_LISTERS == 2


def test_the_lowest_rank_of_each_node_asks_whatever_the_placement() -> None:
    # ranks interleaved over nodes: node a's lowest is 0, b's is 1
    assert askers(["a", "b", "a", "b"]) == {0: True, 1: True}
    # one node: its lowest rank asks, for every tier
    assert askers(["solo"] * 4) == {0: True}


@pytest.mark.parametrize("world", [64, 1024])
def test_the_answers_grow_with_nodes_not_ranks(world: int) -> None:
    nodes = [f"n{r // 8}" for r in range(world)]
    plan = askers(nodes)
    assert len(plan) == world // 8
    assert sum(plan.values()) == PERSISTENT_LISTERS

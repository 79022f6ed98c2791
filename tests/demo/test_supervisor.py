"""The supervisor's placement: ranks stay put on usable nodes, spares fill the gaps."""

from __future__ import annotations

from demo.supervisor import place, usable


def view(state="healthy", isolated=False):
    return {"state": state, "isolated": isolated, "last_seen": "2026-12-01T00:00:00+00:00"}


def test_first_placement_takes_nodes_in_name_order():
    views = {n: view() for n in ("c", "a", "e", "b", "d")}
    assert place(None, views, 4) == ["a", "b", "c", "d"]


def test_an_isolated_node_is_replaced_by_the_spare_and_the_others_stay():
    views = {n: view() for n in ("a", "b", "c", "d", "e")}
    views["a"] = view("unhealthy", isolated=True)
    assert place(["a", "b", "c", "d"], views, 4) == ["e", "b", "c", "d"]


def test_unreachable_and_unhealthy_nodes_are_not_used_even_if_not_isolated():
    views = {n: view() for n in ("a", "b", "c", "d", "e", "f")}
    views["b"] = view("unreachable")
    views["c"] = view("unhealthy")
    assert place(["a", "b", "c", "d"], views, 4) == ["a", "e", "f", "d"]


def test_a_degraded_node_may_run_a_rank():
    assert usable(view("degraded"))
    assert not usable(view("healthy", isolated=True))


def test_too_few_usable_nodes_places_nothing():
    views = {n: view() for n in ("a", "b", "c")}
    views["d"] = view("unhealthy", isolated=True)
    assert place(["a", "b", "c", "d"], views, 4) is None


def test_a_released_node_becomes_a_spare_again():
    views = {n: view() for n in ("a", "b", "c", "d", "e")}
    # e replaced a earlier; a is back (released): nothing moves, a is the spare
    assert place(["e", "b", "c", "d"], views, 4) == ["e", "b", "c", "d"]

"""Which step a restore picks and where each file comes from (pure agreement logic)."""

from __future__ import annotations

import pytest

from tierwatch.agent.checkpoint.format import agreement
from tierwatch.agent.checkpoint.format.manifest import FileEntry, Manifest


def manifest(
    step: int,
    rank: int,
    world: int = 2,
    *,
    node: str | None = None,
    metadata: bool | None = None,
    signature: str = "sig",
    digest: str = "0" * 16,
) -> Manifest:
    files = [FileEntry(name=f"__{rank}_0.distcp", size=10 + rank, xxh3=digest)]
    if metadata if metadata is not None else rank == 0:
        files.append(FileEntry(name=".metadata", size=5, xxh3="1" * 16))
    return Manifest(
        job_id="j",
        step=step,
        rank=rank,
        world_size=world,
        node=node or f"n{rank}",
        files=files,
        signature=signature,
    )


def answer(*entries: tuple[str, str, Manifest]) -> dict:
    return {
        "entries": [
            {
                "tier": t,
                "holder": h,
                "url": f"http://{h}",
                "step": m.step,
                "rank": m.rank,
                "manifest": m.model_dump(mode="json"),
            }
            for t, h, m in entries
        ]
    }


def test_newest_step_with_every_rank_wins() -> None:
    views = agreement.merge_available(
        [
            answer(("memory", "n0", manifest(4, 0)), ("memory", "n0", manifest(5, 0))),
            answer(("memory", "n1", manifest(4, 1))),  # rank 1 of step 5 lost
        ]
    )
    step, reasons = agreement.choose_step(views, 2)
    assert step == 4
    assert "rank(s) [1]" in reasons[5]


def test_nothing_restorable_and_wanted_step() -> None:
    views = agreement.merge_available([answer(("memory", "n0", manifest(3, 0)))])
    assert agreement.choose_step(views, 2) == (None, {3: "no manifest of rank(s) [1]"})
    both = agreement.merge_available(
        [
            answer(
                ("memory", "n0", manifest(3, 0)),
                ("peer", "n0", manifest(3, 1)),
                ("memory", "n0", manifest(7, 0)),
                ("memory", "n1", manifest(7, 1)),
            )
        ]
    )
    assert agreement.choose_step(both, 2, wanted=3)[0] == 3
    assert agreement.choose_step(both, 2, excluded=[7])[0] == 3
    assert agreement.restorable_steps(both, 2) == [3, 7]


@pytest.mark.parametrize(
    ("views_in", "why"),
    [
        ([manifest(1, 0, metadata=False), manifest(1, 1)], "no single rank lists .metadata"),
        (
            [manifest(1, 0, metadata=True), manifest(1, 1, metadata=True)],
            "no single rank lists .metadata",
        ),
        ([manifest(1, 0, signature="a"), manifest(1, 1, signature="b")], "signature"),
        ([manifest(1, 0, world=4), manifest(1, 1, world=4)], "another world size"),
    ],
)
def test_unrestorable_reasons(views_in: list[Manifest], why: str) -> None:
    views = agreement.merge_available([answer(*[("memory", m.node, m) for m in views_in])])
    step, reasons = agreement.choose_step(views, 2)
    assert step is None
    assert why in reasons[1] or why in str(reasons)


def test_conflicting_copies_make_a_step_unrestorable() -> None:
    views = agreement.merge_available(
        [
            answer(("memory", "n0", manifest(2, 0)), ("memory", "n1", manifest(2, 1))),
            answer(("peer", "n0", manifest(2, 1, digest="f" * 16))),
        ]
    )
    assert agreement.choose_step(views, 2)[0] is None
    assert "differ" in agreement.restorable(views[2], 2)


def test_bad_entries_are_ignored() -> None:
    views = agreement.merge_available(
        [None, {"entries": [{"manifest": {"not": "one"}}, {"tier": "memory"}]}]
    )
    assert views == {}


def test_sources_order_local_memory_first_persistent_last() -> None:
    m1 = manifest(9, 1, node="n1")
    views = agreement.merge_available(
        [
            answer(("persistent", "persistent", m1)),
            answer(("peer", "n2", m1)),
            answer(("memory", "n1", m1)),
            answer(("peer", "n0", m1)),
            answer(("memory", "n0", manifest(9, 0, node="n0"))),
        ]
    )
    req = agreement.stage_request(views[9], ["__1_0.distcp"], node="n0")
    holders = [(s["tier"], s["holder"]) for s in req[0]["sources"]]
    assert holders == [
        ("peer", "n0"),
        ("memory", "n1"),
        ("peer", "n2"),
        ("persistent", "persistent"),
    ]
    assert req[0]["size"] == 11
    assert req[0]["sources"][0]["src"] == "n1"
    with pytest.raises(KeyError):
        agreement.stage_request(views[9], ["__7_0.distcp"], node="n0")
    assert agreement.all_file_names(views[9]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

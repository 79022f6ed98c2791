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
    save_id: str = "",
    fences: list[tuple[int, int]] | None = None,
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
        fences=fences or [],
        **({"save_id": save_id} if save_id else {}),  # none: a legacy manifest
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


# -- save identity (docs/checkpointing.md "Save identity") ---------------------------------
OLD = "0190000000aa" + "a" * 20  # the first save of a step number
NEW = "0190000000bb" + "b" * 20  # the same step number saved again (later)


def _files_of(view: agreement.StepView) -> set[tuple[int, str]]:
    return {(r, m.save_id) for r, m in view.manifests.items()}


@pytest.mark.parametrize(
    ("entries", "restorable", "saves", "why"),
    [
        pytest.param(
            [
                ("memory", "n0", manifest(5, 0, save_id=NEW, digest="2" * 16)),
                ("memory", "n1", manifest(5, 1, save_id=NEW, digest="2" * 16)),
                ("persistent", "persistent", manifest(5, 0, save_id=OLD)),
                ("persistent", "persistent", manifest(5, 1, save_id=OLD)),
            ],
            True,
            {(0, NEW), (1, NEW)},
            None,
            id="both-complete-the-newer-save-wins",
        ),
        pytest.param(
            [
                ("memory", "n0", manifest(5, 0, save_id=NEW, digest="2" * 16)),
                ("persistent", "persistent", manifest(5, 0, save_id=OLD)),
                ("persistent", "persistent", manifest(5, 1, save_id=OLD)),
            ],
            True,
            {(0, OLD), (1, OLD)},
            None,
            id="the-newer-incomplete-the-older-complete-save-wins-whole",
        ),
        pytest.param(
            [
                ("memory", "n0", manifest(5, 0, save_id=NEW, digest="2" * 16)),
                ("peer", "n0", manifest(5, 1, save_id=OLD)),
            ],
            False,
            {(0, NEW), (1, OLD)},
            "2 saves of this step",
            id="one-rank-of-each-save-is-never-mixed",
        ),
        pytest.param(
            [
                ("memory", "n0", manifest(5, 0, save_id=NEW, digest="2" * 16)),
                ("memory", "n1", manifest(5, 1, save_id=NEW, digest="2" * 16)),
                ("persistent", "persistent", manifest(5, 0)),
                ("persistent", "persistent", manifest(5, 1)),
            ],
            True,
            {(0, NEW), (1, NEW)},
            None,
            id="a-new-save-over-a-legacy-one",
        ),
        pytest.param(
            [
                ("memory", "n0", manifest(5, 0, save_id=NEW)),
                ("memory", "n1", manifest(5, 1, save_id=NEW)),
                ("peer", "n0", manifest(5, 1, save_id=NEW, digest="3" * 16)),
            ],
            False,
            {(0, NEW), (1, NEW)},
            "copies on n0 and elsewhere differ",
            id="two-copies-of-one-save-differ",
        ),
        pytest.param(
            [
                # a late replication of the abandoned timeline (step 6 before rollback 3 to
                # step 5) next to the new timeline's step 6
                ("peer", "n0", manifest(6, 0, save_id=OLD)),
                ("peer", "n0", manifest(6, 1, save_id=OLD)),
                ("memory", "n0", manifest(6, 0, save_id=NEW, fences=[(3, 5)], digest="2" * 16)),
                ("memory", "n1", manifest(6, 1, save_id=NEW, fences=[(3, 5)], digest="2" * 16)),
            ],
            True,
            {(0, NEW), (1, NEW)},
            None,
            id="late-copy-of-an-abandoned-timeline-is-dead",
        ),
    ],
)
def test_saves_of_one_step_number(entries, restorable, saves, why) -> None:
    step = entries[0][2].step
    views = agreement.merge_available([answer(*entries)])
    view = views[step]
    assert _files_of(view) == saves
    got = agreement.restorable(view, 2)
    assert (got is None) is restorable, got
    if why is not None:
        assert why in (got or "")
    # every source of a rank holds that rank's manifest of the chosen save
    by_tier = {(t, h, m.rank, m.save_id) for t, h, m in entries}
    for rank, sources in view.sources.items():
        for s in sources:
            assert (s.tier, s.holder, rank, view.manifests[rank].save_id) in by_tier


P0 = manifest(6, 0, save_id=OLD)
P1 = manifest(6, 1, save_id=OLD)


@pytest.mark.parametrize(
    ("incoming", "present", "committed", "fences", "why"),
    [
        pytest.param(manifest(6, 1, save_id=OLD), [P0, P1], [0, 1], [], None, id="retry"),
        pytest.param(manifest(6, 1, save_id=NEW), [], [], [], None, id="empty-folder"),
        pytest.param(
            manifest(6, 1, save_id=NEW),
            [P0, P1],
            [0, 1],
            [],
            "committed from save 0190000000aa…",
            id="a-second-save-over-a-committed-one",
        ),
        pytest.param(
            manifest(6, 1, save_id=NEW),
            [P0],
            [0],
            [],
            "committed from save 0190000000aa… (rank 0)",
            id="another-rank-committed",
        ),
        pytest.param(
            manifest(6, 1, save_id=NEW), [P0, P1], [], [], None, id="newer-over-uncommitted"
        ),
        pytest.param(
            manifest(6, 1, save_id=OLD),
            [manifest(6, 0, save_id=NEW)],
            [],
            [],
            "a newer save 0190000000bb… of step 6 is here",
            id="older-over-newer-uncommitted",
        ),
        pytest.param(
            manifest(6, 1),
            [P0],
            [0],
            [],
            "committed from save 0190000000aa…",
            id="legacy-over-committed",
        ),
        pytest.param(
            manifest(6, 1, save_id=NEW),
            [manifest(6, 0)],
            [0],
            [],
            "committed from save legacy",
            id="new-over-committed-legacy",
        ),
        pytest.param(
            manifest(6, 1, save_id=OLD),
            [manifest(6, 0, save_id=NEW, fences=[(3, 5)])],
            [0],
            [],
            "restore request 3 rolled back to step 5: a late transfer from an abandoned",
            id="dead-by-a-manifest-there",
        ),
        pytest.param(
            manifest(6, 1, save_id=OLD),
            [],
            [],
            [(3, 5)],
            "abandoned timeline",
            id="dead-by-the-node-timeline",
        ),
        pytest.param(
            manifest(5, 1, save_id=OLD), [], [], [(3, 5)], None, id="the-fence-step-itself-lives"
        ),
    ],
)
def test_transfer_refusal(incoming, present, committed, fences, why) -> None:
    got = agreement.transfer_refusal(incoming, present, committed_ranks=committed, fences=fences)
    if why is None:
        assert got is None
    else:
        assert got is not None
        assert why in got

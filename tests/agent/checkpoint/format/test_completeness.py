"""The one step-completeness rule (pure, table-tested), and that restore and the CLI use it."""

from __future__ import annotations

import pytest

from tierwatch.agent.checkpoint.format import agreement
from tierwatch.agent.checkpoint.format.completeness import disagreement, step_problem
from tierwatch.agent.checkpoint.format.layout import METADATA, shard_name
from tierwatch.agent.checkpoint.format.manifest import FileEntry, Manifest


def m(
    rank: int,
    *,
    world: int = 2,
    signature: str = "sig",
    metadata: bool | None = None,
    fences: list[tuple[int, int]] | None = None,
    save_id: str = "",
) -> Manifest:
    files = [FileEntry(name=shard_name(rank), size=10, xxh3="0" * 16)]
    if rank == 0 if metadata is None else metadata:
        files.append(FileEntry(name=METADATA, size=5, xxh3="1" * 16))
    return Manifest(
        job_id="j",
        step=1,
        rank=rank,
        world_size=world,
        node=f"n{rank}",
        files=files,
        signature=signature,
        fences=fences or [],
        **({"save_id": save_id} if save_id else {}),  # none: a legacy manifest
    )


ALL = {shard_name(0), shard_name(1), METADATA}
A = "0190000000aa" + "a" * 20  # two saves of one step number (new_save_id's shape)
B = "0190000000bb" + "b" * 20


@pytest.mark.parametrize(
    ("manifests", "kwargs", "why"),
    [
        pytest.param({0: m(0), 1: m(1)}, {}, None, id="complete"),
        pytest.param(
            {0: m(0), 1: m(1)}, {"world_size": 2, "present": ALL}, None, id="complete-with-files"
        ),
        pytest.param({}, {}, "no manifests", id="none"),
        pytest.param(
            {0: m(0), 1: m(1)},
            {"conflicts": ["rank 1: copies differ"]},
            "rank 1: copies differ",
            id="conflict-first",
        ),
        pytest.param(
            {0: m(0), 1: m(1, world=3)},
            {},
            "ranks disagree on the world size (2: rank(s) [0]; 3: rank(s) [1])",
            id="world-sizes-disagree",
        ),
        pytest.param(
            {0: m(0), 1: m(1, signature="other")},
            {},
            "ranks disagree on the state signature (2 signatures)",
            id="signatures",
        ),
        pytest.param(
            {0: m(0), 1: m(1)},
            {"dead": "rolled away: restore request 3 went back to step 0"},
            "rolled away: restore request 3 went back to step 0",
            id="dead",
        ),
        pytest.param(
            {0: m(0, fences=[(7, 0)]), 1: m(1)}, {}, "different timelines", id="timelines"
        ),
        pytest.param(
            {0: m(0, save_id=A), 1: m(1, save_id=A)}, {"present": ALL}, None, id="one-save"
        ),
        pytest.param(
            {0: m(0, save_id=B), 1: m(1, save_id=A)},
            {},
            "come from 2 saves of this step (0190000000aa…: rank(s) [1]; 0190000000bb…: "
            "rank(s) [0])",
            id="two-saves",
        ),
        pytest.param(
            {0: m(0, save_id=A), 1: m(1)},
            {"world_size": 2},
            "come from 2 saves of this step (legacy: rank(s) [1]; 0190000000aa…: rank(s) [0])",
            id="legacy-and-new-saves",
        ),
        pytest.param(
            {0: m(0, save_id=B, fences=[(7, 0)]), 1: m(1, save_id=A)},
            {},
            "different timelines",
            id="timelines-before-saves",
        ),
        pytest.param({0: m(0)}, {}, "no manifest of rank(s) [1]", id="a-rank-missing"),
        pytest.param(
            {0: m(0), 1: m(1)},
            {"world_size": 4},
            "no manifest of rank(s) [2, 3]",
            id="fewer-ranks-than-the-job",
        ),
        pytest.param(
            {0: m(0, world=4), 1: m(1, world=4)},
            {"world_size": 2},
            "saved at another world size",
            id="another-world-size",
        ),
        pytest.param(
            {0: m(0), 1: m(1), 2: m(2)},
            {},
            "saved at another world size",
            id="a-rank-beyond-the-world-size",
        ),
        pytest.param(
            {0: m(0, metadata=False), 1: m(1)},
            {},
            "no single rank lists .metadata",
            id="no-metadata",
        ),
        pytest.param(
            {0: m(0), 1: m(1, metadata=True)},
            {},
            "no single rank lists .metadata",
            id="two-metadata",
        ),
        pytest.param(
            {0: m(0), 1: m(1)},
            {"present": {shard_name(0), shard_name(1)}},
            "files missing: .metadata",
            id="metadata-not-written-yet",
        ),
    ],
)
def test_step_problem(manifests, kwargs, why):
    got = step_problem(manifests, **kwargs)
    if why is None:
        assert got is None
    else:
        assert got is not None
        assert why in got


def test_disagreement_is_about_world_size_and_signature_only():
    assert disagreement({0: m(0), 1: m(1)}) is None
    assert disagreement({0: m(0, fences=[(7, 0)]), 1: m(1)}) is None  # one checkpoint
    assert "world size" in (disagreement({0: m(0, world=3), 1: m(1)}) or "")


def test_restore_agreement_uses_the_same_rule():
    view = agreement.StepView(1, manifests={0: m(0)})
    assert agreement.restorable(view, 2) == step_problem({0: m(0)}, 2)
    view.conflicts.append("rank 0: copies on n1 and elsewhere differ")
    assert agreement.restorable(view, 2) == "rank 0: copies on n1 and elsewhere differ"


def test_ckpt_cli_uses_the_same_rule():
    from tierwatch.agent.checkpoint.tierstore.cli import StepCopy

    copy = StepCopy("memory", "this node", 1, manifests={0: m(0)}, names={shard_name(0), METADATA})
    assert copy.complete() == (False, step_problem({0: m(0)}, present=copy.names))
    copy.manifests[1] = m(1)
    copy.names.add(shard_name(1))
    assert copy.complete() == (True, "complete")


def test_new_save_ids_are_distinct_time_ordered_hex():
    from tierwatch.agent.checkpoint.format.manifest import new_save_id

    ids = [new_save_id(now_ms=1000), new_save_id(now_ms=1000), new_save_id(now_ms=1001)]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == 3
    assert ids[2] > max(ids[:2])  # a later save sorts after, whatever its random bits
    assert new_save_id() > new_save_id(now_ms=1001)
    assert m(0, save_id=ids[0]).save_key < m(0, save_id=ids[2]).save_key
    assert m(0, save_id=ids[2]).save_key < m(0, fences=[(1, 0)]).save_key  # timeline first


def test_a_legacy_manifest_parses_as_the_legacy_save():
    import json

    from tierwatch.agent.checkpoint.format.manifest import LEGACY_SAVE_ID, read_manifest

    data = m(0).model_dump(mode="json")
    del data["save_id"]  # written before save ids existed
    assert read_manifest(json.dumps(data)).save_id == LEGACY_SAVE_ID == ""
    with pytest.raises(ValueError, match="not a valid manifest"):
        read_manifest(json.dumps({**data, "save_id": "not-hex"}))

"""Names tierwatch accepts for jobs, nodes and step files (nothing can escape its folder)."""

from __future__ import annotations

import pytest

from tierwatch.agent.checkpoint.format.layout import (
    LayoutError,
    check_file_name,
    check_job_id,
    check_node_name,
    parse_step_dirname,
)


@pytest.mark.parametrize(
    "bad", ["", "../x", "a/b", ".hidden", "-x", "x" * 129, "abc\n", "a b", "jöb", "a\x00b", 7]
)
def test_bad_job_and_node_names(bad) -> None:
    with pytest.raises(LayoutError):
        check_job_id(bad)
    with pytest.raises(LayoutError):
        check_node_name(bad)


@pytest.mark.parametrize(
    "bad",
    [
        "__0_0.distcp\n",
        "../.metadata",
        "manifest-0.json\n",
        "x.distcp",
        ".metadata.tmp",
        "__a_0.distcp",
    ],
)
def test_bad_file_names(bad) -> None:
    with pytest.raises(LayoutError):
        check_file_name(bad)


def test_good_names() -> None:
    assert check_job_id("gpt-small.v2_1") == "gpt-small.v2_1"
    for name in (".metadata", "__3_1.distcp", "manifest-12.json", "commit-0.json"):
        assert check_file_name(name) == name
    assert parse_step_dirname("step-42") == 42
    assert parse_step_dirname("step-42\n") is None
    assert parse_step_dirname("step-x") is None

"""The packaged XID catalog: content, parsing, action descriptions."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tierwatch.server.fleet import xid_catalog
from tierwatch.server.fleet.xid_catalog import XidInfo, describe_action, load_catalog, lookup

PACKAGED_CSV = Path(xid_catalog.__file__).parent.parent / "data" / "xid_catalog.csv"


@pytest.mark.parametrize(
    ("xid", "mnemonic", "action", "fatal"),
    [
        (79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "RESTART_BM", True),
        (48, "ROBUST_CHANNEL_GPU_ECC_DBE", "WORKFLOW_XID_48", True),
        (95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "RESET_GPU", True),
        (74, "NVLINK_ERROR", "WORKFLOW_NVLINK_ERR", True),
        (13, "ROBUST_CHANNEL_GR_EXCEPTION", "RESTART_APP", False),
        (31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "RESTART_APP", False),
        (43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "IGNORE", False),
        (45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "WORKFLOW_XID_45", False),
        (94, "ROBUST_CHANNEL_CONTAINED_ERROR", "RESTART_APP", False),
        (154, "GPU_RECOVERY_ACTION_CHANGED", "FOLLOW_LINKED_XID", False),
    ],
)
def test_lookup_known_codes(xid: int, mnemonic: str, action: str, fatal: bool) -> None:
    assert lookup(xid) == XidInfo(xid=xid, mnemonic=mnemonic, action=action, fatal=fatal)


@pytest.mark.parametrize("xid", [0, 99999, -1])
def test_lookup_unknown_code_is_none(xid: int) -> None:
    assert lookup(xid) is None


def test_catalog_matches_packaged_csv_and_is_cached() -> None:
    with PACKAGED_CSV.open(encoding="utf-8", newline="") as fh:
        rows = list(csv.DictReader(fh))
    catalog = load_catalog()
    assert len(catalog) == len(rows) == 161
    for row in rows:
        info = catalog[int(row["xid"])]
        assert (info.mnemonic, info.action) == (row["mnemonic"], row["immediate_action"])
        assert info.fatal is (row["severity"] == "FATAL")
    assert load_catalog() is catalog


def test_every_catalog_action_has_a_specific_description() -> None:
    generic = describe_action("NO_SUCH_ACTION")
    for info in load_catalog().values():
        text = describe_action(info.action)
        assert text, info.action
        assert text != generic, info.action
        if info.action.startswith("WORKFLOW_"):
            assert info.action in text


@pytest.mark.parametrize(
    ("action", "fragment"),
    [
        ("RESET_GPU", "Reset the GPU"),
        ("RESTART_BM", "Reboot"),
        ("RESTART_APP", "Restart the application"),
        ("IGNORE", "no action"),
        ("WORKFLOW_XID_48", "WORKFLOW_XID_48"),
        ("SOMETHING_NEW", "Unknown action code SOMETHING_NEW"),
    ],
)
def test_describe_action(action: str, fragment: str) -> None:
    assert fragment in describe_action(action)


def test_parse_catalog_reads_rows() -> None:
    text = (
        "xid,mnemonic,immediate_action,severity\n"
        "7,SEVEN,RESET_GPU,FATAL\n"
        "8,EIGHT,IGNORE,NONFATAL\n\n"
    )
    assert xid_catalog.parse_catalog(text.splitlines()) == {
        7: XidInfo(7, "SEVEN", "RESET_GPU", True),
        8: XidInfo(8, "EIGHT", "IGNORE", False),
    }


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "header"),
        ("xid,mnemonic,action,severity\n1,A,IGNORE,FATAL", "header"),
        ("xid,mnemonic,immediate_action,severity\n1,A,IGNORE", "expected 4 fields"),
        ("xid,mnemonic,immediate_action,severity\nx1,A,IGNORE,FATAL", "not an integer"),
        ("xid,mnemonic,immediate_action,severity\n1,A,IGNORE,FATAL\n1,B,IGNORE,FATAL", "twice"),
        ("xid,mnemonic,immediate_action,severity\n1,A,IGNORE,SEVERE", "FATAL or NONFATAL"),
        ("xid,mnemonic,immediate_action,severity\n1,A,,FATAL", "empty immediate_action"),
    ],
)
def test_parse_catalog_rejects_malformed(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        xid_catalog.parse_catalog(text.splitlines())


def test_load_catalog_falls_back_to_source_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(package: str) -> None:
        raise ModuleNotFoundError(package)

    monkeypatch.setattr(xid_catalog.resources, "files", not_installed)
    load_catalog.cache_clear()
    try:
        assert load_catalog()[79].action == "RESTART_BM"
    finally:
        load_catalog.cache_clear()

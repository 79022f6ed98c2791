"""NVIDIA's XID catalog: what each XID code means and what to do about it.

The table is ``data/xid_catalog.csv`` inside the ``tierwatch.server`` package (columns
``xid,mnemonic,immediate_action,severity``), taken from NVIDIA's public "XID Errors" catalog
as tabulated by NVIDIA's open-source GPU health monitor (see ``app/data/README.md``). It is
read once per process and cached; lookups are pure after that.
"""

from __future__ import annotations

import csv
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

CATALOG_FILENAME = "xid_catalog.csv"
CATALOG_COLUMNS = ("xid", "mnemonic", "immediate_action", "severity")
_SEVERITIES = {"FATAL": True, "NONFATAL": False}

# Immediate-action codes of the catalog, with what an operator should do for each.
CATALOG_ACTIONS: dict[str, str] = {
    "RESTART_APP": "Restart the application that hit the error; the GPU itself is fine.",
    "RESET_GPU": "Reset the GPU (nvidia-smi -r) after draining its workloads.",
    "RESTART_BM": "Reboot the bare-metal node; a GPU reset is not enough.",
    "RESTART_VM": "Restart the virtual machine that owns the GPU.",
    "CHECK_MECHANICALS": "Check the physical installation: seating, power cables, cooling.",
    "UPDATE_SWFW": "Update software or firmware (driver, VBIOS) to a supported version.",
    "IGNORE": "Informational; no action needed on its own.",
    "CHECK_UVM": ("Check the Unified Memory (nvidia-uvm) driver and the application's use of it."),
    "FOLLOW_LINKED_XID": "Act as the XID this event refers to recommends.",
    "UNEXPECTED_ERR_REPORT_ISSUE": (
        "Not expected in normal operation: collect an nvidia-bug-report and report it to "
        "NVIDIA; reset the GPU if it persists."
    ),
}
WORKFLOW_PREFIX = "WORKFLOW_"
WORKFLOW_DESCRIPTION = (
    "Follow the multi-step diagnosis the NVIDIA XID catalog describes for this code ({name})."
)


@dataclass(frozen=True)
class XidInfo:
    """One catalog entry.

    Attributes:
        xid: The XID code as the driver logs it.
        mnemonic: The catalog's symbolic name, e.g. ``ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS``.
        action: The catalog's immediate action code, e.g. ``RESET_GPU`` (see
            :data:`CATALOG_ACTIONS`; ``WORKFLOW_*`` codes name a multi-step diagnosis).
        fatal: True when the catalog classes the code ``FATAL``.
    """

    xid: int
    mnemonic: str
    action: str
    fatal: bool


def describe_action(action: str) -> str:
    """Human description of a catalog immediate-action code.

    Args:
        action: An action code such as ``RESET_GPU`` or ``WORKFLOW_XID_48``.

    Returns:
        One sentence for an operator; codes this module does not know are returned with a
        generic note rather than raising, so a newer catalog never breaks the dashboard.
    """
    if action in CATALOG_ACTIONS:
        return CATALOG_ACTIONS[action]
    if action.startswith(WORKFLOW_PREFIX):
        return WORKFLOW_DESCRIPTION.format(name=action)
    return f"Unknown action code {action}: see NVIDIA's XID catalog."


def parse_catalog(lines: Iterable[str]) -> dict[int, XidInfo]:
    """Parse catalog CSV text into a table keyed by XID code.

    Args:
        lines: The CSV's lines, header first (columns ``xid,mnemonic,immediate_action,severity``).

    Returns:
        XID code -> :class:`XidInfo`.

    Raises:
        ValueError: The header differs from :data:`CATALOG_COLUMNS`, a row has the wrong
            number of fields, an XID is not a non-negative integer or appears twice, or a
            severity is neither ``FATAL`` nor ``NONFATAL``.
    """
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != CATALOG_COLUMNS:
        raise ValueError(f"XID catalog header must be {','.join(CATALOG_COLUMNS)}, got {header}")
    table: dict[int, XidInfo] = {}
    for line_no, row in enumerate(reader, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        if len(row) != len(CATALOG_COLUMNS):
            raise ValueError(f"XID catalog line {line_no}: expected 4 fields, got {len(row)}")
        raw_xid, mnemonic, action, severity = (cell.strip() for cell in row)
        if not raw_xid.isdigit():
            raise ValueError(f"XID catalog line {line_no}: xid {raw_xid!r} is not an integer")
        xid = int(raw_xid)
        if xid in table:
            raise ValueError(f"XID catalog line {line_no}: xid {xid} appears twice")
        if severity not in _SEVERITIES:
            raise ValueError(
                f"XID catalog line {line_no}: severity {severity!r} is not FATAL or NONFATAL"
            )
        if not action:
            raise ValueError(f"XID catalog line {line_no}: empty immediate_action")
        table[xid] = XidInfo(xid=xid, mnemonic=mnemonic, action=action, fatal=_SEVERITIES[severity])
    return table


def _read_catalog_text() -> str:
    try:
        resource = resources.files("tierwatch.server") / "data" / CATALOG_FILENAME
        if resource.is_file():
            return resource.read_text(encoding="utf-8")
    except ModuleNotFoundError:
        pass  # running from a source tree that is not installed: use the file beside us
    return (Path(__file__).parent.parent / "data" / CATALOG_FILENAME).read_text(encoding="utf-8")


@functools.cache
def load_catalog() -> dict[int, XidInfo]:
    """The packaged XID catalog, read once per process.

    Returns:
        XID code -> :class:`XidInfo`. The same dict is returned on every call: do not mutate.

    Raises:
        FileNotFoundError: The packaged CSV is missing (a broken install).
        ValueError: The CSV is malformed (see :func:`parse_catalog`).
    """
    return parse_catalog(_read_catalog_text().splitlines())


def lookup(xid: int) -> XidInfo | None:
    """The catalog entry for one XID code, or None when the catalog does not list it."""
    return load_catalog().get(xid)

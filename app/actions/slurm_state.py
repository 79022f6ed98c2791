"""A Slurm node's state as ``scontrol -o show node`` prints it, and what tierwatch may do
to it (pure: no process is run here; :class:`tierwatch.server.actions.drivers.SlurmDriver`
runs scontrol).

tierwatch marks its own drains: the reason it sets starts with ``tierwatch:``. Release resumes
a node only when the drain still carries that mark and no reboot is pending, so it never
undoes a drain that an admin, NHC or a maintenance script made, before or after tierwatch's.

Sources: scontrol(1) ("NODE STATE" and ``update … State=DRAIN|RESUME Reason=``; a reason is
shown with the user and time that set it, ``Reason=<text> [<user>@<time>]``) and
sinfo(1)/scontrol(1) node state flags (``DRAIN``, ``NOT_RESPONDING``, ``REBOOT_REQUESTED``,
``REBOOT_ISSUED``; ``NextState=`` after ``scontrol reboot … nextstate=``), as printed by
Slurm 22.05.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

MARK = "tierwatch:"
"""The prefix of every drain reason tierwatch sets; release resumes only drains that carry it."""

REBOOT_FLAGS = frozenset({"REBOOT_REQUESTED", "REBOOT_ISSUED"})
"""Flags of a node with a reboot pending (``scontrol reboot``): never resumed by tierwatch."""

DRAIN_BASES = frozenset({"DRAIN", "DRAINED", "DRAINING"})
"""Base states that mean drained in some Slurm versions' output (22.05 prints ``IDLE+DRAIN``)."""

_REASON = re.compile(r"(?:^|\s)Reason=(?P<text>.*?)\s*\[(?P<by>[^@\]\s]*)@(?P<at>[^\]]*)\]")
_REASON_BARE = re.compile(r"(?:^|\s)Reason=(?P<text>.*)$")


class SlurmParseError(ValueError):
    """``scontrol show node`` printed something that is not one node's record."""


@dataclass(frozen=True)
class SlurmNode:
    """One node's state in Slurm.

    Attributes:
        name: ``NodeName``.
        base: the base state, e.g. ``IDLE``, ``ALLOCATED``, ``MIXED``, ``DOWN``.
        flags: the state flags after the base, e.g. ``{"DRAIN", "NOT_RESPONDING"}``.
        reason: the reason text as set (without scontrol's ``[user@time]`` suffix); "" if none.
        reason_by: the user who set the reason ("" unknown).
        reason_at: when, as Slurm prints it ("" unknown).
        next_state: ``NextState`` (e.g. ``RESUME`` after a ``scontrol reboot nextstate=resume``),
            "" when none.
    """

    name: str
    base: str
    flags: frozenset[str]
    reason: str = ""
    reason_by: str = ""
    reason_at: str = ""
    next_state: str = ""

    @property
    def state(self) -> str:
        """``BASE+FLAG+…`` in Slurm's order-insensitive spelling (flags sorted)."""
        return "+".join([self.base, *sorted(self.flags)])

    @property
    def drained(self) -> bool:
        """New jobs cannot start: the DRAIN flag (or a drained base state) is set."""
        return "DRAIN" in self.flags or self.base in DRAIN_BASES

    @property
    def marked(self) -> bool:
        """The reason is tierwatch's own (starts with :data:`MARK`)."""
        return self.reason.startswith(MARK)

    @property
    def reboot_pending(self) -> bool:
        """A ``scontrol reboot`` is requested or issued and not yet done."""
        return bool(self.flags & REBOOT_FLAGS) or self.base.startswith("REBOOT")

    @property
    def responding(self) -> bool:
        """slurmctld hears from the node's slurmd (not DOWN, no NOT_RESPONDING flag)."""
        return self.base != "DOWN" and "NOT_RESPONDING" not in self.flags

    def describe(self) -> str:
        """One line for an operator, e.g. ``IDLE+DRAIN, reason 'admin: bad fan' (root, …)``."""
        text = self.state
        if self.reason:
            who = ", ".join(x for x in (self.reason_by, self.reason_at) if x)
            text += f", reason {self.reason!r}" + (f" ({who})" if who else "")
        if self.next_state:
            text += f", NextState={self.next_state}"
        return text

    def as_detail(self) -> dict[str, Any]:
        """The state as plain JSON for the audit log."""
        return {
            "state": self.state,
            "reason": self.reason,
            "reason_by": self.reason_by,
            "reason_at": self.reason_at,
            "next_state": self.next_state,
            "responding": self.responding,
            "marked": self.marked,
        }


def parse_show_node(text: str) -> SlurmNode:
    """Parse ``scontrol -o show node <name>`` (one line of ``Key=Value`` fields).

    ``Reason`` may hold spaces, so it is read from its key to scontrol's ``[user@time]``
    suffix (or to the end of the line); every other field used has no spaces.

    Raises:
        SlurmParseError: no ``NodeName=`` or ``State=`` field, or more than one node.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    records = [line for line in lines if line.lstrip().startswith("NodeName=")]
    if len(records) != 1:
        shown = " ".join(text.split())[:200]
        raise SlurmParseError(
            f"expected one node record from scontrol -o show node, got {len(records)}: {shown!r}"
        )
    line = records[0]
    fields: dict[str, str] = {}
    head = _REASON_BARE.split(line, maxsplit=1)[0]
    for token in head.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    if "State" not in fields:
        raise SlurmParseError(f"no State= field in {line[:200]!r}")
    base, *flags = fields["State"].split("+")
    reason, by, at = "", "", ""
    if m := _REASON.search(line):
        reason, by, at = m["text"], m["by"], m["at"]
    elif m := _REASON_BARE.search(line):
        reason = m["text"].strip()
    if reason == "(null)":
        reason = ""
    next_state = fields.get("NextState", "")
    return SlurmNode(
        name=fields["NodeName"],
        base=base.rstrip("*~#!%$@^-"),  # sinfo-style suffix symbols, if any
        flags=frozenset(f for f in flags if f),
        reason=reason,
        reason_by=by,
        reason_at=at,
        next_state="" if next_state in ("", "(null)", "None") else next_state,
    )


@dataclass(frozen=True)
class Plan:
    """What to do to a node.

    Attributes:
        action: ``drain``, ``resume`` or ``none`` (leave Slurm as it is).
        note: what was found and, for ``none``, what is left in place and why.
    """

    action: Literal["drain", "resume", "none"]
    note: str


def plan_isolate(node: SlurmNode) -> Plan:
    """Drain unless the node is already drained.

    A drain by someone else is never overwritten: its reason is what the admin (or NHC) needs
    to see, and keeping it means tierwatch's release will not resume the node.
    """
    if node.drained and node.marked:
        return Plan("none", "already drained by tierwatch")
    if node.drained:
        return Plan(
            "none",
            f"already drained by someone else ({node.describe()}): left as it is; tierwatch "
            "records its isolation, and its release will not resume this drain",
        )
    return Plan("drain", f"was {node.describe()}")


def plan_release(node: SlurmNode) -> Plan:
    """Resume only tierwatch's own drain, and only with no reboot pending."""
    if not node.drained:
        return Plan("none", f"not drained ({node.describe()}): nothing to resume")
    if not node.marked:
        return Plan(
            "none",
            f"drained by someone else ({node.describe()}): left in place; only tierwatch's "
            "isolation is released",
        )
    if node.reboot_pending:
        return Plan(
            "none",
            f"a reboot is pending ({node.describe()}): left drained; only tierwatch's isolation "
            "is released (Slurm applies NextState after the reboot)",
        )
    return Plan("resume", f"was {node.describe()}")


def drain_reason(reason: str) -> str:
    """The reason tierwatch gives Slurm: :data:`MARK` + the isolation's reason, on one line."""
    text = " ".join(reason.split())
    return f"{MARK} {text or 'isolated'}"

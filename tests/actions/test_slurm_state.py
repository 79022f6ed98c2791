"""slurm_state: parsing ``scontrol -o show node`` and the drain/resume decisions (pure).

The lines are what Slurm 22.05.8 (Debian's slurm-wlm) printed in the real-Slurm tests."""

from __future__ import annotations

import pytest

from tierwatch.server.actions.slurm_state import (
    SlurmNode,
    SlurmParseError,
    drain_reason,
    parse_show_node,
    plan_isolate,
    plan_release,
)

IDLE = (
    "NodeName=vm Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 CPUEfctv=1 CPUTot=1 CPULoad=0.40 "
    "AvailableFeatures=(null) ActiveFeatures=(null) Gres=(null) NodeAddr=127.0.0.1 "
    "NodeHostName=vm Version=22.05.8 OS=Linux 6.18.44-fc-v1098 #1 SMP PREEMPT_DYNAMIC @0  "
    "RealMemory=1 AllocMem=0 FreeMem=21412 Sockets=1 Boards=1 State=IDLE ThreadsPerCore=1 "
    "TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=main  BootTime=2026-12-02T18:34:28 "
    "SlurmdStartTime=2026-12-02T18:38:22 LastBusyTime=2026-12-02T18:38:22 "
    "CfgTRES=cpu=1,mem=1M,billing=1 AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0 "
    "ExtSensorsJoules=n/s ExtSensorsWatts=0 ExtSensorsTemp=n/s\n"
)
REBOOT = (
    "NodeName=node-b CoresPerSocket=1  CPUAlloc=0 CPUEfctv=1 CPUTot=1 CPULoad=0.43 "
    "NodeAddr=127.0.0.1 NodeHostName=node-b  RealMemory=1 State=DOWN+DRAIN+REBOOT_ISSUED "
    "ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A NextState=RESUME "
    "Partitions=main  BootTime=None SlurmdStartTime=None CfgTRES=cpu=1,mem=1M,billing=1 "
    "AllocTRES= CapWatts=n/a ExtSensorsTemp=n/s Reason=tierwatch: y [root@2026-12-02T18:38:47]\n"
)


def node(state: str, reason: str = "", next_state: str = "") -> SlurmNode:
    base, *flags = state.split("+")
    return SlurmNode("n1", base, frozenset(flags), reason, "root", "t", next_state)


def test_parse_idle_node() -> None:
    n = parse_show_node(IDLE)
    assert (n.name, n.state, n.reason, n.next_state) == ("vm", "IDLE", "", "")
    assert n.responding
    assert not n.drained
    assert not n.reboot_pending


def test_parse_reason_with_spaces_user_time_and_next_state() -> None:
    n = parse_show_node(REBOOT)
    assert n.state == "DOWN+DRAIN+REBOOT_ISSUED"
    assert (n.reason, n.reason_by, n.reason_at) == ("tierwatch: y", "root", "2026-12-02T18:38:47")
    assert n.next_state == "RESUME"
    assert n.drained
    assert n.marked
    assert n.reboot_pending
    assert not n.responding


def test_parse_admin_reason_keeps_its_text() -> None:
    line = "NodeName=g1 State=MIXED+DRAIN Reason=admin: bad fan; see RT#42 [alice@2026-12-01T09:00]"
    n = parse_show_node(line)
    assert n.reason == "admin: bad fan; see RT#42"
    assert n.reason_by == "alice"
    assert not n.marked


@pytest.mark.parametrize(
    "text",
    ["", "Node g9 not found\n", IDLE + IDLE, "NodeName=g1 CPUTot=4\n"],
    ids=["empty", "not-found", "two-nodes", "no-state"],
)
def test_parse_refuses_what_is_not_one_node(text: str) -> None:
    with pytest.raises(SlurmParseError):
        parse_show_node(text)


@pytest.mark.parametrize(
    ("state", "reason", "action"),
    [
        ("IDLE", "", "drain"),
        ("ALLOCATED", "", "drain"),
        ("DOWN+NOT_RESPONDING", "Not responding", "drain"),
        ("IDLE+DRAIN", "tierwatch: xid 79", "none"),
        ("IDLE+DRAIN", "admin: bad fan", "none"),
        ("MIXED+DRAIN+REBOOT_REQUESTED", "fw upgrade", "none"),
    ],
)
def test_plan_isolate(state: str, reason: str, action: str) -> None:
    assert plan_isolate(node(state, reason)).action == action


def test_isolate_of_someone_elses_drain_says_it_is_left() -> None:
    note = plan_isolate(node("IDLE+DRAIN", "admin: bad fan")).note
    assert "someone else" in note
    assert "admin: bad fan" in note


@pytest.mark.parametrize(
    ("state", "reason", "next_state", "action", "says"),
    [
        ("IDLE+DRAIN", "tierwatch: xid 79", "", "resume", "was IDLE+DRAIN"),
        ("ALLOCATED+DRAIN", "tierwatch: xid 79", "", "resume", "was"),
        ("IDLE", "", "", "none", "nothing to resume"),
        ("IDLE+DRAIN", "admin: bad fan", "", "none", "someone else"),
        ("IDLE+DRAIN", "NHC: ECC errors", "", "none", "someone else"),
        ("IDLE+DRAIN+REBOOT_REQUESTED", "tierwatch: xid 79", "RESUME", "none", "reboot"),
        ("DOWN+DRAIN+REBOOT_ISSUED", "tierwatch: xid 79", "RESUME", "none", "reboot"),
    ],
)
def test_plan_release(state: str, reason: str, next_state: str, action: str, says: str) -> None:
    plan = plan_release(node(state, reason, next_state))
    assert plan.action == action
    assert says in plan.note


def test_drain_reason_is_marked_and_on_one_line() -> None:
    assert drain_reason("XID 79\non GPU 3") == "tierwatch: XID 79 on GPU 3"
    assert drain_reason("  ") == "tierwatch: isolated"

"""Table tests of the health rules (tierwatch.server.fleet.rules)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierwatch.agent.protocol import (
    THROTTLE_GPU_IDLE,
    THROTTLE_HW_POWER_BRAKE_SLOWDOWN,
    THROTTLE_HW_SLOWDOWN,
    THROTTLE_HW_THERMAL_SLOWDOWN,
    THROTTLE_SW_POWER_CAP,
    THROTTLE_SW_THERMAL_SLOWDOWN,
    GpuSample,
)
from tierwatch.server.fleet import rules
from tierwatch.server.fleet.rules import (
    Finding,
    HealthThresholds,
    Reason,
    XidRecord,
    evaluate_gpu,
    is_unreachable,
    merge_reasons,
    node_state,
    rule_ecc_uncorrectable,
    rule_nvlink,
    rule_pcie_replay,
    rule_row_remap,
    rule_stale_telemetry,
    rule_straggler,
    rule_temperature,
    rule_throttling,
    rule_xid,
    straggler_ranks,
)

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
TH = HealthThresholds()


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def sample(index: int = 0, t: float = 0.0, **fields: Any) -> GpuSample:
    return GpuSample(index=index, ts=at(t), **fields)


def summary(findings: list[Finding]) -> list[tuple[str, str, int | None, str, str]]:
    return [(f.rule, f.severity, f.gpu, f.key, f.action) for f in findings]


# --- temperature ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temp", "slowdown", "expected"),
    [
        # NVML gives no threshold: assume 90 °C, degraded from 85 °C.
        (84.9, None, None),
        (85.0, None, "degraded"),
        (89.9, None, "degraded"),
        (90.0, None, "unhealthy"),
        (97.0, None, "unhealthy"),
        # The sample's own slowdown threshold wins: 87 °C, degraded from 82 °C.
        (81.9, 87.0, None),
        (82.0, 87.0, "degraded"),
        (86.9, 87.0, "degraded"),
        (87.0, 87.0, "unhealthy"),
        (89.0, 87.0, "unhealthy"),
        # A higher NVML threshold makes 90 °C merely degraded.
        (90.0, 93.0, "degraded"),
        (None, 87.0, None),
    ],
)
def test_temperature(temp: float | None, slowdown: float | None, expected: str | None) -> None:
    cur = sample(index=3, t=5, temperature_c=temp, slowdown_temp_c=slowdown)
    findings = rule_temperature(cur, TH)
    if expected is None:
        assert findings == []
        return
    assert summary(findings) == [("temperature", expected, 3, "", "CHECK_COOLING")]
    (f,) = findings
    assert f.at == at(5)
    assert f.evidence["temperature_c"] == temp
    assert f.evidence["slowdown_temp_c"] == (slowdown if slowdown is not None else 90.0)
    assert f.evidence["slowdown_source"] == ("nvml" if slowdown is not None else "default")


@pytest.mark.parametrize(
    ("temp", "expected"),
    [(74.9, None), (75.0, "degraded"), (84.9, "degraded"), (85.0, "unhealthy")],
)
def test_temperature_custom_thresholds(temp: float, expected: str | None) -> None:
    th = HealthThresholds(default_slowdown_temp_c=85.0, temp_degraded_margin_c=10.0)
    findings = rule_temperature(sample(temperature_c=temp), th)
    assert [f.severity for f in findings] == ([expected] if expected else [])


# --- uncorrectable ECC ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prev_count", "cur_count", "increase"),
    [
        ("no prev", 0, None),
        ("no prev", 5, None),  # first sample is a baseline
        (0, 0, None),
        (2, 2, None),
        (0, 1, 1),
        (3, 5, 2),
        (5, 0, None),  # decrease: GPU reset or driver reload
        (None, 4, None),
        (4, None, None),
    ],
)
def test_ecc_uncorrectable(prev_count: Any, cur_count: int | None, increase: int | None) -> None:
    prev = None if prev_count == "no prev" else sample(index=1, ecc_dbe_volatile=prev_count)
    cur = sample(index=1, t=5, ecc_dbe_volatile=cur_count)
    findings = rule_ecc_uncorrectable(prev, cur)
    if increase is None:
        assert findings == []
        return
    assert summary(findings) == [("ecc_uncorrectable", "unhealthy", 1, "", "RESET_GPU")]
    assert findings[0].evidence == {
        "ecc_dbe_volatile": cur_count,
        "previous": prev_count,
        "increase": increase,
    }
    assert findings[0].at == at(5)


@pytest.mark.parametrize(
    "call",
    [
        lambda p, c: rule_ecc_uncorrectable(p, c),
        lambda p, c: rule_pcie_replay(p, c, TH),
        lambda p, c: rule_nvlink(p, c, TH),
        lambda p, c: evaluate_gpu(p, c, TH),
    ],
)
def test_pair_rules_refuse_samples_of_different_gpus(call: Any) -> None:
    with pytest.raises(ValueError, match="different GPUs"):
        call(sample(index=0), sample(index=1, t=5))


# --- row remapping -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pending", "failure", "expected"),
    [
        (None, None, []),
        (False, False, []),
        (True, False, [("row_remap", "degraded", 2, "", "RESET_GPU_TO_REMAP")]),
        (False, True, [("row_remap", "unhealthy", 2, "", "REPLACE_GPU")]),
        (True, True, [("row_remap", "unhealthy", 2, "", "REPLACE_GPU")]),
        (None, True, [("row_remap", "unhealthy", 2, "", "REPLACE_GPU")]),
    ],
)
def test_row_remap(pending: bool | None, failure: bool | None, expected: list[tuple]) -> None:
    cur = sample(index=2, row_remap_pending=pending, row_remap_failure=failure)
    assert summary(rule_row_remap(cur)) == expected


# --- XID -----------------------------------------------------------------------------------------

NOW = at(10_000)


def xid(code: int, seconds_before_now: float, gpu: int = 0) -> XidRecord:
    return XidRecord(gpu=gpu, xid=code, ts=NOW - timedelta(seconds=seconds_before_now))


@pytest.mark.parametrize(
    ("code", "action"),
    [
        (79, "RESTART_BM"),
        (48, "WORKFLOW_XID_48"),
        (95, "RESET_GPU"),
        (74, "WORKFLOW_NVLINK_ERR"),
        (119, "RESET_GPU"),
    ],
)
def test_xid_fatal_code_is_unhealthy_on_first_occurrence(code: int, action: str) -> None:
    findings = rule_xid([xid(code, 1, gpu=3)], [], TH, NOW)
    assert summary(findings) == [("xid", "unhealthy", 3, str(code), action)]
    assert findings[0].at == NOW - timedelta(seconds=1)
    assert findings[0].evidence["count"] == 1


def test_xid_message_names_code_mnemonic_and_gpu() -> None:
    (f,) = rule_xid([xid(79, 0, gpu=3)], [], TH, NOW)
    assert f.message == "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS on GPU 3"


APP_LEVEL = [
    (13, "RESTART_APP"),
    (31, "RESTART_APP"),
    (43, "IGNORE"),
    (45, "WORKFLOW_XID_45"),
    (94, "RESTART_APP"),
]


@pytest.mark.parametrize(("code", "action"), APP_LEVEL)
@pytest.mark.parametrize(
    ("new_ages", "recent_ages", "repeated"),
    [
        ([5], [], False),  # one occurrence: an event, no reason
        ([5], [300], True),  # repeat within the 600 s window
        ([5, 4], [], True),  # both in one batch
        ([5], [599.9], True),  # just inside the window
        ([5], [600], False),  # exactly at now - window: not after it
        ([5], [3600], False),  # repeat long outside the window
        ([700], [650], False),  # a late replay: both outside the window
    ],
)
def test_xid_app_level_codes_degrade_only_when_repeated(
    code: int, action: str, new_ages: list[float], recent_ages: list[float], repeated: bool
) -> None:
    new = [xid(code, a, gpu=1) for a in new_ages]
    recent = [xid(code, a, gpu=1) for a in recent_ages]
    findings = rule_xid(new, recent, TH, NOW)
    if not repeated:
        assert findings == []
        return
    assert summary(findings) == [("xid_repeat", "degraded", 1, str(code), action)]
    assert findings[0].evidence["count_in_window"] == len(new_ages) + len(recent_ages)


def test_xid_repeat_counts_per_gpu() -> None:
    findings = rule_xid([xid(13, 5, gpu=0)], [xid(13, 60, gpu=1)], TH, NOW)
    assert findings == []


def test_xid_repeat_counts_per_code() -> None:
    assert rule_xid([xid(13, 5)], [xid(31, 60)], TH, NOW) == []


def test_xid_repeat_count_threshold_from_settings() -> None:
    th = HealthThresholds(xid_repeat_count=3, xid_repeat_window_s=60)
    assert rule_xid([xid(13, 1)], [xid(13, 30)], th, NOW) == []
    findings = rule_xid([xid(13, 1)], [xid(13, 30), xid(13, 59)], th, NOW)
    assert summary(findings) == [("xid_repeat", "degraded", 0, "13", "RESTART_APP")]
    assert findings[0].message == (
        "XID 13 ROBUST_CHANNEL_GR_EXCEPTION on GPU 0: 3 occurrences within 60 s"
    )


def test_xid_new_and_recent_overlap_counts_once() -> None:
    event = xid(13, 5)
    assert rule_xid([event], [event], TH, NOW) == []


def test_xid_every_occurrence_counted() -> None:
    first, second = xid(79, 30, gpu=2), xid(79, 10, gpu=2)
    findings = rule_xid([second, first], [], TH, NOW)
    assert summary(findings) == [("xid", "unhealthy", 2, "79", "RESTART_BM")]
    (f,) = findings
    assert f.evidence["count"] == 2
    assert f.evidence["occurrences"] == [first.ts.isoformat(), second.ts.isoformat()]
    assert f.at == second.ts
    assert f.message.endswith("(2 occurrences)")


def test_xid_identical_occurrences_in_one_batch_both_count() -> None:
    event = xid(13, 5)
    findings = rule_xid([event, event], [event], TH, NOW)
    assert summary(findings) == [("xid_repeat", "degraded", 0, "13", "RESTART_APP")]
    assert findings[0].evidence["count"] == 2
    assert findings[0].evidence["count_in_window"] == 2


def test_xid_unknown_code_is_degraded_at_once() -> None:
    findings = rule_xid([xid(99999, 5, gpu=4)], [], TH, NOW)
    assert summary(findings) == [("xid", "degraded", 4, "99999", "UNEXPECTED_ERR_REPORT_ISSUE")]
    assert "not in NVIDIA's catalog" in findings[0].message


def test_xid_no_new_events_no_findings() -> None:
    assert rule_xid([], [xid(79, 5), xid(13, 5), xid(13, 6)], TH, NOW) == []


def test_xid_mixed_batch_one_finding_per_gpu_and_code_sorted() -> None:
    new = [xid(13, 1, gpu=1), xid(79, 2, gpu=1), xid(95, 1, gpu=0), xid(13, 3, gpu=1)]
    assert summary(rule_xid(new, [], TH, NOW)) == [
        ("xid", "unhealthy", 0, "95", "RESET_GPU"),
        ("xid_repeat", "degraded", 1, "13", "RESTART_APP"),
        ("xid", "unhealthy", 1, "79", "RESTART_BM"),
    ]


@pytest.mark.parametrize(
    ("values", "acked", "expected"),
    [
        # fatal by the catalog: unhealthy with the catalog's action, as a live occurrence
        ([(3, 79)], {}, [("xid_before_start", "unhealthy", 3, "79", "RESTART_BM")]),
        ([(0, 48)], {0: None}, [("xid_before_start", "unhealthy", 0, "48", "WORKFLOW_XID_48")]),
        ([(1, 95)], {}, [("xid_before_start", "unhealthy", 1, "95", "RESET_GPU")]),
        # non-fatal, zero and unknown values raise nothing (no time: no repeat to count)
        ([(1, 13)], {}, []),
        ([(1, 94)], {}, []),
        ([(1, 0)], {}, []),
        ([(1, 99999)], {}, []),
        # the value already acknowledged on that GPU raises nothing; another GPU's ack or
        # another code does not hide it
        ([(3, 79)], {3: 79}, []),
        ([(3, 79)], {2: 79}, [("xid_before_start", "unhealthy", 3, "79", "RESTART_BM")]),
        ([(3, 79)], {3: 48}, [("xid_before_start", "unhealthy", 3, "79", "RESTART_BM")]),
        # one finding per (GPU, code), ordered
        (
            [(3, 79), (0, 79), (3, 79)],
            {},
            [
                ("xid_before_start", "unhealthy", 0, "79", "RESTART_BM"),
                ("xid_before_start", "unhealthy", 3, "79", "RESTART_BM"),
            ],
        ),
    ],
)
def test_rule_xid_before_start(values, acked, expected):
    records = [XidRecord(gpu=g, xid=x, ts=at(i)) for i, (g, x) in enumerate(values)]
    found = rules.rule_xid_before_start(records, acked, TH)
    assert summary(found) == expected
    for f in found:
        assert f.message.startswith(f"XID {f.key} ")
        assert f"on GPU {f.gpu}, seen before the agent started" in f.message
        assert f"DCGM_FI_DEV_XID_ERRORS showed {f.key}" in f.message
        assert f.evidence["before_start"] is True
        assert f.at == max(r.ts for r in records if (r.gpu, str(r.xid)) == (f.gpu, f.key))


def test_xid_before_start_reason_stays_until_acknowledged():
    """No quiet period: neither a later evaluation nor a long time clears it."""
    [finding] = rules.rule_xid_before_start([XidRecord(gpu=3, xid=79, ts=at(0))], {}, TH)
    [reason] = merge_reasons([], [finding], at(0), TH)
    for evaluated in (None, set(rules.GPU_SAMPLE_RULES), set(rules.RULES)):
        assert merge_reasons([reason], [], at(30 * 86400), TH, evaluated) == [reason]
    assert node_state([reason], unreachable=False) == "unhealthy"


# --- throttling ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mask", "temp", "action"),
    [
        (None, 60.0, None),
        (0, 60.0, None),
        (THROTTLE_GPU_IDLE, 30.0, None),
        (THROTTLE_SW_POWER_CAP, 60.0, None),  # power cap alone is normal operation
        (THROTTLE_SW_THERMAL_SLOWDOWN, 80.0, None),
        (THROTTLE_HW_SLOWDOWN, 60.0, "INVESTIGATE_POWER"),
        (THROTTLE_HW_SLOWDOWN, 86.0, "CHECK_COOLING"),  # hot: the slowdown is thermal
        (THROTTLE_HW_SLOWDOWN, None, "INVESTIGATE_POWER"),
        (THROTTLE_HW_THERMAL_SLOWDOWN, 60.0, "CHECK_COOLING"),
        (THROTTLE_HW_POWER_BRAKE_SLOWDOWN, 60.0, "INVESTIGATE_POWER"),
        (THROTTLE_HW_THERMAL_SLOWDOWN | THROTTLE_HW_POWER_BRAKE_SLOWDOWN, 60.0, "CHECK_COOLING"),
        (THROTTLE_SW_POWER_CAP | THROTTLE_HW_SLOWDOWN, 60.0, "INVESTIGATE_POWER"),
    ],
)
def test_throttling(mask: int | None, temp: float | None, action: str | None) -> None:
    cur = sample(index=5, throttle_reasons=mask, temperature_c=temp)
    findings = rule_throttling(cur, TH)
    if action is None:
        assert findings == []
        return
    assert summary(findings) == [("throttling", "degraded", 5, "", action)]
    assert findings[0].evidence["throttle_reasons"] == mask


def test_throttling_message_names_active_hardware_reasons() -> None:
    cur = sample(
        throttle_reasons=THROTTLE_SW_POWER_CAP
        | THROTTLE_HW_SLOWDOWN
        | THROTTLE_HW_POWER_BRAKE_SLOWDOWN
    )
    (f,) = rule_throttling(cur)
    assert f.message == ("GPU 0 clocks throttled by hardware: hw_slowdown, hw_power_brake_slowdown")
    assert f.evidence["active_reasons"] == [
        "sw_power_cap",
        "hw_slowdown",
        "hw_power_brake_slowdown",
    ]


# --- PCIe replay, NVLink -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prev_count", "cur_count", "dt", "rate"),
    [
        (0, 10, 60, None),  # exactly 10/min: not over the threshold
        (0, 11, 60, 11.0),
        (100, 112, 10, 12.0),  # a burst within 10 s, over the 60 s minimum window
        (100, 102, 10, None),  # 2 in 10 s: 2/min over the minimum window, not 12/min
        (7, 8, 1, None),  # one replay between 1 s reports is not 60/min
        (0, 0, 60, None),
        (500, 3, 60, None),  # counter reset
        (None, 50, 60, None),
        (0, None, 60, None),
        (0, 50, 0, None),  # same reading again
        (0, 50, -5, None),  # out of order
    ],
)
def test_pcie_replay(
    prev_count: int | None, cur_count: int | None, dt: float, rate: float | None
) -> None:
    prev = sample(index=6, t=0, pcie_replay_count=prev_count)
    cur = sample(index=6, t=dt, pcie_replay_count=cur_count)
    findings = rule_pcie_replay(prev, cur, TH)
    if rate is None:
        assert findings == []
        return
    assert summary(findings) == [("pcie_replay", "degraded", 6, "", "INVESTIGATE_LINK")]
    assert findings[0].evidence["rate_per_min"] == pytest.approx(rate)
    assert findings[0].evidence["increase"] == cur_count - prev_count


def test_pcie_replay_without_prev_is_nothing() -> None:
    assert rule_pcie_replay(None, sample(pcie_replay_count=10_000), TH) == []


def test_pcie_replay_threshold_from_settings() -> None:
    th = HealthThresholds(pcie_replay_per_min=1.0, rate_min_window_s=0)
    prev, cur = sample(pcie_replay_count=0), sample(t=30, pcie_replay_count=1)
    assert rule_pcie_replay(prev, cur, th)[0].evidence["rate_per_min"] == pytest.approx(2.0)
    # with the default 60 s minimum window the same single replay is 1/min: not over
    assert rule_pcie_replay(prev, cur, HealthThresholds(pcie_replay_per_min=1.0)) == []


NV = ("nvlink_crc_errors", "nvlink_replay_errors", "nvlink_recovery_errors")


@pytest.mark.parametrize(
    ("before", "after", "dt", "rate"),
    [
        ((0, 0, 0), (5, 5, 1), 60, 11.0),
        ((0, 0, 0), (5, 5, 0), 60, None),  # exactly 10/min
        ((0, 0, 0), (0, 0, 11), 60, 11.0),
        ((10, 10, 10), (14, 14, 14), 30, 12.0),
        ((10, 10, 10), (12, 12, 12), 30, None),  # 6 in 30 s: 6/min over the 60 s window
        ((0, 0, 0), (0, 0, 0), 60, None),
        ((100, 0, 0), (90, 50, 50), 60, None),  # one counter reset: no rate this time
        ((None, None, None), (50, 50, 50), 60, None),
        ((0, None, 0), (6, 99, 6), 60, 12.0),  # unknown counters are left out
        ((0, 0, 0), (50, 50, 50), 0, None),
    ],
)
def test_nvlink(before: tuple, after: tuple, dt: float, rate: float | None) -> None:
    prev = sample(index=7, t=0, **dict(zip(NV, before, strict=True)))
    cur = sample(index=7, t=dt, **dict(zip(NV, after, strict=True)))
    findings = rule_nvlink(prev, cur, TH)
    if rate is None:
        assert findings == []
        return
    assert summary(findings) == [("nvlink", "degraded", 7, "", "INVESTIGATE_LINK")]
    assert findings[0].evidence["rate_per_min"] == pytest.approx(rate)


def test_nvlink_without_prev_is_nothing() -> None:
    assert rule_nvlink(None, sample(nvlink_crc_errors=10_000), TH) == []


# --- stale telemetry, heartbeat ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sample_age", "node_age", "stale"),
    [
        (0.0, 0.0, False),
        (14.9, 0.0, False),
        (15.0, 0.0, True),  # 3 x 5 s
        (60.0, 2.0, True),
        ("missing", 0.0, True),
        (60.0, 14.9, True),
        (60.0, 15.0, False),  # the node itself is silent: unreachable, not stale
        ("missing", 30.0, False),
        (-10.0, 0.0, False),  # sample from the future (clock skew)
    ],
)
def test_stale_telemetry(sample_age: Any, node_age: float, stale: bool) -> None:
    now = at(1000)
    cur = None if sample_age == "missing" else sample(index=2, t=1000 - sample_age)
    findings = rule_stale_telemetry(cur, 2, now - timedelta(seconds=node_age), 5.0, TH, now)
    if not stale:
        assert findings == []
        return
    assert summary(findings) == [("stale_telemetry", "degraded", 2, "", "CHECK_AGENT")]
    assert findings[0].at == now
    assert findings[0].evidence["limit_s"] == 15.0
    assert findings[0].evidence["sample_age_s"] == (None if cur is None else sample_age)


def test_stale_telemetry_uses_stale_intervals_setting() -> None:
    th = HealthThresholds(stale_intervals=10)
    now = at(1000)
    assert rule_stale_telemetry(sample(t=960), 0, now, 5.0, th, now) == []
    assert len(rule_stale_telemetry(sample(t=950), 0, now, 5.0, th, now)) == 1


def test_stale_telemetry_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="interval"):
        rule_stale_telemetry(None, 0, T0, 0.0, TH, T0)
    with pytest.raises(ValueError, match="GPU 1"):
        rule_stale_telemetry(sample(index=1), 0, T0, 5.0, TH, T0)


@pytest.mark.parametrize(
    ("age", "interval", "missed", "expected"),
    [
        (None, 5.0, 3.0, True),  # never reported
        (0.0, 5.0, 3.0, False),
        (14.9, 5.0, 3.0, False),
        (15.0, 5.0, 3.0, True),
        (100.0, 5.0, 3.0, True),
        (29.9, 10.0, 3.0, False),
        (30.0, 10.0, 3.0, True),
        (9.9, 5.0, 2.0, False),
        (10.0, 5.0, 2.0, True),
        (-5.0, 5.0, 3.0, False),  # reported "in the future" (clock skew)
    ],
)
def test_is_unreachable(age: float | None, interval: float, missed: float, expected: bool) -> None:
    th = HealthThresholds(heartbeat_missed_intervals=missed)
    now = at(500)
    last_seen = None if age is None else now - timedelta(seconds=age)
    assert is_unreachable(last_seen, interval, now, th) is expected


def test_is_unreachable_rejects_non_positive_interval() -> None:
    with pytest.raises(ValueError, match="interval"):
        is_unreachable(T0, 0, T0, TH)


# --- straggler -----------------------------------------------------------------------------------


def job(world: int, slow: dict[int, list[float]], base: float = 10.0, n: int = 5) -> dict:
    series = {rank: [base] * n for rank in range(world)}
    series.update(slow)
    return series


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize(
    ("slow_series", "flagged"),
    [
        ([10, 10, 31, 35, 40], True),  # 3 consecutive > 3 x 10 ms
        ([31, 35, 40, 50, 60], True),
        ([10, 10, 10, 31, 35], False),  # only 2 slow so far
        ([10, 31, 35, 40, 10], False),  # 3 slow, then normal again
        ([10, 31, 10, 35, 40], False),  # not consecutive
        ([10, 10, 30, 30, 30], False),  # exactly 3 x the median is not over it
        ([10, 10, 30.1, 30.1, 30.1], True),
    ],
)
def test_straggler_ranks(world: int, slow_series: list[float], flagged: bool) -> None:
    slow_rank = world - 1
    result = straggler_ranks(job(world, {slow_rank: slow_series}), TH)
    if not flagged:
        assert result == {}
        return
    assert list(result) == [slow_rank]
    assert result[slow_rank] == {
        "latency_ms": slow_series[-3:],
        "median_ms": [10.0, 10.0, 10.0],
        "factor": 3.0,
        "consecutive": 3,
        "ranks": world,
    }


def test_straggler_median_is_over_the_other_ranks() -> None:
    # Two stragglers do not hide each other: each one's median is over the 5 other ranks.
    series = job(6, {4: [40.0] * 5, 5: [100.0] * 5})
    assert sorted(straggler_ranks(series, TH)) == [4, 5]


def test_straggler_median_per_position() -> None:
    # The job slowed down as a whole: rank 1 is not a straggler although its last samples are
    # over 3 x the job's earlier median.
    series = {0: [10, 10, 40, 40, 40], 1: [10, 10, 100, 100, 100], 2: [10, 10, 40, 40, 40]}
    assert straggler_ranks(series, TH) == {}


@pytest.mark.parametrize(
    ("series", "expected"),
    [
        ({}, []),
        ({0: [100.0, 100.0, 100.0]}, []),  # one rank: nothing to compare with
        ({0: [10.0, 10.0, 10.0], 1: [50.0, 50.0]}, []),  # fewer than 3 samples
        ({0: [10.0, 10.0], 1: [50.0, 50.0, 50.0]}, []),  # other rank lacks a position
        ({0: [0.0, 0.0, 0.0], 1: [5.0, 5.0, 5.0]}, []),  # median 0 ms: no verdict
        ({0: [10.0] * 3, 1: [10.0] * 10, 2: [50.0] * 4}, [2]),  # different lengths
    ],
)
def test_straggler_edge_cases(series: dict[int, list[float]], expected: list[int]) -> None:
    assert sorted(straggler_ranks(series, TH)) == expected


def test_straggler_settings() -> None:
    th = HealthThresholds(straggler_factor=2.0, straggler_consecutive=2)
    series = job(4, {1: [10, 10, 10, 25, 25]})
    assert list(straggler_ranks(series, th)) == [1]
    assert straggler_ranks(series, TH) == {}


def test_rule_straggler_finding() -> None:
    evidence = straggler_ranks(job(2, {1: [40.0] * 3}), TH)[1]
    f = rule_straggler(1, "llama-7b", evidence, at(9))
    assert (f.rule, f.severity, f.gpu, f.key, f.action) == (
        "straggler",
        "degraded",
        None,
        "llama-7b:1",
        "INVESTIGATE_STRAGGLER",
    )
    assert f.at == at(9)
    assert f.evidence["job_id"] == "llama-7b"
    assert f.evidence["rank"] == 1
    assert f.evidence["latency_ms"] == [40.0, 40.0, 40.0]
    assert f.message.startswith("rank 1 of job llama-7b is a straggler")


# --- evaluate_gpu --------------------------------------------------------------------------------


def test_evaluate_gpu_healthy_sample_has_no_findings() -> None:
    prev = sample(temperature_c=60, ecc_dbe_volatile=0, pcie_replay_count=0)
    cur = sample(
        t=5,
        temperature_c=61,
        ecc_dbe_volatile=0,
        pcie_replay_count=0,
        throttle_reasons=THROTTLE_SW_POWER_CAP,
        row_remap_pending=False,
    )
    assert evaluate_gpu(prev, cur, TH) == []


def test_evaluate_gpu_runs_every_sample_rule() -> None:
    prev = sample(
        index=1,
        t=0,
        ecc_dbe_volatile=0,
        pcie_replay_count=0,
        **dict(zip(NV, (0, 0, 0), strict=True)),
    )
    cur = sample(
        index=1,
        t=60,
        temperature_c=91,
        ecc_dbe_volatile=1,
        row_remap_pending=True,
        throttle_reasons=THROTTLE_HW_THERMAL_SLOWDOWN,
        pcie_replay_count=100,
        **dict(zip(NV, (20, 0, 0), strict=True)),
    )
    findings = evaluate_gpu(prev, cur, TH)
    assert summary(findings) == [
        ("temperature", "unhealthy", 1, "", "CHECK_COOLING"),
        ("ecc_uncorrectable", "unhealthy", 1, "", "RESET_GPU"),
        ("row_remap", "degraded", 1, "", "RESET_GPU_TO_REMAP"),
        ("throttling", "degraded", 1, "", "CHECK_COOLING"),
        ("pcie_replay", "degraded", 1, "", "INVESTIGATE_LINK"),
        ("nvlink", "degraded", 1, "", "INVESTIGATE_LINK"),
    ]
    assert {f.rule for f in findings} == rules.GPU_SAMPLE_RULES
    json.dumps([f.evidence for f in findings])  # evidence is JSON-serialisable


def test_evaluate_gpu_first_sample() -> None:
    cur = sample(ecc_dbe_volatile=3, pcie_replay_count=10**6, temperature_c=50)
    assert evaluate_gpu(None, cur, TH) == []


# --- merge_reasons -------------------------------------------------------------------------------


def finding(
    rule: str = "temperature",
    severity: str = "degraded",
    gpu: int | None = 0,
    key: str = "",
    t: float = 0.0,
    message: str = "m",
    action: str = "A",
) -> Finding:
    return Finding(
        rule=rule,
        severity=severity,
        gpu=gpu,
        key=key,
        message=message,
        action=action,
        evidence={"t": t},
        at=at(t),
    )


def reason(
    rule: str = "temperature",
    severity: str = "degraded",
    gpu: int | None = 0,
    key: str = "",
    first: float = 0.0,
    last: float = 0.0,
) -> Reason:
    return Reason(
        rule=rule,
        severity=severity,
        gpu=gpu,
        key=key,
        message="old",
        action="OLD",
        evidence={},
        first_seen=at(first),
        last_seen=at(last),
    )


def test_merge_new_finding_creates_reason() -> None:
    (r,) = merge_reasons([], [finding(t=10, message="hot", action="CHECK_COOLING")], at(10), TH)
    assert r == Reason(
        "temperature", "degraded", 0, "", "hot", "CHECK_COOLING", {"t": 10.0}, at(10), at(10)
    )
    assert r.identity == ("temperature", 0, "")


def test_merge_upsert_keeps_first_seen_and_updates_the_rest() -> None:
    previous = [reason(first=0, last=50)]
    (r,) = merge_reasons(
        previous, [finding(severity="unhealthy", t=60, message="hotter")], at(60), TH
    )
    assert (r.first_seen, r.last_seen) == (at(0), at(60))
    assert (r.severity, r.message, r.action, r.evidence) == (
        "unhealthy",
        "hotter",
        "A",
        {"t": 60.0},
    )


def test_merge_older_replayed_finding_does_not_overwrite() -> None:
    previous = [reason(first=100, last=200)]
    (r,) = merge_reasons(previous, [finding(t=50, message="replay")], at(210), TH)
    assert (r.first_seen, r.last_seen, r.message) == (at(50), at(200), "old")


def test_merge_several_findings_of_one_identity() -> None:
    (r,) = merge_reasons([], [finding(t=20, message="b"), finding(t=10, message="a")], at(20), TH)
    assert (r.first_seen, r.last_seen, r.message) == (at(10), at(20), "b")


@pytest.mark.parametrize(
    ("rule", "age", "kept"),
    [
        ("temperature", 29.9, True),
        ("temperature", 30.0, False),
        ("throttling", 29.9, True),
        ("throttling", 30.0, False),
        ("xid", 3599.0, True),
        ("xid", 3600.0, False),
        ("ecc_uncorrectable", 3599.0, True),
        ("ecc_uncorrectable", 3600.0, False),
        ("xid_repeat", 1799.0, True),
        ("xid_repeat", 1800.0, False),
        ("pcie_replay", 299.0, True),
        ("pcie_replay", 300.0, False),
        ("nvlink", 299.0, True),
        ("nvlink", 300.0, False),
        ("straggler", 59.0, True),
        ("straggler", 60.0, False),
        ("row_remap", 0.0, False),  # level rule without a hold: clears at once
        ("stale_telemetry", 0.0, False),
        ("not_a_rule", 0.0, False),
    ],
)
def test_merge_quiet_period_per_rule(rule: str, age: float, kept: bool) -> None:
    previous = [reason(rule=rule, first=0, last=100)]
    merged = merge_reasons(previous, [], at(100 + age), TH)
    assert merged == (previous if kept else [])


def test_merge_quiet_period_from_settings_keeps_other_defaults() -> None:
    th = HealthThresholds(quiet_period_s={"temperature": 120})
    assert th.quiet_period("temperature") == 120
    assert th.quiet_period("xid") == 3600
    previous = [reason(rule="temperature", last=0), reason(rule="throttling", last=0)]
    assert [r.rule for r in merge_reasons(previous, [], at(100), th)] == ["temperature"]


def test_merge_unevaluated_level_rule_is_carried_over() -> None:
    previous = [reason(rule="row_remap", last=0), reason(rule="temperature", last=0)]
    merged = merge_reasons(previous, [], at(1000), TH, evaluated_rules={"xid", "xid_repeat"})
    assert merged == previous


def test_merge_event_rules_expire_even_when_not_evaluated() -> None:
    previous = [reason(rule="xid", key="79", last=0), reason(rule="straggler", gpu=None, key="j:1")]
    merged = merge_reasons(previous, [], at(4000), TH, evaluated_rules=set(rules.GPU_SAMPLE_RULES))
    assert merged == []


def test_merge_different_identities_are_separate_reasons() -> None:
    findings = [
        finding(rule="xid", key="79", gpu=1, severity="unhealthy"),
        finding(rule="xid", key="48", gpu=1, severity="unhealthy"),
        finding(rule="xid", key="79", gpu=2, severity="unhealthy"),
        finding(rule="straggler", key="job:3", gpu=None),
        finding(rule="temperature", gpu=0),
    ]
    merged = merge_reasons([], findings, at(0), TH)
    assert [r.identity for r in merged] == [
        ("xid", 1, "48"),
        ("xid", 1, "79"),
        ("xid", 2, "79"),
        ("straggler", None, "job:3"),
        ("temperature", 0, ""),
    ]


# --- node_state, settings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("severities", "unreachable", "state"),
    [
        ([], False, "healthy"),
        (["degraded"], False, "degraded"),
        (["degraded", "degraded"], False, "degraded"),
        (["degraded", "unhealthy", "degraded"], False, "unhealthy"),
        (["unhealthy"], False, "unhealthy"),
        ([], True, "unreachable"),
        (["unhealthy"], True, "unreachable"),
    ],
)
def test_node_state(severities: list[str], unreachable: bool, state: str) -> None:
    reasons = [reason(severity=s, gpu=i) for i, s in enumerate(severities)]
    assert node_state(reasons, unreachable=unreachable) == state


def test_state_order() -> None:
    assert sorted(rules.STATE_ORDER, key=rules.STATE_ORDER.__getitem__) == [
        "healthy",
        "degraded",
        "unhealthy",
    ]


@pytest.mark.parametrize(
    "bad",
    [
        {"quiet_period_s": {"xid": -1}},
        {"xid_repeat_count": 0},
        {"straggler_consecutive": 0},
        {"heartbeat_missed_intervals": 0},
        {"xid_repeat_window_s": 0},
    ],
)
def test_thresholds_reject_bad_values(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        HealthThresholds(**bad)


def test_every_action_we_emit_has_a_description() -> None:
    for action in [
        "REPLACE_GPU",
        "CHECK_COOLING",
        "INVESTIGATE_POWER",
        "INVESTIGATE_LINK",
        "INVESTIGATE_STRAGGLER",
        "CHECK_AGENT",
        "RESET_GPU_TO_REMAP",
        "RESET_GPU",
        "UNEXPECTED_ERR_REPORT_ISSUE",
    ]:
        assert not rules.describe_action(action).startswith("Unknown"), action


def test_findings_evidence_is_json_serialisable() -> None:
    now = at(1000)
    findings = [
        *rule_xid([xid(79, 1), xid(13, 2), xid(13, 3), xid(99999, 1)], [], TH, NOW),
        *rule_stale_telemetry(None, 0, now, 5.0, TH, now),
        *rule_throttling(sample(throttle_reasons=THROTTLE_HW_SLOWDOWN)),
        rule_straggler(1, "j", straggler_ranks(job(2, {1: [40.0] * 3}), TH)[1], now),
    ]
    assert len(findings) == 6
    for f in findings:
        assert json.loads(json.dumps(f.evidence)) == f.evidence


def test_xid_evidence_keeps_only_the_newest_occurrences() -> None:
    from tierwatch.server.fleet.rules import MAX_EVIDENCE_OCCURRENCES

    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    burst = [XidRecord(gpu=0, xid=79, ts=t0 + timedelta(milliseconds=i)) for i in range(500)]
    [finding] = rule_xid(burst, [], HealthThresholds(), t0 + timedelta(seconds=1))
    assert finding.evidence["count"] == 500
    assert len(finding.evidence["occurrences"]) == MAX_EVIDENCE_OCCURRENCES
    assert finding.evidence["occurrences"][-1] == burst[-1].ts.isoformat()


def _straggler_ranks_by_definition(series, th):
    """The rule as docs/design.md states it, computed the slow way (each rank's others)."""
    import statistics

    k = th.straggler_consecutive
    out = set()
    for rank, values in series.items():
        if len(values) < k:
            continue
        for j in range(k, 0, -1):
            others = [v[-j] for r, v in series.items() if r != rank and len(v) >= j]
            if not others:
                break
            median = statistics.median(others)
            if median <= 0 or not values[-j] > th.straggler_factor * median:
                break
        else:
            out.add(rank)
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.integers(0, 40),
        st.lists(
            st.sampled_from([0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 5.0, 8.0]),
            min_size=0,
            max_size=5,
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([1.2, 1.5, 3.0]),
)
def test_straggler_ranks_match_the_definition(series, factor) -> None:
    """The sorted-once median (O(k n log n)) flags exactly the ranks the definition does,
    ties, zeros, short series and 1-rank jobs included."""
    th = HealthThresholds(straggler_factor=factor, straggler_consecutive=2)
    fast = rules.straggler_ranks(series, th)
    assert set(fast) == _straggler_ranks_by_definition(series, th)
    for rank, ev in fast.items():  # and the medians it reports are the definition's
        import statistics

        k = th.straggler_consecutive
        for n, j in enumerate(range(k, 0, -1)):
            others = [v[-j] for r, v in series.items() if r != rank and len(v) >= j]
            assert ev["median_ms"][n] == statistics.median(others)

"""Which reports carry GPU samples (agent.sampling.SampleGate)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tierwatch.agent.protocol import GpuSample, utcnow
from tierwatch.agent.sampling import SampleGate

T0 = utcnow()


def sample(index: int, n: int = 0, **fields: object) -> GpuSample:
    base = {"temperature_c": 60.0, "slowdown_temp_c": 90.0, "ecc_dbe_volatile": 0}
    return GpuSample(index=index, ts=T0 + timedelta(seconds=n), **{**base, **fields})


def run(gate: SampleGate, reports: list[list[GpuSample]]) -> list[bool]:
    return [gate.admit(r) for r in reports]


def test_steady_readings_go_out_every_n_reports() -> None:
    gate = SampleGate(full_every=3)
    steady = [[sample(0, n), sample(1, n, temperature_c=61.0)] for n in range(7)]
    assert run(gate, steady) == [True, False, False, True, False, False, True]


def test_every_report_when_n_is_1() -> None:
    assert run(SampleGate(full_every=1), [[sample(0, n)] for n in range(4)]) == [True] * 4


@pytest.mark.parametrize(
    "change",
    [
        {"ecc_dbe_volatile": 1},
        {"throttle_reasons": 0x40},  # HW thermal slowdown
        {"row_remap_pending": True},
        {"pcie_replay_count": 3},
        {"temperature_c": 65.0},  # a 5 °C step
        {"temperature_c": 55.0},
        {"temperature_c": None},  # the reading went away
    ],
)
def test_a_health_reading_that_changed_goes_out_at_once(change: dict) -> None:
    gate = SampleGate(full_every=100)
    assert gate.admit([sample(0), sample(1)]) is True
    assert gate.admit([sample(0, 1), sample(1, 1, temperature_c=64.0)]) is False  # drift
    assert gate.admit([sample(0, 2), sample(1, 2, **change)]) is True  # all GPUs go
    assert gate.admit([sample(0, 3), sample(1, 3, **change)]) is False  # then quiet again


def test_a_power_cap_that_comes_and_goes_is_no_news() -> None:
    gate = SampleGate(full_every=100)
    caps = [0x4, 0x0, 0x4, 0x5]  # SW power cap, idle: how a busy GPU runs
    assert run(gate, [[sample(0, n, throttle_reasons=m)] for n, m in enumerate(caps)]) == [
        True,
        False,
        False,
        False,
    ]


def test_near_the_slowdown_threshold_every_report_goes_out() -> None:
    gate = SampleGate(full_every=100)
    hot = [[sample(0, n, temperature_c=82.5)] for n in range(4)]
    assert run(gate, hot) == [True] * 4  # 82.5 °C is within 8 °C of 90 °C
    cool = SampleGate(full_every=100)
    assert run(cool, [[sample(0, n, temperature_c=81.5)] for n in range(3)]) == [
        True,
        False,
        False,
    ]


def test_a_gpu_that_appears_or_disappears_goes_out() -> None:
    gate = SampleGate(full_every=100)
    assert gate.admit([sample(0), sample(1)]) is True
    assert gate.admit([sample(0, 1)]) is True
    assert gate.admit([sample(0, 2)]) is False
    assert gate.admit([sample(0, 3), sample(1, 3)]) is True


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="full_every must be at least 1"):
        SampleGate(full_every=0)
    with pytest.raises(ValueError, match="must not be negative"):
        SampleGate(temp_step_c=-1)

"""The demo report's arithmetic: surviving steps, effective time, the persistent-only
baseline at Young's interval."""

from __future__ import annotations

import math

import pytest

from demo import report
from demo.report import BaselineFailure


def entries(steps, compute=0.5):
    return [{"step": s, "compute_s": compute, "t": float(i)} for i, s in enumerate(steps)]


def test_a_restart_drops_the_steps_it_redoes():
    log = entries([0, 1, 2, 3, 4, 3, 4, 5]) + [{"event": "sdc", "step": 2, "t": 9.0}]
    kept = report.surviving_steps(log)
    assert [e["step"] for e in kept] == [0, 1, 2, 3, 4, 5]
    assert [e["t"] for e in kept][-3:] == [5.0, 6.0, 7.0]  # the re-done copies survive


def test_a_rollback_drops_the_diverged_future():
    kept = report.surviving_steps(entries([0, 1, 2, 3, 4, 5, 6, 2, 3]))
    assert [e["step"] for e in kept] == [0, 1, 2, 3]


def test_effective_time_counts_only_surviving_compute():
    log = entries([0, 1, 2, 3, 2, 3, 4])  # 7 steps run, 5 survive
    assert report.effective_training_time(log, wall_s=5.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="wall time must be > 0"):
        report.effective_training_time(log, wall_s=0)


def test_young_interval():
    assert report.young_interval(0.5, 60) == pytest.approx(math.sqrt(60))
    with pytest.raises(ValueError, match="must be > 0"):
        report.young_interval(0, 60)


def test_baseline_without_failures_pays_only_its_checkpoints():
    frac, tau = report.persistent_only([], wall_s=1000, checkpoint_s=2.0, mtbf_s=100)
    assert tau == pytest.approx(20.0)
    assert frac == pytest.approx(20 / 22, abs=0.005)  # τ of work per τ + δ


def test_a_failure_loses_the_work_since_the_last_checkpoint_and_its_downtime():
    # τ = √(2·2·100) = 20 s, δ = 2 s: checkpoints end at 22, 44, 66 …; a failure at 60
    # loses 60 − 44 = 16 s of work and is down 10 s.
    frac, _ = report.persistent_only(
        [BaselineFailure(60.0, 10.0)], wall_s=100, checkpoint_s=2.0, mtbf_s=100
    )
    # work: 0–20, 22–42 committed (40); 44–60 lost; down 60–70; then 70–90, ckpt 90–92,
    # 92–100 (8): 40 + 20 + 8 = 68
    assert frac == pytest.approx(0.68)


def test_a_failure_during_a_checkpoint_loses_that_checkpoint():
    # the second checkpoint (42–44) is cut at 43: only the first (work 20) counts, then
    # 43–50 is new work
    frac, _ = report.persistent_only(
        [BaselineFailure(43.0, 0.0)], wall_s=50.0, checkpoint_s=2.0, mtbf_s=100
    )
    assert frac == pytest.approx((20 + 7) / 50)


def test_a_failure_while_down_extends_the_outage():
    one, _ = report.persistent_only(
        [BaselineFailure(30, 10)], wall_s=100, checkpoint_s=2, mtbf_s=100
    )
    two, _ = report.persistent_only(
        [BaselineFailure(30, 10), BaselineFailure(35, 10)], wall_s=100, checkpoint_s=2, mtbf_s=100
    )
    assert two < one


def test_the_compute_share_scales_the_baseline():
    full, _ = report.persistent_only([], wall_s=100, checkpoint_s=1, mtbf_s=50)
    part, _ = report.persistent_only([], wall_s=100, checkpoint_s=1, mtbf_s=50, compute_share=0.8)
    assert part == pytest.approx(0.8 * full)


def test_compute_share_ignores_saves_and_restarts():
    log = [
        {"step": 0, "t": 0.0, "compute_s": 0.4, "save_s": 0.0},
        {"step": 1, "t": 1.0, "compute_s": 0.4, "save_s": 0.5},  # Δt 1, save 0.5
        {"step": 2, "t": 1.5, "compute_s": 0.4, "save_s": 0.0},  # Δt 0.5
        {"step": 1, "t": 30.0, "compute_s": 0.4, "save_s": 0.0},
    ]  # a restart: skipped
    assert report.compute_share(log) == pytest.approx(0.8 / 1.0)
    assert report.compute_share([]) == 1.0


def test_shard_tiers_take_the_fastest_copy_any_rank_read():
    sources = [
        {".metadata": "memory:a", "__0_0.distcp": "peer:b", "__1_0.distcp": "memory:b"},
        {"__0_0.distcp": "peer:b", "__1_0.distcp": "peer:a", "__2_0.distcp": "persistent:x"},
    ]
    assert report.shard_tiers(sources) == {"0": "peer", "1": "memory", "2": "persistent"}
    assert report.slowest_tier(report.shard_tiers(sources).values()) == "persistent"
    assert report.slowest_tier([]) is None

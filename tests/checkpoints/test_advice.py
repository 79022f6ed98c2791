"""Interval advice: Young, Daly, tier MTBFs from the Llama 3 table, the commit-time floor."""

from __future__ import annotations

import math

import pytest

from tierwatch.server.checkpoints.advice import (
    AdviceError,
    advise,
    daly_interval_s,
    llama3_table,
    parse_failure_table,
    tier_mtbf_s,
    young_interval_s,
)


def test_llama3_table_weights_by_counts():
    table = llama3_table()
    assert table.total == 419
    assert table.counts == {"process": 63, "node": 315, "rack": 35, "rollback": 6}
    # 419 / (54 days x 24 h x 16,384 GPUs) per GPU-hour, as the data README derives
    assert table.rate_per_gpu_hour() == pytest.approx(1.973e-5, rel=1e-3)
    # job-level MTBF at Llama 3 scale: about 3.1 h
    assert 1 / (table.rate_per_gpu_hour() * 16_384) == pytest.approx(3.09, abs=0.01)


@pytest.mark.parametrize(
    ("tier", "gpus", "hours"),
    [
        # MTBF of the classes each tier serves: memory <- process (63), peer <- node (315),
        # persistent <- rack + rollback (41); 54 d x 24 h x 16,384 GPU-hours observed
        ("memory", 16_384, 54 * 24 / 63),
        ("peer", 16_384, 54 * 24 / 315),
        ("persistent", 16_384, 54 * 24 / 41),
        ("peer", 8, 54 * 24 * 16_384 / 315 / 8),
    ],
)
def test_tier_mtbf(tier, gpus, hours):
    assert tier_mtbf_s(tier, gpus=gpus) == pytest.approx(hours * 3600)


@pytest.mark.parametrize(
    ("cost", "mtbf", "young"),
    [(10.0, 3600.0, math.sqrt(2 * 10 * 3600)), (0.0, 3600.0, 0.0), (1.0, 2.0, 2.0)],
)
def test_young(cost, mtbf, young):
    assert young_interval_s(cost, mtbf) == pytest.approx(young)


def test_daly_refines_young_and_caps_at_mtbf():
    cost, mtbf = 60.0, 3600.0
    x = cost / (2 * mtbf)
    expected = math.sqrt(2 * cost * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - cost
    assert daly_interval_s(cost, mtbf) == pytest.approx(expected)
    assert daly_interval_s(cost, mtbf) < young_interval_s(cost, mtbf)
    assert daly_interval_s(8000.0, 3600.0) == 3600.0  # delta >= 2M: checkpoint once per MTBF


def test_async_tier_is_floored_by_its_commit_time():
    advice = advise("memory", cost_s=0.0, commit_s=2.5, gpus=64)
    assert advice.daly_s == 0.0
    assert advice.recommended_s == 2.5
    assert advice.bounded_by_commit is True
    slow = advise("persistent", cost_s=30.0, commit_s=5.0, gpus=64, mtbf_s=86_400.0)
    assert slow.recommended_s == pytest.approx(daly_interval_s(30.0, 86_400.0))
    assert slow.bounded_by_commit is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tier": "disk", "cost_s": 1, "commit_s": 1, "gpus": 8}, "unknown tier"),
        ({"tier": "peer", "cost_s": -1, "commit_s": 1, "gpus": 8}, "cost"),
        ({"tier": "peer", "cost_s": 1, "commit_s": -1, "gpus": 8}, "commit time"),
        ({"tier": "peer", "cost_s": 1, "commit_s": 1, "gpus": 0}, "at least one GPU"),
        ({"tier": "peer", "cost_s": 1, "commit_s": 1, "gpus": 8, "mtbf_s": 0}, "MTBF"),
        ({"tier": "peer", "cost_s": float("nan"), "commit_s": 1, "gpus": 8}, "cost"),
    ],
)
def test_bad_inputs_say_what_is_wrong(kwargs, message):
    with pytest.raises(AdviceError, match=message):
        advise(**kwargs)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("component,interruptions\nGPU,3\n", "failure_class"),
        ("interruptions,failure_class\n3,cosmic\n", "unknown failure class"),
        ("interruptions,failure_class\nmany,node\n", "interruptions 'many'"),
        ("interruptions,failure_class\n-1,node\n", "negative"),
    ],
)
def test_bad_tables_are_refused(text, message):
    with pytest.raises(AdviceError, match=message):
        parse_failure_table(text, gpus=8, hours=1)

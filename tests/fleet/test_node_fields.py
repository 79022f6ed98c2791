"""The one builder of a node's, a GPU's and a reason's fields (API, dashboard, rules)."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

from tierwatch.agent.protocol import THROTTLE_HW_SLOWDOWN, THROTTLE_HW_THERMAL_SLOWDOWN
from tierwatch.server.fleet import rules
from tierwatch.server.fleet.schemas import GpuOut, ReasonOut
from tierwatch.server.fleet.service import GPU_COLUMNS, gpu_fields, reason_fields

AT = datetime(2024, 5, 1, 12, tzinfo=UTC)


def _row(gpu_index: int) -> SimpleNamespace:
    return SimpleNamespace(
        rule="straggler",
        severity="degraded",
        gpu_index=gpu_index,
        key="job:1",
        message="rank 1 is slow",
        action="INVESTIGATE_STRAGGLER",
        evidence=None,
        first_seen=AT,
        last_seen=AT,
    )


def test_a_node_level_reason_has_no_gpu():
    fields = reason_fields(_row(-1))
    assert (fields["gpu"], fields["evidence"]) == (None, {})
    assert reason_fields(_row(3))["gpu"] == 3


def test_reason_fields_fit_the_api_and_the_rules_engine():
    fields = reason_fields(_row(2))
    assert ReasonOut(**fields).model_dump() == fields
    assert rules.Reason(**fields).identity == ("straggler", 2, "job:1")


def test_gpu_fields_name_the_throttle_bits_and_count_xids():
    values = dict.fromkeys(GPU_COLUMNS) | {
        "index": 1,
        "uuid": "GPU-x",
        "name": "H100",
        "ts": AT,
        "throttle_reasons": THROTTLE_HW_SLOWDOWN | THROTTLE_HW_THERMAL_SLOWDOWN,
    }
    fields = gpu_fields([values[c] for c in GPU_COLUMNS], xid_count=4)
    assert fields["throttle_reason_names"] == ["hw_slowdown", "hw_thermal_slowdown"]
    assert fields["xid_count"] == 4
    assert GpuOut(**fields).model_dump() == fields
    assert gpu_fields([None] * len(GPU_COLUMNS), xid_count=0)["throttle_reason_names"] == []

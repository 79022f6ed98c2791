"""The GPU metric list has one source, the wire model ``GpuSample``: the database columns,
the API shape and the Prometheus gauges are held to it here."""

from __future__ import annotations

import pytest
from sqlalchemy import BigInteger, Boolean, Float

from tierwatch.agent.protocol import GPU_METRIC_TYPES, GPU_METRICS, GpuSample
from tierwatch.server.fleet.models import (
    BOOL_METRICS,
    METRIC_FIELDS,
    Gpu,
    GpuSampleRollup,
    GpuSampleRow,
)
from tierwatch.server.fleet.schemas import GpuOut
from tierwatch.server.metrics import DCGM_GAUGES

SQL_TYPE = {float: Float, int: BigInteger, bool: Boolean}


def test_metric_list_is_the_wire_models_fields_in_order():
    assert list(GpuSample.model_fields) == ["index", "ts", *GPU_METRICS]
    assert METRIC_FIELDS == GPU_METRICS
    assert "nvlink_recovery_errors" in METRIC_FIELDS  # the list is not empty or truncated
    assert set(GPU_METRIC_TYPES.values()) == {float, int, bool}
    assert {name for name, kind in GPU_METRIC_TYPES.items() if kind is bool} == BOOL_METRICS
    assert BOOL_METRICS == {"row_remap_pending", "row_remap_failure"}


@pytest.mark.parametrize(
    ("model", "identity"),
    [
        # acked_xid: the GPU's acknowledged XID code (fleet.service.acknowledge), no metric
        (Gpu, {"id", "node_id", "index", "uuid", "name", "ts", "acked_xid"}),
        (GpuSampleRow, {"node_id", "gpu_index", "ts"}),
        (GpuSampleRollup, {"node_id", "gpu_index", "bucket", "samples"}),
    ],
    ids=["gpus", "gpu_samples", "gpu_sample_rollups"],
)
def test_each_metric_is_a_nullable_column_of_its_type(model, identity):
    columns = model.__table__.columns
    assert set(columns.keys()) == identity | set(METRIC_FIELDS)
    for name, kind in GPU_METRIC_TYPES.items():
        column = columns[name]
        assert column.nullable, name
        assert type(column.type) is SQL_TYPE[kind], (name, column.type)


def test_api_gpu_shape_has_every_metric_with_its_type():
    fields = GpuOut.model_fields
    extra = {"index", "uuid", "name", "ts", "throttle_reason_names", "xid_count"}
    assert set(fields) == extra | set(METRIC_FIELDS)
    for name, kind in GPU_METRIC_TYPES.items():
        assert fields[name].annotation == kind | None, name
        assert fields[name].default is None, name


def test_prometheus_gauges_name_only_metrics():
    assert {metric for _, metric, _ in DCGM_GAUGES} <= set(METRIC_FIELDS)

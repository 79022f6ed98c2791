"""gpu_samples without its surrogate id, partitioned by hour on PostgreSQL, the 5-minute
rollups (gpu_sample_rollups) for long chart ranges, and room for in-place updates of the
latest-value rows (nodes, gpus: fillfactor 50 on PostgreSQL); checkpoint events indexed by
(job, step) for the job page's per-step aggregation

PostgreSQL: the old table is renamed, a ``PARTITION BY RANGE (ts)`` table takes its name with
hourly partitions covering the old rows of the last 31 days up to 3 hours ahead (older rows
go to the default partition), the rows are copied across and the old table is dropped.
The copy runs in the migration's transaction: about 10^5 rows/s here, so a 24 h history of
20,000 GPUs at one sample a minute (29 M rows) takes minutes; the server does not serve
meanwhile. SQLite: the table is rebuilt without ``id``.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 15:00:00.000000
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from alembic import op

from tierwatch.server.fleet import partitions

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_LATEST_FILLFACTOR = 50
_GAUGES = (
    "temperature_c",
    "slowdown_temp_c",
    "shutdown_temp_c",
    "power_w",
    "power_limit_w",
    "utilization_pct",
    "memory_used_mib",
    "memory_total_mib",
)
_COUNTS = (
    "ecc_sbe_volatile",
    "ecc_dbe_volatile",
    "ecc_sbe_aggregate",
    "ecc_dbe_aggregate",
    "remapped_rows_correctable",
    "remapped_rows_uncorrectable",
)
_FLAGS = ("row_remap_pending", "row_remap_failure")
_COUNTS_2 = (
    "pcie_replay_count",
    "throttle_reasons",
    "nvlink_crc_errors",
    "nvlink_replay_errors",
    "nvlink_recovery_errors",
)
_METRICS = _GAUGES + _COUNTS + _FLAGS + _COUNTS_2


def _metric_columns() -> list[sa.Column]:
    cols = [sa.Column(n, sa.Float(), nullable=True) for n in _GAUGES]
    cols += [sa.Column(n, sa.BigInteger(), nullable=True) for n in _COUNTS]
    cols += [sa.Column(n, sa.Boolean(), nullable=True) for n in _FLAGS]
    cols += [sa.Column(n, sa.BigInteger(), nullable=True) for n in _COUNTS_2]
    return cols


def upgrade() -> None:
    op.create_table(
        "gpu_sample_rollups",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.DateTime(timezone=True), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        *_metric_columns(),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_gpu_sample_rollups_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint(
            "node_id", "gpu_index", "bucket", name=op.f("pk_gpu_sample_rollups")
        ),
    )
    op.create_index("ix_gpu_sample_rollups_bucket", "gpu_sample_rollups", ["bucket"])
    op.create_index("ix_checkpoint_events_job_step", "checkpoint_events", ["job_pk", "step"])
    if op.get_bind().dialect.name == "postgresql":
        _partition_postgresql()
        # Every report rewrites its node's row and its GPUs' latest values. With full pages
        # each rewrite is a new row version elsewhere plus new index entries (the tables grew
        # 1.1 GiB/h at 20,000 GPUs); with half of each page free, PostgreSQL updates in place
        # (heap-only tuples) and reclaims old versions as it reads the page, without VACUUM.
        for table in ("nodes", "gpus"):
            op.execute(f"ALTER TABLE {table} SET (fillfactor = {_LATEST_FILLFACTOR})")
    else:
        with op.batch_alter_table("gpu_samples", recreate="always") as batch:
            batch.drop_index("ix_gpu_samples_ts")
            batch.drop_column("id")
            batch.create_index("ix_gpu_samples_ts", ["ts"])


def _partition_postgresql() -> None:
    bind = op.get_bind()
    op.execute("ALTER TABLE gpu_samples RENAME TO gpu_samples_unpartitioned")
    op.execute("ALTER INDEX ix_gpu_samples_node_gpu_ts RENAME TO ix_gpu_samples_old_node_gpu_ts")
    op.execute("ALTER INDEX ix_gpu_samples_ts RENAME TO ix_gpu_samples_old_ts")
    op.execute(
        "ALTER TABLE gpu_samples_unpartitioned "
        "RENAME CONSTRAINT fk_gpu_samples_node_id_nodes TO fk_gpu_samples_old_node_id_nodes"
    )
    op.execute(
        "ALTER TABLE gpu_samples_unpartitioned RENAME CONSTRAINT pk_gpu_samples TO pk_gpu_samples_old"
    )
    ddl_cols = ",\n  ".join(
        f"{c.name} {c.type.compile(dialect=bind.dialect)}" for c in _metric_columns()
    )
    op.execute(
        "CREATE TABLE gpu_samples (\n"
        "  node_id INTEGER NOT NULL,\n"
        "  gpu_index INTEGER NOT NULL,\n"
        "  ts TIMESTAMP WITH TIME ZONE NOT NULL,\n"
        f"  {ddl_cols},\n"
        "  CONSTRAINT fk_gpu_samples_node_id_nodes FOREIGN KEY(node_id) "
        "REFERENCES nodes (id) ON DELETE CASCADE\n"
        ") PARTITION BY RANGE (ts)"
    )
    op.execute("CREATE INDEX ix_gpu_samples_node_gpu_ts ON gpu_samples (node_id, gpu_index, ts)")
    op.execute("CREATE INDEX ix_gpu_samples_ts ON gpu_samples USING brin (ts)")
    op.execute(f"CREATE TABLE {partitions.DEFAULT_PARTITION} PARTITION OF gpu_samples DEFAULT")
    now = datetime.now(UTC)
    oldest = bind.scalar(sa.text("SELECT min(ts) FROM gpu_samples_unpartitioned"))
    since = max(oldest, now - timedelta(days=31)) if oldest is not None else now
    start = partitions.partition_start(min(since, now - partitions.WIDTH))
    while start < now + partitions.AHEAD:
        end = start + partitions.WIDTH
        op.execute(
            f'CREATE TABLE "{partitions.partition_name(start)}" PARTITION OF gpu_samples '
            f"FOR VALUES FROM ('{start.isoformat()}') TO ('{end.isoformat()}')"
        )
        start = end
    cols = ", ".join(("node_id", "gpu_index", "ts", *_METRICS))
    op.execute(f"INSERT INTO gpu_samples ({cols}) SELECT {cols} FROM gpu_samples_unpartitioned")
    op.execute("DROP TABLE gpu_samples_unpartitioned")


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        old = "gpu_samples_partitioned"
        op.execute(f"ALTER TABLE gpu_samples RENAME TO {old}")
        op.execute("ALTER INDEX ix_gpu_samples_node_gpu_ts RENAME TO ix_gpu_samples_p_node_gpu_ts")
        op.execute("ALTER INDEX ix_gpu_samples_ts RENAME TO ix_gpu_samples_p_ts")
        op.execute(
            f"ALTER TABLE {old} "
            "RENAME CONSTRAINT fk_gpu_samples_node_id_nodes TO fk_gpu_samples_p_node_id_nodes"
        )
        _restore_id_table(old, sa.BigInteger())
        op.execute(f"DROP TABLE {old} CASCADE")
    else:
        old = "gpu_samples_noid"
        op.execute(f"ALTER TABLE gpu_samples RENAME TO {old}")
        op.execute("DROP INDEX ix_gpu_samples_node_gpu_ts")
        op.execute("DROP INDEX ix_gpu_samples_ts")
        _restore_id_table(old, sa.Integer())
        op.execute(f"DROP TABLE {old}")
    op.create_index("ix_gpu_samples_node_gpu_ts", "gpu_samples", ["node_id", "gpu_index", "ts"])
    op.create_index("ix_gpu_samples_ts", "gpu_samples", ["ts"])
    if bind.dialect.name == "postgresql":
        for table in ("nodes", "gpus"):
            op.execute(f"ALTER TABLE {table} RESET (fillfactor)")
    op.drop_index("ix_checkpoint_events_job_step", table_name="checkpoint_events")
    op.drop_index("ix_gpu_sample_rollups_bucket", table_name="gpu_sample_rollups")
    op.drop_table("gpu_sample_rollups")


def _restore_id_table(source: str, id_type: sa.types.TypeEngine) -> None:
    """Create 0011's ``gpu_samples`` (with its ``id``) and copy ``source``'s rows into it."""
    op.create_table(
        "gpu_samples",
        sa.Column("id", id_type, autoincrement=True, nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        *_metric_columns(),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name="fk_gpu_samples_node_id_nodes", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_gpu_samples"),
    )
    cols = ", ".join(("node_id", "gpu_index", "ts", *_METRICS))
    op.execute(f"INSERT INTO gpu_samples ({cols}) SELECT {cols} FROM {source}")

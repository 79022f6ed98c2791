"""maintenance windows: a node or the cluster silenced for a time (policy and alerts honour
them); alerts remember the window that silenced them

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 07:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "maintenance_windows",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("scope", sa.String(length=16), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=True),
        sa.Column("starts_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ends_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_by", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_maintenance_windows")),
    )
    op.create_index(
        "ix_maintenance_windows_ends_at", "maintenance_windows", ["ends_at"], unique=False
    )
    op.create_index(
        "ix_maintenance_windows_node_ends_at",
        "maintenance_windows",
        ["node", "ends_at"],
        unique=False,
    )
    with op.batch_alter_table("alerts") as batch:
        batch.add_column(sa.Column("silenced_by", sa.Integer(), nullable=True))
    op.create_index("ix_alerts_silenced_by", "alerts", ["silenced_by"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_alerts_silenced_by", table_name="alerts")
    with op.batch_alter_table("alerts") as batch:
        batch.drop_column("silenced_by")
    op.drop_index("ix_maintenance_windows_node_ends_at", table_name="maintenance_windows")
    op.drop_index("ix_maintenance_windows_ends_at", table_name="maintenance_windows")
    op.drop_table("maintenance_windows")

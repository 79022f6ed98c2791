"""nodes.sample_every: how many reports may pass between a node's GPU samples

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(
            sa.Column("sample_every", sa.Integer(), nullable=False, server_default="1")
        )


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("sample_every")

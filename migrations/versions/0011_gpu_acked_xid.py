"""gpus.acked_xid: the XID code last acknowledged on a GPU, so a pre-start XID value an
operator already acknowledged is not raised again at the next agent start

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 14:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.add_column(sa.Column("acked_xid", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("gpus") as batch:
        batch.drop_column("acked_xid")

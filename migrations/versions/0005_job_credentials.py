"""job credentials: the server's signing keys, and each job's registered (pinned) nodes

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 05:20:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "signing_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("kid", sa.String(length=64), nullable=False),
        sa.Column("algorithm", sa.String(length=16), nullable=False),
        sa.Column("private_key", sa.Text(), nullable=False),
        sa.Column("public_key", sa.Text(), nullable=False),
        sa.Column("job_secret", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_signing_keys")),
        sa.UniqueConstraint("kid", name=op.f("uq_signing_keys_kid")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("registered_nodes", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("registered_world_size", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("registered_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column("registered_by", sa.String(length=128), nullable=True))
        batch_op.add_column(
            sa.Column("credential_expires_at", sa.DateTime(timezone=True), nullable=True)
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("credential_expires_at")
        batch_op.drop_column("registered_by")
        batch_op.drop_column("registered_at")
        batch_op.drop_column("registered_world_size")
        batch_op.drop_column("registered_nodes")
    op.drop_table("signing_keys")

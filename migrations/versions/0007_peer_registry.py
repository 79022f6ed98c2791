"""peer registry: each node's key, advertised URL and the node certificate issued for them

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "peer_registry",
        sa.Column("node_name", sa.String(length=253), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("public_key", sa.String(length=64), nullable=False),
        sa.Column("certificate", sa.Text(), nullable=False),
        sa.Column("kid", sa.String(length=64), nullable=False),
        sa.Column("certificate_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_by", sa.String(length=128), nullable=False),
        sa.PrimaryKeyConstraint("node_name", name=op.f("pk_peer_registry")),
    )


def downgrade() -> None:
    op.drop_table("peer_registry")

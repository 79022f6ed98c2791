"""login failures: the sign-in rate limit's counts, shared by every server replica

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 19:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "login_failures",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("client", sa.String(length=255), nullable=False),
        sa.Column("failed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_login_failures")),
    )
    op.create_index(
        "ix_login_failures_client_failed_at",
        "login_failures",
        ["client", "failed_at"],
        unique=False,
    )
    op.create_index("ix_login_failures_failed_at", "login_failures", ["failed_at"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_login_failures_failed_at", table_name="login_failures")
    op.drop_index("ix_login_failures_client_failed_at", table_name="login_failures")
    op.drop_table("login_failures")

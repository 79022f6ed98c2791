"""operator actions: command queue, restore requests, audit log, policy settings, node
isolation overlay

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 11:41:30.826731
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "audit_log",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("ts", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("target_kind", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.create_index("ix_audit_log_action_ts", ["action", "ts"], unique=False)
        batch_op.create_index("ix_audit_log_target", ["target_kind", "target", "ts"], unique=False)
        batch_op.create_index("ix_audit_log_ts", ["ts"], unique=False)

    op.create_table(
        "policy_settings",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=True),
        sa.Column("unreachable_s", sa.Float(), nullable=True),
        sa.Column("breaker_pct", sa.Float(), nullable=True),
        sa.Column("breaker_window_s", sa.Float(), nullable=True),
        sa.Column("restore_jobs", sa.Boolean(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_by", sa.String(length=128), nullable=False),
        sa.Column("breaker_tripped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("breaker_message", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_policy_settings")),
    )
    op.create_table(
        "restore_requests",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_pk", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(length=128), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("tier", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("layout", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("steps_lost", sa.BigInteger(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_pk"],
            ["jobs.id"],
            name=op.f("fk_restore_requests_job_pk_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_restore_requests")),
    )
    with op.batch_alter_table("restore_requests", schema=None) as batch_op:
        batch_op.create_index("ix_restore_requests_job", ["job_pk", "created_at"], unique=False)

    op.create_table(
        "commands",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("executor", sa.String(length=8), nullable=False),
        sa.Column("driver", sa.String(length=16), nullable=False),
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("restore_id", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("args", sa.JSON(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("output", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"], ["nodes.id"], name=op.f("fk_commands_node_id_nodes"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["restore_id"],
            ["restore_requests.id"],
            name=op.f("fk_commands_restore_id_restore_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_commands")),
    )
    with op.batch_alter_table("commands", schema=None) as batch_op:
        batch_op.create_index("ix_commands_created", ["created_at"], unique=False)
        batch_op.create_index("ix_commands_node_state", ["node_id", "state"], unique=False)
        batch_op.create_index("ix_commands_state_expires", ["state", "expires_at"], unique=False)

    op.create_table(
        "restore_rank_progress",
        sa.Column("request_id", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(length=128), nullable=False),
        sa.Column("phase", sa.String(length=16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("tier", sa.String(length=16), nullable=True),
        sa.Column("files_by_tier", sa.JSON(), nullable=False),
        sa.Column("seconds", sa.Float(), nullable=True),
        sa.Column("steps_lost", sa.BigInteger(), nullable=True),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["restore_requests.id"],
            name=op.f("fk_restore_rank_progress_request_id_restore_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("request_id", "rank", name=op.f("pk_restore_rank_progress")),
    )
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.add_column(sa.Column("isolated_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(
            sa.Column("isolated_by", sa.String(length=128), nullable=False, server_default="")
        )
        batch_op.add_column(
            sa.Column("isolated_reason", sa.Text(), nullable=False, server_default="")
        )
        batch_op.add_column(sa.Column("released_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes", schema=None) as batch_op:
        batch_op.drop_column("released_at")
        batch_op.drop_column("isolated_reason")
        batch_op.drop_column("isolated_by")
        batch_op.drop_column("isolated_at")

    op.drop_table("restore_rank_progress")
    with op.batch_alter_table("commands", schema=None) as batch_op:
        batch_op.drop_index("ix_commands_state_expires")
        batch_op.drop_index("ix_commands_node_state")
        batch_op.drop_index("ix_commands_created")

    op.drop_table("commands")
    with op.batch_alter_table("restore_requests", schema=None) as batch_op:
        batch_op.drop_index("ix_restore_requests_job")

    op.drop_table("restore_requests")
    op.drop_table("policy_settings")
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_index("ix_audit_log_ts")
        batch_op.drop_index("ix_audit_log_target")
        batch_op.drop_index("ix_audit_log_action_ts")

    op.drop_table("audit_log")

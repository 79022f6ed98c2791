"""report_ranges replaces report_receipts: stored batches as ranges of consecutive seqs per
agent epoch (fleet.seqranges), one row per epoch instead of one per report

The receipts are folded into ranges in SQL (consecutive seqs of a node epoch share
``seq - row_number()``); a downgrade expands each range back into one receipt per seq, with
the range's ``last_sent_at`` as every receipt's ``sent_at`` (the exact send times of the
earlier batches are not kept).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 15:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_FOLD = """
INSERT INTO report_ranges (node_id, epoch, first_seq, last_seq, last_sent_at, received_at)
SELECT node_id, epoch, min(seq), max(seq), max(last_sent), max(received_at)
FROM (
    SELECT node_id, epoch, island, seq, received_at,
           first_value(sent_at) OVER (
               PARTITION BY node_id, epoch, island ORDER BY seq DESC
           ) AS last_sent
    FROM (
        SELECT node_id, epoch, seq, sent_at, received_at,
               seq - row_number() OVER (PARTITION BY node_id, epoch ORDER BY seq) AS island
        FROM report_receipts
    ) numbered
) islands
GROUP BY node_id, epoch, island
"""

_EXPAND_POSTGRESQL = """
INSERT INTO report_receipts (node_id, epoch, seq, sent_at, received_at)
SELECT node_id, epoch, generate_series(first_seq, last_seq), last_sent_at, received_at
FROM report_ranges
"""

_EXPAND_SQLITE = """
WITH RECURSIVE seqs(node_id, epoch, seq, last_seq, sent_at, received_at) AS (
    SELECT node_id, epoch, first_seq, last_seq, last_sent_at, received_at FROM report_ranges
    UNION ALL
    SELECT node_id, epoch, seq + 1, last_seq, sent_at, received_at FROM seqs
    WHERE seq < last_seq
)
INSERT INTO report_receipts (node_id, epoch, seq, sent_at, received_at)
SELECT node_id, epoch, seq, sent_at, received_at FROM seqs
"""


def upgrade() -> None:
    op.create_table(
        "report_ranges",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.String(length=64), nullable=False),
        sa.Column("first_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_sent_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_report_ranges_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("node_id", "epoch", "first_seq", name=op.f("pk_report_ranges")),
    )
    op.execute(_FOLD)
    op.drop_index("ix_report_receipts_received_at", table_name="report_receipts")
    op.drop_table("report_receipts")


def downgrade() -> None:
    op.create_table(
        "report_receipts",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["node_id"],
            ["nodes.id"],
            name=op.f("fk_report_receipts_node_id_nodes"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("node_id", "epoch", "seq", name=op.f("pk_report_receipts")),
    )
    op.create_index("ix_report_receipts_received_at", "report_receipts", ["received_at"])
    expand = _EXPAND_POSTGRESQL if op.get_bind().dialect.name == "postgresql" else _EXPAND_SQLITE
    op.execute(expand)
    op.drop_table("report_ranges")

"""per-request durability and retry (issue 17)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 13:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'request_results',
        sa.Column('shard_id', sa.String(length=80), nullable=False),
        sa.Column('seq', sa.Integer(), nullable=False),
        sa.Column('succeeded', sa.Boolean(), nullable=False),
        sa.Column('line', sa.LargeBinary(), nullable=False),
        sa.Column('input_tokens', sa.BigInteger(), nullable=False),
        sa.Column('cached_tokens', sa.BigInteger(), nullable=False),
        sa.Column('output_tokens', sa.BigInteger(), nullable=False),
        sa.Column('attempt', sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(['shard_id'], ['shards.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('shard_id', 'seq'),
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('retry_of', sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('retry_of')
    op.drop_table('request_results')

"""fair share, quotas, deadlines and spend caps

Projects get a ``weight`` (their share of the fleet), ``quotas`` holds per project and model
limits on enqueued tokens and unfinished batches, and a batch gets its ``priority`` within its
project, the planner's ``estimated_completion_at`` and ``deadline_risk_at``, and ``max_cost``.
``ix_shards_started`` serves the fair share's window of work given to each project, and
``ix_shards_batch_status`` a claim's look for a batch's first queued shard.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-03 09:30:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('projects', schema=None) as batch_op:
        batch_op.add_column(sa.Column('weight', sa.Integer(), nullable=False, server_default='1'))
    op.create_table(
        'quotas',
        sa.Column('project_id', sa.String(length=64), nullable=False),
        sa.Column('model', sa.String(length=256), nullable=False),
        sa.Column('enqueued_tokens', sa.BigInteger(), nullable=True),
        sa.Column('unfinished_batches', sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('project_id', 'model'),
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('priority', sa.Integer(), nullable=False, server_default='0'))
        batch_op.add_column(sa.Column('estimated_completion_at', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('deadline_risk_at', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('max_cost', sa.Numeric(20, 10), nullable=True))
    op.create_index('ix_shards_started', 'shards', ['started_at'])
    op.create_index('ix_shards_batch_status', 'shards', ['batch_id', 'status', 'index'])


def downgrade() -> None:
    op.drop_index('ix_shards_batch_status', table_name='shards')
    op.drop_index('ix_shards_started', table_name='shards')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        for name in ('max_cost', 'deadline_risk_at', 'estimated_completion_at', 'priority'):
            batch_op.drop_column(name)
    op.drop_table('quotas')
    with op.batch_alter_table('projects', schema=None) as batch_op:
        batch_op.drop_column('weight')

"""result_cache: deterministic results served again to later batches of the same project

An entry is one succeeded request's response body, keyed by a hash of its model, the engine's
system_fingerprint and its canonical parsed body; it lives while its batch's output file does.
``batches.result_cache`` turns the cache off for one batch; ``cached_requests`` and the
``cache_saved_*`` usage are what a batch was answered from the cache (charged nothing).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 13:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'result_cache',
        sa.Column('batch_id', sa.String(length=64), nullable=False),
        sa.Column('key', sa.String(length=64), nullable=False),
        sa.Column('project_id', sa.String(length=64), nullable=False),
        sa.Column('body', sa.LargeBinary(), nullable=False),
        sa.Column('input_tokens', sa.BigInteger(), nullable=False),
        sa.Column('cached_tokens', sa.BigInteger(), nullable=False),
        sa.Column('output_tokens', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('batch_id', 'key'),
    )
    op.create_index('ix_result_cache_project_key', 'result_cache', ['project_id', 'key'])
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('result_cache', sa.Boolean(), nullable=False, server_default='1'))
        for name in ('cached_requests', 'cache_saved_input_tokens', 'cache_saved_cached_tokens',
                     'cache_saved_output_tokens'):
            batch_op.add_column(sa.Column(name, sa.BigInteger(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        for name in ('cache_saved_output_tokens', 'cache_saved_cached_tokens', 'cache_saved_input_tokens',
                     'cached_requests', 'result_cache'):
            batch_op.drop_column(name)
    op.drop_index('ix_result_cache_project_key', table_name='result_cache')
    op.drop_table('result_cache')

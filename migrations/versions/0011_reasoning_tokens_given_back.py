"""reasoning tokens counted, and shards given back: batches.reasoning_tokens,
shards.reasoning_tokens and request_results.reasoning_tokens, the output tokens of succeeded
requests spent thinking, which a batch's ``usage.output_tokens_details.reasoning_tokens`` sums (0
for rows made before); shards.given_back, the claims a worker gave back (shutting down, the shard
unreadable), which are not lost leases and so do not count against ``max_shard_attempts``

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-06 05:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

TABLES = ('batches', 'shards', 'request_results')


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('reasoning_tokens', sa.BigInteger(), server_default='0', nullable=False))
            if table == 'shards':
                batch_op.add_column(sa.Column('given_back', sa.BigInteger(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_column('given_back')
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('reasoning_tokens')

"""reasoning tokens counted: batches.reasoning_tokens, shards.reasoning_tokens and
request_results.reasoning_tokens, the output tokens of succeeded requests spent thinking, which a
batch's ``usage.output_tokens_details.reasoning_tokens`` sums (0 for rows made before)

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


def downgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('reasoning_tokens')

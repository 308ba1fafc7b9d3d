"""batches.request_unrun and shards.unrun_count: failed requests a cancel or expiry cut off

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('request_unrun', sa.BigInteger(), server_default='0', nullable=False))
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.add_column(sa.Column('unrun_count', sa.BigInteger(), server_default='0', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_column('unrun_count')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('request_unrun')

"""batches.deleted_at: a deleted Message Batch keeps its row, so its usage stays in the reports

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('deleted_at', sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('deleted_at')

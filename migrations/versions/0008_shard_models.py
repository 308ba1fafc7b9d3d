"""shards.model and shards.lines, batches.per_model: a Message Batch's requests run on several models

A shard belongs to one model, filled at its creation; the shards made before take their batch's.
A batch of several models keeps its prices, counts and usage per model in ``per_model``.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 12:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.add_column(sa.Column('model', sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column('lines', sa.JSON(none_as_null=True), nullable=True))
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('per_model', sa.JSON(none_as_null=True), nullable=True))
    op.execute("UPDATE shards SET model = (SELECT batches.model FROM batches WHERE batches.id = shards.batch_id)")


def downgrade() -> None:
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('per_model')
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_column('lines')
        batch_op.drop_column('model')

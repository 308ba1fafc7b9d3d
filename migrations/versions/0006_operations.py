"""operations: admin keys, usage reports (issue 18)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 13:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.add_column(sa.Column('admin', sa.Boolean(), server_default='0', nullable=False))
    op.create_table(
        'dashboard_sessions',
        sa.Column('token_hash', sa.String(length=64), nullable=False),
        sa.Column('api_key_id', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('expires_at', sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(['api_key_id'], ['api_keys.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('token_hash'),
    )
    op.create_index(op.f('ix_dashboard_sessions_api_key_id'), 'dashboard_sessions', ['api_key_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_dashboard_sessions_api_key_id'), table_name='dashboard_sessions')
    op.drop_table('dashboard_sessions')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_column('admin')

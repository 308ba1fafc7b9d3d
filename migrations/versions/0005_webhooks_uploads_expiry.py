"""webhooks, uploads and expiry (issue 17)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 13:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.add_column(sa.Column('expires_at', sa.BigInteger(), nullable=True))
        batch_op.create_index(batch_op.f('ix_files_expires_at'), ['expires_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_files_deleted_at'), ['deleted_at'], unique=False)
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('output_expires_after', sa.BigInteger(), nullable=True))

    op.create_table(
        'webhook_endpoints',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('project_id', sa.String(length=64), nullable=False),
        sa.Column('name', sa.String(length=200), nullable=False),
        sa.Column('url', sa.String(length=2048), nullable=False),
        sa.Column('event_types', sa.JSON(), nullable=False),
        sa.Column('secret', sa.String(length=128), nullable=False),
        sa.Column('previous_secret', sa.String(length=128), nullable=True),
        sa.Column('previous_secret_expires_at', sa.BigInteger(), nullable=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('updated_at', sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('webhook_endpoints', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_webhook_endpoints_project_id'), ['project_id'], unique=False)

    op.create_table(
        'webhook_deliveries',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('event_id', sa.String(length=64), nullable=False),
        sa.Column('endpoint_id', sa.String(length=64), nullable=False),
        sa.Column('project_id', sa.String(length=64), nullable=False),
        sa.Column('batch_id', sa.String(length=64), nullable=False),
        sa.Column('event_type', sa.String(length=64), nullable=False),
        sa.Column('payload', sa.Text(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('next_attempt_at', sa.BigInteger(), nullable=False),
        sa.Column('lease_expires_at', sa.BigInteger(), nullable=True),
        sa.Column('last_attempt_at', sa.BigInteger(), nullable=True),
        sa.Column('last_status_code', sa.Integer(), nullable=True),
        sa.Column('last_error', sa.Text(), nullable=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('delivered_at', sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(['endpoint_id'], ['webhook_endpoints.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('webhook_deliveries', schema=None) as batch_op:
        batch_op.create_index('ix_webhook_deliveries_due', ['status', 'next_attempt_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_webhook_deliveries_endpoint_id'), ['endpoint_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_webhook_deliveries_batch_id'), ['batch_id'], unique=False)

    op.create_table(
        'uploads',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('project_id', sa.String(length=64), nullable=False),
        sa.Column('filename', sa.String(length=512), nullable=False),
        sa.Column('purpose', sa.String(length=32), nullable=False),
        sa.Column('mime_type', sa.String(length=255), nullable=False),
        sa.Column('bytes', sa.BigInteger(), nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('file_expires_after', sa.BigInteger(), nullable=True),
        sa.Column('file_id', sa.String(length=64), nullable=True),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.Column('expires_at', sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('uploads', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_uploads_project_id'), ['project_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_uploads_expires_at'), ['expires_at'], unique=False)

    op.create_table(
        'upload_parts',
        sa.Column('id', sa.String(length=64), nullable=False),
        sa.Column('upload_id', sa.String(length=64), nullable=False),
        sa.Column('bytes', sa.BigInteger(), nullable=False),
        sa.Column('storage_key', sa.String(length=512), nullable=False),
        sa.Column('created_at', sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(['upload_id'], ['uploads.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    with op.batch_alter_table('upload_parts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_upload_parts_upload_id'), ['upload_id'], unique=False)


def downgrade() -> None:
    op.drop_table('upload_parts')
    op.drop_table('uploads')
    op.drop_table('webhook_deliveries')
    op.drop_table('webhook_endpoints')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_column('output_expires_after')
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_files_deleted_at'))
        batch_op.drop_index(batch_op.f('ix_files_expires_at'))
        batch_op.drop_column('expires_at')

"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 16:46:34.284669
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('projects',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    op.create_table('api_keys',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('revoked_at', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_hash')
    )
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_api_keys_project_id'), ['project_id'], unique=False)

    op.create_table('batches',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=True),
    sa.Column('input_file_id', sa.String(length=64), nullable=False),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('errors', sa.JSON(), nullable=True),
    sa.Column('output_file_id', sa.String(length=64), nullable=True),
    sa.Column('error_file_id', sa.String(length=64), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('idempotency_key', sa.String(length=256), nullable=True),
    sa.Column('request_fingerprint', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('in_progress_at', sa.BigInteger(), nullable=True),
    sa.Column('expires_at', sa.BigInteger(), nullable=False),
    sa.Column('finalizing_at', sa.BigInteger(), nullable=True),
    sa.Column('completed_at', sa.BigInteger(), nullable=True),
    sa.Column('failed_at', sa.BigInteger(), nullable=True),
    sa.Column('expired_at', sa.BigInteger(), nullable=True),
    sa.Column('cancelling_at', sa.BigInteger(), nullable=True),
    sa.Column('cancelled_at', sa.BigInteger(), nullable=True),
    sa.Column('validation_lease_expires_at', sa.BigInteger(), nullable=True),
    sa.Column('request_total', sa.BigInteger(), nullable=False),
    sa.Column('request_completed', sa.BigInteger(), nullable=False),
    sa.Column('request_failed', sa.BigInteger(), nullable=False),
    sa.Column('input_tokens', sa.BigInteger(), nullable=False),
    sa.Column('cached_tokens', sa.BigInteger(), nullable=False),
    sa.Column('output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('estimated_input_tokens', sa.BigInteger(), nullable=False),
    sa.Column('estimated_output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('currency', sa.String(length=8), nullable=False),
    sa.Column('price_input', sa.Numeric(precision=20, scale=10), nullable=False),
    sa.Column('price_cached_input', sa.Numeric(precision=20, scale=10), nullable=False),
    sa.Column('price_output', sa.Numeric(precision=20, scale=10), nullable=False),
    sa.Column('discount_percent', sa.Numeric(precision=6, scale=3), nullable=False),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('project_id', 'idempotency_key', name='uq_batches_idempotency')
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_batches_input_file_id'), ['input_file_id'], unique=False)
        batch_op.create_index('ix_batches_project_created', ['project_id', 'created_at', 'id'], unique=False)
        batch_op.create_index('ix_batches_status', ['status'], unique=False)

    op.create_table('files',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('project_id', sa.String(length=64), nullable=False),
    sa.Column('filename', sa.String(length=512), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('storage_key', sa.String(length=512), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('deleted_at', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['project_id'], ['projects.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.create_index('ix_files_project_created', ['project_id', 'created_at', 'id'], unique=False)

    op.create_table('shards',
    sa.Column('id', sa.String(length=80), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('first_line', sa.BigInteger(), nullable=False),
    sa.Column('last_line', sa.BigInteger(), nullable=False),
    sa.Column('start_byte', sa.BigInteger(), nullable=False),
    sa.Column('end_byte', sa.BigInteger(), nullable=False),
    sa.Column('request_count', sa.BigInteger(), nullable=False),
    sa.Column('prompt_tokens', sa.BigInteger(), nullable=False),
    sa.Column('estimated_output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('tokens_counted', sa.Boolean(), nullable=False),
    sa.Column('prompt_token_counts', sa.JSON(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('lease_owner', sa.String(length=200), nullable=True),
    sa.Column('lease_expires_at', sa.BigInteger(), nullable=True),
    sa.Column('output_key', sa.String(length=512), nullable=True),
    sa.Column('error_key', sa.String(length=512), nullable=True),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('completed_count', sa.BigInteger(), nullable=False),
    sa.Column('failed_count', sa.BigInteger(), nullable=False),
    sa.Column('input_tokens', sa.BigInteger(), nullable=False),
    sa.Column('cached_tokens', sa.BigInteger(), nullable=False),
    sa.Column('output_tokens', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.BigInteger(), nullable=False),
    sa.Column('started_at', sa.BigInteger(), nullable=True),
    sa.Column('finished_at', sa.BigInteger(), nullable=True),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('batch_id', 'index', name='uq_shards_batch_index')
    )
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.create_index('ix_shards_status_lease', ['status', 'lease_expires_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('shards', schema=None) as batch_op:
        batch_op.drop_index('ix_shards_status_lease')

    op.drop_table('shards')
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_index('ix_files_project_created')

    op.drop_table('files')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index('ix_batches_status')
        batch_op.drop_index('ix_batches_project_created')
        batch_op.drop_index(batch_op.f('ix_batches_input_file_id'))

    op.drop_table('batches')
    with op.batch_alter_table('api_keys', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_api_keys_project_id'))

    op.drop_table('api_keys')
    op.drop_table('projects')

"""What a batch's end sets off, in the transaction that gives it its final status
(``states.transition`` calls ``batch_ended`` there, and only there): its output and error files
get the ``expires_at`` of the batch's ``output_expires_after``, and its event goes to the webhooks'
outbox, which writes one delivery row per subscribed endpoint. Both are committed with the status
or not at all.

The outbox is called, not registered as a listener: a listener that some process forgot to
register would lose events without a sound, and ``webhooks`` imports nothing of ``batches``, so
the call runs downward."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from batchapi.db.models import Batch, File
from batchapi.webhooks import outbox
from batchapi.webhooks.events import event_type_of


def batch_ended(session: Session, batch_id: str, status: str) -> None:
    # columns, not the ORM object: the session may hold the row as it was before the UPDATE
    row = session.execute(
        select(Batch.project_id, Batch.output_file_id, Batch.error_file_id, Batch.output_expires_after)
        .where(Batch.id == batch_id)
    ).one()
    files = [fid for fid in (row.output_file_id, row.error_file_id) if fid]
    if row.output_expires_after and files:
        session.execute(
            update(File).where(File.id.in_(files)).values(expires_at=File.created_at + row.output_expires_after)
            .execution_options(synchronize_session=False)
        )
    outbox.enqueue(session, row.project_id, batch_id, event_type_of(status))

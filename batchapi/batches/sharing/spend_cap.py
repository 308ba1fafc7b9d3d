"""The spend cap: a batch created with ``max_cost`` stops, as a cancel stops it, once its cost
reaches the cap. The check runs where usage is added (``request_results.add_counts``), in the
same transaction and under the batch's row lock that UPDATE took, so the cost it reads is the
batch's own up to that moment. Requests still running when the cap is reached are cut short as a
cancel cuts them; every finished request is kept and charged, so the cost may pass the cap by what
finished as it was reached (the rest of the group of results that reached it, and what other
workers finish before they see the stop). The batch's ``errors`` say why it stopped
(``max_cost_reached``). A batch with nothing left to run is not stopped: it ends as it would.
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from batchapi.batches import states
from batchapi.batches.billing import cost, format_amount
from batchapi.batches.states import BatchStatus
from batchapi.db.models import Batch
from batchapi.openai.errors import ErrorCode

log = logging.getLogger(__name__)


def stop_at_cap(session: Session, batch_id: str) -> bool:
    """Move the batch to ``cancelling`` if its cost reached its ``max_cost``; whether it did."""
    batch = session.execute(
        select(Batch).where(Batch.id == batch_id).execution_options(populate_existing=True)
    ).scalar_one()
    if batch.max_cost is None or batch.status != BatchStatus.IN_PROGRESS:
        return False
    if batch.request_completed + batch.request_failed >= batch.request_total:
        return False  # every request has ended: a cancel would cut nothing short
    spent = cost(batch).amount
    if spent < batch.max_cost:
        return False
    message = (f"The batch's cost reached its max_cost of {format_amount(batch.max_cost)} {batch.currency} "
               f"({format_amount(spent)} {batch.currency}); it was stopped as a cancel stops a batch, and its "
               "finished requests were kept.")
    errors = {"object": "list", "data": [{"code": str(ErrorCode.MAX_COST_REACHED), "message": message,
                                          "param": "max_cost", "line": None}]}
    moved = states.transition(session, batch_id, BatchStatus.CANCELLING, sources={BatchStatus.IN_PROGRESS},
                              errors=errors)
    if moved:
        log.info("batch %s reached its max_cost: %s", batch_id, message)
    return moved

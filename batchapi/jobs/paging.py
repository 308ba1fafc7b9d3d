"""Cursor paging for listings ordered by (created_at, id); ids are time-ordered too."""

from __future__ import annotations

from sqlalchemy import ColumnElement, and_, or_


def after_cursor(model, created_at: int, row_id: str, newest_first: bool) -> ColumnElement[bool]:
    """Rows that come after the row (``created_at``, ``row_id``) in the listing order."""
    if newest_first:
        return or_(model.created_at < created_at, and_(model.created_at == created_at, model.id < row_id))
    return or_(model.created_at > created_at, and_(model.created_at == created_at, model.id > row_id))

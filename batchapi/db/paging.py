"""Cursor paging for listings ordered by (created_at, id); ids are time-ordered too."""

from __future__ import annotations

from sqlalchemy import ColumnElement, Select, and_, or_
from sqlalchemy.orm import Session


def after_cursor(model, created_at: int, row_id: str, newest_first: bool) -> ColumnElement[bool]:
    """Rows that come after the row (``created_at``, ``row_id``) in the listing order."""
    if newest_first:
        return or_(model.created_at < created_at, and_(model.created_at == created_at, model.id < row_id))
    return or_(model.created_at > created_at, and_(model.created_at == created_at, model.id > row_id))


def page(session: Session, query: Select, model, cursor, limit: int, newest_first: bool) -> tuple[list, bool]:
    """Up to ``limit`` rows of ``query`` after the row ``cursor`` (or from the start), and whether more follow."""
    if cursor is not None:
        query = query.where(after_cursor(model, cursor.created_at, cursor.id, newest_first))
    keys = (model.created_at.desc(), model.id.desc()) if newest_first else (model.created_at, model.id)
    rows = list(session.scalars(query.order_by(*keys).limit(limit + 1)))
    return rows[:limit], len(rows) > limit

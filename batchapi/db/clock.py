"""The clock the database uses: Unix seconds, as the API shows every timestamp."""

from __future__ import annotations

import time


def now() -> int:
    return int(time.time())

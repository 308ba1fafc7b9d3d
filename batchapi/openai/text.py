"""Text that can be stored and written back: no lone UTF-16 surrogates.

JSON lets an unpaired ``"\\ud800"`` escape through and Python keeps it in a ``str``, but it has
no UTF-8 form, so the database driver, the response encoder and the result files all fail on
it, long after it came in. Text from a request (a line's strings, a batch's metadata, a file
name) is checked here on its way in and refused there with a clear error.
"""

from __future__ import annotations

import re

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (the only characters that do not are surrogates)."""
    return _LONE_SURROGATE.search(text) is None

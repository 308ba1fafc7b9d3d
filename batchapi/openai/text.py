"""Text that can be stored and written back: no lone UTF-16 surrogates.

JSON lets an unpaired ``"\\ud800"`` escape through and Python keeps it in a ``str``, but it has
no UTF-8 form, so the database driver, the response encoder and the result files all fail on
it, long after it came in. Text from a request (a line's strings, a batch's metadata, a file
name) is checked here on its way in and refused there with a clear error.
"""

from __future__ import annotations

import re

from batchapi.errors import InvalidRequest
from batchapi.openai.errors import ErrorCode

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def storable(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (the only characters that do not are surrogates)."""
    return _LONE_SURROGATE.search(text) is None


def lone_surrogate(where: str) -> str:
    """The message for text that fails ``storable``."""
    return (f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not valid "
            "Unicode text")


def check_text(value: str | None, param: str) -> None:
    """Refuse request text that has no UTF-8 form before anything is stored."""
    if value is not None and not storable(value):
        raise InvalidRequest(lone_surrogate(f"'{param}'"), param, code=str(ErrorCode.INVALID_ENCODING))

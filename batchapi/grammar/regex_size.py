"""The fewest characters a string matching a regular expression holds: a lower bound, read off the
pattern (a literal, a class or an escape is one, a group the least of its branches, a quantifier
its least count times its atom; anchors, lookarounds and back references nothing). A pattern it
cannot read counts 0, which is always a lower bound. For ``openai.schema``'s patterns, which
Python's ``re`` has compiled already."""

from __future__ import annotations

import re
from functools import lru_cache

COUNT = re.compile(r"\{(\d*)(?:,(\d*))?\}")  # Python reads {,n} as 0 to n
ZERO_WIDTH_ESCAPES = set("bBAZzG")
HEX_DIGITS = {"x": 2, "u": 4, "U": 8}


class _Unread(Exception):
    pass


@lru_cache(maxsize=1024)
def shortest_match(pattern: str) -> int:
    """At least how many characters a string holds that ``pattern`` matches anywhere in (0: unsure)."""
    try:
        size, end = _branches(pattern, 0)
    except (_Unread, IndexError):
        return 0
    return size if end == len(pattern) else 0


def _branches(p: str, i: int) -> tuple[int, int]:
    """The alternation from ``i`` up to an unmatched ')' or the end: its least width and where it stops."""
    size, i = _sequence(p, i)
    while i < len(p) and p[i] == "|":
        other, i = _sequence(p, i + 1)
        size = min(size, other)
    return size, i


def _sequence(p: str, i: int) -> tuple[int, int]:
    total = 0
    while i < len(p) and p[i] not in "|)":
        width, i = _atom(p, i)
        count, i = _quantifier(p, i)
        total += width * count
    return total, i


def _quantifier(p: str, i: int) -> tuple[int, int]:
    if i >= len(p):
        return 1, i
    if p[i] in "*?+":
        count, i = (1 if p[i] == "+" else 0), i + 1
    elif (m := COUNT.match(p, i)) is not None and m.group(0) != "{}":
        count, i = int(m.group(1) or 0), m.end()
    else:
        return 1, i
    if i < len(p) and p[i] in "?+":  # lazy or possessive
        i += 1
    return count, i


def _atom(p: str, i: int) -> tuple[int, int]:
    c = p[i]
    if c == "(":
        return _group(p, i + 1)
    if c == "[":
        return 1, _class_end(p, i + 1)
    if c == "\\":
        return _escape(p, i + 1)
    if c in "^$":
        return 0, i + 1
    return 1, i + 1


def _group(p: str, i: int) -> tuple[int, int]:
    """A group whose '(' is just before ``i``."""
    zero = False
    if p.startswith("?", i):
        if p.startswith(("?=", "?!"), i):
            zero, i = True, i + 2
        elif p.startswith(("?<=", "?<!"), i):
            zero, i = True, i + 3
        elif p.startswith(("?P<", "?<"), i):
            i = p.index(">", i) + 1
        elif p.startswith(("?P=", "?#"), i):
            return 0, p.index(")", i) + 1
        else:  # (?:...), (?flags:...) or a bare (?flags)
            m = re.compile(r"\?[a-zA-Z-]*([:)])").match(p, i)
            if m is None:
                raise _Unread
            if m.group(1) == ")":
                return 0, m.end()
            i = m.end()
    size, i = _branches(p, i)
    if p[i] != ")":
        raise _Unread
    return (0 if zero else size), i + 1


def _class_end(p: str, i: int) -> int:
    """Just past the ']' that closes a class whose '[' is just before ``i``."""
    if p.startswith("^", i):
        i += 1
    if p.startswith("]", i):
        i += 1
    while p[i] != "]":
        i += 2 if p[i] == "\\" else 1
    return i + 1


def _escape(p: str, i: int) -> tuple[int, int]:
    """An escape whose '\\' is just before ``i``."""
    c = p[i]
    if c in ZERO_WIDTH_ESCAPES:
        return 0, i + 1
    if c in "123456789":  # a back reference may match the empty string
        while i < len(p) and p[i].isdigit():
            i += 1
        return 0, i
    if c in HEX_DIGITS:
        if p.startswith("{", i + 1):
            return 1, p.index("}", i) + 1
        return 1, i + 1 + HEX_DIGITS[c]
    if c in "pPN" and p.startswith("{", i + 1):
        return 1, p.index("}", i) + 1
    return 1, i + 1

"""Structured outputs: JSON grammars compiled with llguidance and applied as token bitmasks.

The names load on first use, so that ``batchapi.grammar.spec`` stays plain Python for the
scheduler side and ``check`` needs no torch (validation runs it in the API process), while the
rest brings in torch and llguidance.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchapi.grammar.check import GrammarError, check_grammar
    from batchapi.grammar.compiler import CompiledGrammar, GrammarCompiler
    from batchapi.grammar.matcher import Matcher, apply_masks
    from batchapi.grammar.spec import GrammarSpec

_MODULE_OF = {
    "CompiledGrammar": "compiler",
    "GrammarCompiler": "compiler",
    "GrammarError": "check",
    "check_grammar": "check",
    "Matcher": "matcher",
    "apply_masks": "matcher",
    "GrammarSpec": "spec",
}
__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarSpec",
    "Matcher",
    "apply_masks",
    "check_grammar",
]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"batchapi.grammar.{_MODULE_OF[name]}"), name)

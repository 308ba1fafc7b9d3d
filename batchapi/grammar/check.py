"""A spec as llguidance grammar text, and the check that the grammar engine takes it, without a tokenizer. No torch:
validation (in the API process) checks each distinct schema of a file here before the batch runs, and, given the
bytes the model's context can hold, that the schema's shortest document fits in them (``grammar.size``): the grammar
engine takes ``"pattern": "^a{1000000}$"`` without complaint, and a request held to it would only be cut off."""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance

from batchapi.grammar.size import shortest_document
from batchapi.grammar.spec import GrammarSpec

# no whitespace between JSON tokens and compact "," ":" separators, whatever a schema's own
# "x-guidance" asks: a small model can otherwise loop on spaces and newlines forever
JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": None, "item_separator": ",", "key_separator": ":"}
JSON_OBJECT_SCHEMA = '{"type":"object"}'


class GrammarError(ValueError):
    """The grammar engine refused the schema; str() is a clear message for the user."""


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(verbose_errors=False)  # messages for users, without parser dumps


def grammar_text(spec: GrammarSpec) -> str:
    schema = spec.schema if spec.kind == "json_schema" else JSON_OBJECT_SCHEMA
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as exc:  # not a JSON object
        raise GrammarError(f"invalid JSON schema: {exc}") from None


def check_grammar(spec: GrammarSpec, context_bytes: int | None = None) -> None:
    """Raise GrammarError if the grammar engine would refuse ``spec`` (~1 ms the first time; a
    file's lines usually share one schema, so each distinct spec is checked once), or if no
    document of it fits in ``context_bytes`` (the model's context times its longest token's bytes:
    more than any output can hold)."""
    problem = _problem(spec)
    if problem is None and context_bytes is not None and spec.kind == "json_schema":
        problem = _too_long(spec, context_bytes)
    if problem is not None:
        raise GrammarError(problem)


@lru_cache(maxsize=256)
def _too_long(spec: GrammarSpec, context_bytes: int) -> str | None:
    shortest = shortest_document(json.loads(spec.schema), explain_over=context_bytes + 1)
    if not shortest.exact or shortest.size <= context_bytes:
        return None
    where = "#" + "".join(f"/{token}" for token in shortest.pointer)
    return (f"no document of this schema fits the model's context: the shortest is at least {int(shortest.size)} "
            f"bytes (most of them at '{where}'), and the context holds at most {context_bytes}")


@lru_cache(maxsize=256)
def _problem(spec: GrammarSpec) -> str | None:
    try:
        text = grammar_text(spec)
    except GrammarError as exc:
        return str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, limits=parser_limits())
    return f"unsupported JSON schema: {messages[0]}" if is_error else None

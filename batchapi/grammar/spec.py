"""What a request's output must match. Plain Python: the scheduler side imports it without torch or
a grammar library, and a spec is the key of the compiled-grammar cache."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_object", "json_schema")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json_object" | "json_schema"
    schema: str = ""  # json_schema: the schema as compact JSON text; "" for json_object

    def __post_init__(self):
        assert self.kind in KINDS, f"unknown grammar kind {self.kind!r}, expected one of {KINDS}"
        assert (self.kind == "json_schema") == bool(self.schema), f"{self.kind} with schema {self.schema!r}"

    @classmethod
    def json_schema(cls, schema: dict) -> GrammarSpec:
        # compact, so equal schemas share one compile whatever their spacing; keys are not sorted, as
        # a document's keys come out in the schema's order (OpenAI's rule: "reasoning" before "answer")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

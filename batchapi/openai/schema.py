"""The JSON schemas a request may carry, checked against the subset the grammar can enforce.

A schema comes in as ``response_format.json_schema.schema`` or as a tool's
``function.parameters``. ``check_schema`` refuses, with code ``invalid_json_schema`` (OpenAI's
own) and the JSON path of the offending part, everything outside this subset:

- ``type`` (one or a list of string, number, integer, boolean, object, array, null), ``enum``,
  ``const``, ``anyOf``;
- objects: ``properties``, ``required``, ``additionalProperties`` (a boolean or a schema);
- arrays: ``items`` (one schema), ``minItems``, ``maxItems``;
- strings: ``minLength``, ``maxLength``, ``pattern`` (it must compile with Python's ``re``, a
  proxy for the ECMA dialect), ``format`` (one of ``FORMATS``);
- numbers: ``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum`` (numbers, not the
  draft-4 booleans);
- ``$defs`` / ``definitions`` and ``$ref`` to a local ``#...`` pointer that names a schema of
  the same document (recursion allowed, a cycle of bare refs not), beside annotations only;
- annotations: ``description``, ``title``, ``default``, ``examples``, ``$comment``, ``$schema``.

Refused by name: ``allOf``, ``oneOf``, ``not``, ``if``/``then``/``else``, ``patternProperties``,
``dependent*``, ``unevaluated*``, ``contains``, ``uniqueItems``, ``prefixItems``,
``multipleOf`` (a token grammar cannot follow divisibility), ``nullable`` (write a type list
with ``null``), ``$id`` and remote refs. Values nest at most ``MAX_DEPTH`` levels, and a schema
holds at most ``MAX_PROPERTIES`` properties and ``MAX_ENUM_VALUES`` enum values in all.

In strict mode (OpenAI's ``strict: true``) the root is an object, and every object sets
``additionalProperties: false`` and lists all its properties in ``required``.

A schema that no finite value satisfies (a required property whose ``$ref`` leads back to itself,
directly or through ``$defs``, with no optional way out) is refused too, naming the ``$ref`` that
closes the recursion (``grammar.size``); validation also refuses a schema whose shortest document
cannot fit the model's context (``grammar.check``).
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from typing import Any

from batchapi.grammar.size import ref_target, shortest_document
from batchapi.openai.errors import ErrorCode, RequestError

TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment", "$schema"})
KEYWORDS = ANNOTATIONS | {
    "type", "enum", "const", "anyOf", "properties", "required", "additionalProperties", "items", "minItems",
    "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "$defs", "definitions", "$ref",
}
HINTS = {
    "allOf": "; merge the schemas into one",
    "oneOf": "; use 'anyOf'",
    "nullable": "; give 'type' as a list with 'null', e.g. [\"string\", \"null\"]",
    "prefixItems": "; 'items' takes one schema for every element",
}
MAX_DEPTH = 10  # levels of values nested in values, as OpenAI allows
MAX_NESTING = 40  # schemas nested in schemas by any keyword (anyOf, $defs too): bounds the walk
MAX_PROPERTIES = 5000
MAX_ENUM_VALUES = 1000

Pointer = tuple[str, ...]


def check_schema(schema: Any, param: str, *, strict: bool = False) -> None:
    """Refuse ``schema`` (found at ``param`` in the body) unless the grammar can enforce it."""
    walk = _Walk(strict)
    walk.schema(schema, (), param, depth=0, nesting=0)
    walk.check_refs()
    endless = _endless(json.dumps(schema, separators=(",", ":"))) if walk.refs else None  # no $ref: all finite
    if endless is not None:
        raise _error(walk.paths.get(endless, param),
                     "no finite JSON value satisfies the schema: this required value leads back to itself through "
                     "'$ref' with no way to end (make a property on the way optional, or allow another type such "
                     "as null)")
    if strict and not (isinstance(schema.get("type"), str) and schema["type"] == "object"):
        raise _error(param, "in strict mode the root schema must be of type 'object'")


@lru_cache(maxsize=256)
def _endless(schema: str) -> Pointer | None:
    """Where a schema (compact JSON text: a file's lines mostly share one) recurses with no way out, if it does."""
    shortest = shortest_document(json.loads(schema))
    return shortest.pointer if math.isinf(shortest.size) else None


def _error(path: str, problem: str) -> RequestError:
    return RequestError(f"{path}: {problem}", path, ErrorCode.INVALID_JSON_SCHEMA)


def _child(path: str, key: str) -> str:
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_$][A-Za-z0-9_$-]*", key) else f"{path}[{key!r}]"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Walk:
    """One pass over a schema: checks each part, counts what is bounded, and notes every
    schema's pointer so that each ``$ref`` can be checked to name one."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.properties = 0
        self.enum_values = 0
        self.paths: dict[Pointer, str] = {}  # every schema's pointer and its path in the body
        self.refs: dict[Pointer, tuple[Pointer, str]] = {}  # a $ref's schema: its target and path

    def schema(self, node: Any, pointer: Pointer, path: str, depth: int, nesting: int) -> None:
        if not isinstance(node, dict):
            raise _error(path, f"a schema must be an object, got {type(node).__name__}")
        if depth > MAX_DEPTH:
            raise _error(path, f"values may nest at most {MAX_DEPTH} levels deep")
        if nesting > MAX_NESTING:
            raise _error(path, f"schemas may nest at most {MAX_NESTING} levels deep")
        for key in node:
            if key not in KEYWORDS:
                raise _error(path, f"the keyword {key!r} is not supported{HINTS.get(key, '')}")
        self.paths[pointer] = path
        if "$ref" in node:
            self.ref(node, pointer, path)
            return
        self.type(node, path)
        self.values(node, path)
        self.strings(node, path)
        self.numbers(node, path)
        self.arrays(node, pointer, path, depth, nesting)
        self.objects(node, pointer, path, depth, nesting)
        self.subschemas(node, pointer, path, depth, nesting)

    def ref(self, node: dict, pointer: Pointer, path: str) -> None:
        ref = node["$ref"]
        others = sorted(set(node) - ANNOTATIONS - {"$ref"})
        if others:
            raise _error(path, f"'$ref' may stand beside annotations only, not {others[0]!r}")
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise _error(f"{path}.$ref", f"only local references ('#' or '#/...') are supported, got {ref!r}")
        self.refs[pointer] = (ref_target(ref), f"{path}.$ref")

    def check_refs(self) -> None:
        for target, path in self.refs.values():
            if target not in self.paths:
                raise _error(path, f"the reference '#/{'/'.join(target)}' does not name a schema of this document")
        for start in self.refs:
            seen, at = {start}, self.refs[start][0]
            while at in self.refs:
                if at in seen:
                    raise _error(self.refs[start][1], "the references form a cycle that never reaches a schema")
                seen.add(at)
                at = self.refs[at][0]

    def type(self, node: dict, path: str) -> None:
        if "type" not in node:
            return
        kinds = node["type"] if isinstance(node["type"], list) else [node["type"]]
        if not kinds or len(set(map(repr, kinds))) != len(kinds):
            raise _error(f"{path}.type", "a list of types must be non-empty and hold no repeats")
        for kind in kinds:
            if kind not in TYPES:
                raise _error(f"{path}.type", f"unknown type {kind!r}; expected one of {list(TYPES)}")

    def values(self, node: dict, path: str) -> None:
        if "enum" in node:
            if not isinstance(node["enum"], list) or not node["enum"]:
                raise _error(f"{path}.enum", "'enum' must be a non-empty array")
            self.enum_values += len(node["enum"])
            if self.enum_values > MAX_ENUM_VALUES:
                raise _error(f"{path}.enum", f"a schema may hold at most {MAX_ENUM_VALUES} enum values in all")
        if "examples" in node and not isinstance(node["examples"], list):
            raise _error(f"{path}.examples", "'examples' must be an array")
        for key in ("description", "title", "$comment"):
            if key in node and not isinstance(node[key], str):
                raise _error(f"{path}.{key}", f"'{key}' must be a string")

    def strings(self, node: dict, path: str) -> None:
        self.bounds(node, path, "minLength", "maxLength")
        if "pattern" in node:
            pattern = node["pattern"]
            if not isinstance(pattern, str):
                raise _error(f"{path}.pattern", "'pattern' must be a string")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise _error(f"{path}.pattern",
                             f"the pattern {pattern!r} is not a valid regular expression ({exc})") from None
        if "format" in node and node["format"] not in FORMATS:
            raise _error(f"{path}.format", f"the format {node['format']!r} is not supported; expected one of "
                                           f"{sorted(FORMATS)}")

    def numbers(self, node: dict, path: str) -> None:
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in node and not _is_number(node[key]):
                raise _error(f"{path}.{key}", f"'{key}' must be a number")
        low = [node[k] for k in ("minimum", "exclusiveMinimum") if k in node]
        high = [node[k] for k in ("maximum", "exclusiveMaximum") if k in node]
        if low and high and max(low) > min(high):
            raise _error(path, "no number lies within its bounds")

    def arrays(self, node: dict, pointer: Pointer, path: str, depth: int, nesting: int) -> None:
        self.bounds(node, path, "minItems", "maxItems")
        if "items" in node:
            if isinstance(node["items"], list):
                raise _error(f"{path}.items", "'items' must be one schema (arrays of item schemas are not supported)")
            self.schema(node["items"], (*pointer, "items"), f"{path}.items", depth + 1, nesting + 1)

    def bounds(self, node: dict, path: str, low: str, high: str) -> None:
        for key in (low, high):
            if key in node and not (_is_int(node[key]) and node[key] >= 0):
                raise _error(f"{path}.{key}", f"'{key}' must be a non-negative integer")
        if low in node and high in node and node[low] > node[high]:
            raise _error(path, f"'{low}' is greater than '{high}'")

    def objects(self, node: dict, pointer: Pointer, path: str, depth: int, nesting: int) -> None:
        properties = node.get("properties", {})
        if not isinstance(properties, dict):
            raise _error(f"{path}.properties", "'properties' must be an object")
        required = node.get("required", [])
        if not (isinstance(required, list) and all(isinstance(r, str) for r in required)) \
                or len(set(required)) != len(required):
            raise _error(f"{path}.required", "'required' must be an array of distinct property names")
        extra = node.get("additionalProperties", True)
        if not isinstance(extra, bool):
            self.schema(extra, (*pointer, "additionalProperties"), f"{path}.additionalProperties", depth + 1,
                        nesting + 1)
        unknown = [name for name in required if name not in properties]
        if extra is False and unknown:
            raise _error(f"{path}.required", f"{unknown[0]!r} is required but not among the properties")
        self.properties += len(properties)
        if self.properties > MAX_PROPERTIES:
            raise _error(f"{path}.properties", f"a schema may hold at most {MAX_PROPERTIES} properties in all")
        for name, sub in properties.items():
            self.schema(sub, (*pointer, "properties", name), _child(f"{path}.properties", name), depth + 1,
                        nesting + 1)
        kinds = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if self.strict and ("object" in kinds or "properties" in node):
            self.strict_object(node, path, properties, required)

    def strict_object(self, node: dict, path: str, properties: dict, required: list) -> None:
        if node.get("additionalProperties") is not False:
            raise _error(path, "in strict mode every object must set 'additionalProperties' to false")
        missing = [name for name in properties if name not in required]
        if missing:
            raise _error(f"{path}.required", f"in strict mode every property must be required; {missing[0]!r} is "
                                             "not (allow null in its type to make it optional)")

    def subschemas(self, node: dict, pointer: Pointer, path: str, depth: int, nesting: int) -> None:
        if "anyOf" in node:
            options = node["anyOf"]
            if not isinstance(options, list) or not options:
                raise _error(f"{path}.anyOf", "'anyOf' must be a non-empty array of schemas")
            for i, sub in enumerate(options):
                self.schema(sub, (*pointer, "anyOf", str(i)), f"{path}.anyOf[{i}]", depth, nesting + 1)
        for key in ("$defs", "definitions"):
            if key not in node:
                continue
            if not isinstance(node[key], dict):
                raise _error(f"{path}.{key}", f"'{key}' must be an object of schemas")
            for name, sub in node[key].items():
                self.schema(sub, (*pointer, key, name), _child(f"{path}.{key}", name), depth, nesting + 1)

"""The shortest JSON document a schema admits: whether any finite one does, and how many bytes it
takes at the least. Plain Python, on the schema subset ``openai.schema`` admits.

The grammar engine compiles a schema whose every document is infinite (a required property whose
``$ref`` leads back to itself) or longer than any context (``"pattern": "^a{1000000}$"``) without
complaint, and a request held to it can only run until it is cut off. So each schema node gets a
lower bound on the compact JSON bytes of its shortest value, ``inf`` where no finite value exists:
``null`` and booleans 4, a number 1, a string its quotes and the longer of ``minLength`` and its
pattern's shortest match, an array ``minItems`` items, an object its required properties. A node
with ``$ref`` takes its target's bound; the bounds of ``$ref`` targets are found by rounds until
none changes (each round can only lower them, and a shortest value never passes through one target
twice, so there are at most as many rounds as targets, plus one). The grammar engine finds the rest
of what no value satisfies (an ``enum`` of the wrong type, bounds with no integer between them).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from urllib.parse import unquote

from batchapi.grammar.regex_size import shortest_match

INF = math.inf
MAX_VISITS = 200_000  # node visits over all rounds; a schema past it is left to the grammar engine
Pointer = tuple[str, ...]
ALL_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
DEFS = ("$defs", "definitions")
SKIPPED = ("enum", "const", "default", "examples", *DEFS)  # no schemas of the value under them
SCALAR_BYTES = {"null": 4, "boolean": 4, "number": 1, "integer": 1}  # null, true, 0


@dataclass(frozen=True)
class Shortest:
    size: float  # bytes of the shortest document, at the least; inf: no finite document
    # where the size (or its infinity) comes from, a "$ref" for a recursion with no way out; () when
    # the size is under the ``explain_over`` it was asked with
    pointer: Pointer
    exact: bool = True  # False: the bound was not worked out (too large a schema), size is 0


class _TooLarge(Exception):
    pass


def shortest_document(schema: dict, explain_over: float = INF) -> Shortest:
    """The shortest document of ``schema`` (a schema ``openai.schema.check_schema`` accepted), and
    where its size comes from if it is ``explain_over`` or more."""
    sizes = _Sizes(schema)
    try:
        sizes.settle()
        size = sizes.node(schema)
        return Shortest(size, sizes.blame(schema, (), {()}) if size >= explain_over else ())
    except (_TooLarge, LookupError, TypeError, ValueError):  # a schema check_schema did not see
        return Shortest(0, (), exact=False)


def ref_target(ref: str) -> Pointer:
    """The pointer of a local ``$ref`` ('#' or '#/...')."""
    return () if ref == "#" else tuple(unquote(t).replace("~1", "/").replace("~0", "~") for t in ref[2:].split("/"))


def _resolve(root, pointer: Pointer):
    node = root
    for token in pointer:
        node = node[int(token)] if isinstance(node, list) else node[token]
    return node


def _kinds(node: dict) -> list[str]:
    kinds = node.get("type", ALL_TYPES)
    return list(kinds) if isinstance(kinds, (list, tuple)) else [kinds]


def _refs(node, into_defs: bool = False) -> list[Pointer]:
    """The targets of the $refs in a node's value (in its ``$defs`` too with ``into_defs``)."""
    found: list[Pointer] = []
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                found.append(ref_target(node["$ref"]))
            stack.extend(value for key, value in node.items() if key not in SKIPPED or into_defs and key in DEFS)
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _json_bytes(value) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


class _Sizes:
    def __init__(self, root: dict):
        self.root = root
        self.targets: dict[Pointer, float] = {}  # the bound of each $ref target, lowered round by round
        self.known: dict[int, float] = {}  # id(node) -> its bound, under the targets' bounds as they are now
        self.visits = 0
        for target in self._ordered(root):
            self.targets[target] = INF

    @staticmethod
    def _ordered(root: dict) -> list[Pointer]:
        """Every $ref target, each after the targets its value refers to where no cycle forbids it
        (a depth-first post-order), so that one round settles a schema without cycles."""
        order: list[Pointer] = []
        seen: set[Pointer] = set()
        starts = _refs(root, into_defs=True)
        for start in [(), *starts]:
            if start in seen:
                continue
            seen.add(start)
            stack = [(start, iter(_refs(_resolve(root, start))))]
            while stack:
                pointer, refs = stack[-1]
                target = next(refs, None)
                if target is None:
                    stack.pop()
                    order.append(pointer)
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, iter(_refs(_resolve(root, target)))))
        return [pointer for pointer in order if pointer != () or () in starts]

    def settle(self) -> None:
        for _ in range(len(self.targets) + 1):
            changed = False
            for target in self.targets:
                size = self.node(_resolve(self.root, target))
                if size < self.targets[target]:
                    self.targets[target], changed = size, True
                    self.known.clear()
            if not changed:
                return

    def node(self, node: dict) -> float:
        known = self.known.get(id(node))
        if known is not None:
            return known
        self.visits += 1
        if self.visits > MAX_VISITS:
            raise _TooLarge
        if "$ref" in node:
            return self.targets[ref_target(node["$ref"])]
        size = self.own(node)
        if "anyOf" in node:  # a value satisfies the node's own keywords and one of the options
            size = max(size, min(self.node(option) for option in node["anyOf"]))
        self.known[id(node)] = size
        return size

    def own(self, node: dict) -> float:
        for key in ("const", "enum"):
            if key in node:
                values = [node[key]] if key == "const" else node[key]
                return min(_json_bytes(value) for value in values)
        kinds = _kinds(node)
        return min(self.of_type(node, kind) for kind in kinds)

    def of_type(self, node: dict, kind: str) -> float:
        if kind in SCALAR_BYTES:
            return SCALAR_BYTES[kind]
        if kind == "string":
            return 2 + max(node.get("minLength", 0), shortest_match(node.get("pattern", "")))
        if kind == "array":
            count = node.get("minItems", 0)
            if count == 0:
                return 2
            item = self.node(node["items"]) if isinstance(node.get("items"), dict) else 1
            return 2 + count * item + count - 1
        required = node.get("required", [])
        return 2 + sum(_json_bytes(name) + 1 + self.property(node, name) for name in required) + \
            max(len(required) - 1, 0)

    def property(self, node: dict, name: str) -> float:
        schema = node.get("properties", {}).get(name, node.get("additionalProperties", True))
        if schema is False:
            return INF
        return 1 if schema is True else self.node(schema)

    def blame(self, node: dict, pointer: Pointer, seen: set[Pointer]) -> Pointer:
        """Where the size of ``node`` comes from: the part that makes it infinite (a ``$ref`` that
        closes a recursion with no way out), or else the largest part of its shortest value."""
        while True:
            size = self.node(node)
            for part, at in self.parts(node, pointer):
                if part is None:  # a $ref: follow it once
                    target = ref_target(node["$ref"])
                    if target in seen or not math.isinf(size) and size < 64:
                        return pointer
                    seen.add(target)
                    node, pointer = _resolve(self.root, target), target
                    break
                part_size = self.node(part)
                if math.isinf(part_size) if math.isinf(size) else size < part_size * 2 < INF:
                    node, pointer = part, at
                    break
            else:
                return pointer

    def parts(self, node: dict, pointer: Pointer):
        """The schemas a node's shortest value is built of: its ref, its options, its items, its required properties."""
        if "$ref" in node:
            yield None, pointer
            return
        kinds = _kinds(node)
        if "anyOf" in node:
            options = [(sub, (*pointer, "anyOf", str(i))) for i, sub in enumerate(node["anyOf"])]
            yield min(options, key=lambda option: self.node(option[0]))
        if "const" in node or "enum" in node:
            return
        if "array" in kinds and node.get("minItems", 0) > 0 and isinstance(node.get("items"), dict):
            yield node["items"], (*pointer, "items")
        if "object" in kinds:
            for name in node.get("required", []):
                if name in node.get("properties", {}):
                    yield node["properties"][name], (*pointer, "properties", name)
                elif isinstance(node.get("additionalProperties"), dict):
                    yield node["additionalProperties"], (*pointer, "additionalProperties")

"""Schemas of the OpenAI strict-mode subset that the grammar tests generate documents for."""

LABEL = {
    "type": "object",
    "properties": {"label": {"enum": ["billing", "technical", "account", "sales", "other"]}},
    "required": ["label"],
    "additionalProperties": False,
}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "emails": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["name", "age", "emails"],
    "additionalProperties": False,
}

EXTRACTION = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "people": {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 3},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4},
        "meta": {
            "type": "object",
            "properties": {"source": {"const": "email"}, "urgent": {"type": "boolean"}},
            "required": ["source", "urgent"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "people", "tags", "meta"],
    "additionalProperties": False,
}

SHAPES = {
    "$defs": {
        "point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "circle": {
            "type": "object",
            "properties": {"kind": {"const": "circle"}, "center": {"$ref": "#/$defs/point"}, "r": {"type": "number"}},
            "required": ["kind", "center", "r"],
            "additionalProperties": False,
        },
        "polygon": {
            "type": "object",
            "properties": {
                "kind": {"const": "polygon"},
                "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 3, "maxItems": 4},
            },
            "required": ["kind", "points"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "shapes": {
            "type": "array",
            "items": {"anyOf": [{"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/polygon"}]},
            "minItems": 1,
            "maxItems": 3,
        },
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["shapes", "note"],
    "additionalProperties": False,
}

# no free text anywhere: a walk that prefers whitespace must still end
NO_STRINGS = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "label": LABEL,
    },
    "required": ["n", "flags", "label"],
    "additionalProperties": False,
}

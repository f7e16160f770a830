"""The JSON-schema tasks of bench/structured.py: 50 prompts over ten kinds of record, each schema with
nested objects, enums, arrays and numbers with ranges (five shapes per kind, simplest first).

`example(schema)` writes one valid instance of a schema (bench/grammar_libs.py steps the grammar
engines through its tokens); `is_valid(text, schema)` is the judge: the text parses as JSON and the
jsonschema library accepts it.
"""

from __future__ import annotations

import json
from typing import Any

# kind -> (what to ask for, its string fields, an enum field and its values, a number field and range)
_KINDS: dict[str, tuple[str, list[str], tuple[str, list[str]], tuple[str, int, int]]] = {
    "person": ("a fictional person", ["name", "city"], ("role", ["student", "engineer", "doctor", "artist"]),
               ("age", 0, 120)),
    "product": ("a product in an online shop", ["title", "brand"], ("category", ["books", "toys", "food", "tools"]),
                ("price", 1, 1000)),
    "book": ("a novel", ["title", "author"], ("genre", ["mystery", "romance", "fantasy", "history"]),
             ("year", 1800, 2025)),
    "event": ("a concert", ["venue", "headliner"], ("day", ["monday", "friday", "saturday", "sunday"]),
              ("tickets", 10, 50000)),
    "weather": ("today's weather in a city", ["city", "summary"], ("sky", ["clear", "cloudy", "rain", "snow"]),
                ("temperature", -40, 50)),
    "recipe": ("a simple recipe", ["dish", "cuisine"], ("difficulty", ["easy", "medium", "hard"]),
               ("minutes", 5, 240)),
    "flight": ("a flight booking", ["origin", "destination"], ("cabin", ["economy", "business", "first"]),
               ("passengers", 1, 9)),
    "movie": ("a film review", ["title", "director"], ("rating", ["G", "PG", "PG-13", "R"]),
              ("score", 0, 10)),
    "pet": ("a pet at an animal shelter", ["name", "breed"], ("species", ["dog", "cat", "rabbit", "bird"]),
            ("weight_kg", 0, 90)),
    "order": ("a customer order", ["customer", "address"], ("status", ["pending", "shipped", "delivered"]),
              ("quantity", 1, 100)),
}


def _object(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _schema(kind: str, shape: int) -> dict[str, Any]:
    _, strings, (enum_key, enum_values), (num_key, lo, hi) = _KINDS[kind]
    props: dict[str, Any] = {s: {"type": "string", "maxLength": 40} for s in strings}
    props[enum_key] = {"enum": enum_values}
    props[num_key] = {"type": "integer", "minimum": lo, "maximum": hi}
    if shape >= 1:  # an array of strings
        props["tags"] = {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3}
    if shape >= 2:  # a nested object with a bounded number
        props["details"] = _object({"note": {"type": "string", "maxLength": 60},
                                    "confidence": {"type": "number", "minimum": 0, "maximum": 1}})
    if shape >= 3:  # an array of objects
        props["history"] = {"type": "array", "maxItems": 2,
                            "items": _object({"when": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                              "what": {"type": "string", "maxLength": 30}})}
    if shape >= 4:  # a boolean and a nested enum
        props["verified"] = {"type": "boolean"}
        props["contact"] = _object({"kind": {"enum": ["email", "phone", "none"]},
                                    "value": {"type": "string", "maxLength": 40}})
    return _object(props)


def tasks() -> list[dict[str, Any]]:
    """[{"name", "prompt", "schema"}] x 50."""
    out = []
    for kind, (what, *_rest) in _KINDS.items():
        for shape in range(5):
            schema = _schema(kind, shape)
            fields = ", ".join(schema["properties"])
            prompt = (f"Describe {what} as a JSON object with the fields {fields}. "
                      f"Answer with the JSON object only.")
            out.append({"name": f"{kind}-{shape}", "prompt": prompt, "schema": schema})
    return out


def example(schema: dict[str, Any]) -> Any:
    """One valid instance of a schema made by `_schema` (first enum value, mid-range numbers)."""
    if "enum" in schema:
        return schema["enum"][0]
    t = schema.get("type")
    if t == "object":
        return {k: example(v) for k, v in schema["properties"].items()}
    if t == "array":
        return [example(schema["items"])] * max(1, schema.get("minItems", 1))
    if t == "integer":
        return (schema["minimum"] + schema["maximum"]) // 2
    if t == "number":
        return (schema["minimum"] + schema["maximum"]) / 2
    if t == "boolean":
        return True
    return "example text"


def is_valid(text: str, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True

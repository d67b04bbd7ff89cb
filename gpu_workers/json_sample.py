"""A JSON value valid against a JSON schema, chosen deterministically: the simulated engine's guided output.

Covers what request schemas use in practice: objects (properties, required, additionalProperties),
arrays (items, minItems, maxItems), strings (enum, const, minLength, maxLength, a few formats), numbers
and integers (bounds, multipleOf), booleans, null, anyOf/oneOf (the first branch that samples), allOf
(merged objects) and local `$ref`s. Pure.

A budget (in characters) bounds the work: once it is spent, strings, arrays and objects stop growing, so
a schema that asks for a billion characters costs what the request can send (its max_tokens), not the
worker's memory. The answer is then cut at max_tokens like any long answer.
"""

from __future__ import annotations

from typing import Any

_WORDS = ("amber", "brook", "cedar", "delta", "ember", "fjord", "grove", "harbor")
_FORMATS = {
    "date": "2026-01-01",
    "date-time": "2026-01-01T00:00:00Z",
    "email": "a@example.com",
    "uri": "https://example.com",
}
_MAX_DEPTH = 12


class UnsupportedSchema(ValueError):
    """The schema uses something this sampler cannot satisfy."""


class Budget:
    """Characters still worth producing."""

    def __init__(self, chars: int) -> None:
        self.left = chars

    def spend(self, chars: int) -> None:
        self.left -= chars

    @property
    def spent(self) -> bool:
        return self.left <= 0


UNBOUNDED = 1 << 62


def _resolve(ref: str, root: dict[str, Any]) -> dict[str, Any]:
    if not ref.startswith("#"):
        raise UnsupportedSchema(f"only local $ref is supported, not {ref!r}")
    node: Any = root
    for part in ref.lstrip("#").strip("/").split("/") if ref != "#" else []:
        node = node[part.replace("~1", "/").replace("~0", "~")]
    if not isinstance(node, dict):
        raise UnsupportedSchema(f"$ref {ref!r} does not name a schema")
    return node


def _string(schema: dict[str, Any], seed: int, budget: Budget) -> str:
    if schema.get("format") in _FORMATS:
        text = _FORMATS[schema["format"]]
    else:
        text = _WORDS[seed % len(_WORDS)]
        low, high = min(int(schema.get("minLength", 0)), max(budget.left, 0)), schema.get("maxLength")
        while len(text) < low:
            text += _WORDS[(seed + len(text)) % len(_WORDS)]
        text = text[: int(high)] if high is not None else text
    budget.spend(len(text) + 2)
    return text


def _number(schema: dict[str, Any], seed: int, integer: bool) -> int | float:
    low = schema.get("minimum", schema.get("exclusiveMinimum"))
    high = schema.get("maximum", schema.get("exclusiveMaximum"))
    value: float = seed % 10
    if low is not None:
        value = max(value, low + (1 if "exclusiveMinimum" in schema and "minimum" not in schema else 0))
    if high is not None:
        value = min(value, high - (1 if "exclusiveMaximum" in schema and "maximum" not in schema else 0))
    step = schema.get("multipleOf")
    if step:
        value = (value // step) * step
        if low is not None and value < low:
            value += step
    return int(value) if integer else float(value)


def sample(
    schema: dict[str, Any] | bool,
    root: dict[str, Any] | None = None,
    seed: int = 0,
    depth: int = 0,
    budget: Budget | None = None,
) -> Any:
    """A value valid against `schema` while `budget` lasts; past it, a shorter value (cut at max_tokens)."""
    budget = budget or Budget(UNBOUNDED)
    if schema is True or schema == {}:
        word = _WORDS[seed % len(_WORDS)]
        budget.spend(len(word) + 2)
        return word
    if schema is False:
        raise UnsupportedSchema("the schema `false` admits no value")
    assert isinstance(schema, dict)
    root = schema if root is None else root
    if depth > _MAX_DEPTH:
        raise UnsupportedSchema("the schema nests deeper than the sampler follows")
    if "$ref" in schema:
        return sample(_resolve(schema["$ref"], root), root, seed, depth + 1, budget)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][seed % len(schema["enum"])]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            for branch in schema[key]:
                try:
                    return sample(branch, root, seed, depth + 1, budget)
                except UnsupportedSchema:
                    continue
            raise UnsupportedSchema(f"no branch of {key} could be sampled")
    if "allOf" in schema:
        merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for part in schema["allOf"]:
            part = _resolve(part["$ref"], root) if "$ref" in part else part
            merged.setdefault("properties", {}).update(part.get("properties", {}))
            merged["required"] = [*merged.get("required", []), *part.get("required", [])]
            merged.setdefault("type", part.get("type"))
        return sample(merged, root, seed, depth + 1, budget)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        props: dict[str, Any] = schema.get("properties", {})
        obj: dict[str, Any] = {}
        for i, (name, sub) in enumerate(props.items()):
            if budget.spent:
                break
            budget.spend(len(name) + 4)
            obj[name] = sample(sub, root, seed + i, depth + 1, budget)
        return obj
    if kind == "array":
        count = max(int(schema.get("minItems", 1)), 1)
        if "maxItems" in schema:
            count = min(count, int(schema["maxItems"]))
        items = schema.get("items", {})
        values: list[Any] = []
        while len(values) < count and not budget.spent:
            values.append(sample(items, root, seed + len(values), depth + 1, budget))
            budget.spend(1)
        return values
    if kind == "string":
        return _string(schema, seed, budget)
    if kind in ("integer", "number"):
        return _number(schema, seed, kind == "integer")
    if kind == "boolean":
        return seed % 2 == 0
    if kind == "null":
        return None
    raise UnsupportedSchema(f"unknown type {kind!r}")

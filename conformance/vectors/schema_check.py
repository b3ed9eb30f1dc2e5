"""The vector manifest's JSON Schema (conformance/vectors/schema/), applied without a dependency.

:func:`schema_error` checks a parsed manifest against
``vectors.schema.json`` with the keywords that schema uses (``$ref``,
``type``, ``const``, ``enum``, ``required``, ``properties``,
``additionalProperties``, ``items``, ``prefixItems``, ``minItems``,
``maxItems``, ``minimum``, ``exclusiveMinimum``, ``pattern``, ``oneOf``),
and returns the first violation with the path of the field. Types are
strict: ``true`` is not an integer, ``2.0`` is not an integer (integers are
written without a fraction), and a number must be finite. The tests check
that ``jsonschema`` rejects what this rejects.

>>> schema_error({"format": "paged-spec-vectors", "version": True})
'example: missing'
>>> schema_error([1])
'manifest: [1] is not an object'
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA = Path(__file__).resolve().parent / "schema" / "vectors.schema.json"


@cache
def vectors_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(SCHEMA.read_text())
    return schema


def schema_error(manifest: object) -> str | None:
    """The first way ``manifest`` breaks the schema, as ``"path: what"``; ``None`` if none."""
    schema = vectors_schema()
    return _check(manifest, schema, schema, "")


def _is(value: object, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        number = isinstance(value, int | float) and not isinstance(value, bool)
        return number and math.isfinite(value)  # type: ignore[arg-type]
    types: dict[str, type[Any]] = {
        "string": str,
        "array": list,
        "object": dict,
        "null": type(None),
        "boolean": bool,
    }
    return isinstance(value, types[kind])


def _same(a: object, b: object) -> bool:
    """JSON equality: a bool is not a number."""
    return type(a) is type(b) and a == b


def _check(value: object, rule: Mapping[str, Any], root: Mapping[str, Any], at: str) -> str | None:
    name = at or "manifest"
    if "$ref" in rule:
        target: Any = root
        for part in str(rule["$ref"]).removeprefix("#/").split("/"):
            target = target[part]
        return _check(value, target, root, at)
    if "type" in rule and not _is(value, rule["type"]):
        return f"{name}: {value!r} is not {_TYPES[rule['type']]}"
    if "const" in rule and not _same(value, rule["const"]):
        return f"{name}: {value!r} is not {rule['const']!r}"
    if "enum" in rule and not any(_same(value, x) for x in rule["enum"]):
        return f"{name}: {value!r} is not one of {', '.join(map(_json, rule['enum']))}"
    if "oneOf" in rule:
        return _one_of(value, rule["oneOf"], root, at)
    if isinstance(value, dict):
        return _object(value, rule, root, at)
    if isinstance(value, list):
        return _array(value, rule, root, at)
    if isinstance(value, str) and "pattern" in rule and not re.search(rule["pattern"], value):
        return f"{name}: {value!r} does not match {rule['pattern']}"
    if _is(value, "number"):
        low, above = rule.get("minimum"), rule.get("exclusiveMinimum")
        if low is not None and value < low:
            return f"{name}: {value!r} is less than {low}"
        if above is not None and value <= above:
            return f"{name}: {value!r} is not greater than {above}"
    return None


def _one_of(value: object, options: list[Any], root: Mapping[str, Any], at: str) -> str | None:
    errors = [_check(value, option, root, at) for option in options]
    matched = errors.count(None)
    if matched == 1:
        return None
    if matched > 1:
        return f"{at or 'manifest'}: {value!r} matches more than one allowed form"
    named = [e for option, e in zip(options, errors, strict=True) if _named_by(value, option, root)]
    if named:  # the form whose constant fields (an operation's "op") the value has
        return named[0]
    forms = [_form(option, root) for option in options]
    said = list(dict.fromkeys(f for f in forms if f is not None))
    if None not in forms:  # each form said in words ("null or an integer of at least 1")
        return f"{at or 'manifest'}: {value!r} is not {' or '.join(said)}"
    return max((e for e in errors if e), key=lambda e: len(e.split(":")[0]))  # the deepest


_TYPES = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "array": "an array",
    "object": "an object",
    "null": "null",
    "boolean": "true or false",
}


def _json(value: object) -> str:
    return json.dumps(value)


def _form(rule: Mapping[str, Any], root: Mapping[str, Any]) -> str | None:
    """A form of a ``oneOf`` in words (``None`` if it is not a simple one).

    >>> _form({"type": "integer", "minimum": 1}, {})
    'an integer of at least 1'
    """
    while "$ref" in rule:
        target: Any = root
        for part in str(rule["$ref"]).removeprefix("#/").split("/"):
            target = target[part]
        rule = target
    kind = rule.get("type")
    simple = {"type", "minimum", "exclusiveMinimum", "pattern", "description"}
    if kind not in _TYPES or (kind not in ("array", "object") and set(rule) - simple):
        return None
    words = _TYPES[kind]
    if "minimum" in rule:
        words += f" of at least {rule['minimum']}"
    if "exclusiveMinimum" in rule:
        words += f" above {rule['exclusiveMinimum']}"
    if "pattern" in rule:
        words += " like " + rule["pattern"].strip("^$").replace("[0-9]+", "NNN").replace("\\.", ".")
    return words


def _named_by(value: object, option: Mapping[str, Any], root: Mapping[str, Any]) -> bool:
    """Whether object ``value`` has the constant fields of ``option`` (at least one)."""
    while "$ref" in option:
        target: Any = root
        for part in str(option["$ref"]).removeprefix("#/").split("/"):
            target = target[part]
        option = target
    consts = {k: p["const"] for k, p in option.get("properties", {}).items() if "const" in p}
    return (
        isinstance(value, dict)
        and bool(consts)
        and all(_same(value.get(k), c) for k, c in consts.items())
    )


def _object(
    value: dict[str, Any], rule: Mapping[str, Any], root: Mapping[str, Any], at: str
) -> str | None:
    prefix = f"{at}." if at else ""
    for key in rule.get("required", ()):
        if key not in value:
            return f"{prefix}{key}: missing"
    properties = rule.get("properties", {})
    for key, item in value.items():
        if key not in properties:
            if rule.get("additionalProperties") is False:
                return f"{prefix}{key}: not a field of this object"
            continue
        error = _check(item, properties[key], root, f"{prefix}{key}")
        if error:
            return error
    return None


def _array(
    value: list[Any], rule: Mapping[str, Any], root: Mapping[str, Any], at: str
) -> str | None:
    name = at or "manifest"
    if len(value) < rule.get("minItems", 0):
        return f"{name}: {len(value)} items, fewer than {rule['minItems']}"
    if "maxItems" in rule and len(value) > rule["maxItems"]:
        return f"{name}: {len(value)} items, more than {rule['maxItems']}"
    prefix = rule.get("prefixItems", [])
    for i, item in enumerate(value):
        sub = prefix[i] if i < len(prefix) else rule.get("items")
        if sub is not None:
            error = _check(item, sub, root, f"{at}[{i}]")
            if error:
                return error
    return None

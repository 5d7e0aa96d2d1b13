"""``manifest.json``'s JSON Schema (``docs/manifest.schema.json``, shipped beside this
module as ``manifest.schema.json``), validated with the ``jsonschema`` package (Draft
2020-12), and its errors in words: each problem is ``"<key path>: expected <what>, got
<value>"``. The library decides what is valid; this module only words what it reports,
the same way as the Rust trainer (``crates/trainops-trainer/src/schema.rs``) words the
``jsonschema`` crate's errors (``tests/test_reader_contract.py`` compares the two).

One keyword is given ECMA-262's meaning, which the Rust crate has: ``pattern``'s ``$`` is
the end of the string (Python's ``$`` also matches before a final newline)."""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache
from typing import Any

__all__ = ["Validator", "json_equal", "manifest_validator", "show", "SCHEMA_PATH",
           "DRAFT_2020_12"]

SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "manifest.schema.json")
DRAFT_2020_12 = "https://json-schema.org/draft/2020-12/schema"

_TYPE_WORDS = {"object": "an object", "array": "an array", "string": "a string",
               "integer": "an integer", "number": "a number", "boolean": "a boolean",
               "null": "null"}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def json_equal(a, b) -> bool:
    """JSON equality: numbers by value, ``true`` never equal to ``1``, objects by keys."""
    if _is_number(a) and _is_number(b):
        return a == b
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return type(a) is type(b) and a == b
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return False


def show(v) -> str:
    """``v`` as the messages show it: compact JSON, cut at 80 characters."""
    text = json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    return text if len(text) <= 80 else text[:77] + "..."


@lru_cache(maxsize=None)
def _ecma(pattern: str) -> re.Pattern:
    """``pattern`` compiled with ECMA-262's final ``$``: the end of the string."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1] + r"\Z"
    return re.compile(pattern)


def _pattern(validator, pattern, instance, schema):
    import jsonschema

    if validator.is_type(instance, "string") and not _ecma(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _key(path: str, k) -> str:
    if isinstance(k, int):
        return f"{path}[{k}]"
    return f"{path}.{k}" if path else k


class Validator:
    """Validates JSON values against ``schema`` (a dict declaring Draft 2020-12):
    :meth:`problems` lists every violation as ``"<key path>: expected ..., got ..."``."""

    def __init__(self, schema: dict):
        import jsonschema
        from jsonschema import validators

        if not isinstance(schema, dict) or schema.get("$schema") != DRAFT_2020_12:
            raise ValueError(f"schema: expected \"$schema\": {DRAFT_2020_12!r}")
        base = jsonschema.Draft202012Validator
        base.check_schema(schema)
        cls = validators.extend(base, validators={"pattern": _pattern})
        self.schema = schema
        self._validator = cls(schema)
        # A failure inside one of these says its description (identity: the resolver
        # hands out the schema's own dicts).
        self._defs = {id(d): d.get("description") for d in schema.get("$defs", {}).values()}

    # -- what a schema expects, in words -------------------------------------------------
    def expected(self, s: dict) -> str:
        """``s`` in words (for messages): a definition's ``description`` when ``s`` refers
        to one that has it, else its keywords."""
        if "$ref" in s:
            target = self.schema
            for part in s["$ref"].lstrip("#").strip("/").split("/"):
                target = target[part]
            return target.get("description") or self.expected(target)
        if "const" in s:
            return show(s["const"])
        if "enum" in s:
            return "one of " + ", ".join(show(v) for v in s["enum"])
        if "oneOf" in s:
            return " or ".join(self.expected(b) for b in s["oneOf"])
        t = s.get("type")
        if t is None:
            return "a value"
        words = _TYPE_WORDS[t]
        if t == "string" and "pattern" in s:
            words += f" matching {s['pattern']}"
        elif t == "string" and s.get("minLength", 0) >= 1:
            words = "a non-empty string"
        if t in ("integer", "number"):
            if "minimum" in s:
                words += f" >= {s['minimum']}"
            if "maximum" in s:
                words += f"{' and' if 'minimum' in s else ''} <= {s['maximum']}"
        if t == "array":
            if s.get("minItems", 0) >= 1:
                words = "a non-empty array"
            if "items" in s:
                words += f", each item {self.expected(s['items'])}"
            if s.get("uniqueItems"):
                words += ", without repeats"
        return words

    # -- validation ----------------------------------------------------------------------
    def problems(self, value: Any) -> list[str]:
        """Every way ``value`` violates the schema (empty: it is valid), each
        ``"<key path>: expected ..., got ..."`` (``states[0].dtype``)."""
        out: list[str] = []
        missing_done = set()
        for e in self._validator.iter_errors(value):
            path = ""
            for k in e.absolute_path:
                path = _key(path, k)
            if e.validator == "required":
                # one error per missing key, naming it only in its message: word them all
                # once, from the object
                if path not in missing_done:
                    missing_done.add(path)
                    props = e.schema.get("properties", {})
                    out += [f"{_key(path, k)}: required key is missing (expected "
                            f"{self.expected(props.get(k, {}))})"
                            for k in e.validator_value if k not in e.instance]
                continue
            out.append(self._problem(e, path or "(the manifest)"))
        return out

    def _problem(self, e, at: str) -> str:
        s, kw = e.schema, e.validator
        if kw in ("type", "pattern", "minimum", "maximum", "uniqueItems"):
            what = self.expected(s)
        elif kw == "const":
            what = show(s["const"])
        elif kw in ("enum", "oneOf"):
            what = self.expected({kw: s[kw]})
        elif kw == "not":
            what = f"{self.expected(s)}, not {self.expected(s['not'])}"
        elif kw == "minLength":
            what = f"a string of at least {s['minLength']} character(s)"
        elif kw == "minItems":
            what = f"an array of at least {s['minItems']} item(s)"
        else:
            return f"{at}: {e.message}"
        return f"{at}: expected {self._defs.get(id(s)) or what}, got {show(e.instance)}"


@lru_cache(maxsize=1)
def manifest_validator() -> Validator:
    """The validator of ``manifest.schema.json`` (read once)."""
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return Validator(json.load(f))

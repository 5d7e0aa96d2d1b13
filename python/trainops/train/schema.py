"""``manifest.json``'s JSON Schema (``docs/manifest.schema.json``, shipped beside this
module as ``manifest.schema.json``) and a validator of the part of JSON Schema 2020-12 it
uses, so the package checks every manifest it reads against the schema itself with no
extra dependency. The Rust trainer (``crates/trainops-trainer/src/schema.rs``) validates
the same way; ``tests/test_reader_contract.py`` checks this validator against the
``jsonschema`` package.

Keywords understood: ``type``, ``const``, ``enum``, ``required``, ``properties``,
``additionalProperties`` (``false``), ``items``, ``minItems``, ``uniqueItems``,
``minLength``, ``pattern`` (anchored with ``^``/``$``: ``$`` is the end of the string, as
in ECMA-262), ``minimum``, ``maximum``, ``oneOf``, ``not``, ``$ref`` (``#/$defs/...``);
annotations (``$schema``, ``$id``, ``title``, ``description``, ``$defs``) are skipped. A
schema using any other keyword is refused when it is loaded, so the two cannot drift
apart silently. Numbers compare by value (``1 == 1.0``); ``true`` is not ``1``."""

from __future__ import annotations

import json
import math
import os
import re
from functools import lru_cache
from typing import Any

__all__ = ["Validator", "json_equal", "manifest_validator", "SCHEMA_PATH"]

SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "manifest.schema.json")

KEYWORDS = {"type", "const", "enum", "required", "properties", "additionalProperties",
            "items", "minItems", "uniqueItems", "minLength", "pattern", "minimum", "maximum",
            "oneOf", "not", "$ref"}
ANNOTATIONS = {"$schema", "$id", "title", "description", "$defs"}
_TYPE_WORDS = {"object": "an object", "array": "an array", "string": "a string",
               "integer": "an integer", "number": "a number", "boolean": "a boolean",
               "null": "null"}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_type(v, t: str) -> bool:
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    if t == "string":
        return isinstance(v, str)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "null":
        return v is None
    if t == "number":
        return _is_number(v)
    if t == "integer":  # JSON Schema: any number with a zero fractional part
        return _is_number(v) and (isinstance(v, int) or (math.isfinite(v) and v.is_integer()))
    raise ValueError(f"schema: unknown type {t!r}")


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


def _ecma(pattern: str) -> str:
    """A Python regex for the ECMA-262 ``pattern``: a final ``$`` is the end of the string
    (Python's ``$`` also matches before a final newline)."""
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        return pattern[:-1] + r"\Z"
    return pattern


class Validator:
    """Validates JSON values against ``schema`` (a dict): :meth:`problems` lists every
    violation as ``"<key path>: expected ..., got ..."``."""

    def __init__(self, schema: dict):
        self.schema = schema
        self._patterns = {}
        self._check_keywords(schema, "#")

    def _check_keywords(self, s, where: str) -> None:
        if not isinstance(s, dict):
            raise ValueError(f"schema {where}: expected an object")
        unknown = set(s) - KEYWORDS - ANNOTATIONS
        if unknown:
            raise ValueError(f"schema {where}: keywords {sorted(unknown)} are not supported")
        if s.get("additionalProperties", False) is not False:
            raise ValueError(f"schema {where}: additionalProperties must be false")
        for k, sub in s.get("$defs", {}).items():
            self._check_keywords(sub, f"{where}/$defs/{k}")
        for k, sub in s.get("properties", {}).items():
            self._check_keywords(sub, f"{where}/properties/{k}")
        for i, sub in enumerate(s.get("oneOf", [])):
            self._check_keywords(sub, f"{where}/oneOf/{i}")
        for k in ("items", "not"):
            if k in s:
                self._check_keywords(s[k], f"{where}/{k}")
        if "$ref" in s:
            self._resolve(s["$ref"])
        if "pattern" in s:
            self._patterns[s["pattern"]] = re.compile(_ecma(s["pattern"]))

    def _resolve(self, ref: str) -> dict:
        if not ref.startswith("#/$defs/"):
            raise ValueError(f"schema: $ref {ref!r}: only '#/$defs/<name>' is supported")
        try:
            return self.schema["$defs"][ref[len("#/$defs/"):]]
        except KeyError:
            raise ValueError(f"schema: $ref {ref!r} names no definition") from None

    # -- what a schema expects, in words -------------------------------------------------
    def expected(self, s: dict) -> str:
        """``s`` in words (for messages): a definition's ``description`` when ``s`` refers
        to one that has it, else its keywords."""
        if "$ref" in s:
            target = self._resolve(s["$ref"])
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
        self._check(value, self.schema, "", out)
        return out

    def is_valid(self, value: Any, s: dict) -> bool:
        """Whether ``value`` satisfies the subschema ``s``."""
        out: list[str] = []
        self._check(value, s, "", out)
        return not out

    def _check(self, v, s: dict, path: str, out: list[str], desc: str | None = None) -> None:
        """Appends to ``out`` the violations of ``s`` by ``v`` at ``path``; ``desc``: the
        description of the definition ``s`` is (through ``$ref``), for the messages."""
        where = path or "(the manifest)"

        def bad(what: str) -> None:
            out.append(f"{where}: expected {desc or what}, got {show(v)}")

        if "$ref" in s:
            target = self._resolve(s["$ref"])
            self._check(v, target, path, out, target.get("description"))
        if "type" in s:
            types = s["type"] if isinstance(s["type"], list) else [s["type"]]
            if not any(_is_type(v, t) for t in types):
                bad(self.expected(s))
                return
        if "const" in s and not json_equal(v, s["const"]):
            bad(show(s["const"]))
        if "enum" in s and not any(json_equal(v, e) for e in s["enum"]):
            bad(self.expected({"enum": s["enum"]}))
        if "oneOf" in s and sum(self.is_valid(v, b) for b in s["oneOf"]) != 1:
            bad(self.expected({"oneOf": s["oneOf"]}))
        if "not" in s and self.is_valid(v, s["not"]):
            bad(f"{self.expected(s)}, not {self.expected(s['not'])}")
        if isinstance(v, str):
            if len(v) < s.get("minLength", 0):
                bad(f"a string of at least {s['minLength']} character(s)")
            if "pattern" in s and not self._patterns[s["pattern"]].search(v):
                bad(self.expected(s))
        if _is_number(v):
            if "minimum" in s and not v >= s["minimum"]:
                bad(self.expected(s))
            if "maximum" in s and not v <= s["maximum"]:
                bad(self.expected(s))
        if isinstance(v, list):
            if len(v) < s.get("minItems", 0):
                bad(f"an array of at least {s['minItems']} item(s)")
            if s.get("uniqueItems"):
                for i, j in _repeats(v):
                    out.append(f"{path}[{j}]: expected no repeats, got {show(v[j])} "
                               f"again (also {path}[{i}])")
            if "items" in s:
                for i, item in enumerate(v):
                    self._check(item, s["items"], f"{path}[{i}]", out)
        if isinstance(v, dict):
            for k in s.get("required", []):
                if k not in v:
                    out.append(f"{_key(path, k)}: required key is missing (expected "
                               f"{self.expected(s.get('properties', {}).get(k, {}))})")
            props = s.get("properties", {})
            for k, item in v.items():
                if k in props:
                    self._check(item, props[k], _key(path, k), out)
                elif s.get("additionalProperties", True) is False:
                    out.append(f"{_key(path, k)}: unknown key (expected one of "
                               f"{', '.join(sorted(props))})")


def _key(path: str, k: str) -> str:
    return f"{path}.{k}" if path else k


def _repeats(items: list) -> list[tuple[int, int]]:
    """``(first, again)`` index pairs of equal items (strings by a dict, others pairwise)."""
    found, seen = [], {}
    others = []
    for j, v in enumerate(items):
        if isinstance(v, str):
            if v in seen:
                found.append((seen[v], j))
            else:
                seen[v] = j
        else:
            i = next((i for i in others if json_equal(items[i], v)), None)
            if i is None:
                others.append(j)
            else:
                found.append((i, j))
    return found


@lru_cache(maxsize=1)
def manifest_validator() -> Validator:
    """The validator of ``manifest.schema.json`` (read once)."""
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return Validator(json.load(f))

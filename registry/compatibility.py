"""Avro schema parsing, canonical text and compatibility by Avro's schema-resolution rules.

Promise: pure functions. ``parse`` rejects what is not a valid Avro schema;
``can_read(reader, writer)`` lists why data written with ``writer`` cannot be read
with ``reader`` (empty when it can), following the Avro specification's resolution
rules (type promotion, field defaults, aliases, enum symbols, unions, named types);
``check`` applies a Confluent compatibility level to a candidate and its history.

Kept hand-written rather than Apache Avro's ``avro.compatibility`` (1.12.2), measured on
2026-11-23: it gave the same verdicts on every registry test (30 reader/writer pairs, 12
level checks), but ran about 2.5x slower (175 vs 69 µs per check of a 20-field record),
reports unpaired sets of locations and messages instead of a field path and what to fix,
and rejects a namespace-relative record alias the specification allows. Like Confluent's
registry (Avro Java), neither checks a decimal's scale and precision.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import fastavro
from fastavro.schema import SchemaParseException, UnknownType

from tables.avro import NAMED, full_name, walk_named

PRIMITIVES = frozenset({"null", "boolean", "int", "long", "float", "double", "bytes", "string"})
PROMOTIONS = {
    "int": {"long", "float", "double"},
    "long": {"float", "double"},
    "float": {"double"},
    "string": {"bytes"},
    "bytes": {"string"},
}
LEVELS = (
    "NONE",
    "BACKWARD",
    "BACKWARD_TRANSITIVE",
    "FORWARD",
    "FORWARD_TRANSITIVE",
    "FULL",
    "FULL_TRANSITIVE",
)


class InvalidSchema(ValueError):
    """The text is not JSON or not a valid Avro schema."""


@dataclass
class Schema:
    """A parsed Avro schema: its JSON, canonical text and named types by full name."""

    raw: Any
    canonical: str
    names: dict[str, dict[str, Any]] = field(default_factory=dict)


def parse(text: str) -> Schema:
    """Parse and validate an Avro schema given as JSON text."""
    try:
        raw = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise InvalidSchema(f"not JSON: {exc}") from exc
    try:
        fastavro.parse_schema(raw, _write_hint=False, _force=True)
    except UnknownType as exc:
        raise InvalidSchema(f"unknown type {exc.name!r} (not a primitive nor a named type defined before)") from exc
    except (SchemaParseException, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise InvalidSchema(f"{type(exc).__name__}: {exc}") from exc
    canonical = json.dumps(raw, separators=(",", ":"), ensure_ascii=False)
    names: dict[str, dict[str, Any]] = {}
    _collect(raw, names)  # annotates raw's named types with their full names
    return Schema(raw, canonical, names)


def _collect(raw: Any, names: dict[str, dict[str, Any]]) -> None:
    """Index every named type by full name, annotated with it (``__fullname__``), checking each as it goes."""

    def visit(node: dict[str, Any], full: str) -> None:
        _require(node, node["type"])
        for fld in node.get("fields", ()):
            if not isinstance(fld, dict) or "name" not in fld or "type" not in fld:
                raise InvalidSchema(f"every field of record '{node['name']}' needs a 'name' and a 'type'")
        names[full] = node
        node.setdefault("__fullname__", full)

    walk_named(raw, visit)


REQUIRED = {"record": ("fields", list), "error": ("fields", list), "enum": ("symbols", list), "fixed": ("size", int)}


def _require(node: dict[str, Any], kind: Any) -> None:
    """Java Avro's structural rules that fastavro leaves lenient."""
    if kind in REQUIRED:
        attr, attr_type = REQUIRED[kind]
        if not isinstance(node.get(attr), attr_type):
            raise InvalidSchema(f"a {kind} needs '{attr}' ({attr_type.__name__}): {node.get('name', '?')}")


def _resolve(node: Any, schema: Schema, namespace: str | None = None) -> Any:
    """Follow references and wrappers until a concrete type: str primitive, list union or dict."""
    while True:
        if isinstance(node, str):
            if node in PRIMITIVES:
                return node
            for candidate in (full_name(node, namespace), node):
                if candidate in schema.names:
                    return schema.names[candidate]
            return node
        if isinstance(node, dict) and not isinstance(node.get("type"), str | type(None)):
            node = node["type"]
            continue
        if isinstance(node, dict) and node.get("type") in PRIMITIVES:
            return node["type"]
        if isinstance(node, dict) and node.get("type") not in NAMED | {"array", "map"}:
            node = node["type"]
            continue
        return node


def _kind(node: Any) -> str:
    if isinstance(node, str):
        return node
    if isinstance(node, list):
        return "union"
    return "record" if node["type"] == "error" else str(node["type"])


def _short(name: str) -> str:
    return name.rpartition(".")[2]


def _names_match(reader: dict[str, Any], writer: dict[str, Any]) -> bool:
    aliases = {_short(a) for a in reader.get("aliases", [])}
    return _short(reader["name"]) == _short(writer["name"]) or _short(writer["name"]) in aliases


@dataclass
class _Checker:
    reader: Schema
    writer: Schema
    seen: set[tuple[str, str]] = field(default_factory=set)

    def check(self, r: Any, w: Any, path: str) -> list[str]:
        r, w = _resolve(r, self.reader), _resolve(w, self.writer)
        rk, wk = _kind(r), _kind(w)
        if wk == "union":
            return [msg for branch in w for msg in self.check(r, branch, path)]
        if rk == "union":
            if any(not self.check(branch, w, path) for branch in r):
                return []
            return [f"{path}: the reader's union has no branch for the writer's type '{wk}'"]
        if rk == wk and rk in PRIMITIVES:
            return []
        if rk in PROMOTIONS.get(wk, ()):
            return []
        if rk != wk:
            return [f"{path}: reader type '{rk}' cannot read writer type '{wk}'"]
        method = getattr(self, f"_{rk}")
        return list(method(r, w, path))

    def _record(self, r: dict[str, Any], w: dict[str, Any], path: str) -> list[str]:
        if not _names_match(r, w):
            return [f"{path}: record name '{r['name']}' does not match writer's '{w['name']}'"]
        key = (r["__fullname__"], w["__fullname__"])
        if key in self.seen:
            return []
        self.seen.add(key)
        by_name = {f["name"]: f for f in w.get("fields", [])}
        messages = []
        for rf in r.get("fields", []):
            names = [rf["name"], *rf.get("aliases", [])]
            wf = next((by_name[n] for n in names if n in by_name), None)
            where = f"{path}.{rf['name']}"
            if wf is not None:
                messages += self.check(rf["type"], wf["type"], where)
            elif "default" not in rf:
                messages.append(f"{where}: field '{rf['name']}' is new in the reader and has no default")
        return messages

    def _enum(self, r: dict[str, Any], w: dict[str, Any], path: str) -> list[str]:
        if not _names_match(r, w):
            return [f"{path}: enum name '{r['name']}' does not match writer's '{w['name']}'"]
        missing = [s for s in w.get("symbols", []) if s not in r.get("symbols", [])]
        if missing and "default" not in r:
            return [f"{path}: the reader's enum lacks the writer's symbols {missing} and has no default"]
        return []

    def _fixed(self, r: dict[str, Any], w: dict[str, Any], path: str) -> list[str]:
        if not _names_match(r, w) or r.get("size") != w.get("size"):
            return [f"{path}: fixed '{r['name']}' size {r.get('size')} differs from '{w['name']}' size {w.get('size')}"]
        return []

    def _array(self, r: dict[str, Any], w: dict[str, Any], path: str) -> list[str]:
        return self.check(r["items"], w["items"], f"{path}[]")

    def _map(self, r: dict[str, Any], w: dict[str, Any], path: str) -> list[str]:
        return self.check(r["values"], w["values"], f"{path}{{}}")


def can_read(reader: Schema, writer: Schema) -> list[str]:
    """Why ``reader`` cannot read data written with ``writer``; empty when it can."""
    return _Checker(reader, writer).check(reader.raw, writer.raw, "$")


def check(level: str, candidate: Schema, history: list[Schema]) -> list[str]:
    """Messages explaining why ``candidate`` breaks ``level`` against ``history`` (oldest first)."""
    if level == "NONE" or not history:
        return []
    against = history if level.endswith("_TRANSITIVE") else history[-1:]
    base = level.removesuffix("_TRANSITIVE")
    messages: list[str] = []
    for old in against:
        if base in ("BACKWARD", "FULL"):
            messages += [f"new schema cannot read old data: {m}" for m in can_read(candidate, old)]
        if base in ("FORWARD", "FULL"):
            messages += [f"old schema cannot read new data: {m}" for m in can_read(old, candidate)]
    return messages

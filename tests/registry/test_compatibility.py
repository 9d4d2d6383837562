"""Avro schema resolution and Confluent compatibility levels (pure functions)."""

from __future__ import annotations

import json

import pytest

from registry.compatibility import InvalidSchema, can_read, check, parse

pytestmark = pytest.mark.unit


def record(*fields: dict, name: str = "Order", **extra: object) -> str:
    return json.dumps({"type": "record", "name": name, "fields": list(fields), **extra})


def f(name: str, kind: object, **extra: object) -> dict:
    return {"name": name, "type": kind, **extra}


V1 = record(f("id", "long"), f("total", "double"))
ADD_WITH_DEFAULT = record(f("id", "long"), f("total", "double"), f("note", ["null", "string"], default=None))
ADD_NO_DEFAULT = record(f("id", "long"), f("total", "double"), f("note", "string"))
DROP_TOTAL = record(f("id", "long"))


@pytest.mark.parametrize(
    ("writer", "reader"),
    [
        ('"int"', '"long"'),
        ('"int"', '"double"'),
        ('"long"', '"float"'),
        ('"float"', '"double"'),
        ('"string"', '"bytes"'),
        ('"bytes"', '"string"'),
        ('"int"', '["null", "long"]'),
        ('["null", "int"]', '["null", "long", "string"]'),
    ],
)
def test_promotions_and_unions_resolve(writer: str, reader: str) -> None:
    assert can_read(parse(reader), parse(writer)) == []


@pytest.mark.parametrize(
    ("writer", "reader"),
    [('"long"', '"int"'), ('"double"', '"float"'), ('"string"', '"int"'), ('["null", "string"]', '"string"')],
)
def test_narrowing_is_refused(writer: str, reader: str) -> None:
    assert can_read(parse(reader), parse(writer)) != []


def test_new_field_needs_a_default_to_read_old_data() -> None:
    assert can_read(parse(ADD_WITH_DEFAULT), parse(V1)) == []
    problems = can_read(parse(ADD_NO_DEFAULT), parse(V1))
    assert len(problems) == 1 and "note" in problems[0] and "no default" in problems[0]


def test_dropped_field_is_ignored_by_reader() -> None:
    assert can_read(parse(DROP_TOTAL), parse(V1)) == []
    assert can_read(parse(V1), parse(DROP_TOTAL)) != []  # old reader needs 'total', which has no default


def test_field_alias_matches_renamed_field() -> None:
    renamed = record(f("id", "long"), f("amount", "double", aliases=["total"]))
    assert can_read(parse(renamed), parse(V1)) == []


def test_record_name_must_match_or_be_aliased() -> None:
    other = record(f("id", "long"), f("total", "double"), name="Invoice")
    assert can_read(parse(other), parse(V1)) != []
    aliased = record(f("id", "long"), f("total", "double"), name="Invoice", aliases=["Order"])
    assert can_read(parse(aliased), parse(V1)) == []


def test_enum_symbols() -> None:
    old = '{"type": "enum", "name": "S", "symbols": ["A", "B"]}'
    more = '{"type": "enum", "name": "S", "symbols": ["A", "B", "C"]}'
    with_default = '{"type": "enum", "name": "S", "symbols": ["A", "B"], "default": "A"}'
    assert can_read(parse(more), parse(old)) == []
    assert can_read(parse(old), parse(more)) != []
    assert can_read(parse(with_default), parse(more)) == []


def test_nested_arrays_maps_and_fixed() -> None:
    writer = record(f("xs", {"type": "array", "items": "int"}), f("m", {"type": "map", "values": "float"}))
    reader = record(f("xs", {"type": "array", "items": "long"}), f("m", {"type": "map", "values": "double"}))
    assert can_read(parse(reader), parse(writer)) == []
    assert can_read(parse(writer), parse(reader)) != []
    fixed4, fixed8 = (json.dumps({"type": "fixed", "name": "F", "size": n}) for n in (4, 8))
    assert can_read(parse(fixed8), parse(fixed4)) != []


def test_recursive_named_types_terminate() -> None:
    node = record(f("v", "int"), f("next", ["null", "Node"], default=None), name="Node")
    assert can_read(parse(node), parse(node)) == []


def test_logical_types_resolve_by_their_underlying_type() -> None:
    decimal = '{"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}'
    ts = '{"type": "long", "logicalType": "timestamp-micros"}'
    assert can_read(parse(decimal), parse('"bytes"')) == []
    assert can_read(parse(ts), parse('"long"')) == []


@pytest.mark.parametrize(
    ("level", "candidate", "ok"),
    [
        ("BACKWARD", ADD_WITH_DEFAULT, True),
        ("BACKWARD", ADD_NO_DEFAULT, False),
        ("BACKWARD", DROP_TOTAL, True),
        ("FORWARD", DROP_TOTAL, False),
        ("FORWARD", ADD_NO_DEFAULT, True),
        ("FULL", ADD_WITH_DEFAULT, True),
        ("FULL", ADD_NO_DEFAULT, False),
        ("NONE", record(f("id", "string")), True),
    ],
)
def test_levels_against_latest(level: str, candidate: str, ok: bool) -> None:
    assert (check(level, parse(candidate), [parse(V1)]) == []) is ok


def test_transitive_checks_every_version() -> None:
    # v1 -> v2 drops 'total' (BACKWARD ok); v3 adds 'total' back without default:
    # compatible with v2 (latest) but not with v1 transitively? It can read v1 (v1 has total),
    # so use a type change instead: v3 makes 'total' a string, which v2 cannot disagree with.
    v1, v2 = parse(V1), parse(DROP_TOTAL)
    v3 = parse(record(f("id", "long"), f("total", ["null", "string"], default=None)))
    assert check("BACKWARD", v3, [v1, v2]) == []
    problems = check("BACKWARD_TRANSITIVE", v3, [v1, v2])
    assert problems and "total" in problems[0]


@pytest.mark.parametrize(
    "text",
    ["not json", '{"type": "recrd", "name": "x"}', record(f("a", "nosuchtype")), '{"type": "record", "name": "R"}'],
)
def test_invalid_schemas_are_refused(text: str) -> None:
    with pytest.raises(InvalidSchema):
        parse(text)


def test_canonical_text_ignores_whitespace_only() -> None:
    assert parse(' { "type" : "string" } ').canonical == parse('{"type":"string"}').canonical
    assert parse(V1).canonical != parse(DROP_TOTAL).canonical

"""The registry state machine: planned records, replay, Confluent error codes (no I/O)."""

from __future__ import annotations

import json

import pytest

from registry.errors import RegistryError
from registry.store import Record, Store

pytestmark = pytest.mark.unit

A = json.dumps({"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}]})
B = json.dumps(
    {
        "type": "record",
        "name": "R",
        "fields": [{"name": "a", "type": "int"}, {"name": "b", "type": "int", "default": 0}],
    }
)
C = json.dumps({"type": "record", "name": "R", "fields": [{"name": "a", "type": "string"}]})


class Logged(Store):
    """A store that applies its own planned records and keeps them, like one registry would."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[Record] = []

    def write(self, records: list[Record]) -> None:
        for key, value in records:
            self.apply(key, value)
            self.log.append((key, value))

    def register(self, subject: str, text: str) -> int:
        answer, records = self.plan_register(subject, text)
        self.write(records)
        return int(answer["id"])


def code_of(fn: object, *args: object) -> int:
    with pytest.raises(RegistryError) as info:
        fn(*args)  # type: ignore[operator]
    return info.value.code


def test_same_schema_same_id_and_no_new_version() -> None:
    s = Logged()
    assert s.register("x-value", A) == 1
    assert s.register("x-value", A) == 1
    assert s.register("y-value", A) == 1  # the id is global for the schema text
    assert s.versions("x-value") == [1]
    assert s.register("x-value", B) == 2
    assert s.versions("x-value") == [1, 2]


def test_incompatible_is_409_and_writes_nothing() -> None:
    s = Logged()
    s.register("x-value", A)
    before = len(s.log)
    assert code_of(s.plan_register, "x-value", C) == 409
    assert len(s.log) == before


def test_error_codes() -> None:
    s = Logged()
    s.register("x-value", A)
    assert code_of(s.versions, "nope") == 40401
    assert code_of(s.version, "x-value", 9) == 40402
    assert code_of(s.version, "x-value", "abc") == 42202
    assert code_of(s.schema_by_id, 77) == 40403
    assert code_of(s.lookup, "x-value", B) == 40403
    assert code_of(s.plan_register, "x-value", "{bad") == 42201
    assert code_of(s.plan_config, None, "SIDEWAYS") == 42203


def test_soft_then_permanent_delete() -> None:
    s = Logged()
    s.register("x-value", A)
    s.register("x-value", B)
    assert code_of(s.plan_delete_subject, "x-value", True) == 40405  # must soft-delete first
    versions, records = s.plan_delete_subject("x-value", False)
    s.write(records)
    assert versions == [1, 2]
    assert s.subject_names() == [] and s.subject_names(deleted=True) == ["x-value"]
    assert s.version("x-value", 2, deleted=True)["id"] == 2
    _, records = s.plan_delete_subject("x-value", True)
    s.write(records)
    assert s.subject_names(deleted=True) == []
    assert s.schema_by_id(1).canonical  # ids stay resolvable for old messages


def test_replaying_the_log_rebuilds_the_same_state() -> None:
    s = Logged()
    s.register("x-value", A)
    s.register("x-value", B)
    s.write(s.plan_config("x-value", "full"))
    s.register("z-key", '"long"')
    s.write(s.plan_delete_version("x-value", "1", False)[1])
    replica = Store()
    for key, value in s.log:
        replica.apply(key, value)
    for store in (s, replica):
        assert store.versions("x-value") == [2]
        assert store.level("x-value") == "FULL"
        assert store.lookup("z-key", '"long"')["id"] == 3


def _state(store: Store) -> tuple[object, ...]:
    subjects = {s: {n: (v.schema_id, v.deleted) for n, v in vs.items()} for s, vs in store.subjects.items()}
    schemas = {i: schema.canonical for i, schema in store.schemas.items()}
    return subjects, schemas, store.global_level, store.subject_levels


def test_snapshot_rebuilds_everything_in_a_fresh_log_ids_unchanged() -> None:
    s = Logged()
    s.register("x-value", A)
    s.register("x-value", B)
    s.register("gone-value", C)  # id 3, then permanently deleted: no version uses it any more
    s.write(s.plan_delete_subject("gone-value", False)[1])
    s.write(s.plan_delete_subject("gone-value", True)[1])
    s.register("gone-value", A)  # version 1 again, now with id 1: shares the key of id 3's first version
    s.write(s.plan_delete_version("x-value", "1", False)[1])
    s.write(s.plan_config(None, "forward"))
    s.write(s.plan_config("x-value", "none"))
    rebuilt = Store()
    for key, value in s.snapshot():
        rebuilt.apply(key, value)
    assert _state(rebuilt) == _state(s)
    assert rebuilt.snapshot() == s.snapshot()
    assert rebuilt.version("gone-value", 1)["id"] == 1 and rebuilt.schema_by_id(3).canonical
    assert rebuilt.plan_register("new-value", '"long"')[0] == {"id": 4}  # id 3 is never given again
    schemas = [
        (json.loads(key)["subject"], json.loads(value)["id"])
        for key, value in s.snapshot()
        if value and b'"id"' in value
    ]
    # the unused id first (its key is then overwritten by the live version), then every version in id order
    assert schemas == [("gone-value", 3), ("gone-value", 1), ("x-value", 1), ("x-value", 2)]

"""The sink's source positions, as pure functions of what it is given: the snapshot sorts before the stream."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest

from capture.changes import ChangeSink, RowChange, TxBuffer, snapshot_commit_lsn
from capture.jsonformat import JsonChangeWriter
from tables import types as t
from tables.catalog import ColumnInfo, TableSchema

pytestmark = pytest.mark.unit

TABLE = TableSchema.build("p", "public", "t", [ColumnInfo("id", t.PgType(23, "int4"), -1, False, True)])


class Recorder:
    """The part of ``ChangeProducer`` the sink calls, keeping what it was given."""

    def __init__(self) -> None:
        self.values: list[dict[str, object]] = []
        self.marks: list[int] = []

    def send(self, key: bytes, value: bytes) -> None:
        self.values.append(json.loads(value))

    def send_all(self, records: Iterable[tuple[bytes, bytes]]) -> None:
        for key, value in records:
            self.send(key, value)

    def mark(self, lsn: int) -> None:
        self.marks.append(lsn)


def test_a_transaction_committed_at_the_consistent_point_sorts_after_the_snapshot(tmp_path: Path) -> None:
    """PostgreSQL streams every transaction whose commit record starts at or after the slot's consistent point,
    and the first may start exactly there: the snapshot's records carry one less, and the slot is still
    confirmed at the consistent point itself once the snapshot is acknowledged."""
    point = 0x16B3748
    producer = Recorder()
    sink = ChangeSink(JsonChangeWriter(), producer)  # type: ignore[arg-type]
    sink.start_snapshot(point, 0)
    sink.snapshot_emitter(TABLE)(b'{"id":1}', b'{"id":1}')
    sink.end_snapshot(1, sink.next_position())
    tx = TxBuffer(1 << 20, tmp_path)
    tx.add(RowChange("UPDATE", "public", "t", TABLE.topic, b'{"id":1}', None, b'{"id":1}'))
    sink.emit_transaction(tx, point, point + 0x38, 7, 0)

    order = [(v["op"], v["commit_lsn"], v["position"]) for v in producer.values]
    assert order == [("READ", point - 1, 0), ("SNAPSHOT_END", point - 1, 1), ("UPDATE", point, 0)]
    assert sorted(order, key=lambda o: (o[1], o[2])) == order
    assert producer.marks == [point, point + 0x38]
    assert snapshot_commit_lsn(point) < point

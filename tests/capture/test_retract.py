"""Retractions after an abandoned snapshot: the live keys of the raw topic (pure), and which of them
PostgreSQL no longer holds, for keys of every common key type, in both output formats."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from datetime import UTC, date, datetime
from typing import Any

import fastavro
import psycopg2
import pytest
from psycopg2 import sql

from capture import catalog, retract
from capture.encoder import ChangeWriter, RowEncoder
from capture.jsonformat import JsonChangeWriter
from tables.catalog import TableSchema
from tables.change import CHANGE_KEY_SCHEMA, CHANGE_VALUE_SCHEMA
from tables.wire import body, schema_id

T = ("public", "t")
OTHER = ("public", "other")


def key(n: int, frame: bytes = b"\x00\x00\x00\x00\x01") -> bytes:
    return frame + bytes([n])


@pytest.mark.unit
def test_live_keys_apply_the_raw_topic_in_order() -> None:
    live = retract.LiveKeys([T, OTHER])
    for op, table, k, before in [
        ("READ", T, key(1), None), ("READ", T, key(2), None), ("INSERT", T, key(3), None),
        ("DELETE", T, key(1), None),
        ("UPDATE", T, key(4), key(2)),  # the key changed from 2 to 4: 2 is gone
        ("UPDATE", T, key(3), b"\x00\x00\x00\x00\x07full-old-row"),  # REPLICA IDENTITY FULL: not a key
        ("READ", ("public", "untracked"), key(9), None),
        ("READ", OTHER, key(5), None), ("TRUNCATE", OTHER, None, None), ("INSERT", OTHER, key(6), None),
        ("SNAPSHOT_END", ("", ""), None, None), ("READ", T, None, None),
    ]:  # fmt: skip
        live.apply(op, table, k, before)
    assert list(live.keys[T]) == [key(3), key(4)]
    assert list(live.keys[OTHER]) == [key(6)]
    assert ("public", "untracked") not in live.keys and len(live) == 3


@pytest.mark.unit
def test_live_keys_past_a_backfills_end_lose_keys_and_gain_none() -> None:
    """A restarted backfill reads the changes past the end it began at for what they take away (the DELETEs it
    wrote before): a delete, an update's old key, a truncate; what they add (its own READ rows) is not a key
    the raw topic held before it."""
    live = retract.LiveKeys([T, OTHER])
    for k in (1, 2, 3, 4):
        live.apply("READ", T, key(k), None)
    live.apply("READ", OTHER, key(5), None)
    for op, table, k, before in [
        ("READ", T, key(7), None), ("INSERT", T, key(8), None), ("DELETE", T, key(1), None),
        ("UPDATE", T, key(9), key(2)), ("UPDATE", T, key(3), b"\x00\x00\x00\x00\x07full-old-row"),
        ("TRUNCATE", OTHER, None, None), ("DELETE", ("public", "untracked"), key(4), None),
    ]:  # fmt: skip
        live.remove(op, table, k, before)
    assert list(live.keys[T]) == [key(3), key(4)]
    assert list(live.keys[OTHER]) == []


@pytest.mark.unit
def test_live_keys_past_the_end_take_out_the_keys_of_a_restarted_backfills_own_rows() -> None:
    """Its READ rows there were read by chunks that vouched: a key held as it is framed is taken out and counted,
    any other (a row added since, or a held key framed by another schema id, whose bytes may mean another value)
    leaves the held keys as they are; other ops, other tables and a second READ of a key change nothing more."""
    live = retract.LiveKeys([T])
    for k in (1, 2, 3):
        live.apply("READ", T, key(k), None)
    other_frame = b"\x00\x00\x00\x00\x09" + key(2)[5:]
    for op, table, k in [("READ", T, key(1)), ("READ", T, key(1)), ("INSERT", T, key(2)), ("READ", T, other_frame),
                         ("READ", T, key(7)), ("READ", OTHER, key(3)), ("READ", T, None)]:  # fmt: skip
        live.read(op, table, k)
    assert list(live.keys[T]) == [key(2), key(3)]
    assert live.taken[T] == 1


def avro_key_decoder(calls: list[bytes]) -> Callable[[bytes], Any]:
    parsed = fastavro.parse_schema(CHANGE_KEY_SCHEMA)

    def decode(key: bytes) -> Any:
        calls.append(key)
        return fastavro.schemaless_reader(io.BytesIO(body(key)), parsed, None)

    return decode


@pytest.mark.unit
def test_key_filter_passes_changes_keyed_by_its_tables_and_decodes_each_key_once() -> None:
    calls: list[bytes] = []
    wanted = retract.KeyFilter([T], avro_key_decoder(calls))
    mine, other = ChangeWriter(7, 8).encode_key(*T), ChangeWriter(7, 8).encode_key(*OTHER)
    older = ChangeWriter(3, 4).encode_key(*T)  # the same key under another schema id
    seen = [wanted(k) for k in (mine, other, mine, other, older, None, b"\x00\x00\x00\x00\x07\xff", b"")]
    assert seen == [True, False, True, False, True, True, True, True]  # no key, or no change key: the value decides
    assert calls.count(mine) == 1 and calls.count(other) == 1


class InMemorySchemas:
    """The two registry calls ``retract.HeadReader`` makes, over schemas kept in memory by id."""

    def __init__(self, by_id: dict[int, dict[str, Any]]) -> None:
        self.by_id = by_id

    def schema(self, schema_id: int) -> dict[str, Any]:
        return self.by_id[schema_id]

    def decode(self, data: bytes | None) -> Any:
        assert data is not None
        parsed = fastavro.parse_schema(self.by_id[int.from_bytes(data[1:5], "big")])
        return fastavro.schemaless_reader(io.BytesIO(body(data)), parsed, None)

    def register(self, subject: str, schema: dict[str, Any], *, table: str | None = None) -> int:
        raise AssertionError("not asked")


OLDER = {**CHANGE_VALUE_SCHEMA, "fields": CHANGE_VALUE_SCHEMA["fields"][:-1]}  # before ``backfill`` was added
OTHER_LAYOUT = {**CHANGE_VALUE_SCHEMA, "fields": [*CHANGE_VALUE_SCHEMA["fields"][:9], {"name": "extra", "type": "long"},
                                                  *CHANGE_VALUE_SCHEMA["fields"][9:]]}  # fmt: skip


def framed(schema_id: int, schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return b"\x00" + schema_id.to_bytes(4, "big") + out.getvalue()


@pytest.mark.unit
def test_head_reader_reads_op_table_key_and_before_of_every_change_layout() -> None:
    reader = retract.HeadReader(InMemorySchemas({2: CHANGE_VALUE_SCHEMA, 3: OLDER, 4: OTHER_LAYOUT}))  # type: ignore[arg-type]
    writer, tx = ChangeWriter(1, 2), ChangeWriter.transaction(2**40, 7, 1_700_000_000_000_000)
    full_row = b"\x00\x00\x00\x00\x07full-old-row"
    cases = [("READ", key(1), None, key(9), 5), ("UPDATE", key(2), key(1), key(8), None),
             ("DELETE", key(3), full_row, None, None), ("TRUNCATE", None, None, None, None)]  # fmt: skip
    whole, read_whole = reader.whole, []
    reader.whole = lambda value: read_whole.append(value) or whole(value)  # type: ignore[assignment,func-returns-value]
    for op, k, before, after, backfill in cases:
        value = writer.encode(op, "public", "ü", "p.ü", tx, 3, writer.size(4), k, before, after, backfill)
        assert reader(value) == (op, ("public", "ü"), k, before)
        record = {"op": op, "schema": "s", "table": "t", "topic": "p.t", "commit_lsn": 1, "xid": 2,
                  "commit_time": datetime(2024, 1, 1, tzinfo=UTC), "position": 0, "tx_size": 1, "key": k,
                  "before": before, "after": after, "extra": -5}  # fmt: skip
        assert reader(framed(3, OLDER, record)) == (op, ("s", "t"), k, before)
        assert reader(framed(4, OTHER_LAYOUT, record)) == (op, ("s", "t"), k, before)  # read whole
    assert {schema_id(f): known for f, known in reader.heads.items()} == {2: True, 3: True, 4: False}
    assert [schema_id(v) for v in read_whole] == [4] * len(cases)  # the others' heads were read in C
    value = writer.encode("READ", "public", "t", "p.t", tx, 0, writer.size(1), key(1), None, key(2))
    with pytest.raises(EOFError):  # the head read refuses it, the whole read says why
        reader(value[:12])


@pytest.mark.unit
def test_head_reader_tells_a_change_that_takes_no_key_away_by_its_first_byte() -> None:
    reader = retract.HeadReader(InMemorySchemas({2: CHANGE_VALUE_SCHEMA, 4: OTHER_LAYOUT}))  # type: ignore[arg-type]
    writer, tx = ChangeWriter(1, 2), ChangeWriter.transaction(2**40, 7, 1_700_000_000_000_000)

    def change(op: str) -> bytes:
        return writer.encode(op, "public", "t", "p.t", tx, 0, writer.size(1), None if op == "TRUNCATE" else key(1),
                             key(2) if op == "UPDATE" else None, key(3), None)  # fmt: skip

    assert reader.may_remove(change("READ"))  # its writer schema not read yet: read it to know
    reader(change("READ"))
    assert [reader.may_remove(change(op)) for op in ("READ", "INSERT", "UPDATE", "DELETE", "TRUNCATE")] == [
        False, False, True, True, True]  # fmt: skip
    reads = retract.HeadReader(reader.registry, retract.NO_READ)  # a read past the end that wants READ rows too
    reads(change("READ"))
    assert [reads.may_remove(change(op)) for op in ("READ", "INSERT", "DELETE")] == [True, False, True]
    record = {"op": "READ", "schema": "s", "table": "t", "topic": "p.t", "commit_lsn": 1, "xid": 2,
              "commit_time": datetime(2024, 1, 1, tzinfo=UTC), "position": 0, "tx_size": 1, "key": key(1),
              "before": None, "after": None, "extra": -5}  # fmt: skip
    other = framed(4, OTHER_LAYOUT, record)
    reader(other)
    assert reader.may_remove(other)  # another layout: always read
    assert retract.JsonHeads().may_remove(b'{"op":"READ"}')


@pytest.mark.unit
def test_key_filter_reads_json_change_keys() -> None:
    wanted = retract.KeyFilter([T], json.loads)
    writer = JsonChangeWriter()
    assert wanted(writer.encode_key(*T)) and not wanted(writer.encode_key(*OTHER))
    assert wanted(b"not json") and wanted(b"[1]")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, None),
        ("a b", "a b"),
        (True, "true"),
        (7, "7"),
        (b"\x00\xff", "\\x00ff"),
        (date(2024, 2, 29), "2024-02-29"),
        (date.max, "infinity"),
        (datetime.min, "-infinity"),
        (datetime.max.replace(tzinfo=UTC), "infinity"),
    ],
)
def test_key_values_as_postgresql_text(value: Any, text: str | None) -> None:
    assert retract.pg_text(value) == text
    if text in ("infinity", "-infinity"):
        assert retract.pg_text(value, literal=True) == value.isoformat()


KEY_TYPES = """
CREATE TYPE mood AS ENUM ('ok', 'sad');
CREATE TABLE k (
    i int, t text, u uuid, ts timestamptz, n numeric(10, 2), b bytea, d date, m mood, f timestamp,
    v text, PRIMARY KEY (i, t, u, ts, n, b, d, m, f)
);
INSERT INTO k SELECT g, 'txt ' || g || ' ü''"', md5(g::text)::uuid, '2024-03-01 10:00:00.123456+02'::timestamptz
       + g * interval '1 hour', g / 7.0, decode(lpad(to_hex(g), 4, '0'), 'hex'), date '2024-01-01' + g,
       (ARRAY['ok', 'sad'])[1 + g % 2]::mood,
       CASE WHEN g % 3 = 0 THEN timestamp 'infinity' WHEN g % 3 = 1 THEN timestamp '9999-12-31 23:59:59.999999'
            ELSE timestamp '2024-01-01' END, 'v'
FROM generate_series(1, 60) g;
"""


def shape_of(conn: Any) -> TableSchema:
    with conn.cursor() as cur:
        cur.execute("SELECT 'public.k'::regclass::oid")
        oid = cur.fetchone()[0]
    conn.commit()
    return catalog.table_schema(conn, catalog.TypeCache(conn), "p", catalog.TableRef(oid, "public", "k", True))


def key_images(conn: Any, shape: TableSchema, fmt: str) -> list[bytes]:
    """Every row's key as capture writes it, from PostgreSQL's text (the streaming path)."""
    encoder = RowEncoder(shape, 1, 2, fmt)
    with conn.cursor() as cur:
        columns = sql.SQL(", ").join(sql.SQL("{}::text").format(sql.Identifier(c.name)) for c in shape.columns)
        cur.execute(sql.SQL("SELECT {} FROM k ORDER BY k.i").format(columns))
        rows = cur.fetchall()
    conn.commit()
    images = [encoder.encode_key(encoder.convert(list(row))) for row in rows]
    assert all(images)
    return images  # type: ignore[return-value]


@pytest.mark.parametrize("fmt", ["avro", "json"])
def test_missing_finds_exactly_the_deleted_keys_of_every_key_type(pg_database: str, fmt: str) -> None:
    conn = catalog.connect(pg_database)
    with conn.cursor() as cur:
        cur.execute(KEY_TYPES)
    conn.commit()
    shape = shape_of(conn)
    images = key_images(conn, shape, fmt)
    with conn.cursor() as cur:
        cur.execute("DELETE FROM k WHERE i % 10 = 3 RETURNING i")
        deleted = sorted(i for (i,) in cur.fetchall())
    conn.commit()
    decode = retract.json_keys(shape) if fmt == "json" else retract.avro_keys(shape, lambda _: shape.key_schema)
    assert len(images) == 60 and deleted == [3, 13, 23, 33, 43, 53]
    gone = retract.missing(conn, shape, images, decode)
    assert gone == [images[i - 1] for i in deleted], "exactly the deleted rows, and no row that exists"
    conn.close()


def test_missing_works_in_batches(pg_database: str, monkeypatch: pytest.MonkeyPatch) -> None:
    conn = psycopg2.connect(pg_database)
    with conn.cursor() as cur:
        cur.execute(KEY_TYPES)
        cur.execute("DELETE FROM k WHERE i > 50")
    conn.commit()
    conn.close()
    conn = catalog.connect(pg_database)
    shape = shape_of(conn)
    images = key_images(conn, shape, "avro")
    ghost = images[0][:5] + images[0][5:]  # the same key twice is fine: it exists
    monkeypatch.setattr(retract, "BATCH", 7)
    assert retract.missing(conn, shape, [*images, ghost], retract.avro_keys(shape, lambda _: shape.key_schema)) == []
    conn.close()

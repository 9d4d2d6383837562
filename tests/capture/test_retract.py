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
from tables.change import CHANGE_KEY_SCHEMA
from tables.wire import body

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

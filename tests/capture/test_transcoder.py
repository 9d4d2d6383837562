"""The fast paths write exactly what the general path writes, or leave the row to it.

The transcoder (streaming) on hand-built pgoutput tuples, and the compiled snapshot
``Copier`` on ``COPY`` text lines; then both on real bytes from PostgreSQL.
"""

from __future__ import annotations

import io
import random
import struct
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import fastavro
import pytest

from capture import catalog
from capture import decoder as pg
from capture._copier import Copier
from capture.changes import ChangeSink
from capture.config import CaptureConfig
from capture.encoder import ChangeWriter, RowEncoder
from capture.snapshot import _Lines, copy_field, general_path
from capture.state import State
from capture.stream import Streamer
from capture.transcoder import Transcoder, copier_columns, copier_spec
from tables import types as t
from tables.catalog import ColumnInfo, TableSchema
from tables.registry import NoRegistry
from tests.capture.test_types import EVERY_TYPE, copy_row

MOOD = t.PgType(900, "mood", "public", "e", labels=("sad", "ok", "happy"))
ODD = t.PgType(901, "odd", "public", "e", labels=("a b", "c"))
COLUMNS = [
    ("id", t.PgType(20, "int8"), -1, False, True),
    ("code", t.PgType(25, "text"), -1, False, True),
    ("i2", t.PgType(21, "int2"), -1, True, False),
    ("i4", t.PgType(23, "int4"), -1, False, False),
    ("price", t.PgType(1700, "numeric"), ((12 << 16) | 2) + 4, True, False),
    ("whole", t.PgType(1700, "numeric"), ((10 << 16) | 0) + 4, True, False),
    ("wide", t.PgType(1700, "numeric"), ((38 << 16) | 10) + 4, False, False),
    ("free", t.PgType(1700, "numeric"), -1, True, False),
    ("name", t.PgType(1043, "varchar"), 24, True, False),
    ("flag", t.PgType(16, "bool"), -1, True, False),
    ("ratio", t.PgType(701, "float8"), -1, True, False),
    ("small", t.PgType(700, "float4"), -1, True, False),
    ("at", t.PgType(1184, "timestamptz"), -1, True, False),
    ("local", t.PgType(1114, "timestamp"), -1, False, False),
    ("day", t.PgType(1082, "date"), -1, True, False),
    ("clock", t.PgType(1083, "time"), -1, True, False),
    ("span", t.PgType(1186, "interval"), -1, True, False),
    ("uid", t.PgType(2950, "uuid"), -1, True, False),
    ("doc", t.PgType(3802, "jsonb"), -1, True, False),
    ("mood", MOOD, -1, False, False),
    ("mood2", MOOD, -1, True, False),
    ("odd", ODD, -1, True, False),
    ("ints", t.PgType(1007, "_int4", element=t.PgType(23, "int4")), -1, True, False),
    ("blob", t.PgType(17, "bytea"), -1, True, False),
    ("cash", t.PgType(790, "money"), -1, True, False),
    ("ip", t.PgType(869, "inet"), -1, True, False),
]
TABLE = TableSchema.build("p", "public", "every", [ColumnInfo(*c) for c in COLUMNS])
VALUE_FRAME, KEY_FRAME = b"\x00\x00\x00\x00\x07", b"\x00\x00\x00\x00\x08"
ROW = [
    "42", "k\tq\\1", "-32768", "2147483647", "12.50", "7", "1234567890123456789012345678.9012345678",
    "1.000000000000000000000000001",
    "héllo ✓", "t", "3.141592653589793", "1.5", "2024-02-29 07:04:56.789012+00", "2024-02-29 12:34:56",
    "2024-02-29", "23:59:59.999999", "P1Y2M3DT4H5M6.789S", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
    '{"a": [1, 2]}', "sad", "happy", "a b", "{1,NULL,3}", "\\x00ff10", "$1,234.56", "192.168.0.1/24",
]  # fmt: skip


def tup(values: list[Any]) -> bytes:
    out = struct.pack("!h", len(values))
    for value in values:
        if value is None:
            out += b"n"
        elif value is pg.UNCHANGED:
            out += b"u"
        elif isinstance(value, bytes):
            out += b"b" + struct.pack("!i", len(value)) + value
        else:
            data = value.encode()
            out += b"t" + struct.pack("!i", len(data)) + data
    return out


def copy_line(values: list[Any]) -> bytes:
    """A row as ``COPY ... TO STDOUT`` writes it (text format)."""
    escape = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})
    return "\t".join("\\N" if v is None else v.translate(escape) for v in values).encode()


def codecs() -> tuple[Transcoder, RowEncoder]:
    enc = RowEncoder(TABLE, 7, 8)
    return Transcoder(TABLE, VALUE_FRAME, KEY_FRAME), enc


WRITER = ChangeWriter(3, 4)
TX = WRITER.transaction(1234, 0, 1_700_000_000_000_000)
CHANGE_KEY = WRITER.encode_key("public", "every")
READ = WRITER.read_encoder("public", "every", TABLE.topic, TX, WRITER.size(0))


def read_message(position: int, row: list[Any]) -> bytes:
    """The raw-topic READ change the general path writes for ``row``."""
    value, key, _ = general(RowEncoder(TABLE, 7, 8), row)
    return READ(position, key, value)


def refuse(line: bytes) -> Any:
    raise AssertionError(f"the general path was not expected for {line!r}")


Batches = list[list[dict[str, bytes]]]


def copier_for(fallback: Any, *, position: int = 0, stride: int = 1, batch_rows: int = 100, on_batch: Any = None,
               sender: Any = None) -> tuple[Copier, Batches, list[tuple[bytes, int, str]]]:  # fmt: skip
    """A Copier of TABLE with the envelope ``READ`` writes, collecting what it hands on."""
    batches: list[list[dict[str, bytes]]] = []
    large: list[tuple[bytes, int, str]] = []

    def collect(batch: list[dict[str, bytes]], found: list[tuple[bytes, int, str]]) -> None:
        batches.append(batch)
        large.extend(found)

    head = WRITER.read_head("public", "every", TABLE.topic, TX)
    copier = Copier(copier_columns(TABLE), VALUE_FRAME, KEY_FRAME, head, WRITER.size(0), CHANGE_KEY, position,
                    stride, fallback, on_batch or collect, batch_rows, sender)  # fmt: skip
    return copier, batches, large


def general(enc: RowEncoder, values: list[Any]) -> tuple[bytes, bytes | None, list[tuple[int, str]]]:
    converted = enc.convert(values)
    return enc.encode_value(converted), enc.encode_key(converted), enc.large_values(values)


def with_(**changes: Any) -> list[Any]:
    names = [c[0] for c in COLUMNS]
    row = list(ROW)
    for name, value in changes.items():
        row[names.index(name)] = value
    return row


@pytest.mark.unit
@pytest.mark.parametrize(
    "row",
    [
        ROW,
        with_(**{c[0]: None for c in COLUMNS if c[3]}),  # every nullable column NULL
        with_(price="-0.50", whole="-12", wide="-0.0000000001", flag="f", ratio="-Infinity", i4="-1"),
        with_(price="0.00", ratio="NaN", at="infinity", local="-infinity", day="infinity", free="NaN"),
        with_(at="-infinity", local="infinity", day="-infinity"),
        with_(price="99999999999.99", id="9223372036854775807", i2="0", at="1970-01-01 00:00:00+00"),
        with_(name="", code="", doc="x" * 300, mood="ok", at="2024-02-29 07:04:56+00", local="0001-01-01 00:00:00"),
        with_(code="k-1", blob=None, doc='{"b": "x"}', ints="{1,2}"),  # no escapes: COPY lines on the fast path
        with_(name="é" * 200, code="ü" * 300),  # ≥ 256 bytes, < 256 characters / ≥ 256 characters
        with_(at="2024-02-29 07:04:56.5+00", local="2024-02-29 12:34:56.000001"),
    ],
)
def test_rows_equal_the_general_path(row: list[Any]) -> None:
    fast, enc = codecs()
    buf = b"I\x00\x00\x00\x01N" + tup(row)
    found = fast.row(buf, 6)
    assert found is not None
    value, key, large, end = found
    assert end == len(buf)
    assert (value, key, large or []) == general(enc, row)
    key_tuple = tup([v if c[4] else None for v, c in zip(row, COLUMNS, strict=True)])
    assert fast.key is not None and fast.key(b"K" + key_tuple, 1) == (key, len(key_tuple) + 1)
    # the snapshot's COPY lines: the same bytes, escapes included, as whole raw-topic messages
    assert [copy_field(f) for f in copy_line(row).decode().split("\t")] == row
    copier, batches, _ = copier_for(refuse)
    copier.write(copy_line(row) + b"\n")
    copier.finish()
    assert copier.fast == copier.rows == 1
    assert batches == [[{"value": read_message(0, row), "key": CHANGE_KEY}]]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "ends"),
    [("infinity", (datetime.max, date.max)), ("-infinity", (datetime.min, date.min))],
)
def test_infinities_are_written_as_the_ends_every_avro_reader_decodes(text: str, ends: tuple[Any, ...]) -> None:
    """The streaming and snapshot fast paths write PostgreSQL's infinities as README "Types" says."""
    row = with_(at=text, local=text, day=text)
    fast, _ = codecs()
    found = fast.row(tup(row), 0)
    assert found is not None
    copier, batches, _ = copier_for(refuse)
    copier.write(copy_line(row) + b"\n")
    copier.finish()
    assert batches[0][0]["value"].endswith(found[0] + b"\x00")  # the READ change: the framed row, backfill null
    decoded = fastavro.schemaless_reader(io.BytesIO(found[0][5:]), fastavro.parse_schema(TABLE.value_schema), None)
    assert (decoded["at"], decoded["local"], decoded["day"]) == (ends[0].replace(tzinfo=UTC), *ends)


@pytest.mark.unit
@pytest.mark.parametrize(
    "row",
    [
        with_(price="NaN"),  # the union's string branch
        with_(price="Infinity"),
        with_(price="12.5"),  # not at the column's scale: PostgreSQL never sends it, but the general path copes
        with_(whole="7.0"),
    ],
)
def test_declines_what_the_general_path_writes(row: list[Any]) -> None:
    fast, enc = codecs()
    assert fast.row(b"I" + tup(row), 1) is None
    assert general(enc, row)[0].startswith(VALUE_FRAME)


@pytest.mark.unit
@pytest.mark.parametrize(
    "row",
    [
        with_(doc=pg.UNCHANGED),  # an unchanged TOAST value: the streamer fills it in
        with_(name=b"\x00\x01"),  # a binary column
        with_(i4=None),  # NULL in a non-null column: the general path says which table
        with_(mood="angry"),  # a label the schema does not have
    ],
)
def test_declines_what_needs_more_than_the_tuple(row: list[Any]) -> None:
    fast, _ = codecs()
    try:
        found = fast.row(b"I" + tup(row), 1)
    except KeyError:  # the unknown label
        found = None
    assert found is None


@pytest.mark.unit
def test_wrong_column_count_and_truncated_tuples_decline() -> None:
    fast, _ = codecs()
    assert fast.row(tup(ROW[:-1]), 0) is None
    truncated = b"I\x00\x00\x00\x01N" + tup(ROW)[:-3]
    found = fast.row(truncated, 6)
    assert found is not None and found[3] > len(truncated)  # the streamer declines a tuple past the end
    with pytest.raises(pg.DecodeError, match="truncated"):
        pg.decode(truncated)


@pytest.mark.unit
def test_wide_numeric_keeps_every_digit() -> None:
    """numeric(38,10) holds 38 digits; Python's default decimal context would round to 28."""
    fast, enc = codecs()
    found = fast.row(tup(ROW), 0)
    assert found is not None
    assert found[0] == general(enc, ROW)[0]
    unscaled = 12345678901234567890123456789012345678
    assert unscaled.to_bytes(16, "big", signed=True) in found[0]


REAL_CHANGES = (
    "; ".join([copy_row(1, 3, "1.25"), copy_row(2, 4)])
    + """;
UPDATE every SET t = 'changed' WHERE id = 3;
UPDATE every SET id = 6 WHERE id = 3;
DELETE FROM every WHERE id = 4;
ALTER TABLE every REPLICA IDENTITY FULL;
UPDATE every SET i4 = 5 WHERE id = 6;
DELETE FROM every WHERE id = 6;
"""
)


@pytest.mark.usefixtures("local_stack")
def test_streamer_takes_the_fast_path_for_real_messages(pg_database: str, unique_name: str, tmp_path: Path) -> None:
    """Every type's Insert, Update (no old, old key, old row) and Delete (key, old row) as PostgreSQL
    sends them: the streamer's fast path takes each and writes what its general path writes."""
    conn = catalog.connect(pg_database)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(EVERY_TYPE)
        cur.execute(f"CREATE PUBLICATION {unique_name} FOR TABLE every")
        cur.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (unique_name,))
        cur.execute(REAL_CHANGES)
        cur.execute(
            "SELECT data FROM pg_logical_slot_get_binary_changes(%s, NULL, NULL,"
            " 'proto_version', '1', 'publication_names', %s)",
            (unique_name, unique_name),
        )
        payloads = [bytes(row[0]) for row in cur.fetchall()]
        cur.execute("SELECT pg_drop_replication_slot(%s)", (unique_name,))
    conn.autocommit = False
    cfg = CaptureConfig(state_dir=tmp_path)
    state = State(tmp_path, "t")
    sink = ChangeSink(ChangeWriter(0, 0), None)  # no producer: changes are compared before their commit
    streamer = Streamer(cfg, conn, catalog.TypeCache(conn), NoRegistry(), sink, state, {("public", "every"): True})
    kinds = []
    try:
        for payload in payloads:
            if payload[:1] not in (b"I", b"U", b"D"):
                if payload[:1] != b"C":
                    streamer.handle(payload)
                continue
            kinds.append(payload[:1] + (payload[5:6] if payload[:1] != b"I" else b""))
            streamer.tx.clear()
            streamer.handle(payload)
            fast = list(streamer.tx)
            streamer.tx.clear()
            streamer._handle(payload)  # the general path
            assert fast == list(streamer.tx), kinds[-1]
    finally:
        state.close()
        conn.close()
    assert kinds == [b"I", b"I", b"UN", b"UK", b"DK", b"UO", b"DO"]
    assert streamer.fast_rows == len(kinds)


@pytest.mark.unit
@pytest.mark.parametrize(
    "line",
    [
        copy_line(with_(i4=None)),  # NULL in a non-null column: the general path names table and column
        copy_line(with_(mood="angry")),  # a label the schema does not have: the enum's encoder refuses it
        copy_line(ROW[:-1]),  # a field too few
        copy_line(ROW) + b"\tspare",  # a field too many
        copy_line(with_(day="2024-13-45")),  # a value its column's own encoder refuses too
    ],
)
def test_copier_leaves_rows_it_cannot_write_to_the_general_path(line: bytes) -> None:
    seen: list[bytes] = []

    def fallback(raw: bytes) -> tuple[bytes, bytes | None, None]:
        seen.append(raw)
        return b"value", b"\x00\x00\x00\x00\x08key", None

    copier, batches, _ = copier_for(fallback, position=7)
    copier.write(line + b"\n")
    copier.finish()
    assert seen == [line] and copier.rows == 1 and copier.fast == 0
    # whatever the general path answers is wrapped in the same envelope, at the row's position
    assert batches == [[{"value": READ(7, b"\x00\x00\x00\x00\x08key", b"value"), "key": CHANGE_KEY}]]


@pytest.mark.unit
def test_copier_counts_positions_batches_and_toast_sized_values_across_any_chunking() -> None:
    rows = [
        with_(id=str(n), name="é" * 200, code="ü" * 300 if n % 2 else "short", doc="d" * (250 + n)) for n in range(1, 8)
    ]
    data = b"".join(copy_line(row) + b"\n" for row in rows)
    copier, batches, large = copier_for(refuse, position=5, stride=3, batch_rows=3)
    for start in range(0, len(data), 97):  # lines cut anywhere, as a file object may be written to
        copier.write(data[start : start + 97])
    copier.finish()
    assert [len(b) for b in batches] == [3, 3, 1] and copier.rows == copier.fast == 7
    assert copier.position == 5 + 7 * 3
    messages = [m["value"] for batch in batches for m in batch]
    assert messages == [read_message(5 + 3 * i, row) for i, row in enumerate(rows)]
    enc = RowEncoder(TABLE, 7, 8)
    expected = [(k[5:], i, text) for row in rows for _, k, found in [general(enc, row)] for i, text in found if k]
    assert large == expected and len(large) == 4 + 2  # code of odd ids (300 characters), doc of ids 6 and 7


@pytest.mark.unit
def test_copier_takes_a_last_line_without_newline_and_raises_what_on_batch_raises() -> None:
    copier, batches, _ = copier_for(refuse)
    copier.write(copy_line(ROW))
    assert batches == []
    copier.finish()
    assert copier.rows == 1 and batches[0][0]["value"] == read_message(0, ROW)

    class Refused(Exception):
        pass

    def on_batch(batch: list[Any], large: list[Any]) -> None:
        raise Refused("the broker said no")

    copier, _, _ = copier_for(refuse, batch_rows=1, on_batch=on_batch)
    with pytest.raises(Refused, match="the broker said no"):
        copier.write(copy_line(ROW) + b"\n")


@pytest.mark.usefixtures("local_stack")
def test_copier_writes_what_the_general_path_writes_for_real_copy_output(pg_database: str, unique_name: str) -> None:
    """Every type, as ``COPY ... TO STDOUT`` prints it (escapes, NULLs, NaN, infinities, TOAST-sized
    text), through psycopg2 into the Copier: every row on its own path, each message equal."""
    conn = catalog.connect(pg_database)
    conn.autocommit = True
    extra = """
    INSERT INTO every (id, t, vc, n_nan, ts, tstz, dt, d, atx) VALUES
      (10, E'tab\\there\\nnew line \\\\ back', E'a\\rb', 'NaN', 'infinity', '-infinity', 'infinity',
       'NaN', '{"a\\tb"}'),
      (11, repeat('ü', 300), repeat('x', 20), 99999999.99, '0001-01-01 00:00:00', '1970-01-01 00:00:00+00',
       '0001-01-01', -0.0, '{}'),
      (12, '', '', NULL, '-infinity', 'infinity', '-infinity', 'Infinity', '{}');
    """
    with conn.cursor() as cur:
        cur.execute(EVERY_TYPE)
        cur.execute(extra)
    conn.autocommit = False
    with conn.cursor() as cur:
        cur.execute("SELECT 'every'::regclass::oid")
        oid = cur.fetchone()[0]  # type: ignore[index]
    conn.commit()
    shape = catalog.table_schema(conn, catalog.TypeCache(conn), "p", catalog.TableRef(oid, "public", "every", True))
    enc = RowEncoder(shape, 7, 8)
    spec = copier_spec(enc)
    assert spec is not None
    query = "COPY (SELECT * FROM every ORDER BY id) TO STDOUT"
    lines: list[bytes] = []
    with conn.cursor() as cur:
        cur.copy_expert(query, _Lines(lines.append))
    read = WRITER.read_encoder("public", "every", shape.topic, TX, WRITER.size(0))
    expected = [read(n, key, value) for n, (value, key, _) in enumerate(map(general_path(enc), lines))]
    batches: list[list[dict[str, bytes]]] = []
    head = WRITER.read_head("public", "every", shape.topic, TX)
    copier = Copier(spec.columns, spec.value_prefix, spec.key_prefix, head, WRITER.size(0), CHANGE_KEY, 0, 1,
                    refuse, lambda batch, large: batches.append(batch), 2)  # fmt: skip
    with conn.cursor() as cur:
        cur.copy_expert(query, copier)
    copier.finish()
    conn.close()
    assert len(lines) == 5 and any(b"\\t" in line for line in lines)  # an escaped tab came through
    assert copier.fast == copier.rows == 5
    assert [m["value"] for batch in batches for m in batch] == expected


FUZZ_PIECES = ["0", "7", "-", ".", "12.50", "9" * 20, "\\", "\\N", "\\t", "t", "f", "NaN", "Infinity", "é", "x",
               " ", "2024-02-29", " 07:04:56", ".5", "+00", "+05:30", "sad", "e", "1e5", "00", "infinity"]  # fmt: skip


@pytest.mark.unit
def test_copier_agrees_with_the_general_path_on_random_lines() -> None:
    """Lines of plausible and implausible field texts: the Copier writes exactly what the general
    path writes, or leaves the row to it; it never writes a row the general path refuses."""
    rng = random.Random(20261122)
    enc = RowEncoder(TABLE, 7, 8)
    checked = fast_rows = refused = 0
    base = copy_line(ROW).decode().split("\t")  # COPY's text of each field
    for _ in range(3000):
        row = list(base)
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(row))
            pieces = rng.choices(FUZZ_PIECES, k=rng.randint(0, 3))
            row[i] = "".join(pieces) if rng.random() < 0.7 else row[i] + "".join(pieces)
        line = "\t".join(row).encode()  # the pieces' backslashes are COPY escapes (or broken ones)
        fields = [copy_field(f) for f in line.decode().split("\t")]
        try:
            value, key, _ = general(enc, fields)
            expected: bytes | None = READ(0, key, value)
        except Exception:  # any refusal of the reference
            expected = None
        leftover: list[bytes] = []

        def fallback(raw: bytes, leftover: list[bytes] = leftover) -> Any:
            leftover.append(raw)
            return b"value", None, None

        copier, batches, _ = copier_for(fallback)
        copier.write(line + b"\n")
        copier.finish()
        written = batches[0][0]["value"]
        if expected is None:
            assert leftover == [line], line  # the general path will say what is wrong
            refused += 1
        elif not leftover:
            assert written == expected, line
            fast_rows += 1
        checked += 1
    assert checked == 3000 and fast_rows > 500 and refused > 500

"""PostgreSQL text values to Avro: the pure converters, and a round trip of every listed type."""

from __future__ import annotations

import copy
import io
import json
import time
from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import fastavro
import httpx
import psycopg2
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from capture.jsonformat import JsonRowWriter
from headwater.reconcile import same
from tables import types as t
from tables.avro import compile_schema
from tests.plugins.capture import Capture

INT4 = t.PgType(23, "int4")
NUMERIC = t.PgType(1700, "numeric")


def typmod(precision: int, scale: int) -> int:
    return ((precision << 16) | scale) + 4


@pytest.mark.unit
class TestParsers:
    def test_timestamps_keep_microseconds_and_offsets(self) -> None:
        assert t.parse_timestamp("1970-01-01 00:00:00") == 0
        assert t.parse_timestamp("2024-01-02 03:04:05.123456+00") == 1704164645123456
        assert t.parse_timestamp("2024-01-02 05:04:05.123456+02") == 1704164645123456
        assert t.parse_timestamp("2024-01-02 03:04:05.5-00:30") == 1704166445500000
        assert t.parse_timestamp("1969-12-31 23:59:59.5") == -500000

    def test_dates_and_times(self) -> None:
        assert t.parse_date("1970-01-02") == 1 and t.parse_date("1969-12-31") == -1
        assert t.parse_time("00:00:01.000001") == 1_000_001 and t.parse_time("24:00:00") == 86_400_000_000
        with pytest.raises(t.UnsupportedValue):
            t.parse_date("0044-03-15 BC")

    def test_infinities_become_the_ends_python_and_avro_readers_hold(self) -> None:
        """date.max/min and datetime.max/min, as psycopg2 reads them; the text stays for the json format."""
        assert t.parse_date("infinity") == t.parse_date("9999-12-31") == 2_932_896
        assert t.parse_date("-infinity") == t.parse_date("0001-01-01") == -719_162
        assert t.parse_timestamp("infinity") == t.parse_timestamp("9999-12-31 23:59:59.999999+00")
        assert t.parse_timestamp("-infinity") == t.parse_timestamp("0001-01-01 00:00:00") == -62_135_596_800_000_000
        infinite = [t.parse_date(x) for x in ("infinity", "-infinity")] + [
            t.parse_timestamp(x) for x in ("infinity", "-infinity")
        ]
        assert [x.text for x in infinite if isinstance(x, t.Infinite)] == ["infinity", "-infinity"] * 2
        assert not isinstance(t.parse_date("9999-12-31"), t.Infinite)
        assert copy.deepcopy(t.DATE_INFINITY).text == "infinity"  # copies and pickles keep the text

    @pytest.mark.parametrize(
        ("logical", "text", "decoded"),
        [
            ("date", "infinity", date.max),
            ("date", "-infinity", date.min),
            ("local-timestamp-micros", "infinity", datetime.max),
            ("local-timestamp-micros", "-infinity", datetime.min),
            ("timestamp-micros", "infinity", datetime.max.replace(tzinfo=UTC)),
            ("timestamp-micros", "-infinity", datetime.min.replace(tzinfo=UTC)),
        ],
    )
    def test_infinities_decode_in_fastavro(self, logical: str, text: str, decoded: Any) -> None:
        """fastavro is what confluent-kafka's AvroDeserializer decodes with: the int and long
        range ends written before raised OverflowError there."""
        pgtype = {"date": "date", "timestamp-micros": "timestamptz"}.get(logical, "timestamp")
        entry, conv = t.field("at", t.PgType(0, pgtype), -1, nullable=True, seen=set())
        assert entry["type"][1]["logicalType"] == logical
        schema = fastavro.parse_schema({"type": "record", "name": "r", "fields": [entry]})
        body = compile_schema(schema)([conv(text)])
        assert fastavro.schemaless_reader(io.BytesIO(body), schema, None) == {"at": decoded}

    def test_json_format_writes_infinities_as_postgres_prints_them(self) -> None:
        types = [t.PgType(0, name) for name in ("date", "timestamp", "timestamptz")]
        writer = JsonRowWriter(["d", "ts", "tz"], types)
        convert = [t.field("x", p, -1, nullable=True, seen=set())[1] for p in types]
        row = writer.encode([c("-infinity") for c in convert])
        assert json.loads(row) == {"d": "-infinity", "ts": "-infinity", "tz": "-infinity"}
        texts = ("9999-12-31", "9999-12-31 23:59:59.999999", "0001-01-01 00:00:00+00")
        real = [c(text) for c, text in zip(convert, texts, strict=True)]
        assert json.loads(writer.encode(real)) == {
            "d": "9999-12-31", "ts": "9999-12-31T23:59:59.999999", "tz": "0001-01-01T00:00:00Z",
        }  # fmt: skip

    def test_intervals_keep_months_days_micros_apart(self) -> None:
        assert t.parse_interval("P1Y2M3DT4H5M6.789S") == {"months": 14, "days": 3, "microseconds": 14_706_789_000}
        assert t.parse_interval("P-1Y-2M") == {"months": -14, "days": 0, "microseconds": 0}
        assert t.parse_interval("PT-0.000001S") == {"months": 0, "days": 0, "microseconds": -1}
        assert t.parse_interval("P2W") == {"months": 0, "days": 14, "microseconds": 0}
        with pytest.raises(t.UnsupportedValue):
            t.parse_interval("1 day")

    def test_numeric_money_bytea(self) -> None:
        assert t.parse_numeric("12.340") == Decimal("12.340") and t.parse_numeric("NaN") == "NaN"
        assert t.parse_money("-$1,234.56") == Decimal("-1234.56") and t.parse_money("$0.01") == Decimal("0.01")
        assert t.parse_bytea("\\x00ff") == b"\x00\xff"

    def test_arrays(self) -> None:
        assert t.parse_array('{1,NULL,"a,b","say \\"hi\\""}') == ["1", None, "a,b", 'say "hi"']
        assert t.parse_array("{}") == [] and t.parse_array("[0:1]={7,8}") == ["7", "8"]
        assert t.parse_array("{{1,2},{3,4}}") == [["1", "2"], ["3", "4"]]

    def test_numeric_schema_from_typmod(self) -> None:
        entry, conv = t.field("total", NUMERIC, typmod(14, 2), nullable=True, seen=set())
        assert conv("NaN") == "NaN" and conv("1.50") == Decimal("1.50")
        assert entry["type"] == [
            "null",
            {"type": "bytes", "logicalType": "decimal", "precision": 14, "scale": 2},
            "string",
        ]
        assert entry["pg.type"] == "numeric(14,2)" and entry["default"] is None
        free, conv_free = t.field("x", NUMERIC, -1, nullable=False, seen=set())
        assert free["type"] == "string" and conv_free("1.000000000000000000001") == "1.000000000000000000001"

    def test_enums_valid_names_become_avro_enums(self) -> None:
        mood = t.PgType(900, "mood", "public", "e", labels=("happy", "sad"))
        odd = t.PgType(901, "odd", "public", "e", labels=("a b", "c"))
        seen: set[str] = set()
        assert t.field("m", mood, -1, nullable=False, seen=seen)[0]["type"]["symbols"] == ["happy", "sad"]
        assert t.field("m2", mood, -1, nullable=False, seen=seen)[0]["type"] == "headwater.pg.public.mood"
        assert t.field("o", odd, -1, nullable=False, seen=set())[0]["type"] == "string"

    def test_unknown_types_travel_as_text_with_their_name(self) -> None:
        point = t.PgType(600, "point")
        entry, conv = t.field("p", point, -1, nullable=False, seen=set())
        assert entry["type"] == "string" and entry["pg.type"] == "point" and conv("(1,2)") == "(1,2)"

    def test_odd_column_names_are_made_valid(self) -> None:
        entry, _ = t.field("order-id", INT4, -1, nullable=False, seen=set())
        assert entry["name"] == "order_id" and entry["pg.name"] == "order-id"


EVERY_TYPE = """
CREATE TYPE mood AS ENUM ('happy', 'sad');
CREATE TYPE odd AS ENUM ('a b', 'c');
CREATE DOMAIN posint AS int CHECK (VALUE > 0);
CREATE TABLE every (
    id int PRIMARY KEY, i2 smallint, i4 int, i8 bigint, n numeric(12,3), n_nan numeric(10,2), nu numeric,
    r real, d double precision, b boolean, t text, vc varchar(20), c char(5), ba bytea, dt date, tm time,
    ts timestamp, tstz timestamptz, iv interval, u uuid, j json, jb jsonb, ai int[], atx text[], e mood, e2 odd,
    m money, ip inet, net cidr, dom posint, pt point, n38 numeric(38,10)
);
INSERT INTO every VALUES (
    1, -32768, 2147483647, -9223372036854775808, 123456789.125, 'NaN', 1.000000000000000000000000001,
    1.5, 3.141592653589793, true, 'héllo ✓', 'varchar', 'ab', '\\x00ff10', '2024-02-29', '23:59:59.999999',
    '2024-02-29 12:34:56.789012', '2024-02-29 12:34:56.789012+05:30', '1 year 2 mons 3 days 04:05:06.789',
    'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{"a": [1, 2]}', '{"b": {"c": null}}', '{1,NULL,3}',
    '{"x y",z}', 'sad', 'a b', '-1234.56', '192.168.0.1/24', '10.0.0.0/8', 7, '(1.5,2)',
    1234567890123456789012345678.9012345678
);
INSERT INTO every (id) VALUES (2);
"""
COLUMNS = (
    "id, i2, i4, i8, n, n_nan, nu, r, d, b, t, vc, c, ba, dt, tm, ts, tstz, iv, u, j, jb, ai, atx, e, e2, m, "
    "ip, net, dom, pt, n38"
)


def copy_row(source: int, new_id: int, n_nan: str = "n_nan") -> str:
    """SQL inserting a copy of row ``source`` of EVERY_TYPE as ``new_id`` (fixed literals only)."""
    values = COLUMNS.replace("id, ", f"{new_id}, ", 1).replace("n_nan", n_nan)
    return f"INSERT INTO every ({COLUMNS}) SELECT {values} FROM every WHERE id = {source}"  # noqa: S608


# streamed after the snapshot: both rows again (ids 3, 4), and row 1 with a finite n_nan (id 5)
EVERY_AGAIN = "; ".join([copy_row(1, 3), copy_row(2, 4), copy_row(1, 5, "12.5")])
# infinite dates and timestamps (ids 6, 7), and streamed again (ids 8, 9)
INFINITIES = """
INSERT INTO every (id, dt, ts, tstz) VALUES (6, 'infinity', 'infinity', 'infinity'),
  (7, '-infinity', '-infinity', '-infinity');
"""
INFINITIES_AGAIN = "; ".join([copy_row(6, 8), copy_row(7, 9)])
# what every standard Avro reader (fastavro, confluent-kafka, Spark) gives for them: README "Types"
ENDS = {
    6: {"dt": date.max, "ts": datetime.max, "tstz": datetime.max.replace(tzinfo=UTC)},
    7: {"dt": date.min, "ts": datetime.min, "tstz": datetime.min.replace(tzinfo=UTC)},
}


def test_every_type_round_trips_through_confluent_deserializer(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    """Snapshot rows (COPY text, the general path) and streamed rows (pgoutput, the fast path)."""
    conn = psycopg2.connect(pg_database)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(EVERY_TYPE + INFINITIES)
        cur.execute("SELECT * FROM every ORDER BY id")
        names = [d.name for d in cur.description]
        expected = {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}
    capture = capture_factory(pg_database).start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len([c for c in capture.changes() if c["op"] == "READ"]) < 4:
        capture.raise_error()
        time.sleep(0.5)
    with conn.cursor() as cur:
        cur.execute(EVERY_AGAIN + "; " + INFINITIES_AGAIN)
    capture.wait_caught_up(pg_database)
    capture.stop()
    conn.close()
    changes = [c for c in capture.changes() if c["op"] in ("READ", "INSERT")]
    assert [c["op"] for c in changes] == ["READ"] * 4 + ["INSERT"] * 5

    topic = f"{capture.cfg.topic_prefix}.every"
    with SchemaRegistryClient({"url": capture.cfg.registry_url}) as client:
        deserialize = AvroDeserializer(client)
        ctx = SerializationContext(topic, MessageField.VALUE)
        rows = {row["id"]: row for row in (deserialize(c["after"], ctx) for c in changes)}

    check_infinities(rows, expected)
    full = expected[1]
    for got in (rows[1], rows[3], rows[5]):
        check_full_row(got, full, nan=got["id"] != 5)
    assert rows[5]["n_nan"] == Decimal("12.50")
    for got in (rows[2], rows[4]):
        assert all(v is None for k, v in got.items() if k != "id")
    assert full["dt"] == date(2024, 2, 29) and full["tm"] == datetime(1, 1, 1, 23, 59, 59, 999999).time()
    assert timedelta(days=3) < full["iv"]  # psycopg2's own reading, for the record

    schema = json.loads(
        httpx.get(f"{capture.cfg.registry_url}/subjects/{topic}-value/versions/latest").json()["schema"]
    )
    by_name = {f["name"]: f for f in schema["fields"]}
    assert by_name["n"]["pg.type"] == "numeric(12,3)" and by_name["pt"]["pg.type"] == "point"
    assert by_name["tstz"]["type"] == ["null", {"type": "long", "logicalType": "timestamp-micros"}]
    assert by_name["id"]["type"] == "int"  # key columns are not nullable
    parsed = fastavro.parse_schema(schema)  # fastavro alone, as any Python consumer decodes
    decoded = [fastavro.schemaless_reader(io.BytesIO(c["after"][5:]), parsed, None) for c in changes]
    assert {row["id"]: row for row in decoded} == rows


def check_infinities(rows: dict[int, dict[str, Any]], pg: dict[int, dict[str, Any]]) -> None:
    """Rows 6 and 7 of INFINITIES (snapshot) and 8 and 9 (streamed): the sentinels, equal (by
    ``reconcile.same``) to what psycopg2 reads for PostgreSQL's infinities."""
    for source, again in ((6, 8), (7, 9)):
        for got in (rows[source], rows[again]):
            assert {k: got[k] for k in ENDS[source]} == ENDS[source], got["id"]
            assert all(same(pg[source][k], got[k]) for k in ENDS[source]), (pg[source], got)


def check_full_row(got: dict[str, Any], full: dict[str, Any], *, nan: bool) -> None:
    """A decoded Avro row against what psycopg2 reads for row 1 of EVERY_TYPE."""
    for column in ("i2", "i4", "i8", "n", "r", "d", "b", "t", "vc", "c", "dt", "tm", "ts", "ai", "atx", "e", "e2",
                   "ip", "net", "dom", "pt", "n38"):  # fmt: skip
        assert got[column] == full[column], column
    assert got["n38"] == Decimal("1234567890123456789012345678.9012345678")  # every digit (numeric(38,10))
    assert got["ba"] == bytes(full["ba"])
    assert got["tstz"] == full["tstz"] == datetime(2024, 2, 29, 7, 4, 56, 789012, tzinfo=UTC)
    assert not nan or (got["n_nan"] == "NaN" and full["n_nan"].is_nan())
    assert Decimal(got["nu"]) == full["nu"] and got["nu"] == "1.000000000000000000000000001"
    assert got["iv"] == {"months": 14, "days": 3, "microseconds": 14_706_789_000}
    assert str(got["u"]) == full["u"]
    assert json.loads(got["j"]) == full["j"] and json.loads(got["jb"]) == full["jb"]
    assert got["m"] == Decimal("-1234.56")

"""Every PostgreSQL type capture writes, read back by Spark with the type that holds it exactly."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from datetime import time as clock
from decimal import Decimal
from typing import Any

import psycopg2
import pytest
from confluent_kafka import Producer
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from analytics.config import AnalyticsConfig
from analytics.jobs import read
from tests.analytics.test_shop import plain
from tests.capture.test_types import ENDS, EVERY_TYPE, INFINITIES
from tests.plugins.capture import Capture

pytestmark = pytest.mark.slow


def test_every_listed_type_reads_back_as_postgres_holds_it(
    pg_database: str, capture_factory: Callable[..., Capture], spark: SparkSession,
    analytics_config: Callable[..., AnalyticsConfig],
) -> None:  # fmt: skip
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute(EVERY_TYPE + INFINITIES)
        cur.execute("SELECT * FROM every WHERE id = 1")
        full = dict(zip([d.name for d in cur.description], cur.fetchone(), strict=True))
    conn.close()
    capture = capture_factory(pg_database).start()
    deadline = time.monotonic() + 30
    reads: list[dict[str, Any]] = []
    while time.monotonic() < deadline and len(reads) < 4:
        capture.raise_error()
        time.sleep(0.5)
        reads = [c for c in capture.changes() if c["op"] == "READ"]
    capture.stop()
    topic = f"{capture.cfg.topic_prefix}.every"  # what the fan-out writes: the row images as capture framed them
    producer = Producer({"bootstrap.servers": capture.cfg.bootstrap})
    for change in reads:
        producer.produce(topic, change["after"], change["key"])
    assert producer.flush(10) == 0

    frame = read(spark, analytics_config(capture.cfg.topic_prefix), topic=topic, mode="latest")
    types = {f.name: f.dataType for f in frame.schema.fields}
    assert types["n"] == T.DecimalType(12, 3) and types["m"] == T.DecimalType(19, 2)
    assert types["tstz"] == T.TimestampType() and types["ts"] == T.TimestampNTZType()
    assert types["tm"] == T.TimeType(6) and types["dt"] == T.DateType() and types["ba"] == T.BinaryType()
    assert types["ai"] == T.ArrayType(T.IntegerType(), True)
    assert types["iv"].fieldNames() == ["months", "days", "microseconds"]
    check_infinities(frame)
    collected = frame.filter("id < 6").collect()
    rows = {r["id"]: plain(r) for r in collected}
    assert {r["id"]: r["ts"] for r in collected}[1] == full["ts"]  # timestamp without zone: as written, no shift
    assert all(v is None for k, v in rows[2].items() if k != "id")
    got = rows[1]
    for column in ("i2", "i4", "i8", "n", "r", "d", "b", "t", "vc", "c", "dt", "ai", "atx", "e", "e2",
                   "ip", "net", "dom", "pt", "u"):  # fmt: skip
        assert got[column] == full[column], column
    assert got["tstz"] == full["tstz"] == datetime(2024, 2, 29, 7, 4, 56, 789012, tzinfo=UTC)
    assert got["tm"] == full["tm"] == clock(23, 59, 59, 999999)
    assert bytes(got["ba"]) == bytes(full["ba"])
    assert got["n_nan"] is None and full["n_nan"].is_nan()  # NaN has no Spark decimal (README "Analytics")
    assert got["nu"] == "1.000000000000000000000000001" and Decimal(got["nu"]) == full["nu"]
    assert got["iv"] == {"months": 14, "days": 3, "microseconds": 14_706_789_000}
    assert json.loads(got["j"]) == full["j"] and json.loads(got["jb"]) == full["jb"]
    assert got["m"] == Decimal("-1234.56")


def check_infinities(frame: DataFrame) -> None:
    """PostgreSQL's infinities (rows 6 and 7) read as the ends README "Types" names, in Spark's own
    terms: the session's time zone is UTC; Python's naive local datetimes are not used for timestamptz."""
    got = frame.filter("id >= 6").selectExpr(
        "id", "dt", "ts", "unix_micros(tstz) AS micros", "CAST(tstz AS STRING) AS shown",
        "dt = DATE'9999-12-31' OR dt = DATE'0001-01-01' AS at_an_end",
    ).collect()  # fmt: skip
    ends = {6: (ENDS[6]["dt"], ENDS[6]["ts"]), 7: (ENDS[7]["dt"], ENDS[7]["ts"])}
    assert {r["id"]: (r["dt"], r["ts"]) for r in got} == ends
    micros = {r["id"]: r["micros"] for r in got}
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert micros == {k: (ENDS[k]["tstz"] - epoch) // timedelta(microseconds=1) for k in (6, 7)}
    assert {r["id"]: r["shown"] for r in got} == {6: "9999-12-31 23:59:59.999999", 7: "0001-01-01 00:00:00"}
    assert all(r["at_an_end"] for r in got)

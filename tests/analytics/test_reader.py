"""The data source on topics written here: schema changes, planned ends and gaps, bad input, splits."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import fastavro
import pytest
from confluent_kafka import Producer
from pyspark.sql import SparkSession

from analytics.config import AnalyticsConfig
from analytics.jobs import explain, read
from analytics.plan import Request, Slice, plan, value_schema
from analytics.reader import SliceReader
from tables.config import StackConfig
from tables.errors import HeadwaterError
from tables.registry import Registry
from tables.wire import avro_body, frame
from tests.plugins.stack import free_port

pytestmark = pytest.mark.slow

V1 = {"type": "record", "name": "thing", "fields": [
    {"name": "id", "type": "int"}, {"name": "name", "type": "string"}]}  # fmt: skip
V2 = {"type": "record", "name": "thing", "fields": [
    {"name": "id", "type": "long"}, {"name": "name", "type": "string"},
    {"name": "note", "type": ["null", "string"], "default": None}]}  # fmt: skip
KEY = {"type": "record", "name": "thing_key", "fields": [{"name": "id", "type": "long"}]}


def framed(schema_id: int, schema: dict[str, Any], datum: Any) -> bytes:
    return frame(schema_id) + avro_body(fastavro.parse_schema(schema), datum)


class Things:
    """A topic of ``thing`` records: v1 rows, then v2 rows, then tombstones, in chosen partitions."""

    def __init__(self, stack: StackConfig, topic: str) -> None:
        self.topic = topic
        self.registrar = Registry(stack.registry_url)
        self.producer = Producer({"bootstrap.servers": stack.bootstrap, "linger.ms": 5})
        self.key_id = self.registrar.register(f"{topic}-key", KEY)
        self.v1 = self.registrar.register(f"{topic}-value", V1)
        self.v2: int | None = None

    def put(self, thing_id: int, value: bytes | None, partition: int) -> None:
        key = framed(self.key_id, KEY, {"id": thing_id})
        self.producer.produce(self.topic, value, key, partition=partition, headers=[("hw.lsn", b"%d" % thing_id)])

    def write(self, partitions: int) -> None:
        for n in range(40):
            self.put(n, framed(self.v1, V1, {"id": n, "name": f"v1-{n}"}), n % partitions)
        self.v2 = self.registrar.register(f"{self.topic}-value", V2)
        for n in range(30, 60):
            self.put(n, framed(self.v2, V2, {"id": n, "name": f"v2-{n}", "note": f"note {n}"}), n % partitions)
        for n in range(0, 60, 10):
            self.put(n, None, n % partitions)  # tombstones
        assert self.producer.flush(30) == 0


@pytest.fixture
def things(local_stack: StackConfig, topic_factory: Callable[..., str]) -> Iterator[Things]:
    made = Things(local_stack, topic_factory("things", partitions=3))
    made.write(3)
    yield made
    del made.producer  # before the stack goes: no reconnect noise
    made.registrar.close()


def test_a_schema_change_reads_as_the_newest_schema_in_both_modes(
    spark: SparkSession, things: Things, analytics_config: Callable[..., AnalyticsConfig]
) -> None:
    cfg = analytics_config("")
    changes = read(spark, cfg, topic=things.topic, metadata="true")
    assert changes.columns == ["id", "name", "note", "_op", "_partition", "_offset", "_commit_lsn"]
    rows = changes.collect()
    assert len(rows) == 40 + 30 + 6
    deletes = sorted(r.id for r in rows if r._op == "DELETE")
    assert deletes == list(range(0, 60, 10))
    assert all(r.name is None for r in rows if r._op == "DELETE")
    old = {r.id: r for r in rows if r._op == "UPSERT" and r.name.startswith("v1")}
    assert len(old) == 40 and all(r.note is None for r in old.values())  # the new field's default
    assert all(r._commit_lsn == r.id and r._partition == r.id % 3 for r in rows)
    per_partition: dict[int, list[int]] = {}
    for r in rows:
        per_partition.setdefault(r._partition, []).append(r._offset)
    assert all(sorted(offsets) == list(range(len(offsets))) for offsets in per_partition.values())

    latest = {r.id: (r.name, r.note) for r in read(spark, cfg, topic=things.topic, mode="latest").collect()}
    expected = {n: (f"v1-{n}", None) for n in range(30)} | {n: (f"v2-{n}", f"note {n}") for n in range(30, 60)}
    assert latest == {n: v for n, v in expected.items() if n % 10}


def test_big_partitions_are_split_into_tasks_that_read_the_same_messages(
    spark: SparkSession, things: Things, analytics_config: Callable[..., AnalyticsConfig]
) -> None:
    cfg = analytics_config("", task_records=7)
    req = Request.from_options({**cfg.source_options(), "topic": things.topic})
    slices = plan(req)
    assert len(slices) > 3 and all(s.end - s.start <= 7 for s in slices)
    whole = read(spark, analytics_config(""), topic=things.topic, metadata="true")
    split = read(spark, cfg, topic=things.topic, metadata="true")
    assert split.rdd.getNumPartitions() == len(slices)

    def ordered(rows: list[Any]) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in sorted(rows, key=lambda r: (r._partition, r._offset))]

    assert ordered(split.collect()) == ordered(whole.collect())
    latest = read(spark, cfg, topic=things.topic, mode="latest")
    assert latest.rdd.getNumPartitions() == 3  # a key's last value needs its whole partition
    assert latest.count() == 54


def test_a_reader_stops_at_its_planned_end_and_at_a_gap_before_it(
    things: Things, analytics_config: Callable[..., AnalyticsConfig]
) -> None:
    cfg = analytics_config("")
    req = Request.from_options({**cfg.source_options(), "topic": things.topic, "metadata": "true"})
    reader = SliceReader(req, value_schema(req))
    planned = {s.partition: s for s in plan(req)}
    things.write(3)  # written after planning: not read
    for partition, piece in planned.items():
        offsets = [o for batch in reader.read(piece) for o in batch.column("_offset").to_pylist()]
        assert offsets == list(range(piece.start, piece.end)), partition
    # an end past the last record (compaction removed the tail, or a transaction marker ends it) stops at EOF
    end = planned[0].end * 2
    gap = Slice(things.topic, 0, planned[0].end, end + 50)
    got = [o for batch in reader.read(gap) for o in batch.column("_offset").to_pylist()]
    assert got == list(range(planned[0].end, end))


def test_a_task_reading_near_the_end_of_a_partition_of_many_batches_grows_its_fetch_wait(
    local_stack: StackConfig, topic_factory: Callable[..., str], analytics_config: Callable[..., AnalyticsConfig],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The local broker lists a partition's batches within a fetch's wait: at 10 ms it does not reach the last
    of 20,000 one-record batches, and a task reading them got nothing until its timeout."""
    count = 20_000
    things = Things(local_stack, topic_factory("many"))
    things.producer = Producer({"bootstrap.servers": local_stack.bootstrap, "linger.ms": 0, "batch.num.messages": 1})
    for n in range(count):
        things.put(n, framed(things.v1, V1, {"id": n, "name": f"v1-{n}"}), 0)
        things.producer.poll(0)
    assert things.producer.flush(60) == 0
    del things.producer
    things.registrar.close()
    cfg = analytics_config("", timeout=60)
    req = Request.from_options({**cfg.source_options(), "topic": things.topic, "metadata": "true",
                                "kafka.fetch.wait.max.ms": "10"})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="headwater.analytics"):
        batches = SliceReader(req, value_schema(req)).read(Slice(things.topic, 0, count - 50, count))
        offsets = [o for batch in batches for o in batch.column("_offset").to_pylist()]
    assert offsets == list(range(count - 50, count))
    assert any("came back empty below the known end" in r.getMessage() for r in caplog.records)


def error_of(call: Callable[[], Any]) -> HeadwaterError:
    with pytest.raises(Exception) as caught:  # Spark relays our error inside its own
        call()
    found = caught.value if isinstance(caught.value, HeadwaterError) else explain(caught.value)
    assert found is not None, str(caught.value)[:2000]
    return found


def test_bad_input_names_topic_partition_offset_and_the_fix(
    spark: SparkSession, things: Things, analytics_config: Callable[..., AnalyticsConfig], local_stack: StackConfig
) -> None:
    cfg = analytics_config("")
    missing = error_of(lambda: read(spark, cfg, topic=f"{things.topic}-nope").collect())
    assert f"topic {things.topic}-nope" in str(missing) and "does not exist" in str(missing)

    dead = analytics_config("", registry_url=f"http://127.0.0.1:{free_port()}")
    unreachable = error_of(lambda: read(spark, dead, topic=things.topic).collect())
    assert "unreachable" in str(unreachable) and "registry" in str(unreachable)

    no_broker = analytics_config("", bootstrap=f"127.0.0.1:{free_port()}", timeout=2)
    silent = error_of(lambda: read(spark, no_broker, topic=things.topic).collect())
    assert f"topic {things.topic}" in str(silent) and "does not answer" in str(silent) and "bootstrap" in str(silent)

    things.producer.produce(things.topic, b"\0\0\x0f\x42\x40" + b"junk", b"k", partition=1)  # schema id 1000000
    assert things.producer.flush(10) == 0
    bad = error_of(lambda: read(spark, cfg, topic=things.topic).collect())
    assert f"topic {things.topic}, partition 1, offset 25" in str(bad), str(bad)
    assert "schema id 1000000 is not in the registry" in str(bad)

    no_cut = error_of(lambda: read(spark, cfg, topic=things.topic, cut="latest").collect())
    assert "no cut of this view" in str(no_cut) and "streams worker" in str(no_cut)

    given = error_of(lambda: spark.read.format("headwater").schema("id long").options(**cfg.source_options())
                     .option("topic", things.topic).load().collect())  # fmt: skip
    assert "the columns asked for are not the value schema's" in str(given) and ".schema(...)" in str(given)

    planning = error_of(lambda: read(spark, cfg, topic=things.topic, mode="newest"))
    assert "unknown mode 'newest'" in str(planning) and "changes, latest" in str(planning)


def test_prices_written_before_a_numeric_column_got_a_larger_scale_read_at_their_value(
    spark: SparkSession, local_stack: StackConfig, topic_factory: Callable[..., str],
    analytics_config: Callable[..., AnalyticsConfig],
) -> None:  # fmt: skip
    """``ALTER ... TYPE numeric(14,3)``: the records written under scale 2 are read as the newest schema means them."""
    price = {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}
    old = {"type": "record", "name": "priced",
           "fields": [{"name": "id", "type": "long"}, {"name": "price", "type": price}]}  # fmt: skip
    new = {**old, "fields": [old["fields"][0], {"name": "price", "type": {**price, "precision": 14, "scale": 3}}]}
    topic = topic_factory("priced", partitions=1)
    registrar = Registry(local_stack.registry_url)
    producer = Producer({"bootstrap.servers": local_stack.bootstrap})
    key_id, old_id = registrar.register(f"{topic}-key", KEY), registrar.register(f"{topic}-value", old)
    for n, value in [(1, framed(old_id, old, {"id": 1, "price": Decimal("1.50")})),
                     (2, framed(registrar.register(f"{topic}-value", new), new, {"id": 2, "price": Decimal("0.150")}))]:
        producer.produce(topic, value, framed(key_id, KEY, {"id": n}), headers=[("hw.lsn", b"%d" % n)])
    assert producer.flush(30) == 0
    del producer  # before the stack goes: no reconnect noise
    registrar.close()
    rows = read(spark, analytics_config(""), topic=topic, mode="latest").collect()
    assert sorted((r.id, r.price) for r in rows) == [(1, Decimal("1.500")), (2, Decimal("0.150"))]

"""Reading a topic into Spark against a plain confluent-kafka consumer, on one topic, in one run.

A topic of ``messages`` Avro order records (the sample shop's ``orders`` row: bigint,
enum, numeric(14,2), timestamptz, nullable text) in ``PARTITIONS`` partitions is
written once. Then, on the same broker and machine:

1. baseline: one confluent-kafka consumer assigned every partition drains the topic to
   the end, decoding every value with fastavro (schema fetched once from the registry,
   logical types as fastavro gives them: Decimal, datetime);
2. ours: ``spark.read.format("headwater").option("topic", ...).load().count()`` on
   ``local[*]`` (2 cores here) — planning, tasks, decoding into Arrow, counting.

Spark's session start-up is left out; its first query (Python workers starting) is
shown apart from the second, which is the figure compared.
"""

from __future__ import annotations

import io
import json
import random
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import fastavro
import httpx
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from analytics.config import AnalyticsConfig
from analytics.jobs import read
from analytics.session import spark_session
from bench import capture
from headwater import stack
from tables.registry import Registry
from tables.wire import avro_body, body, frame

PARTITIONS = 4
TOPIC = "bench.orders"
STATUSES = ("pending", "paid", "shipped", "delivered", "cancelled")
ORDER = {
    "type": "record", "name": "orders", "namespace": "headwater.public",
    "fields": [
        {"name": "id", "type": "long"},
        {"name": "customer_id", "type": "long"},
        {"name": "status", "type": {"type": "enum", "name": "order_status",
                                    "symbols": list(STATUSES)}},
        {"name": "total", "type": {"type": "bytes", "logicalType": "decimal", "precision": 14, "scale": 2}},
        {"name": "placed_at", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "note", "type": ["null", "string"], "default": None},
    ],
}  # fmt: skip
KEY = {"type": "record", "name": "orders_key", "namespace": "headwater.public",
       "fields": [{"name": "id", "type": "long"}]}  # fmt: skip


def write(cfg: stack.StackConfig, messages: int) -> float:
    admin = AdminClient({"bootstrap.servers": cfg.bootstrap})
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])[TOPIC].result()
    registrar = Registry(cfg.registry_url)
    value_frame = frame(registrar.register(f"{TOPIC}-value", ORDER))
    key_frame = frame(registrar.register(f"{TOPIC}-key", KEY))
    registrar.close()
    value_schema, key_schema = fastavro.parse_schema(ORDER), fastavro.parse_schema(KEY)
    producer = Producer({"bootstrap.servers": cfg.bootstrap, "linger.ms": 20, "batch.num.messages": 10000,
                         "queue.buffering.max.messages": 500000, "compression.type": "none"})  # fmt: skip
    rng = random.Random(1)
    start, epoch = time.monotonic(), datetime(2026, 1, 1, tzinfo=UTC)
    for n in range(messages):
        order = {"id": n, "customer_id": rng.randint(1, 5000), "status": rng.choice(STATUSES),
                 "total": Decimal(rng.randint(0, 10**8)) / 100, "placed_at": epoch + timedelta(seconds=n),
                 "note": None if n % 3 else f"note {n}"}  # fmt: skip
        while True:
            try:
                key = key_frame + avro_body(key_schema, {"id": n})
                producer.produce(TOPIC, value_frame + avro_body(value_schema, order), key, partition=n % PARTITIONS)
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(120) == 0
    return time.monotonic() - start


def plain_consumer(cfg: stack.StackConfig) -> tuple[float, int]:
    """Drain every partition to its end, decoding each value; (seconds, messages)."""
    schema = fastavro.parse_schema(json.loads(httpx.get(f"{cfg.registry_url}/subjects/{TOPIC}-value/versions/latest")
                                              .json()["schema"]))  # fmt: skip
    consumer = Consumer({"bootstrap.servers": cfg.bootstrap, "group.id": "bench-plain", "enable.auto.commit": False,
                         "enable.partition.eof": True, "fetch.wait.max.ms": 50})  # fmt: skip
    consumer.assign([TopicPartition(TOPIC, p, 0) for p in range(PARTITIONS)])
    start = time.monotonic()
    done: set[int] = set()
    count = 0
    while len(done) < PARTITIONS:
        for msg in consumer.consume(5000, 0.5):
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    done.add(int(msg.partition() or 0))
                continue
            fastavro.schemaless_reader(io.BytesIO(body(msg.value())), schema, None)  # type: ignore[index]
            count += 1
    seconds = time.monotonic() - start
    consumer.close()
    return seconds, count


def spark_count(cfg: stack.StackConfig) -> tuple[float, float, int]:
    """(first query seconds, second query seconds, rows) of ``count()`` on the topic."""
    settings = AnalyticsConfig(bootstrap=cfg.bootstrap, registry_url=cfg.registry_url, topic_prefix="bench")
    spark = spark_session(settings, "headwater-bench")
    try:
        times, rows = [], 0
        for _ in range(2):
            start = time.monotonic()
            rows = read(spark, settings, topic=TOPIC).count()
            times.append(time.monotonic() - start)
        return times[0], times[1], rows
    finally:
        spark.stop()


def main(messages: int) -> None:
    with capture.seeded_stack() as (cfg, _, _):
        wrote = write(cfg, messages)
        print(f"\nwrote {messages} Avro order records into {PARTITIONS} partitions of {TOPIC} in {wrote:.1f} s")
        base, counted = plain_consumer(cfg)
        first, second, rows = spark_count(cfg)
    assert counted == rows == messages, (counted, rows, messages)
    print(f"  plain confluent-kafka consumer + fastavro decode: {base:6.1f} s  {messages / base:9.0f} rows/s")
    print(f"  spark.read.format('headwater') ... .count(), 1st: {first:6.1f} s  {messages / first:9.0f} rows/s"
          " (Python workers starting)")  # fmt: skip
    print(f"  spark.read.format('headwater') ... .count(), 2nd: {second:6.1f} s  {messages / second:9.0f} rows/s")
    print(f"  ratio (2nd query): {base / second:.0%} of the plain consumer; 1st query: {base / first:.0%}")

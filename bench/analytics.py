"""Reading a topic into Spark against a plain confluent-kafka consumer, on one topic, in one run.

A topic of ``messages`` Avro order records (the sample shop's ``orders`` row: bigint,
enum, numeric(14,2), timestamptz, nullable text) in ``PARTITIONS`` partitions is
written once. Then, on the same broker and machine:

1. baseline: one confluent-kafka consumer assigned every partition drains the topic to
   the end, decoding every value with fastavro (schema fetched once from the registry,
   logical types as fastavro gives them: Decimal, datetime);
2. ours: ``spark.read.format("headwater").option("topic", ...).load().count()`` on
   ``local[*]`` (2 cores here) — planning, tasks, decoding into Arrow, counting;
3. the same topic as a stream, in the same session: ``spark.readStream.format("headwater")``
   with ``trigger(availableNow=True)`` into Spark's ``noop`` sink, once in one micro-batch
   and once in ten (``maxOffsetsPerTrigger``), against a batch read into the same sink.

Spark's session start-up is left out; its first query (Python workers starting) is
shown apart from the second, which is the figure compared.
"""

from __future__ import annotations

import io
import json
import random
import tempfile
import time
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

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
ORDER: dict[str, Any] = {
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
            fastavro.schemaless_reader(io.BytesIO(body(msg.value() or b"")), schema, None)
            count += 1
    seconds = time.monotonic() - start
    consumer.close()
    return seconds, count


def spark_count(cfg: stack.StackConfig, messages: int) -> dict[str, tuple[float, int]]:
    """Seconds and rows of each Spark read of the topic, by name, in one session."""
    settings = AnalyticsConfig(bootstrap=cfg.bootstrap, registry_url=cfg.registry_url, topic_prefix="bench")
    spark = spark_session(settings, "headwater-bench")
    out: dict[str, tuple[float, int]] = {}
    try:
        for name in ("count, 1st", "count, 2nd"):
            start = time.monotonic()
            rows = read(spark, settings, topic=TOPIC).count()
            out[name] = (time.monotonic() - start, rows)
        start = time.monotonic()
        read(spark, settings, topic=TOPIC).write.format("noop").mode("overwrite").save()
        out["batch -> noop"] = (time.monotonic() - start, messages)
        out["stream, 1 batch -> noop"] = stream_to_noop(spark, settings, None)
        out["stream, 10 batches -> noop"] = stream_to_noop(spark, settings, max(messages // 10, 1))
        return out
    finally:
        spark.stop()


def stream_to_noop(spark: Any, settings: AnalyticsConfig, per_batch: int | None) -> tuple[float, int]:
    """(seconds, rows) of an availableNow stream of the topic from its start into the noop sink."""
    options = {**settings.source_options(), "topic": TOPIC}
    if per_batch:
        options["maxOffsetsPerTrigger"] = str(per_batch)
    with tempfile.TemporaryDirectory(prefix="headwater-bench-stream-") as checkpoint:
        start = time.monotonic()
        query = (spark.readStream.format("headwater").options(**options).load().writeStream.format("noop")
                 .option("checkpointLocation", checkpoint).trigger(availableNow=True).start())  # fmt: skip
        query.awaitTermination()
        seconds = time.monotonic() - start
    if query.exception() is not None:
        raise RuntimeError(f"the stream failed: {query.exception()}")
    return seconds, sum(p.numInputRows for p in query.recentProgress)


def main(messages: int) -> None:
    with capture.seeded_stack() as (cfg, _, _):
        report(cfg, messages)


def report(cfg: stack.StackConfig, messages: int) -> None:
    """Write the topic on ``cfg``'s stack, read it every way, print the rates."""
    wrote = write(cfg, messages)
    print(f"\nwrote {messages} Avro order records into {PARTITIONS} partitions of {TOPIC} in {wrote:.1f} s")
    base, counted = plain_consumer(cfg)
    reads = spark_count(cfg, messages)
    assert counted == messages and all(rows == messages for _, rows in reads.values()), (counted, reads)
    print(f"  plain confluent-kafka consumer + fastavro decode: {base:6.1f} s  {messages / base:9.0f} rows/s")
    for name, (seconds, _) in reads.items():
        note = " (Python workers starting)" if name.endswith("1st") else ""
        print(f"  spark {name + ':':<31} {seconds:6.1f} s  {messages / seconds:9.0f} rows/s{note}")
    second, batch = reads["count, 2nd"][0], reads["batch -> noop"][0]
    one, ten = reads["stream, 1 batch -> noop"][0], reads["stream, 10 batches -> noop"][0]
    print(f"  ratio (count, 2nd): {base / second:.0%} of the plain consumer; 1st: {base / reads['count, 1st'][0]:.0%}")
    print(f"  stream's rate against the batch read into the same sink: one batch {batch / one:.0%},"
          f" ten {batch / ten:.0%}")

"""Reading topics back the way any Confluent consumer would: to the end, Avro decoded via the registry.

Promise: ``read_topic`` returns every record of a topic, stopping at partition EOF as
reported by fetches — right on real Kafka and on Tansu, whose ListOffsets is wrong on
multi-record batches while its fetch high watermark is right. ``AvroDecoder``
decodes Confluent-framed Avro with schemas fetched once per id from the registry.
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from typing import Any, cast

import fastavro
import httpx
from confluent_kafka import Consumer, KafkaError, TopicPartition

from headwater.errors import FatalError, RetryableError


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


def read_topic(bootstrap: str, topic: str, *, timeout: float = 30.0) -> list[Record]:
    """Every record of ``topic`` (all partitions), in offset order per partition."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{topic}-{time.monotonic_ns()}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        waiting = set(partitions)
        out: list[Record] = []
        deadline = time.monotonic() + timeout
        while waiting and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            error = msg.error()
            partition, offset = int(msg.partition() or 0), int(msg.offset() or 0)
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    waiting.discard(partition)
                    continue
                raise RetryableError(f"reading {topic}: {error}")
            raw_headers: list[tuple[str, Any]] = cast(Any, msg.headers()) or []  # librdkafka: (name, bytes) pairs
            headers = tuple((k, v if isinstance(v, bytes) else str(v or "").encode()) for k, v in raw_headers)
            out.append(Record(partition, offset, msg.key(), msg.value(), headers))
        if waiting:
            raise RetryableError(f"no end of {topic} partitions {sorted(waiting)} within {timeout:.0f} s")
        return out
    finally:
        consumer.close()


class AvroDecoder:
    """Decodes Confluent-framed Avro with schemas fetched (once) from the registry."""

    def __init__(self, registry_url: str) -> None:
        self.url = registry_url
        self.schemas: dict[int, Any] = {}

    def schema(self, schema_id: int) -> Any:
        if schema_id not in self.schemas:
            text = httpx.get(f"{self.url}/schemas/ids/{schema_id}", timeout=10).json()["schema"]
            self.schemas[schema_id] = fastavro.parse_schema(json.loads(text))
        return self.schemas[schema_id]

    def __call__(self, data: bytes | None) -> Any:
        if data is None:
            return None
        if data[0] != 0:
            raise FatalError(f"not the Confluent wire format (first byte {data[0]})")
        return fastavro.schemaless_reader(io.BytesIO(data[5:]), self.schema(int.from_bytes(data[1:5], "big")), None)

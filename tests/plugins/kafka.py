"""Reading topics back the way any Confluent consumer would: to the end, Avro decoded via the registry.

``read_topic`` stops at partition EOF as reported by fetches (Tansu's ListOffsets is
wrong on multi-record batches, its fetch high watermark is right).
"""

from __future__ import annotations

import io
import json
import time
from dataclasses import dataclass
from typing import Any

import fastavro
import httpx
from confluent_kafka import Consumer, KafkaError, TopicPartition


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


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
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    waiting.discard(msg.partition())
                    continue
                raise AssertionError(f"reading {topic}: {msg.error()}")
            out.append(Record(msg.partition(), msg.offset(), msg.key(), msg.value()))
        assert not waiting, f"no EOF on {topic} partitions {waiting} within {timeout} s"
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
        assert data[0] == 0, "not the Confluent wire format"
        return fastavro.schemaless_reader(io.BytesIO(data[5:]), self.schema(int.from_bytes(data[1:5], "big")), None)

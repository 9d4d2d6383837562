"""The raw topic read by a generic consumer: each message with its row images decoded in one call."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal

import psycopg2
import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from tables.change import decode_change
from tables.kafka import read_topic
from tables.registry import Registry
from tests.plugins.capture import Capture

pytestmark = pytest.mark.slow


def test_a_raw_message_decodes_with_its_images_by_headwater_or_by_confluents_own_deserializer(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL, n numeric(8, 2))")
        cur.execute("INSERT INTO t VALUES (1, 'one', 1.50)")
    capture = capture_factory(pg_database).start()
    capture.wait_caught_up(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("UPDATE t SET id = 2, v = 'two' WHERE id = 1; DELETE FROM t WHERE id = 2")
    capture.wait_caught_up(pg_database)
    conn.close()
    raw = [r.value for r in read_topic(capture.cfg.bootstrap, capture.cfg.changes_topic) if r.value]
    registry = Registry(capture.cfg.registry_url)
    ours = [decode_change(v, registry) for v in raw]
    registry.close()
    images = [(c["op"], c["key"], c["before"], c["after"]) for c in ours if c["op"] != "SNAPSHOT_END"]
    assert images == [
        ("READ", {"id": 1}, None, {"id": 1, "v": "one", "n": Decimal("1.50")}),
        ("UPDATE", {"id": 2}, {"id": 1}, {"id": 2, "v": "two", "n": Decimal("1.50")}),  # the old key
        ("DELETE", {"id": 2}, None, None),
    ]
    context = SerializationContext(capture.cfg.changes_topic, MessageField.VALUE)
    with SchemaRegistryClient({"url": capture.cfg.registry_url}) as client:
        confluent = AvroDeserializer(client)
        theirs = [decode_change(v, lambda data: None if data is None else confluent(data, context)) for v in raw]
    assert [(c["op"], c["key"], c["before"], c["after"]) for c in theirs] == [(c["op"], c["key"], c["before"],
                                                                              c["after"]) for c in ours]

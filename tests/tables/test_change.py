"""The raw topic read by a generic consumer: each message with its row images decoded in one call, with framed
images (Headwater's ``decode_change``, or confluent-kafka's deserializer and a second call per image) and with
nested ones (confluent-kafka's ``AvroDeserializer`` alone, or fastavro with the schema its id names)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import fastavro
import httpx
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


EXPECTED = [
    ("READ", {"id": 1}, None, {"id": 1, "v": "one", "n": Decimal("1.50")}),
    ("UPDATE", {"id": 2}, {"id": 1}, {"id": 2, "v": "two", "n": Decimal("1.50")}),  # the old key
    ("DELETE", {"id": 2}, None, None),
]


def captured(pg_database: str, capture_factory: Callable[..., Capture], images: str) -> tuple[Capture, list[bytes]]:
    """A key change and a delete captured with ``raw_images = images``: the raw topic's values."""
    conn = psycopg2.connect(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL, n numeric(8, 2))")
        cur.execute("INSERT INTO t VALUES (1, 'one', 1.50)")
    capture = capture_factory(pg_database, raw_images=images).start()
    capture.wait_caught_up(pg_database)
    with conn, conn.cursor() as cur:
        cur.execute("UPDATE t SET id = 2, v = 'two' WHERE id = 1; DELETE FROM t WHERE id = 2")
    capture.wait_caught_up(pg_database)
    conn.close()
    return capture, [r.value for r in read_topic(capture.cfg.bootstrap, capture.cfg.changes_topic) if r.value]


def images_of(changes: list[dict[str, Any]]) -> list[tuple[str, Any, Any, Any]]:
    return [(c["op"], c["key"], c["before"], c["after"]) for c in changes if c["op"] != "SNAPSHOT_END"]


@pytest.mark.parametrize("images", ["framed", "nested"])
def test_a_raw_message_decodes_with_its_images_by_headwater_or_by_confluents_own_deserializer(
    pg_database: str, capture_factory: Callable[..., Capture], images: str
) -> None:
    capture, raw = captured(pg_database, capture_factory, images)
    registry = Registry(capture.cfg.registry_url)
    ours = [decode_change(v, registry) for v in raw]
    registry.close()
    assert images_of(ours) == EXPECTED
    context = SerializationContext(capture.cfg.changes_topic, MessageField.VALUE)
    with SchemaRegistryClient({"url": capture.cfg.registry_url}) as client:
        confluent = AvroDeserializer(client)
        theirs = [decode_change(v, lambda data: None if data is None else confluent(data, context)) for v in raw]
    assert [(c["op"], c["key"], c["before"], c["after"]) for c in theirs] == [(c["op"], c["key"], c["before"],
                                                                              c["after"]) for c in ours]


def test_a_nested_message_is_read_whole_by_confluents_deserializer_or_fastavro_alone(
    pg_database: str, capture_factory: Callable[..., Capture]
) -> None:
    """No Headwater code on the reading side: one decode per message gives the change and its rows."""
    capture, raw = captured(pg_database, capture_factory, "nested")
    context = SerializationContext(capture.cfg.changes_topic, MessageField.VALUE)
    with SchemaRegistryClient({"url": capture.cfg.registry_url}) as client:
        confluent = AvroDeserializer(client)
        theirs = [confluent(v, context) for v in raw]
    assert images_of(theirs) == EXPECTED
    assert theirs[-1]["op"] == "DELETE" and theirs[-1]["table"] == "t" and theirs[-1]["tx_size"] == 2

    def schema_of(schema_id: int) -> Any:  # the registry's REST API, as any client asks it
        answer = httpx.get(f"{capture.cfg.registry_url}/schemas/ids/{schema_id}").json()
        return fastavro.parse_schema(json.loads(answer["schema"]))

    plain = [fastavro.schemaless_reader(io.BytesIO(v[5:]), schema_of(int.from_bytes(v[1:5], "big")), None)
             for v in raw]  # fmt: skip
    assert images_of(plain) == EXPECTED
    topic = capture.cfg.changes_topic  # its value schemas by record name (TopicRecordNameStrategy): none as -value
    subjects = sorted(s for s in httpx.get(f"{capture.cfg.registry_url}/subjects").json() if s.startswith(topic + "-"))
    assert subjects == [f"{topic}-headwater.Marker", f"{topic}-headwater.public.t.Change", f"{topic}-key"]

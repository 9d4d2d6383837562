"""The embedded registry over HTTP, driven by the two real clients users have.

Runs against the session's real registry process and the real Tansu broker.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry import error as sr_error
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from schema_registry.client import SchemaRegistryClient as PySchemaRegistryClient
from schema_registry.client import schema as py_schema

from tables.config import StackConfig
from tests.plugins.stack import RegistryProcess

V1 = {"type": "record", "name": "Customer", "namespace": "shop", "fields": [
    {"name": "id", "type": "long"},
    {"name": "email", "type": "string"},
]}  # fmt: skip
V2_COMPATIBLE = {**V1, "fields": [*V1["fields"], {"name": "region", "type": ["null", "string"], "default": None}]}
V2_INCOMPATIBLE = {**V1, "fields": [*V1["fields"], {"name": "region", "type": "string"}]}


@pytest.fixture
def sr_client(local_stack: StackConfig) -> Iterator[SchemaRegistryClient]:
    with SchemaRegistryClient({"url": local_stack.registry_url}) as client:
        yield client


def test_python_schema_registry_client_round_trip(local_stack: StackConfig, unique_name: str) -> None:
    client = PySchemaRegistryClient(url=local_stack.registry_url)
    subject = f"{unique_name}-value"
    first = client.register(subject, py_schema.AvroSchema(V1))
    assert client.register(subject, py_schema.AvroSchema(V1)) == first  # idempotent
    second = client.register(subject, py_schema.AvroSchema(V2_COMPATIBLE))
    assert second != first
    assert client.get_versions(subject) == [1, 2]
    latest = client.get_schema(subject)
    assert latest is not None and latest.version == 2 and latest.schema_id == second
    fetched = client.get_by_id(first)
    assert fetched is not None and fetched.raw_schema == V1
    found = client.check_version(subject, py_schema.AvroSchema(V1))
    assert found is not None and found.version == 1 and found.schema_id == first
    assert subject in client.get_subjects()
    assert client.test_compatibility(subject, py_schema.AvroSchema(V2_INCOMPATIBLE)) is False
    assert client.delete_subject(subject) == [1, 2]
    assert subject not in client.get_subjects()


def test_confluent_client_register_lookup_versions_delete(sr_client: SchemaRegistryClient, unique_name: str) -> None:
    client = sr_client
    subject = f"{unique_name}-value"
    schema_id = client.register_schema(subject, Schema(json.dumps(V1), "AVRO"))
    registered = client.lookup_schema(subject, Schema(json.dumps(V1), "AVRO"))
    assert registered.schema_id == schema_id and registered.version == 1
    assert client.get_versions(subject) == [1]
    assert client.get_latest_version(subject).schema_id == schema_id
    assert json.loads(client.get_schema(schema_id).schema_str) == V1
    assert client.get_compatibility() == "BACKWARD"

    with pytest.raises(sr_error.SchemaRegistryError) as refused:
        client.register_schema(subject, Schema(json.dumps(V2_INCOMPATIBLE), "AVRO"))
    assert refused.value.http_status_code == 409 and refused.value.error_code == 409
    assert "region" in refused.value.error_message

    newer = client.register_schema(subject, Schema(json.dumps(V2_COMPATIBLE), "AVRO"))
    assert newer != schema_id and client.get_versions(subject) == [1, 2]

    client.set_compatibility(subject, "NONE")
    assert client.get_compatibility(subject) == "NONE"
    client.register_schema(subject, Schema(json.dumps(V2_INCOMPATIBLE), "AVRO"))  # allowed under NONE

    assert client.delete_subject(subject) == [1, 2, 3]
    with pytest.raises(sr_error.SchemaRegistryError) as gone:
        client.get_versions(subject)
    assert gone.value.error_code == 40401
    assert client.delete_subject(subject, permanent=True) == [1, 2, 3]


def test_confluent_avro_serde_round_trip_through_kafka(
    local_stack: StackConfig, sr_client: SchemaRegistryClient, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory()
    client = sr_client
    serializer = AvroSerializer(client, json.dumps(V1))
    deserializer = AvroDeserializer(client)
    row = {"id": 42, "email": "ada@example.com"}
    ctx = SerializationContext(topic, MessageField.VALUE)
    payload = serializer(row, ctx)
    assert payload is not None and payload[0] == 0  # Confluent wire format: magic byte
    producer = Producer({"bootstrap.servers": local_stack.bootstrap})
    producer.produce(topic, value=payload)
    assert producer.flush(10) == 0
    consumer = Consumer({"bootstrap.servers": local_stack.bootstrap, "group.id": topic, "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, 0)])
    message = consumer.poll(10)
    consumer.close()
    assert message is not None and message.error() is None
    assert deserializer(message.value(), ctx) == row
    assert f"{topic}-value" in client.get_subjects()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"schema": '{"type": "recrd"}'}, 42201),
        ({"schema": "not json at all"}, 42201),
        ({"schema": json.dumps({"type": "record", "name": "R"})}, 42201),
        ({"schema": '"string"', "schemaType": "PROTOBUF"}, 42201),
        ({"nothing": 1}, 42201),
    ],
)
def test_invalid_schema_is_422_42201(local_stack: StackConfig, unique_name: str, body: dict, code: int) -> None:
    response = httpx.post(f"{local_stack.registry_url}/subjects/{unique_name}/versions", json=body)
    assert response.status_code == 422
    assert response.json()["error_code"] == code
    assert response.json()["message"].startswith("Invalid schema")


def test_not_found_error_codes(local_stack: StackConfig, unique_name: str) -> None:
    base = local_stack.registry_url
    assert httpx.get(f"{base}/subjects/{unique_name}/versions").json()["error_code"] == 40401
    assert httpx.get(f"{base}/schemas/ids/999999").json()["error_code"] == 40403
    httpx.post(f"{base}/subjects/{unique_name}/versions", json={"schema": '"string"'}).raise_for_status()
    missing = httpx.get(f"{base}/subjects/{unique_name}/versions/7")
    assert missing.status_code == 404 and missing.json()["error_code"] == 40402
    assert httpx.get(f"{base}/subjects/{unique_name}/versions/x").json()["error_code"] == 42202
    bad_level = httpx.put(f"{base}/config/{unique_name}", json={"compatibility": "SIDEWAYS"})
    assert bad_level.status_code == 422 and bad_level.json()["error_code"] == 42203


@pytest.mark.slow
def test_ids_survive_restart_and_a_second_instance_agrees(
    registry_factory: Callable[[], RegistryProcess], unique_name: str
) -> None:
    first = registry_factory()
    with SchemaRegistryClient({"url": first.url}) as client:
        ids = {
            subject: client.register_schema(subject, Schema(json.dumps(V1 | {"name": name}), "AVRO"))
            for subject, name in ((f"{unique_name}-a", "A"), (f"{unique_name}-b", "B"))
        }
        client.set_compatibility(f"{unique_name}-a", "FULL")
    first.stop(signal.SIGKILL)  # no clean shutdown: everything must already be in Kafka

    restarted, second = registry_factory(), registry_factory()
    for instance in (restarted, second):
        assert sorted(httpx.get(f"{instance.url}/subjects").json()) == sorted(ids)
        for subject, schema_id in ids.items():
            latest = httpx.get(f"{instance.url}/subjects/{subject}/versions/latest").json()
            assert latest["id"] == schema_id and latest["version"] == 1
        assert httpx.get(f"{instance.url}/config/{unique_name}-a").json() == {"compatibilityLevel": "FULL"}

    # a new schema continues the id sequence, and the other instance follows the log
    new = httpx.post(f"{restarted.url}/subjects/{unique_name}-c/versions", json={"schema": '"long"'}).json()
    assert new["id"] == max(ids.values()) + 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        seen = httpx.get(f"{second.url}/subjects/{unique_name}-c/versions/latest").json()
        if seen.get("id") == new["id"]:
            break
        time.sleep(0.1)
    assert seen.get("id") == new["id"]

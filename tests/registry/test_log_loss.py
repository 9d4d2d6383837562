"""The embedded registry when its broker restarts and its ``_schemas`` topic is lost.

The local broker (Tansu) keeps topics in memory: a restart on the same port empties it.
Each test runs a broker and a registry process of its own, as the stack starts them.
The registry must rewrite the topic from memory with the same ids, answer writes with
503 meanwhile, and never acknowledge a schema it cannot serve.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.plugins.stack import BrokerProcess, RegistryProcess

pytestmark = pytest.mark.slow

TOPIC = "_schemas"
RECOVERY_SECONDS = 30


def record(name: str, *extra: str) -> str:
    fields = [
        {"name": "id", "type": "long"},
        *({"name": f, "type": ["null", "string"], "default": None} for f in extra),
    ]
    return json.dumps({"type": "record", "name": name, "fields": fields})


@pytest.fixture
def own(broker_factory: Callable[[], BrokerProcess], tmp_path: Path) -> Iterator[tuple[BrokerProcess, RegistryProcess]]:
    """A broker of this test's own and a registry process on it (default ``_schemas`` topic)."""
    broker = broker_factory()
    registry = RegistryProcess(broker.cfg, TOPIC, tmp_path / "registry.log")
    yield broker, registry
    registry.stop()


def post(url: str, subject: str, schema: str) -> httpx.Response:
    return httpx.post(f"{url}/subjects/{subject}/versions", json={"schema": schema}, timeout=30)


def schema_of(url: str, schema_id: int) -> httpx.Response:
    return httpx.get(f"{url}/schemas/ids/{schema_id}", timeout=10)


def assert_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    body = response.json()
    assert body["error_code"] == 50001
    assert f"schema log '{TOPIC}'" in body["message"] and "retry" in body["message"]


def register_until_accepted(url: str, subject: str, schema: str) -> int:
    """POST until the registry takes writes again; every refusal on the way must be a 503."""
    deadline = time.monotonic() + RECOVERY_SECONDS
    while True:
        response = post(url, subject, schema)
        if response.status_code == 200:
            return int(response.json()["id"])
        assert_unavailable(response)
        assert time.monotonic() < deadline, f"writes still refused after {RECOVERY_SECONDS} s: {response.text}"
        time.sleep(0.2)


def read_log(bootstrap: str) -> list[tuple[dict, dict | None]]:
    """Every record of the topic, read from its start to partition EOF."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "reader", "enable.partition.eof": True, "log_level": 0}
    )
    consumer.assign([TopicPartition(TOPIC, 0, OFFSET_BEGINNING)])
    records: list[tuple[dict, dict | None]] = []
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            message = consumer.poll(1)
            if message is None:
                continue
            if message.error():
                break  # partition EOF
            value = message.value()
            records.append((json.loads(message.key()), json.loads(value) if value is not None else None))
    finally:
        consumer.close()
    return records


def seed(url: str, tag: str) -> dict[tuple[str, int], int]:
    """Two versions of one subject, another subject with its own level, and an id no version uses."""
    ids = {
        (f"{tag}a-value", 1): post(url, f"{tag}a-value", record("A")).json()["id"],
        (f"{tag}a-value", 2): post(url, f"{tag}a-value", record("A", "note")).json()["id"],
        (f"{tag}b-value", 1): post(url, f"{tag}b-value", record("B")).json()["id"],
    }
    httpx.put(f"{url}/config/{tag}b-value", json={"compatibility": "FULL"}).raise_for_status()
    ids[(f"{tag}gone-value", 1)] = post(url, f"{tag}gone-value", record("Gone")).json()["id"]
    httpx.delete(f"{url}/subjects/{tag}gone-value").raise_for_status()
    httpx.delete(f"{url}/subjects/{tag}gone-value", params={"permanent": "true"}).raise_for_status()
    return ids


def test_a_broker_restart_rebuilds_the_log_from_memory_with_the_same_ids(
    own: tuple[BrokerProcess, RegistryProcess], tmp_path: Path
) -> None:
    broker, registry = own
    ids = seed(registry.url, "s")
    schemas = {schema_id: schema_of(registry.url, schema_id).json()["schema"] for schema_id in ids.values()}

    broker.restart()  # same port, empty broker: the topic is gone

    new_id = register_until_accepted(registry.url, "snew-value", record("New"))
    assert new_id > max(ids.values())  # never an id some schema had, even one no version uses
    assert json.loads(schema_of(registry.url, new_id).json()["schema"])["name"] == "New"
    for schema_id, text in schemas.items():
        assert schema_of(registry.url, schema_id).json() == {"schema": text}
    assert httpx.get(f"{registry.url}/subjects/sa-value/versions").json() == [1, 2]
    assert httpx.get(f"{registry.url}/config/sb-value").json() == {"compatibilityLevel": "FULL"}

    # the new broker's topic holds every schema, created explicitly with one partition
    held = {
        (k["subject"], k["version"]): v["id"] for k, v in read_log(broker.bootstrap) if k["keytype"] == "SCHEMA" and v
    }
    assert held.items() >= {**ids, ("snew-value", 1): new_id}.items()
    topics = AdminClient({"bootstrap.servers": broker.bootstrap, "log_level": 0}).list_topics(timeout=10).topics
    assert len(topics[TOPIC].partitions) == 1

    log = (tmp_path / "registry.log").read_text()
    assert "cannot be trusted" in log and "rebuilt from memory" in log


def test_while_the_broker_is_down_writes_are_refused_and_reads_still_answered(
    own: tuple[BrokerProcess, RegistryProcess],
) -> None:
    broker, registry = own
    first = post(registry.url, "da-value", record("A")).json()["id"]

    broker.stop()

    assert_unavailable(post(registry.url, "db-value", record("B")))
    assert_unavailable(post(registry.url, "db-value", record("B")))
    assert_unavailable(httpx.put(f"{registry.url}/config/da-value", json={"compatibility": "NONE"}, timeout=30))
    assert post(registry.url, "da-value", record("A")).json() == {"id": first}  # known already: from memory
    assert json.loads(schema_of(registry.url, first).json()["schema"])["name"] == "A"
    assert httpx.get(f"{registry.url}/subjects").json() == ["da-value"]

    broker.start()

    second = register_until_accepted(registry.url, "db-value", record("B"))
    assert second != first
    assert json.loads(schema_of(registry.url, second).json()["schema"])["name"] == "B"
    held = {v["id"] for k, v in read_log(broker.bootstrap) if k["keytype"] == "SCHEMA" and v}
    assert held == {first, second}


def test_a_broker_slow_to_answer_for_a_few_seconds_does_not_stop_writes(
    own: tuple[BrokerProcess, RegistryProcess], tmp_path: Path
) -> None:
    broker, registry = own
    first = post(registry.url, "pa-value", record("A")).json()["id"]
    pid = broker.service.pid()
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # one probe goes unanswered for its 5 s (a busy machine did that once)
    try:
        time.sleep(7)
    finally:
        os.kill(pid, signal.SIGCONT)

    second = post(registry.url, "pb-value", record("B"))
    assert second.status_code == 200, second.text
    assert second.json()["id"] != first
    log = (tmp_path / "registry.log").read_text()
    assert "did not answer a probe" in log and "cannot be trusted" not in log, log[-2000:]


def test_a_log_topic_recreated_with_wrong_settings_is_recreated_and_rebuilt(
    own: tuple[BrokerProcess, RegistryProcess], tmp_path: Path
) -> None:
    broker, registry = own
    first = post(registry.url, "wa-value", record("A")).json()["id"]
    admin = AdminClient({"bootstrap.servers": broker.bootstrap, "log_level": 0})
    registry.proc.send_signal(signal.SIGSTOP)  # the registry sees nothing until both are done
    try:
        admin.delete_topics([TOPIC])[TOPIC].result(10)
        # what a client's auto-create leaves on Tansu: 4 partitions, not compacted
        admin.create_topics([NewTopic(TOPIC, 4, 1)])[TOPIC].result(10)
    finally:
        registry.proc.send_signal(signal.SIGCONT)

    second = register_until_accepted(registry.url, "wb-value", record("B"))
    assert second != first
    topics = admin.list_topics(timeout=10).topics
    assert len(topics[TOPIC].partitions) == 1
    held = {v["id"] for k, v in read_log(broker.bootstrap) if k["keytype"] == "SCHEMA" and v}
    assert held == {first, second}
    assert json.loads(schema_of(registry.url, first).json()["schema"])["name"] == "A"
    assert "4 partitions" in (tmp_path / "registry.log").read_text()

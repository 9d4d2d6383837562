"""The fan-out's Kafka side on the real stack: its checkpoint, read back by the schema that wrote it."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import fastavro
import pytest
from confluent_kafka import KafkaError

from streams.fanout import Output
from streams.writer import CHECKPOINT_SCHEMA, Checkpoint, TableWriter
from tables.config import StackConfig
from tables.errors import FatalError
from tables.registry import Registry
from tables.wire import avro_body, frame
from tests.plugins.stack import BrokerProcess
from tests.streams.test_engine import engine_config


def test_a_checkpoint_from_before_it_named_the_raw_topic_reads_and_the_next_one_names_it_and_what_was_examined(
    local_stack: StackConfig, unique_name: str, tmp_path: Path
) -> None:  # fmt: skip
    cfg = engine_config(local_stack, unique_name, tmp_path)
    writer = TableWriter(cfg)
    writer.ensure_topics([cfg.progress_topic], partitions=1)
    old = {**CHECKPOINT_SCHEMA, "fields": CHECKPOINT_SCHEMA["fields"][:3]}  # the schema before raw_topic_id
    framed = frame(Registry(cfg.registry_url).register(f"{cfg.progress_topic}-value", old))
    value = framed + avro_body(fastavro.parse_schema(old), {"raw_offset": 7, "commit_lsn": 5, "position": 1})
    writer.produce(cfg.progress_topic, 0, cfg.changes_topic.encode(), value, [])
    writer.flush()
    old_one = writer.checkpoint()
    assert old_one == Checkpoint(7, (5, 1), "", {}, {}), "an old checkpoint: offsets kept, the topic not checked"
    verified = {("p.orders", 0): 5, ("p.orders", 2): 9, ("p.items", 0): 0}  # partition 1 of orders: not known
    writer.save_checkpoint(Checkpoint(9, (6, 0), "AaIU4nE8cGGQGSoJJXdFSw", verified, {"p.orders": 4}))
    writer.flush()
    assert writer.checkpoint() == Checkpoint(9, (6, 0), "AaIU4nE8cGGQGSoJJXdFSw", verified, {"p.orders": 4})
    assert writer.raw_topic_id() == "", "no raw topic yet: no id"


def test_after_a_batch_kafka_refused_no_later_batch_counts_as_written(
    local_stack: StackConfig, unique_name: str, tmp_path: Path
) -> None:  # fmt: skip
    """A refused record stops the fan-out; nothing after it (a revocation's last checkpoint) may settle past it."""
    writer = TableWriter(engine_config(local_stack, unique_name, tmp_path))
    refused, later = writer.open_batch(), writer.open_batch()
    refused.end, later.end = 5, 9
    refused.failed = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    for _ in range(2):
        with pytest.raises(FatalError, match="Kafka refused a record"):
            writer.settle()
    assert list(writer.ledger) == [later], "the batch after the refused one never counts as written"


@pytest.mark.slow
def test_a_record_refused_because_the_broker_lost_its_topic_names_the_topic_as_gone(
    local_stack: StackConfig, unique_name: str, tmp_path: Path, broker_factory: Callable[[], BrokerProcess]
) -> None:  # fmt: skip
    """A broker restarted without its data fails the records in flight for an unknown topic: the fan-out says the
    broker no longer has that topic (what to do about it), not just that Kafka refused a record."""
    broker = broker_factory()
    cfg = engine_config(local_stack, unique_name, tmp_path, bootstrap=broker.bootstrap)
    writer, topic = TableWriter(cfg), f"{unique_name}.items"
    writer.ensure_topics([topic])
    first = writer.open_batch()
    writer.write([Output(topic, 0, b"k", b"v", [])], first)
    first.end = 1
    writer.flush()
    assert writer.settle() is first
    broker.restart()
    second = writer.open_batch()
    writer.write([Output(topic, 0, b"k", b"w", [])], second)
    second.end = 2
    deadline = time.monotonic() + 90
    with pytest.raises(FatalError) as refused:
        while time.monotonic() < deadline and writer.settle() is None:
            time.sleep(0.2)
    assert f"the broker no longer has {topic}" in str(refused.value)

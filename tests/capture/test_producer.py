"""The snapshot's own producer (``SnapshotSender`` over ``capture._copier.Sender``), on the real broker.

What the Copier sends through it reaches the topic byte for byte as the batches the
``ChangeProducer`` path sends; a full local queue is waited out; a delivery that fails
is reported, never taken for acknowledged. Backfill chunks and the stream's messages
around them reach the topic in send order, with no wait for Kafka between them. Producer
batches are sized under the raw topic's ``max.message.bytes``, and batches that large are read
back whole by every kind of reader here.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic

from capture._copier import Sender, envelopes, send_envelopes
from capture.config import CaptureConfig
from capture.errors import BrokerError
from capture.producer import (
    BIG_BATCH,
    RAW_MAX_MESSAGE_BYTES,
    ChangeProducer,
    SnapshotSender,
    batch_settings,
    ensure_changes_topic,
    librdkafka_library,
    librdkafka_line,
    librdkafka_settings,
    producer_settings,
    sized,
    statistics,
)
from streams.clients import READER_MEMORY
from tables.config import Secret, Settings, StackConfig
from tables.errors import FatalError
from tables.kafka import read_topic, read_topic_from
from tables.logs import KAFKA_LOGGER
from tests.capture.test_transcoder import CHANGE_KEY, ROW, copier_for, copy_line, with_
from tests.plugins.stack import free_port


def config(bootstrap: str, topic_prefix: str, **producer: Any) -> CaptureConfig:
    return CaptureConfig(dsn=Secret("postgresql:///unused"), bootstrap=bootstrap, topic_prefix=topic_prefix,
                         producer=Settings(producer))  # fmt: skip


def test_settings_are_librdkafka_text_without_the_python_logger() -> None:
    settings = librdkafka_settings(config("127.0.0.1:9", "p", **{"socket.keepalive.enable": True}))
    assert settings["enable.idempotence"] == "true" and settings["acks"] == "all"
    assert settings["socket.keepalive.enable"] == "true" and settings["batch.num.messages"] == "10000"
    assert "logger" not in settings and all(isinstance(v, str) for v in settings.values())
    with pytest.raises(FatalError, match=r"sasl\.password must be text") as refused:
        librdkafka_settings(config("127.0.0.1:9", "p", **{"sasl.password": ["s3cret"]}))
    assert "s3cret" not in str(refused.value)


def test_a_bad_setting_is_refused_by_name() -> None:
    library = librdkafka_library()
    assert library is not None, "confluent-kafka's wheel ships librdkafka beside the package"
    with pytest.raises(ValueError, match=r"no\.such\.property"):
        Sender(library, {"no.such.property": "1"}, "t", BrokerError, librdkafka_line)


def test_copier_sends_through_the_sender_what_it_would_batch(
    local_stack: StackConfig, topic_factory: Callable[..., str]
) -> None:
    """Rows of every kind (one left to the general path), written in odd pieces: the topic holds the
    messages the batch path hands to librdkafka, in order, each with the raw topic's key."""
    topic = topic_factory()
    rows = [with_(id=str(n), doc="d" * (250 + n)) for n in range(1, 12)] + [ROW]
    fallback_line = copy_line(with_(id="99", i4=None))  # NULL in a non-null column: the general path
    data = b"".join(copy_line(row) + b"\n" for row in rows) + fallback_line + b"\n"

    def general(line: bytes) -> tuple[bytes, bytes | None, None]:
        assert line == fallback_line
        return b"\x00fallback value", b"\x00\x00\x00\x00\x08key", None

    batched, batches, large = copier_for(general, position=4, stride=2, batch_rows=5)
    batched.write(data)
    batched.finish()
    expected = [m["value"] for batch in batches for m in batch]
    assert len(expected) == 13 and large

    library = librdkafka_library()
    assert library is not None
    handle = Sender(library, librdkafka_settings(config(local_stack.bootstrap, "p")), topic, BrokerError,
                    librdkafka_line)  # fmt: skip
    counts: list[int] = []
    sent_large: list[tuple[bytes, int, str]] = []

    def on_batch(batch: Any, found: list[tuple[bytes, int, str]]) -> None:
        counts.append(batch)
        sent_large.extend(found)

    direct, _, _ = copier_for(general, position=4, stride=2, batch_rows=5, on_batch=on_batch, sender=handle)
    for start in range(0, len(data), 61):
        direct.write(data[start : start + 61])
    direct.finish()
    assert handle.flush(30.0) == 0 and handle.failure is None and handle.sent == 13
    handle.close()
    assert counts == [5, 5, 3] and sent_large == large and direct.position == batched.position
    records = read_topic(local_stack.bootstrap, topic)
    assert [r.value for r in records] == expected
    assert {r.key for r in records} == {CHANGE_KEY}


def test_a_full_local_queue_is_waited_out(local_stack: StackConfig, topic_factory: Callable[..., str]) -> None:
    topic = topic_factory()
    settings = librdkafka_settings(config(local_stack.bootstrap, "p", **{"queue.buffering.max.messages": "10"}))
    sender = Sender(librdkafka_library() or "", settings, topic, BrokerError, librdkafka_line)
    for n in range(500):
        sender.send(b"value %d" % n, b"key")
    assert sender.flush(30.0) == 0 and sender.failure is None
    sender.close()
    assert [r.value for r in read_topic(local_stack.bootstrap, topic)] == [b"value %d" % n for n in range(500)]


def test_a_chunk_larger_than_the_local_queue_goes_out_whole_and_in_order(
    local_stack: StackConfig, topic_factory: Callable[..., str]
) -> None:
    """``send_envelopes`` hands librdkafka its messages in batches: a full queue stops a batch part way, and the
    rest follows once there is room, none lost, none twice, none out of order."""
    topic = topic_factory()
    settings = librdkafka_settings(config(local_stack.bootstrap, "p", **{"queue.buffering.max.messages": "1000"}))
    sender = Sender(librdkafka_library() or "", settings, topic, BrokerError, librdkafka_line)
    head, size, tail = b"head", b"\x02", b"tail"
    rows: list[tuple[bytes | None, bytes | None]] = [(b"key %d" % n, b"value %d" % n) for n in range(3000)]
    send_envelopes(sender, b"k", head, size, rows[:2500], tail, 0, False)
    send_envelopes(sender, b"k", head, size, rows[2500:], tail, 2500, False)
    assert sender.flush(30.0) == 0 and sender.failure is None and sender.sent == 3000
    sender.close()
    assert [r.value for r in read_topic(local_stack.bootstrap, topic)] == envelopes(head, size, rows, tail)


def test_a_message_librdkafka_refuses_in_a_chunk_is_raised_with_nothing_after_it_sent(
    local_stack: StackConfig, topic_factory: Callable[..., str]
) -> None:
    """What reaches the topic is the chunk's messages before the refused one, as one by one: no hole."""
    topic = topic_factory()
    settings = librdkafka_settings(config(local_stack.bootstrap, "p", **{"message.max.bytes": "1000"}))
    sender = Sender(librdkafka_library() or "", settings, topic, BrokerError, librdkafka_line)
    rows: list[tuple[bytes | None, bytes | None]] = [(b"key %d" % n, b"small") for n in range(5)]
    with pytest.raises(BrokerError, match=f"cannot send to {re.escape(topic)}: .*too large"):
        send_envelopes(sender, b"k", b"head", b"\x02", [*rows, (b"key", b"x" * 3000), *rows], b"tail", 0, False)
    assert sender.flush(30.0) == 0 and sender.sent == 5
    sender.close()
    assert [r.value for r in read_topic(local_stack.bootstrap, topic)] == envelopes(b"head", b"\x02", rows, b"tail")


def test_a_failed_delivery_is_raised_not_taken_for_acknowledged() -> None:
    cfg = config(f"127.0.0.1:{free_port()}", "nobody", **{"message.timeout.ms": "500"})  # no broker there
    sender = SnapshotSender(cfg, librdkafka_library() or "")
    sender.handle.send(b"value", b"key")
    with pytest.raises(ValueError, match="timeout"):
        sender.handle.flush(-1.0)
    with pytest.raises(BrokerError, match=r"delivery to nobody\.changes failed") as failed:
        sender.flush(10.0)
    assert failed.value.failed_deliveries == 1 == sender.handle.errors
    with pytest.raises(BrokerError, match=r"delivery to nobody\.changes failed"):
        sender.handle.send(b"later", b"key")
    sender.close()
    with pytest.raises(RuntimeError, match="closed"):
        sender.handle.send(b"after close", b"key")


def test_making_a_sender_does_not_create_its_topic(local_stack: StackConfig, unique_name: str) -> None:
    """Workers make their sender before capture created the raw topic (with one partition): asking
    for the topic's metadata then would have the broker create it with its default partitions."""
    sender = SnapshotSender(config(local_stack.bootstrap, unique_name), librdkafka_library() or "")
    sender.handle.poll(1.0)
    sender.close()
    admin = AdminClient({"bootstrap.servers": local_stack.bootstrap})
    assert f"{unique_name}.changes" not in admin.list_topics(timeout=10).topics


def test_batches_without_a_sender_wait_for_room_too(local_stack: StackConfig, unique_name: str) -> None:
    """Where no librdkafka can be opened directly, the Copier's batches go through confluent-kafka's
    ``produce_batch``: a batch bigger than the local queue is sent in full all the same."""
    cfg = config(local_stack.bootstrap, unique_name, **{"queue.buffering.max.messages": "10"})
    ensure_changes_topic(cfg)  # the producer never makes it (no auto-create)
    producer = ChangeProducer(cfg)
    producer.send_batch([{"value": b"value %d" % n, "key": b"key"} for n in range(500)])
    producer.flush(30.0)
    values = [r.value for r in read_topic(local_stack.bootstrap, cfg.changes_topic)]
    assert sorted(values) == sorted(b"value %d" % n for n in range(500))


def test_a_senders_librdkafka_lines_are_log_records_on_the_sending_thread(caplog: pytest.LogCaptureFixture) -> None:
    """Not text on stderr: records of ``headwater.kafka`` (so --log-format json and the gate on connection
    noise apply), made while the sender polls — from the thread that polls, never librdkafka's own."""
    port = free_port()  # no broker there: connections are refused
    settings = librdkafka_settings(config(f"127.0.0.1:{port}", "nobody", debug="broker"))
    threads: set[str] = set()

    def line(level: int, text: str) -> None:
        threads.add(threading.current_thread().name)
        librdkafka_line(level, text)

    sender = Sender(librdkafka_library() or "", settings, "nobody.changes", BrokerError, line)
    with caplog.at_level(logging.DEBUG, logger=KAFKA_LOGGER):
        time.sleep(1.5)
        assert not caplog.records, "logged before a poll: from librdkafka's threads"
        sender.poll(1.0)
        sender.close()
    refused = [r for r in caplog.records if f"Connect to ipv4#127.0.0.1:{port} failed" in r.getMessage()]
    assert refused and all(r.name == KAFKA_LOGGER for r in refused)
    assert any(r.levelno == logging.DEBUG for r in caplog.records)  # debug=broker's lines, at DEBUG
    assert threads == {threading.current_thread().name}


@pytest.mark.unit
def test_events_coming_and_going_in_librdkafkas_queue_are_not_taken_for_acks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Events in librdkafka's queue (counted with the messages) coming and going while the broker refuses connections:
    Kafka counts as silent until a message is acknowledged (a 10 s outage during a backfill went unseen)."""
    producer = ChangeProducer(config(f"127.0.0.1:{free_port()}", "nobody"))
    start = 100.0  # exact sums
    producer._sent, producer._progress = 10, (0, start)
    lengths = iter([10, 12, 11, 13, 10, 12, 4, 6])  # 10 messages wait, events come and go; then 6 are acknowledged
    monkeypatch.setattr(producer, "waiting", lambda: next(lengths))
    assert [producer.unanswered(start + t) for t in range(6)] == [0, 1, 2, 3, 4, 5]
    assert producer.unanswered(start + 6) == 0 and producer.unanswered(start + 7) == 1  # acks moved, then stood


def test_the_producers_statistics_interval_is_the_users_if_set() -> None:
    assert statistics({"bootstrap.servers": "x"})["statistics.interval.ms"] == 1000
    assert statistics({"statistics.interval.ms": "60000"})["statistics.interval.ms"] == "60000"


def test_chunks_and_the_stream_around_them_keep_send_order_without_waiting_for_kafka(
    local_stack: StackConfig, unique_name: str
) -> None:
    """Once a chunk went through the chunks' producer the stream's messages follow it there: a chunk returns with
    its messages still unacknowledged, the topic holds everything in send order, and a commit's LSN is confirmed
    only once everything before it was acknowledged."""
    cfg = config(local_stack.bootstrap, unique_name, **{"queue.buffering.max.messages": "300", "linger.ms": "200"})
    ensure_changes_topic(cfg)
    producer = ChangeProducer(cfg)
    sender = producer.chunk_sender()
    assert sender is not None
    expected: list[bytes] = []
    for n in range(3):
        stream = [b"stream %d.%d" % (n, i) for i in range(400)]  # more than the queue holds: room is waited for
        producer.send_all((b"k", value) for value in stream)
        producer.mark(10 * n + 1)
        rows: list[tuple[bytes | None, bytes | None]] = [(b"key %d" % i, b"row %d.%d" % (n, i)) for i in range(250)]
        producer.send_chunk(sender, b"k", b"head", b"\x02", rows, b"tail", False)
        assert producer.waiting() > 0, "a chunk waited for Kafka"
        producer.mark(10 * n + 2)
        expected += [*stream, *envelopes(b"head", b"\x02", rows, b"tail")]
    assert producer.routed
    producer.flush(30.0)
    assert producer.acked_lsn() == 22 and producer.acknowledged() == producer.sent == len(expected) == 1950
    assert [r.value for r in read_topic(local_stack.bootstrap, cfg.changes_topic)] == expected
    producer.abandon()


def test_the_stream_goes_back_to_its_own_producer_once_the_chunks_are_acknowledged(
    local_stack: StackConfig, unique_name: str
) -> None:
    """After the backfills (``unroute``), the stream's messages leave through its own producer again, and the topic
    still holds everything in send order; while a chunk is unacknowledged they stay behind it."""
    cfg = config(local_stack.bootstrap, unique_name, **{"linger.ms": "200"})
    ensure_changes_topic(cfg)
    producer = ChangeProducer(cfg)
    sender = producer.chunk_sender()
    assert sender is not None
    rows: list[tuple[bytes | None, bytes | None]] = [(b"key %d" % i, b"row %d" % i) for i in range(100)]
    producer.send_chunk(sender, b"k", b"head", b"\x02", rows, b"tail", False)
    producer.unroute()
    assert producer.routed, "left the chunks' producer with a chunk unacknowledged"
    producer.flush(30.0)
    producer.unroute()
    assert not producer.routed
    producer.send_all((b"k", b"stream %d" % i) for i in range(10))
    # (len() of a confluent-kafka producer counts its pending events, statistics included, with its messages)
    assert len(producer.producer) >= 10 and not len(sender), "the stream's messages went through the chunks' producer"
    producer.flush(30.0)
    expected = [*envelopes(b"head", b"\x02", rows, b"tail"), *(b"stream %d" % i for i in range(10))]
    assert [r.value for r in read_topic(local_stack.bootstrap, cfg.changes_topic)] == expected
    producer.abandon()


KAFKA_DEFAULT_LIMIT = 1_048_588  # Apache Kafka's message.max.bytes unless a broker is configured otherwise


def test_batches_are_sized_under_the_topics_limit_with_room_for_framing() -> None:
    assert batch_settings(None) == {}  # unknown: librdkafka's own 1 MB batches
    big = batch_settings(RAW_MAX_MESSAGE_BYTES)
    assert int(big["batch.size"]) == BIG_BATCH and int(big["message.max.bytes"]) > BIG_BATCH
    for limit in (KAFKA_DEFAULT_LIMIT, 200_000, 1_500_000):
        size = int(batch_settings(limit)["batch.size"])
        assert size + limit // 20 < limit  # lz4's worst growth and the batch's framing fit
    assert int(batch_settings(200_000)["message.max.bytes"]) >= 1_000_000  # one row may still be 1 MB


def test_the_users_producer_settings_win_over_the_sizing() -> None:
    cfg = config("127.0.0.1:9", "p", **{"batch.size": "65536"})
    chosen = sized(cfg, RAW_MAX_MESSAGE_BYTES)
    assert chosen.producer["batch.size"] == "65536"
    assert chosen.producer["batch.num.messages"] == "100000" and cfg.producer == {"batch.size": "65536"}
    assert sized(cfg, None) is cfg
    assert librdkafka_settings(sized(config("127.0.0.1:9", "p"), KAFKA_DEFAULT_LIMIT))["batch.size"] == str(
        KAFKA_DEFAULT_LIMIT - KAFKA_DEFAULT_LIMIT // 16)


def topic_setting(bootstrap: str, topic: str, name: str) -> str | None:
    admin, resource = AdminClient({"bootstrap.servers": bootstrap}), ConfigResource(ConfigResource.Type.TOPIC, topic)
    entry = admin.describe_configs([resource])[resource].result(timeout=10).get(name)
    return entry.value if entry is not None else None


def test_the_raw_topic_is_made_to_take_big_batches_unless_the_user_says(
    local_stack: StackConfig, unique_name: str
) -> None:
    cfg = config(local_stack.bootstrap, unique_name)
    assert ensure_changes_topic(cfg) == RAW_MAX_MESSAGE_BYTES == ensure_changes_topic(cfg)  # made, then found
    assert topic_setting(local_stack.bootstrap, cfg.changes_topic, "max.message.bytes") == str(RAW_MAX_MESSAGE_BYTES)
    limit = Settings({"max.message.bytes": "2000000"})
    own = CaptureConfig(dsn=Secret("postgresql:///unused"), bootstrap=local_stack.bootstrap,
                        topic_prefix=unique_name + "-own", topic_config=limit)  # fmt: skip
    assert ensure_changes_topic(own) == 2_000_000


def test_a_raw_topic_reporting_no_limit_keeps_librdkafkas_batches(local_stack: StackConfig, unique_name: str) -> None:
    """The local broker reports only settings a topic was made with: a raw topic made by an older
    capture (or by hand) has no known limit, so batches stay at librdkafka's 1 MB."""
    cfg = config(local_stack.bootstrap, unique_name)
    admin = AdminClient({"bootstrap.servers": local_stack.bootstrap})
    admin.create_topics([NewTopic(cfg.changes_topic, 1, 1)])[cfg.changes_topic].result(timeout=10)
    assert ensure_changes_topic(cfg) is None
    assert "batch.size" not in librdkafka_settings(sized(cfg, None))


def test_big_batches_are_read_whole_by_a_reader_fetching_a_megabyte(local_stack: StackConfig, unique_name: str) -> None:
    """Batches of 4 MB (before lz4) are larger than the workers' readers fetch at once (1 MB): the broker
    hands each over whole all the same, and every message is read, in order."""
    cfg = sized(config(local_stack.bootstrap, unique_name, **{"linger.ms": "200"}), RAW_MAX_MESSAGE_BYTES)
    ensure_changes_topic(cfg)
    largest: list[int] = []
    producer = Producer({**statistics(producer_settings(cfg)), "statistics.interval.ms": 100, "stats_cb":
                         lambda s: largest.append(json.loads(s)["topics"].get(cfg.changes_topic, {}).get(
                             "batchcnt", {}).get("max", 0)) if "topics" in json.loads(s) else None})  # fmt: skip
    values = [(b"%06d" % n) * 25 for n in range(40_000)]  # 6 MB
    for n, value in enumerate(values):
        producer.produce(cfg.changes_topic, value, b"key %d" % n, partition=0)
    producer.flush(60.0)
    time.sleep(0.3)
    producer.poll(0)
    assert max(largest) > 10_000  # messages in a batch: librdkafka's 1 MB batches held ~6,000 of these
    settings = {"bootstrap.servers": local_stack.bootstrap, **READER_MEMORY}
    assert [r.value for r in read_topic_from(settings, cfg.changes_topic)] == values

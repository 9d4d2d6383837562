"""Reading topics back: a reader that stalls (the broker paused) is replaced by a new one that reads on from
where the first stood, every record once, in order. One-shot reads of a partition of many batches (a
partition's end, its last records) grow their fetch wait on the local broker and finish. A topic made again
is told apart by its id."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import cast

import pytest
from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, ClusterMetadata, NewTopic, PartitionMetadata, TopicMetadata

from headwater.stack import Broker, StackConfig
from tables import kafka
from tables.errors import RetryableError
from tables.kafka import FetchWait, Stalled, StallWatch, _past, _taken, bounds, create_topics, read_on, topic_ids
from tests.plugins.stack import one_record_batches

RECORDS = 30_000


@pytest.mark.slow
def test_a_reader_that_stalls_is_replaced_and_reads_on_from_where_it_stood(
    local_stack: StackConfig, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    create_topics(AdminClient({"bootstrap.servers": local_stack.bootstrap}), [NewTopic(unique_name, 1, 1)])
    producer = Producer({"bootstrap.servers": local_stack.bootstrap, "linger.ms": 20})
    for i in range(RECORDS):
        producer.produce(unique_name, str(i).encode(), partition=0)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(30) == 0
    del producer  # its connection must not outlive the test
    small = {"queued.max.messages.kbytes": 16, "fetch.max.bytes": 65536, "message.max.bytes": 65536,
             "max.partition.fetch.bytes": 16384}  # fmt: skip
    starts = {(unique_name, 0): 0}
    reading = read_on({"bootstrap.servers": local_stack.bootstrap, **small}, starts, timeout=120)
    offsets = [int(m.offset() or 0) for m in itertools.islice(reading, 1000)]
    broker = Broker(local_stack).pid()
    assert broker is not None
    os.kill(broker, signal.SIGSTOP)  # nothing answers: the reader drains what it holds, then stalls
    resume = threading.Timer(9.0, os.kill, (broker, signal.SIGCONT))
    resume.start()
    try:
        with caplog.at_level(logging.WARNING, logger="tables.kafka"):
            offsets += [int(m.offset() or 0) for m in reading]
    finally:
        resume.join()
        os.kill(broker, signal.SIGCONT)
    assert offsets == list(range(RECORDS))
    assert starts == {(unique_name, 0): RECORDS}
    assert any("reading on from" in r.getMessage() for r in caplog.records), "the reader never stalled"


@pytest.mark.slow
def test_one_shot_reads_of_a_partition_of_many_batches_grow_their_fetch_wait_and_finish(
    local_stack: StackConfig, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """At the workers' 10 ms the local broker's listing of 20,000 one-record batches does not reach the end:
    ``bounds`` (a worker's start, the table feed's, the leader's, capture's) stalled there for good."""
    batches = 20_000
    one_record_batches(local_stack.bootstrap, unique_name, batches)
    settings = {"bootstrap.servers": local_stack.bootstrap, "fetch.wait.max.ms": 10}
    with caplog.at_level(logging.WARNING, logger="tables.kafka"):
        assert bounds(settings, unique_name, 0) == (0, batches)
        last = [int(m.offset() or 0) for m in read_on(settings, {(unique_name, 0): batches - 50}, timeout=60)]
    assert last == list(range(batches - 50, batches))
    grown = [r.getMessage() for r in caplog.records if "came back empty below the known end" in r.getMessage()]
    assert grown, "the reads never needed a longer wait: the partition is too short to show it"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tables.kafka"):  # a view partition's read-back: the whole of it
        whole = [int(m.offset() or 0) for m in read_on(settings, {(unique_name, 0): 0}, timeout=60, bulk=True)]
    assert whole == list(range(batches))
    assert not [r.getMessage() for r in caplog.records], "a bulk read had to grow its wait from BULK_WAIT_MS"


@pytest.mark.slow
def test_an_idle_timed_read_lasts_as_long_as_its_callers_work_and_ends_once_nothing_comes(
    local_stack: StackConfig, unique_name: str
) -> None:
    """A whole table topic read for a re-key or a TRUNCATE: the caller's work on each record counts in the read's
    time, so its timeout counts from the last batch; a broker that stops answering still ends it."""
    one_record_batches(local_stack.bootstrap, unique_name, 3_000)
    settings = {"bootstrap.servers": local_stack.bootstrap}

    def slowly(idle: bool) -> list[int]:  # 3,000 records at 1 ms each: past the 2 s timeout in all
        out = []
        for m in read_on(settings, {(unique_name, 0): 0}, timeout=2, idle=idle):
            out.append(int(m.offset() or 0))
            time.sleep(0.001)
        return out

    with pytest.raises(RetryableError, match="no end of"):
        slowly(idle=False)
    assert slowly(idle=True) == list(range(3_000))
    broker = Broker(local_stack).pid()
    assert broker is not None
    small = {"queued.max.messages.kbytes": 16, "fetch.max.bytes": 65536, "message.max.bytes": 65536,
             "max.partition.fetch.bytes": 16384}  # fmt: skip
    reading = read_on({**settings, **small}, {(unique_name, 0): 0}, timeout=2, idle=True)
    next(reading)
    os.kill(broker, signal.SIGSTOP)  # the reader drains what it holds, then nothing comes
    started = time.monotonic()
    try:
        with pytest.raises(RetryableError, match=r"no end of|nothing was read for"):
            list(reading)
    finally:
        os.kill(broker, signal.SIGCONT)
    assert time.monotonic() - started < 30


def test_a_topic_made_again_has_another_id_and_a_missing_one_none(
    local_stack: StackConfig, topic_factory: Callable[..., str]
) -> None:  # fmt: skip
    admin = AdminClient({"bootstrap.servers": local_stack.bootstrap})
    topic = topic_factory("ids")
    first = topic_ids(admin, [topic, topic + ".absent"])
    assert list(first) == [topic] and first == topic_ids(admin, [topic]), "an id that stays while the topic does"
    admin.delete_topics([topic])[topic].result(timeout=10)
    assert topic_ids(admin, [topic]) == {}
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=10)
    again = topic_ids(admin, [topic])
    assert list(again) == [topic] and again[topic] != first[topic]
    assert topic_ids(admin, []) == {}


def msg(partition: int, offset: int, code: int | None = None) -> Message:
    return Message(topic="t", partition=partition, offset=offset, value=b"v",
                   error=KafkaError(code) if code is not None else None)  # fmt: skip


def topic(*leaders: int, error: KafkaError | None = None) -> TopicMetadata:
    """A topic's metadata as librdkafka gives it: one partition per leader (-1: none yet)."""
    meta = TopicMetadata()
    meta.error = error
    for i, leader in enumerate(leaders):
        partition = PartitionMetadata()
        partition.id, partition.leader = i, leader
        meta.partitions[i] = partition
    return meta


@pytest.mark.unit
def test_a_topic_is_shown_once_every_partition_of_it_has_a_leader() -> None:
    failing = topic(1, 1)
    failing.partitions[1].error = KafkaError(KafkaError.LEADER_NOT_AVAILABLE)
    listed = {"led": topic(1, 1), "leaderless": topic(1, -1), "bare": topic(), "partly": failing,
              "failing": topic(1, error=KafkaError(KafkaError.LEADER_NOT_AVAILABLE))}  # fmt: skip
    assert kafka.unshown(listed, ["led", "leaderless", "bare", "partly", "failing", "absent"]) == [
        "leaderless", "bare", "partly", "failing", "absent"]  # fmt: skip
    assert kafka.unshown(listed, ["led"]) == []


@pytest.mark.unit
def test_topics_just_made_are_waited_for_until_the_metadata_shows_them_and_no_longer() -> None:
    """Kafka answers CreateTopics before every broker knows the topic: the first looks miss it or its leader."""
    looks = iter([{}, {"t": topic(-1)}, {"t": topic(1), "u": topic(2)}])
    now, slept = [0.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    kafka.wait_shown(lambda: next(looks), ["t", "u"], within=1.0, sleep=sleep, clock=lambda: now[0])
    assert len(slept) == 2
    with pytest.raises(RetryableError, match=r"topics \['u'\] were made.*within 0.5 s"):
        kafka.wait_shown(lambda: {"t": topic(1)}, ["t", "u"], within=0.5, sleep=sleep, clock=lambda: now[0])


class Made:
    """An admin client's two answers as a broker that serves a topic a look after making it gives them."""

    def __init__(self) -> None:
        self.looks = [ClusterMetadata(), ClusterMetadata()]
        self.looks[1].topics = {"t": topic(1)}

    def create_topics(self, topics: list[NewTopic]) -> dict[str, Future[None]]:
        made: Future[None] = Future()
        made.set_result(None)
        return {t.topic: made for t in topics}

    def list_topics(self, timeout: float) -> ClusterMetadata:
        return self.looks.pop(0)


@pytest.mark.unit
def test_create_topics_returns_once_the_broker_serves_them_and_asks_nothing_for_none() -> None:
    made = Made()
    create_topics(cast(AdminClient, made), [NewTopic("t", 1, 1)])
    assert made.looks == []  # looked until it showed
    create_topics(cast(AdminClient, None), [])  # no admin needed: nothing to make, nothing asked


@pytest.mark.unit
def test_a_batch_is_taken_up_to_the_last_end_it_waits_for() -> None:
    """An EOF takes its partition off the wait; at the last one the batch ends, whatever follows it."""
    waiting = {("t", 0), ("t", 1)}
    batch = [msg(0, 7), msg(0, 8, KafkaError._PARTITION_EOF), msg(1, 3), msg(1, 4, KafkaError._PARTITION_EOF),
             msg(0, 8)]  # fmt: skip
    assert [(m.partition(), m.offset()) for m in _taken(batch, waiting)] == [(0, 7), (1, 3)]
    assert waiting == set()
    with pytest.raises(RetryableError, match="reading t"):
        _taken([msg(0, 1), msg(0, 2, KafkaError._MSG_TIMED_OUT)], {("t", 0)})


class Batches:
    """A consumer that gives these batches, then nothing."""

    def __init__(self, *batches: list[Message]) -> None:
        self.batches, self.closed = list(batches), 0

    def assign(self, partitions: list[TopicPartition]) -> None:
        pass

    def consume(self, n: int, timeout: float) -> list[Message]:
        return self.batches.pop(0) if self.batches else []

    def close(self) -> None:
        self.closed += 1


@pytest.mark.unit
def test_a_partitions_last_messages_count_for_its_end_when_its_eof_comes_in_the_same_batch() -> None:
    """On Tansu the reported end is the last batch's base + 1: the messages past it, read with the EOF that takes
    the partition off the wait, make its end."""
    eof = KafkaError._PARTITION_EOF
    consumer = Batches([msg(0, 5), msg(0, 6), msg(0, 7, eof), msg(1, 2)], [msg(1, 3), msg(1, 4, eof)])
    ends = kafka.fetched_ends({}, {("t", 0): 6, ("t", 1): 3, ("t", 2): 0}, consumer=cast(Consumer, consumer))
    assert ends == {("t", 0): 7, ("t", 1): 4, ("t", 2): 0}
    assert consumer.closed == 1


@pytest.mark.unit
def test_a_batch_moves_each_partition_past_its_last_message() -> None:
    batch = [msg(0, 7), msg(1, 3), msg(0, 8), msg(1, 4), msg(2, 1)]
    assert _past(batch, 3) == {("t", 0): 9, ("t", 1): 5, ("t", 2): 2}
    assert _past(batch, 5) == {("t", 0): 9, ("t", 1): 5, ("t", 2): 2}  # fewer partitions in it than assigned
    assert _past([msg(0, 7), msg(0, 8)], 1) == {("t", 0): 9}


@pytest.mark.unit
def test_empty_fetches_grow_the_wait_only_when_the_broker_answered_before_and_after_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A broker paused (SIGSTOP) sends nothing: its silence is not an empty fetch, nor is a slow answer, nor the dry
    time in which it came back (a CI leg's feed grew its wait to 20 ms from a pause's end); a reader that reached its
    end since has left the silence behind."""
    now, late, asked = [0.0], [True], [0]

    def dry_until_asked(ok: bool, took: float = 0.0) -> None:
        """Empty fetches every 0.25 s until the watch asks the broker, which answers (``ok``) in ``took`` s."""
        def answer(consumer: object, tp: TopicPartition) -> bool:
            asked[0] += 1
            now[0] += took
            return ok

        monkeypatch.setattr(kafka, "answers", answer)
        before = asked[0]
        while asked[0] == before:
            now[0] += 0.25
            watch._dry(None, {("t", 0)})  # type: ignore[arg-type]  # behind and answers are the test's

    monkeypatch.setattr(kafka.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(kafka, "behind", lambda consumer, parts: [TopicPartition("t", 0, 5)] if late[0] else [])
    wait = FetchWait({"fetch.wait.max.ms": 10})
    watch = StallWatch(wait=wait)
    dry_until_asked(False, 2.0)  # the broker silent: no answer
    dry_until_asked(True)  # it answers: but this dry time began in its silence
    dry_until_asked(True, 1.0)  # a slow answer: a broker just back
    dry_until_asked(True)  # after which the first dry time is timed again
    assert wait.ms == 10
    with pytest.raises(Stalled, match="came back empty"):
        dry_until_asked(True)  # empty fetches from a broker that answers
    assert wait.ms == 20
    dry_until_asked(False, 2.0)  # silent again
    late[0] = False
    now[0] += 0.25
    watch._dry(None, {("t", 0)})  # type: ignore[arg-type]  # the reader at its end
    late[0] = True
    with pytest.raises(Stalled, match="came back empty"):
        dry_until_asked(True)
    assert wait.ms == 40


@pytest.mark.unit
def test_empty_reads_look_at_the_positions_every_tenth_of_a_second_and_still_grow_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reader's empty reads every 5 ms look at its positions no more than every ``LOOK_EVERY_S`` (each look holds
    the GIL), and their time still adds up to a dry time, also with a message read now and then among them (a short
    wait on a long partition lets one through)."""
    now, looks = [0.0], [0]

    def late(consumer: object, parts: object) -> list[TopicPartition]:
        looks[0] += 1
        return [TopicPartition("t", 0, 5)]

    monkeypatch.setattr(kafka.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(kafka, "behind", late)
    monkeypatch.setattr(kafka, "answers", lambda consumer, tp: True)
    wait = FetchWait({"fetch.wait.max.ms": 10})
    watch = StallWatch(wait=wait)
    watch.check(None, {("t", 0)})  # type: ignore[arg-type]
    assert looks[0] == 1  # the first empty read looks at once
    with pytest.raises(Stalled, match="came back empty"):
        for read in range(1, 1000):
            now[0] += 0.005
            if read % 7 == 0:
                watch.seen()  # a message now and then
            else:
                watch.check(None, {("t", 0)})  # type: ignore[arg-type]  # behind and answers are the test's
    assert wait.ms == 20
    assert 0.9 <= now[0] <= 1.3  # about DRY of empty reads, not more
    assert looks[0] <= now[0] / kafka.LOOK_EVERY_S + 1


@pytest.mark.slow
def test_the_ends_of_partitions_written_faster_than_the_fetch_wait_are_found_all_the_same(
    local_stack: StackConfig, unique_name: str
) -> None:
    """A feed's read of the points topic's end after its wait grew, the table feed's ``bounds_of``: at a wait
    longer than the gap between two records every fetch brings something, so the busy partition never reports
    EOF and the read stalled until its timeout. The quiet partition's end is still its true end."""
    create_topics(AdminClient({"bootstrap.servers": local_stack.bootstrap}), [NewTopic(unique_name, 2, 1)])
    producer = Producer({"bootstrap.servers": local_stack.bootstrap, "linger.ms": 0})
    for i in range(7):
        producer.produce(unique_name, b"%d" % i, partition=1)
    assert producer.flush(30) == 0
    acked, stop = [0], threading.Event()

    def count(err: KafkaError | None, _: Message) -> None:
        acked[0] += err is None

    def busy() -> None:  # a record every 2 ms on partition 0, well inside the reader's 200 ms wait
        while not stop.is_set():
            producer.produce(unique_name, b"x", partition=0, on_delivery=count)
            producer.poll(0.002)

    writer = threading.Thread(target=busy)
    writer.start()
    try:
        time.sleep(1.0)
        before = acked[0]  # offsets 0..before-1 are written: the true end is at least that
        settings = {"bootstrap.servers": local_stack.bootstrap, "fetch.wait.max.ms": 200}
        started = time.monotonic()
        ends = kafka.fetched_ends(settings, {(unique_name, 0): before, (unique_name, 1): 1}, timeout=20)
        took = time.monotonic() - started
    finally:
        stop.set()
        writer.join()
        assert producer.flush(30) == 0
    assert took < 10, f"finding the ends took {took:.1f} s"
    assert ends[(unique_name, 1)] == 7
    assert before <= ends[(unique_name, 0)] <= acked[0]

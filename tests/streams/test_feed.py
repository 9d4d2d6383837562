"""The feeds' retry loop: a stalled reader is replaced at once, other failures pause, and the pause
grows only while nothing is read. A feed on a partition of many batches, whose fetches the local broker
answers empty at a short wait, grows its wait and reads to the end; a broker that does not answer at all
(paused) leaves the wait as it was."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from headwater.stack import Broker, StackConfig
from streams.cursor import Raw
from streams.feed import Feed, Follower
from tables.errors import FatalError
from tables.kafka import FetchWait, Stalled, create_topics
from tests.plugins.stack import one_record_batches
from tests.plugins.streams import run_until

BATCHES = 20_000  # one record each: at a 10 ms fetch wait the local broker's listing stops short of the end


class Script(Follower):
    """A follower whose runs do what ``steps`` say: 'stall', 'fail', 'read+fail' or 'stop'."""

    def __init__(self, steps: list[str]) -> None:
        self.fatal: list[FatalError] = []
        super().__init__("script", self.fatal.append)
        self.steps = steps
        self.starts: list[float] = []

    def _follow(self) -> None:
        self.starts.append(time.monotonic())
        step = self.steps.pop(0)
        if step == "stop":
            self.stopping.set()
        elif step == "stall":
            raise Stalled("reading [('t', 0)] stalled below the known end")
        else:
            self.progressed = step.startswith("read")
            raise RuntimeError("broker hiccup")


def gaps(steps: list[str]) -> list[float]:
    follower = Script(steps)
    follower.run()
    return [b - a for a, b in zip(follower.starts, follower.starts[1:], strict=False)]


@pytest.mark.unit
def test_a_stalled_reader_is_replaced_without_a_pause() -> None:
    assert all(gap < 0.5 for gap in gaps(["stall", "stall", "stall", "stop"]))


@pytest.mark.unit
def test_the_pause_doubles_while_nothing_is_read_and_starts_again_after_a_read() -> None:
    first, second, third = gaps(["fail", "fail", "read+fail", "stop"])
    assert 0.9 < first < 1.5 and 1.9 < second < 2.5  # 1 s, then 2 s: nothing read
    assert 0.9 < third < 1.5  # the run read something before failing: back to 1 s


@pytest.mark.unit
def test_a_fetch_wait_doubles_up_to_a_second_and_one_never_set_does_not_grow() -> None:
    wait = FetchWait({"fetch.wait.max.ms": 300})
    assert wait.grow() and wait.applied({"a": 1}) == {"a": 1, "fetch.wait.max.ms": 600}
    assert wait.grow() and wait.ms == 1000
    assert not wait.grow() and wait.ms == 1000
    unset = FetchWait({})
    assert not unset.grow() and unset.applied({"a": 1}) == {"a": 1}


@pytest.mark.slow
def test_a_feed_on_a_partition_of_many_batches_grows_its_fetch_wait_and_reads_to_the_end(
    local_stack: StackConfig, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    one_record_batches(local_stack.bootstrap, unique_name, BATCHES)
    got: list[int] = []
    done, fatal = threading.Event(), []

    def handle(batch: list[Raw]) -> None:
        got.extend(offset for offset, _, _ in batch)
        if got[-1] == BATCHES - 1:
            done.set()

    settings = {"bootstrap.servers": local_stack.bootstrap, "fetch.wait.max.ms": 10}
    feed = Feed("waits", unique_name, settings, start=lambda: got[-1] + 1 if got else BATCHES - 100, handle=handle,
                on_fatal=fatal.append, batch_size=500, wait=0.005)  # fmt: skip
    said = run_until(feed, done, caplog, lambda: f"read {len(got)} of the last 100; wait {feed.fetch_wait.ms} ms")
    assert got == list(range(BATCHES - 100, BATCHES)) and not fatal
    assert feed.fetch_wait.ms is not None and feed.fetch_wait.ms > 10
    assert any("came back empty below the known end" in line for line in said)


@pytest.mark.slow
def test_a_feed_behind_while_the_broker_is_paused_keeps_its_fetch_wait_and_reads_on(
    local_stack: StackConfig, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Silence is not an empty fetch: a wait grown by a pause would stay for the worker's life."""
    records = 20_000
    create_topics(AdminClient({"bootstrap.servers": local_stack.bootstrap}), [NewTopic(unique_name, 1, 1)])
    producer = Producer({"bootstrap.servers": local_stack.bootstrap, "linger.ms": 20, "batch.num.messages": 500})
    for i in range(records):
        producer.produce(unique_name, b"%d" % i, partition=0)
        producer.poll(0)
    assert producer.flush(60) == 0
    del producer  # its connection must not outlive the test (nor see the broker paused)
    got: list[int] = []
    entered, release, done, fatal = threading.Event(), threading.Event(), threading.Event(), []

    def handle(batch: list[Raw]) -> None:
        entered.set()
        release.wait(30)  # the first batch holds the feed while the broker is paused: it is behind then
        got.extend(offset for offset, _, _ in batch)
        if got[-1] == records - 1:
            done.set()

    small = {"queued.max.messages.kbytes": 16, "fetch.max.bytes": 65536, "message.max.bytes": 65536,
             "max.partition.fetch.bytes": 16384}  # fmt: skip
    settings = {"bootstrap.servers": local_stack.bootstrap, "fetch.wait.max.ms": 10, **small}
    feed = Feed("paused", unique_name, settings, start=lambda: got[-1] + 1 if got else 0, handle=handle,
                on_fatal=fatal.append, batch_size=100, wait=0.005)  # fmt: skip
    broker = Broker(local_stack).pid()
    assert broker is not None
    with caplog.at_level(logging.WARNING, logger="headwater.streams"):
        feed.start()
        resume = threading.Timer(8.0, os.kill, (broker, signal.SIGCONT))
        try:
            assert entered.wait(30), "the feed read nothing"
            os.kill(broker, signal.SIGSTOP)
            resume.start()
            release.set()
            assert done.wait(120), f"read {len(got)} of {records}; fetch wait {feed.fetch_wait.ms} ms"
        finally:
            release.set()
            resume.cancel()
            os.kill(broker, signal.SIGCONT)
            feed.stop()
    assert got == list(range(records)) and not fatal
    assert feed.fetch_wait.ms == 10, f"the pause grew the wait to {feed.fetch_wait.ms} ms"
    assert not any("came back empty" in r.getMessage() for r in caplog.records)

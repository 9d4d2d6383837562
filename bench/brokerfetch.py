"""The local broker's fetch against how many batches a partition holds, at the workers' fetch wait.

Found on 2026-11-27 chasing a CI leg where a worker's fan-out caught up at ~140 changes/s: Tansu
0.6.0 looks through a partition's batches for every fetch and answers with what it found when the
fetch's ``fetch.wait.max.ms`` is up. The workers' readers wait 10 ms there (``streams.clients``),
for latency: Tansu holds a fetch for its whole wait even when records arrive. Past some thousands
of batches the look-through no longer fits in 10 ms and a reader gets nothing, even at the tail.
Capture writes a batch per 50 ms linger under a steady load (up to 20 a second), so a local
stack's raw topic gets there after minutes of small transactions.

For each batch size, one partition of 40,000 300-byte records is written in batches of
that many records, then read with the workers' reader settings from the middle and from ten
records before the end: at the workers' 10 ms wait, at 100 ms (the baseline), and by the workers'
feed (``streams.feed.Feed``), which starts at 10 ms and grows its wait when fetches come back empty
(``tables.kafka.FetchWait``). Printed: the seconds each read took, or how far it got in 20 s, the
ratio of the first to the baseline, and the feed's time and the wait it ended with. Then, per
partition, how long ``tables.kafka.bounds`` takes at the workers' settings (a worker's start, its table
feed's, its leader's: one-shot reads that grow their wait the same way), and how long a one-shot read of
the whole partition from offset 0 takes (``tables.kafka.read_on``, a worker's read-back of a view partition it
takes): from the workers' 10 ms, and as a ``bulk`` read (from ``BULK_WAIT_MS``), with their ratio. Only the
broker runs (the benchmarks' fixed port).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from headwater import stack
from streams.clients import READER_MEMORY, TANSU_FETCH_WAIT_MS
from streams.cursor import Raw
from streams.feed import Feed
from tables.kafka import BULK_WAIT_MS, bounds, read_on, reader

BASELINE_WAIT_MS, LIMIT = 100, 20.0


def write(bootstrap: str, topic: str, messages: int, per_batch: int) -> int:
    """``messages`` records into partition 0 of a new ``topic``, a flush after every ``per_batch``: batches made."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result()
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "compression.type": "lz4"})
    for i in range(messages):
        producer.produce(topic, b"x" * 300, b"k%d" % i, partition=0)
        if i % per_batch == per_batch - 1:
            producer.flush()
    producer.flush()
    return -(-messages // per_batch)


def read(bootstrap: str, topic: str, start: int, end: int, wait_ms: int) -> tuple[int, float]:
    """(records, seconds) reading ``start`` to ``end`` (``LIMIT`` seconds at most) with the workers' reader
    settings."""
    consumer = reader({**READER_MEMORY, "fetch.wait.max.ms": wait_ms, "bootstrap.servers": bootstrap})
    try:
        consumer.assign([TopicPartition(topic, 0, start)])
        got, began = 0, time.monotonic()
        while got < end - start and time.monotonic() - began < LIMIT:
            got += sum(1 for m in consumer.consume(500, 0.1) if m.error() is None)
        return got, time.monotonic() - began
    finally:
        consumer.close()


def fed(bootstrap: str, topic: str, start: int, end: int) -> tuple[int, float, int]:
    """(records, seconds, the wait it ended with) reading ``start`` to ``end`` (``LIMIT`` s at most) with the
    workers' feed, from 10 ms and growing its wait; a replaced reader goes on after what was handled."""
    got, done = [start - 1], threading.Event()

    def handle(batch: list[Raw]) -> None:
        got.append(batch[-1][0])
        if got[-1] >= end - 1:
            done.set()

    settings = {**READER_MEMORY, "fetch.wait.max.ms": TANSU_FETCH_WAIT_MS, "bootstrap.servers": bootstrap}
    feed = Feed("bench", topic, settings, start=lambda: got[-1] + 1, handle=handle, on_fatal=lambda exc: done.set(),
                batch_size=500, wait=0.005)  # fmt: skip
    began = time.monotonic()
    feed.start()
    done.wait(LIMIT)
    seconds = time.monotonic() - began
    feed.stop()
    return got[-1] + 1 - start, seconds, int(feed.fetch_wait.ms or 0)


def shown(got: int, seconds: float, want: int) -> str:
    return f"{seconds:5.2f} s" if got >= want else f"{got} of {want} in {seconds:.0f} s"


def ratio(ours: tuple[int, float], base: tuple[int, float], want: int) -> str:
    """Our read's time against the baseline's, or that ours did not finish."""
    if ours[0] < want:
        return "ours unfinished"
    return f"{ours[1] / base[1]:.1f}x" if base[0] >= want else "baseline unfinished"


def whole(bootstrap: str, topic: str, bulk: bool) -> tuple[int, float]:
    """(records, seconds) of a one-shot read of partition 0 from offset 0 at the workers' reader settings."""
    settings = {**READER_MEMORY, "fetch.wait.max.ms": TANSU_FETCH_WAIT_MS, "bootstrap.servers": bootstrap}
    began = time.monotonic()
    read = sum(1 for _ in read_on(settings, {(topic, 0): 0}, timeout=120, bulk=bulk))
    return read, time.monotonic() - began


def main(messages: int = 40_000) -> None:
    work = Path(tempfile.mkdtemp(prefix="headwater-bench-"))
    cfg = stack.StackConfig(data_dir=work / "stack", kafka_port=29092)
    broker = stack.Broker(cfg)
    print(f"\nlocal broker: one partition of {messages} records; seconds to read its second half, then its last 10")
    print(f"  (the workers' {TANSU_FETCH_WAIT_MS} ms fetch wait against {BASELINE_WAIT_MS} ms; {LIMIT:.0f} s at most)")
    logging.getLogger("headwater.streams").setLevel(logging.ERROR)  # the feed's growth warnings: the wait is printed
    try:
        broker.start()
        for per_batch in (300, 30, 10, 6, 3):
            topic = f"fetch-{per_batch}"
            batches = write(cfg.bootstrap, topic, messages, per_batch)
            for name, start in (("second half", messages // 2), ("last 10", messages - 10)):
                want = messages - start
                ours = read(cfg.bootstrap, topic, start, messages, TANSU_FETCH_WAIT_MS)
                base = read(cfg.bootstrap, topic, start, messages, BASELINE_WAIT_MS)
                got, seconds, wait = fed(cfg.bootstrap, topic, start, messages)
                print(f"  {batches:6} batches of {per_batch:3}, {name:>11}: {shown(*ours, want):>22} at "
                      f"{TANSU_FETCH_WAIT_MS} ms, {shown(*base, want):>22} at {BASELINE_WAIT_MS} ms, "
                      f"{ratio(ours, base, want)}; the feed {shown(got, seconds, want)}, "
                      f"{ratio((got, seconds), base, want)}, ending at {wait} ms")  # fmt: skip
            settings = {**READER_MEMORY, "fetch.wait.max.ms": TANSU_FETCH_WAIT_MS, "bootstrap.servers": cfg.bootstrap}
            began = time.monotonic()
            found = bounds(settings, topic, 0)
            print(f"  {batches:6} batches of {per_batch:3}: bounds {found} in {time.monotonic() - began:.2f} s")
            (plain, plain_s), (bulk, bulk_s) = whole(cfg.bootstrap, topic, False), whole(cfg.bootstrap, topic, True)
            print(f"  {batches:6} batches of {per_batch:3}: the whole partition one-shot {plain} records in "
                  f"{plain_s:.2f} s from {TANSU_FETCH_WAIT_MS} ms, {bulk} in {bulk_s:.2f} s in bulk (from "
                  f"{BULK_WAIT_MS} ms): {plain_s / bulk_s:.1f}x")  # fmt: skip
    finally:
        broker.stop()
        shutil.rmtree(work, ignore_errors=True)

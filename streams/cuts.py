"""A worker's share of the cuts: its view rows out, and each point's fragment once Kafka has its rows.

Promise: ``Cuts.write(topic, partition, key, value, headers)`` sends one view row without waiting
and counts it against the current point; ``Cuts.point(lsn, offset, parts, seconds)`` closes the
point (its commit LSN, raw offset, the ``(view, partition)`` it published and how long that took).
A poller thread serves the producer's deliveries and, in the order the points were closed, hands
each point to ``done`` with the end offset of every partition it names, once all of its rows and
every earlier point's are acknowledged (``done`` writes the worker's fragment of the cuts,
``streams.materializer``); just before, ``on_rows`` (when set: the Redis mirror beside these views)
gets the point's rows as Kafka has them, when they are no more than ``HAND_ROWS``. A refused row
stops it for good: ``failed`` names it and the next ``write`` raises. ``tails`` takes the view
topics' ends as Kafka reports them, asked while ``settled`` (nothing of this worker's in flight or
outside a point handed on): records past this worker's last row are found the same way. ``drain``
waits until everything written is acknowledged and handed on — a revocation returns only then, so
no row of a partition given up lands after its next owner has read the partition back. The view
topics' ends are shared between the poller and the feed thread (which sets them when it reads a
partition back) under one lock. ``close`` stops the poller and
waits for it. No I/O until the first point.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, Producer

from streams.errors import refused
from streams.writer import Pending, produce
from tables.errors import FatalError

log = logging.getLogger("headwater.streams")
Ends = list[tuple[str, int, int]]  # (view, partition, end offset)
Stray = tuple[str, int, int]  # (view, partition, offset): records of another writer lie from there on
Delivery = tuple[str, int, int, bytes, bytes | None]  # a view row as Kafka has it: topic, partition, offset, key, value
HAND_ROWS = 1000  # a point's rows handed to ``on_rows`` at most (the Redis mirror's read: ``streams.mirror``)


class Delivered(Pending):
    """A ``Pending`` that also remembers, per partition it wrote to, the first and end offsets and how many,
    and its rows as Kafka has them while they are no more than ``keep`` (``Cuts.on_rows``)."""

    __slots__ = ("counts", "ends", "firsts", "keep", "rows")

    def __init__(self, keep: int = 0) -> None:
        super().__init__()
        self.ends: dict[tuple[str, int], int] = {}
        self.firsts: dict[tuple[str, int], int] = {}
        self.counts: dict[tuple[str, int], int] = {}
        self.keep = keep
        self.rows: list[Delivery] | None = [] if keep else None

    def delivered(self, error: KafkaError | None, msg: Any) -> None:
        super().delivered(error, msg)
        if error is None:
            at, offset = (msg.topic(), msg.partition()), msg.offset()
            self.ends[at] = max(self.ends.get(at, 0), offset + 1)
            self.firsts[at] = min(self.firsts.get(at, offset), offset)
            self.counts[at] = self.counts.get(at, 0) + 1
            if self.rows is not None:
                self.rows.append((at[0], at[1], offset, msg.key(), msg.value()))
                self.rows = self.rows if len(self.rows) <= self.keep else None

    def interleaved(self, at: tuple[str, int], known: int) -> bool:
        """Whether records not written here lie among or before this point's rows of ``at``, whose end was
        ``known`` before them (they follow it one after another otherwise)."""
        return self.firsts[at] > known or self.ends[at] - self.firsts[at] > self.counts[at]


@dataclass
class Point:
    """A consistent point whose rows are on their way to Kafka."""

    lsn: int
    offset: int  # the raw offset it is at
    parts: list[tuple[str, int]]  # (view, partition) published at it
    seconds: float  # how long the publication took
    delivered: Delivered = field(default_factory=Delivered)


class Cuts:
    """View rows out, and each point handed on once Kafka acknowledged its rows (see the module promise)."""

    def __init__(self, producer: Producer, views: dict[str, str], done: Callable[[Point, Ends], None]) -> None:
        self.producer = producer
        self.views = views  # view name -> its topic
        self.names = {topic: name for name, topic in views.items()}
        self.done = done
        self.ends: dict[str, dict[int, int]] = {name: {} for name in views}
        self.lock = threading.Lock()  # guards ends and handed
        self.handed: int | None = None  # commit LSN of the last point handed on
        self.found: list[Stray] = []  # records of another writer found among this worker's, not yet taken
        self.failed: FatalError | None = None
        self.pending: deque[Point] = deque()
        self.on_rows: Callable[[int, list[Delivery]], None] | None = None  # a point's rows, before ``done``
        self.current = self._delivered()
        self.stopping = threading.Event()
        self.poller: threading.Thread | None = None

    def _delivered(self) -> Delivered:
        return Delivered(HAND_ROWS if self.on_rows is not None else 0)

    def write(self, topic: str, partition: int, key: bytes, value: bytes | None, headers: list[Any]) -> None:
        if self.failed is not None:
            raise self.failed
        self.current.outstanding += 1
        produce(self.producer, topic, partition, key, value, headers, self.current.delivered)

    def point(self, lsn: int, offset: int, parts: list[tuple[str, int]], seconds: float) -> None:
        """Close the current point: it is handed on once its rows are acknowledged (at once when it wrote no
        row and no earlier point waits: a partition without changes is not held back by the poller's wait)."""
        point = Point(lsn, offset, parts, seconds, self.current)
        self.current = self._delivered()
        if not self.pending and point.delivered.outstanding == 0:
            self._hand_on(point)
            return
        self.pending.append(point)
        if self.poller is None:
            self.poller = threading.Thread(target=self._poll, name="headwater-view-cuts", daemon=True)
            self.poller.start()

    def reached(self, view: str, ends: dict[int, int]) -> None:
        """The view topic holds at least ``ends`` (read back when a partition was taken)."""
        with self.lock:
            held = self.ends[view]
            for partition, end in ends.items():
                held[partition] = max(held.get(partition, 0), end)

    def last(self) -> int | None:
        """The commit LSN of the last point handed on (its rows all acknowledged)."""
        with self.lock:
            return self.handed

    def drain(self, timeout: float = 60.0) -> bool:
        """Until every row written is acknowledged and every point handed on (False: not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        if self.producer.flush(timeout) > 0:
            return False
        while self.pending and self.poller is not None and self.poller.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def _poll(self) -> None:
        while not self.stopping.is_set():
            self.producer.poll(0.05)  # a delivery ends the wait
            while self.pending and self.pending[0].delivered.outstanding <= 0:
                point = self.pending[0]
                if point.delivered.failed is not None:
                    self.failed = refused(point.delivered.failed, point.delivered.failed_topic, "a view row",
                                          hint="check the broker log and the view topics' settings")  # fmt: skip
                    log.error("%s: no more points are published", self.failed)
                    return
                self._hand_on(point)
                self.pending.popleft()

    def end(self, view: str, partition: int) -> int | None:
        """The offset after this worker's last row of a partition in a point handed on, or the partition's end
        when it was read back (None: never read)."""
        with self.lock:
            return self.ends[view].get(partition)

    def strays(self) -> list[Stray]:
        """Where records of another writer were found among this worker's since the last call (taken)."""
        with self.lock:
            found, self.found = self.found, []
        return found

    def settled(self) -> bool:
        """Whether none of this worker's view rows is in flight, and every one written is in a point handed on.
        Read without the lock: only the feed thread adds points and rows, and the poller moves the ends (under the
        lock) before it lets a point go."""
        current = self.current
        return not self.pending and current.outstanding == 0 and not current.ends and len(self.producer) == 0

    def tails(self, ends: dict[tuple[str, int], int]) -> list[Stray]:
        """Where Kafka says partitions end, asked while ``settled``: one ending past this worker's last row has
        another writer's records at its tail (found, as those among its rows are)."""
        with self.lock:
            found = []
            for (topic, partition), end in ends.items():
                name = self.names.get(topic, "")  # not a view topic: no end known
                known = self.ends.get(name, {}).get(partition)
                if known is not None and end > known and (name, partition, known) not in self.found:
                    found.append((name, partition, known))
            self.found += found
        return found

    def _hand_on(self, point: Point) -> None:
        with self.lock:
            stray = set()
            for (topic, partition), end in point.delivered.ends.items():
                name = self.names[topic]
                known = self.ends[name].get(partition)
                if known is not None and point.delivered.interleaved((topic, partition), known):
                    stray.add((name, partition))
                    self.found.append((name, partition, known))
                self.ends[name][partition] = max(known or 0, end)
            ends = [(view, partition, self.ends[view].get(partition, 0)) for view, partition in point.parts
                    if (view, partition) not in stray]  # fmt: skip
        hook, rows = self.on_rows, point.delivered.rows
        if hook is not None and rows:
            hook(point.lsn, rows)
        for view, partition in sorted(stray):
            log.warning("views: another worker wrote to %s[%d] among this worker's rows (one that lost the partition "
                        "and had not noticed yet); no cut is made over them: the rows they got wrong are written "
                        "again at the next point", self.views[view], partition)  # fmt: skip
        self.done(point, ends)
        with self.lock:
            self.handed = point.lsn

    def close(self, timeout: float = 10.0) -> None:
        """Stop the poller (points not yet handed on are published again by the next run) and flush."""
        self.stopping.set()
        if self.poller is not None:
            self.poller.join(timeout)
            self.poller = None
        self.producer.flush(timeout)

"""Publishing the views' cuts: each consistent point's cut once Kafka has every row written before it.

Promise: ``Cuts.write(topic, partition, key, value, headers)`` sends one view row without
waiting and counts it against the current point; ``Cuts.point(lsn)`` closes the point. A poller
thread serves the producer's deliveries and, in the order the points were closed, publishes
each point's cut — per view, the commit LSN and every view-topic partition's end — once all of
its rows and every earlier point's are acknowledged. A refused row stops the cuts for good:
``failed`` names it and the next ``write`` raises. The view topics' ends are shared between the
poller and the feed thread (which sets them when it reads the topics back) under one lock.
``close`` stops the poller and waits for it. No I/O until the first point.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fastavro
from confluent_kafka import KafkaError, Producer

from streams.writer import Pending, produce
from tables.errors import FatalError
from tables.topics import CUTS_PARTITION
from tables.views import CUT_PARSED
from tables.wire import HEADER_LSN, avro_body

log = logging.getLogger("headwater.streams")
KEY_STRING = fastavro.parse_schema("string")
Frames = tuple[bytes, bytes]  # the cut value's and key's Confluent frames


class Delivered(Pending):
    """A ``Pending`` that also remembers the end offset of every partition it wrote to."""

    __slots__ = ("ends",)

    def __init__(self) -> None:
        super().__init__()
        self.ends: dict[tuple[str, int], int] = {}

    def delivered(self, error: KafkaError | None, msg: Any) -> None:
        super().delivered(error, msg)
        if error is None:
            at = (msg.topic(), msg.partition())
            self.ends[at] = max(self.ends.get(at, 0), msg.offset() + 1)


@dataclass
class PendingCut:
    """A consistent point whose rows are on their way to Kafka."""

    lsn: int
    delivered: Delivered


class Cuts:
    """View rows out, and each consistent point's cuts once Kafka acknowledged its rows."""

    def __init__(self, producer: Producer, topic: str, views: dict[str, str],
                 frames: Callable[[], Frames]) -> None:  # fmt: skip
        self.producer = producer
        self.topic = topic  # the cuts topic
        self.views = views  # view name -> its topic
        self.frames = frames  # registers the cut schemas when first needed
        self.ends: dict[str, dict[int, int]] = {name: {} for name in views}
        self.lock = threading.Lock()  # guards ends and cut
        self.cut: int | None = None  # commit LSN of the last cut published
        self.failed: KafkaError | None = None
        self.pending: deque[PendingCut] = deque()
        self.current = Delivered()
        self.stopping = threading.Event()
        self.poller: threading.Thread | None = None

    def write(self, topic: str, partition: int, key: bytes, value: bytes | None, headers: list[Any]) -> None:
        if self.failed is not None:
            raise FatalError(f"Kafka refused a view row: {self.failed}",
                             hint="check the broker log and the view topics' settings")  # fmt: skip
        self.current.outstanding += 1
        produce(self.producer, topic, partition, key, value, headers, self.current.delivered)

    def point(self, lsn: int) -> None:
        """Close the current point at ``lsn``: its cuts follow once its rows are acknowledged."""
        self.pending.append(PendingCut(lsn, self.current))
        self.current = Delivered()
        if self.poller is None:
            self.poller = threading.Thread(target=self._poll, name="headwater-view-cuts", daemon=True)
            self.poller.start()

    def reached(self, view: str, ends: dict[int, int]) -> None:
        """The view topic holds at least ``ends`` (read back at a start)."""
        with self.lock:
            held = self.ends[view]
            for partition, end in ends.items():
                held[partition] = max(held.get(partition, 0), end)

    def last(self) -> int | None:
        with self.lock:
            return self.cut

    def _poll(self) -> None:
        while not self.stopping.is_set():
            self.producer.poll(0.005)
            while self.pending and self.pending[0].delivered.outstanding <= 0:
                point = self.pending.popleft()
                if point.delivered.failed is not None:
                    self.failed = point.delivered.failed
                    log.error("Kafka refused a view row (%s): no more cuts are published", self.failed)
                    return
                self._publish(point)

    def _publish(self, point: PendingCut) -> None:
        value_frame, key_frame = self.frames()
        for name, topic in self.views.items():
            self.reached(name, {p: end for (t, p), end in point.delivered.ends.items() if t == topic})
            with self.lock:
                ends = [{"partition": p, "offset": o} for p, o in sorted(self.ends[name].items())]
            value = value_frame + avro_body(CUT_PARSED, {"view": name, "commit_lsn": point.lsn, "topic": topic,
                                                         "ends": ends})  # fmt: skip
            key = key_frame + avro_body(KEY_STRING, name)
            produce(self.producer, self.topic, CUTS_PARTITION, key, value, [(HEADER_LSN, b"%d" % point.lsn)])
        with self.lock:
            self.cut = point.lsn

    def close(self, timeout: float = 10.0) -> None:
        """Stop the poller (cuts not yet published are published by the next run) and flush."""
        self.stopping.set()
        if self.poller is not None:
            self.poller.join(timeout)
            self.poller = None
        self.producer.flush(timeout)

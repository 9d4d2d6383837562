"""Kafka, looked at from a thread and a client of its own while capture copies a snapshot.

Promise: during the snapshot the rows go out from C senders in worker processes, out of sight of
capture's own producer, which sends nothing until the snapshot ends; so while capture's phase is
``snapshot`` a ``KafkaWatch`` asks the broker for the raw topic's metadata every
``KAFKA_EVERY`` seconds (a librdkafka client made from capture's producer settings, so the same
security settings) and tells ``CaptureMetrics.kafka`` whether it answered within
``ANSWER_WITHIN`` seconds. An outage is then logged as it is while streaming: once when it has
lasted ``BROKER_WARN_AFTER`` seconds and once when Kafka answers again, with
``headwater_capture_broker_reachable`` at 0 meanwhile. In every other phase it only waits:
capture's own producer judges Kafka then. It runs beside capture's probe
(``capture.metrics.Probe(beside=...)``), so it starts after the snapshot workers are forked.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from confluent_kafka import KafkaException, Producer

from capture.config import CaptureConfig
from capture.metrics import CaptureMetrics
from capture.producer import producer_settings

log = logging.getLogger("headwater.capture")
KAFKA_EVERY = 1.0  # seconds between two looks while the snapshot is copied
ANSWER_WITHIN = 3.0  # seconds a metadata request may take before Kafka counts as not answering


class KafkaWatch(threading.Thread):
    def __init__(self, cfg: CaptureConfig, metrics: CaptureMetrics) -> None:
        super().__init__(name="headwater-kafka-watch", daemon=True)
        self.cfg, self.metrics = cfg, metrics
        self.stopping = threading.Event()
        self.client: Any = None

    def run(self) -> None:
        while not self.stopping.wait(KAFKA_EVERY):
            if self.metrics.phase == "snapshot":
                self.look()

    def look(self) -> None:
        """One metadata request; its answer (or none, since it was asked: the episode keeps its first) goes to
        the metrics."""
        started = time.monotonic()
        detail = self.ask()
        if self.client is not None:
            self.client.poll(0)  # its log lines (the Kafka gate counts the connection failures)
        self.metrics.kafka(None if detail is None else (started, detail), 0, time.monotonic())

    def ask(self) -> str | None:
        """None when the broker told the raw topic's metadata in time; else what it did instead."""
        try:
            if self.client is None:
                self.client = Producer(producer_settings(self.cfg))
            self.client.list_topics(self.cfg.changes_topic, timeout=ANSWER_WITHIN)
        except KafkaException as exc:
            return f"no metadata within {ANSWER_WITHIN:.0f} s: {exc.args[0].str() if exc.args else exc}"
        return None

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=10)
        self.client = None

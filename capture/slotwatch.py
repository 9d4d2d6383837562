"""The replication slot, looked at from a thread and a connection of its own, in every phase.

Promise: while capture runs — setting up, copying a snapshot, streaming, reconnecting, or stuck
waiting on Kafka — a ``SlotWatch`` reads the slot's row (``capture.slot.find``) every
``SLOT_EVERY`` status intervals (at least every second) and hands it to ``CaptureMetrics.slot``:
WAL retained, lag, confirmed and current position, and the ``slot_warn_bytes`` lines. A look that
fails (PostgreSQL away) drops the connection and tries again at the next look, quietly: the
session says why it fails. Before the slot exists there is nothing to show, so nothing is.
It runs beside capture's probe (``capture.metrics.Probe(beside=...)``), started with it: after the
snapshot workers are forked, which happens only while capture has a single thread.
"""

from __future__ import annotations

import logging
import threading

import psycopg2

from capture import catalog
from capture import slot as slots
from capture.config import CaptureConfig
from capture.metrics import CaptureMetrics
from tables.errors import HeadwaterError

log = logging.getLogger("headwater.capture")
SLOT_EVERY = 5  # status intervals between looks at the slot


class SlotWatch(threading.Thread):
    def __init__(self, cfg: CaptureConfig, metrics: CaptureMetrics) -> None:
        super().__init__(name="headwater-slot", daemon=True)
        self.cfg, self.metrics = cfg, metrics
        self.every = max(SLOT_EVERY * cfg.status_interval, 1.0)
        self.stopping = threading.Event()
        self.conn: catalog.Connection | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                self.look()
                self.stopping.wait(self.every)
        finally:
            self.close()

    def look(self) -> None:
        """One look at the slot (a failure is left for the next look)."""
        try:
            if self.conn is None or self.conn.closed:
                self.conn = catalog.connect(self.cfg.dsn.reveal())
            info = slots.find(self.conn, self.cfg.slot)
        except (psycopg2.Error, HeadwaterError) as exc:
            log.debug("cannot look at slot %s now: %s", self.cfg.slot, exc)
            self.close()
            return
        if info is not None:
            self.metrics.slot(info.retained_bytes, info.lag_bytes, info.confirmed_lsn or 0, info.current_lsn)

    def close(self) -> None:
        if self.conn is not None and not self.conn.closed:
            self.conn.close()
        self.conn = None

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=10)

"""Capture's metrics, health and readiness, and the lines it logs once per episode.

Promise: ``CaptureMetrics`` is the one place capture's metric names are written (Prometheus
conventions: ``headwater_capture_..._total`` counters, ``_bytes``, ``_seconds``), in a registry of
its own with the process's CPU, memory and file descriptors. Capture feeds it per transaction
and per status interval, never per message. It also knows what capture is doing — starting,
copying the snapshot, streaming, reconnecting, stopping — and whether Kafka answers, so
``ready()`` is None when capture streams with Kafka reachable, else the reason; and it logs at
WARNING, once when each begins and once when it ends: a reconnect, Kafka unreachable (for
``BROKER_WARN_AFTER`` seconds), the slot holding more WAL than ``[capture] slot_warn_bytes``.
``snapshot_rows(kind, table, read, expected)`` is the hook for any copy of table rows
(``kind`` ``snapshot`` today; incremental snapshots and backfills report the same way).

``Probe`` serves ``GET /metrics`` (Prometheus text format), ``GET /health`` (200 while the
process runs) and ``GET /ready`` (200, or 503 with the reason) on ``[capture] metrics_host:
metrics_port`` — 127.0.0.1 unless configured, off when the port is 0.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from capture.changes import UNIX_FROM_PG_MICROS, ChangeSink
from capture.config import CaptureConfig
from tables.errors import FatalError
from tables.logs import Episode, facts
from tables.wire import lsn_text

if TYPE_CHECKING:  # prometheus_client reads /proc when imported: imported when metrics are made, not at import
    from prometheus_client import Counter, Gauge

log = logging.getLogger("headwater.capture")
BROKER_WARN_AFTER = 5.0  # seconds Kafka must be unreachable before it is logged (and /ready says so)
STALL_AFTER = 2.0  # seconds messages may wait with no acknowledgement before Kafka counts as not answering


# attribute, type, name, help, labels: every metric capture exposes (names are a contract: here only)
FAMILIES: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("confirmed_lsn", "gauge", "headwater_capture_confirmed_lsn",
     "LSN the slot was last confirmed up to (every commit below it is in Kafka)", ()),
    ("server_lsn", "gauge", "headwater_capture_server_lsn", "the server's WAL position as last reported", ()),
    ("retained", "gauge", "headwater_capture_slot_retained_bytes",
     "WAL the server keeps for the slot (current position minus the slot's restart_lsn)", ()),
    ("slot_lag", "gauge", "headwater_capture_slot_lag_bytes",
     "current WAL position minus the slot's confirmed LSN", ()),
    ("behind", "gauge", "headwater_capture_behind_source_seconds",
     "when the last captured transaction arrived, how long after its commit (Debezium's MilliSecondsBehindSource)",
     ()),
    ("last_commit", "gauge", "headwater_capture_last_commit_timestamp_seconds",
     "commit time of the last captured transaction (Unix time)", ()),
    ("events", "counter", "headwater_capture_events", "changes written to the raw topic", ("table", "op")),
    ("transactions", "counter", "headwater_capture_transactions", "source transactions written", ()),
    ("queue", "gauge", "headwater_capture_producer_queue_messages",
     "messages in the producer's queue, not yet acknowledged by Kafka", ()),
    ("queue_max", "gauge", "headwater_capture_producer_queue_max_messages",
     "the producer queue's capacity (queue.buffering.max.messages)", ()),
    ("delivery_errors", "counter", "headwater_capture_delivery_errors",
     "messages Kafka refused or that timed out (each ends the session; capture resumes from the slot)", ()),
    ("heartbeats", "counter", "headwater_capture_heartbeats", "heartbeats written to keep the slot moving", ()),
    ("reconnects", "counter", "headwater_capture_reconnects",
     "sessions started again after a transient failure (PostgreSQL or Kafka)", ()),
    ("streaming", "gauge", "headwater_capture_streaming", "1 while capture streams from the slot", ()),
    ("broker_up", "gauge", "headwater_capture_broker_reachable", "0 while Kafka does not answer", ()),
    ("rows_read", "gauge", "headwater_capture_snapshot_rows_read",
     "rows copied by the running or last snapshot, per table (kind: snapshot, backfill)", ("kind", "table")),
    ("rows_expected", "gauge", "headwater_capture_snapshot_rows_expected",
     "rows the snapshot expects to copy (PostgreSQL's estimate, or the rows copied if more)", ("kind", "table")),
)  # fmt: skip


class CaptureMetrics:
    """Capture's metric families, its phase for ``/ready``, and its once-per-episode lines."""

    confirmed_lsn: Gauge
    server_lsn: Gauge
    retained: Gauge
    slot_lag: Gauge
    behind: Gauge
    last_commit: Gauge
    events: Counter
    transactions: Counter
    queue: Gauge
    queue_max: Gauge
    delivery_errors: Counter
    heartbeats: Counter
    reconnects: Counter
    streaming: Gauge
    broker_up: Gauge
    rows_read: Gauge
    rows_expected: Gauge

    def __init__(self, cfg: CaptureConfig, version: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Info, PlatformCollector, ProcessCollector

        self.cfg = cfg
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        Info("headwater_capture", "what this capture reads and writes", registry=r).info(
            {"slot": cfg.slot, "publication": cfg.publication, "topic": cfg.changes_topic, "version": version})
        kinds = {"counter": Counter, "gauge": Gauge}
        for attribute, kind, name, doc, labels in FAMILIES:
            setattr(self, attribute, kinds[kind](name, doc, labels, registry=r))
        self.broker_up.set(1)
        self.phase = "starting"
        self.broker = Episode(after=BROKER_WARN_AFTER)
        self.slot_high = Episode()
        self.outage = Episode()  # a reconnect: from the first failure until streaming again
        self.failures = 0  # failed attempts in the current reconnect episode

    # ---- what capture does ---------------------------------------------------------------
    def ready(self) -> str | None:
        """None when capture streams and Kafka answers; else why not (the body of a 503)."""
        if self.phase != "streaming":
            return self.phase
        if self.broker.announced:
            return f"Kafka at {self.cfg.bootstrap} does not answer"
        return None

    def snapshot_rows(self, kind: str, table: str, read: int, expected: int) -> None:
        """Progress of a copy of ``table``'s rows (the snapshot; later incremental snapshots and backfills)."""
        self.rows_read.labels(kind, table).set(read)
        self.rows_expected.labels(kind, table).set(max(read, expected))

    def snapshot(self, started: bool) -> None:
        self.phase = "copying the snapshot" if started else "starting"

    def stream_started(self) -> None:
        """The session streams: a reconnect episode (if any) ends here."""
        self.phase = "streaming"
        self.streaming.set(1)
        now = time.monotonic()
        lasted = self.outage.lasted(now)
        if self.outage.update(False, now) == "ended":
            log.warning("reconnected after %.0f s and %d failed attempts: streaming from slot %s again", lasted,
                        self.failures, self.cfg.slot, extra=facts(slot=self.cfg.slot, seconds=round(lasted, 1)))
        self.failures = 0

    def session_failed(self, exc: BaseException, delay: float) -> None:
        """A transient failure: the first of an episode at WARNING, the retries at INFO."""
        self.phase = f"reconnecting after: {exc}"
        self.streaming.set(0)
        self.failures += 1
        self.reconnects.inc()
        if self.outage.update(True, time.monotonic()) == "began":
            log.warning("%s; reconnecting (retrying every 1-30 s; logged again once streaming)", exc,
                        extra=facts(slot=self.cfg.slot, error=type(exc).__name__))  # fmt: skip
        else:
            log.info("still failing (%s); retrying in %.0f s", exc, delay)

    def stopped(self) -> None:
        self.phase = "stopping"
        self.streaming.set(0)

    # ---- per transaction and per status interval ----------------------------------------
    def count(self, sink: ChangeSink) -> None:
        """Take what was counted since the last call: changes by (schema, table, op) (the writer's and the
        sink's: snapshot reads, retractions), transactions."""
        counts = sink.writer.take_counts()
        counts.update(sink.tally)
        sink.tally.clear()
        for (schema, table, op), n in counts.items():
            self.events.labels(f"{schema}.{table}", op).inc(n)
        if sink.transactions:
            self.transactions.inc(sink.transactions)
            sink.transactions = 0

    def positions(self, confirmed: int, server: int) -> None:
        self.confirmed_lsn.set(confirmed)
        if server:
            self.server_lsn.set(server)

    def commit_seen(self, pg_time: int, seen_monotonic: float) -> None:
        """The last captured commit (PostgreSQL µs) and when it arrived (monotonic)."""
        if not pg_time:
            return
        committed = (pg_time + UNIX_FROM_PG_MICROS) / 1e6
        arrived = time.time() - (time.monotonic() - seen_monotonic)
        self.last_commit.set(committed)
        self.behind.set(max(arrived - committed, 0.0))

    def producer(self, waiting: int, capacity: int) -> None:
        self.queue.set(waiting)
        self.queue_max.set(capacity)

    def kafka(self, down: bool, detail: str, waiting: int, now: float) -> None:
        """Whether Kafka answers now; logs the episode's beginning and end."""
        change = self.broker.update(down, now)
        if change == "began":
            self.broker_up.set(0)
            log.warning("Kafka at %s does not answer (%s); %d messages wait, nothing is lost: capture confirms "
                        "nothing past them and goes on once Kafka is back", self.cfg.bootstrap,
                        detail or "no acknowledgement", waiting,
                        extra=facts(topic=self.cfg.changes_topic, seconds=round(self.broker.lasted(now), 1)))
        elif change == "ended":
            self.broker_up.set(1)
            log.warning("Kafka at %s answers again", self.cfg.bootstrap, extra=facts(topic=self.cfg.changes_topic))

    def slot(self, retained: int, lag: int, confirmed: int) -> None:
        """The slot's WAL, with a WARNING when it passes ``slot_warn_bytes`` and when it is back under."""
        self.retained.set(retained)
        self.slot_lag.set(lag)
        limit = self.cfg.slot_warn_bytes
        change = self.slot_high.update(limit > 0 and retained > limit, time.monotonic())
        where = facts(slot=self.cfg.slot, lsn=confirmed)
        if change == "began":
            log.warning("slot %s holds %d bytes of WAL, above slot_warn_bytes (%d): capture is behind (confirmed "
                        "up to %s) and the server keeps the WAL until it catches up", self.cfg.slot, retained, limit,
                        lsn_text(confirmed), extra=where)  # fmt: skip
        elif change == "ended":
            log.warning("slot %s is back under slot_warn_bytes (%d bytes of WAL retained)", self.cfg.slot, retained,
                        extra=where)  # fmt: skip


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    """No line per request (a scrape every few seconds would fill the log)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Probe:
    """``/metrics``, ``/health`` and ``/ready`` over HTTP (see the module promise)."""

    def __init__(self, cfg: CaptureConfig, metrics: CaptureMetrics) -> None:
        from prometheus_client import make_wsgi_app

        self.cfg, self.metrics = cfg, metrics
        self.prometheus = make_wsgi_app(metrics.registry)
        self.server: _Server | None = None

    def start(self) -> None:
        """Listen (once; a port of 0 turns the probe off). A port in use is a ``FatalError`` naming it."""
        if self.server is not None or not self.cfg.metrics_port:
            return
        host, port = self.cfg.metrics_host, self.cfg.metrics_port
        try:
            self.server = make_server(host, port, self.app, _Server, _Quiet)
        except OSError as exc:
            raise FatalError(f"cannot serve metrics on {host}:{port}: {exc.strerror}",
                             hint="set [capture] metrics_port to a free port (0 turns it off)") from exc  # fmt: skip
        threading.Thread(target=self.server.serve_forever, name="headwater-metrics", daemon=True).start()
        log.info("metrics on http://%s:%d/metrics, health on /health and /ready", host, port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return list(self.prometheus(environ, start_response))
        if path == "/health":
            return answer(start_response, 200, {"status": "alive", "phase": self.metrics.phase})
        if path == "/ready":
            reason = self.metrics.ready()
            return answer(start_response, 503 if reason else 200, {"ready": reason is None, "reason": reason})
        return answer(start_response, 404, {"error": "not found: try /metrics, /health or /ready"})


STATUS = {200: "200 OK", 404: "404 Not Found", 503: "503 Service Unavailable"}


def answer(start_response: Callable[..., Any], status: int, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(STATUS[status], [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]

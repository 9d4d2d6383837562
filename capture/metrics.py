"""Capture's metrics, health and readiness, and the lines it logs once per episode.

Promise: ``CaptureMetrics`` is the one place capture's metric names are written (Prometheus
conventions: ``headwater_capture_..._total`` counters, ``_bytes``, ``_seconds``), in a registry of
its own with the process's CPU, memory and file descriptors. Capture feeds it per transaction
and per status interval, never per message; changes and transactions are counted once Kafka
acknowledged them (a change sent again after a reconnect is counted again: it is on the topic
twice). A value capture does not know yet — positions and the slot's WAL before the first look,
the time behind the source before the first transaction, whether Kafka answers before the first
check — has no sample rather than a made-up 0 or 1. It knows what capture is doing (``phase``:
starting, snapshot, streaming, reconnecting, stopping) and whether Kafka answers, so ``ready()``
is None when capture streams with Kafka answering, else the reason; ``silent_for`` says how long
capture's own thread has given no sign (``/health`` fails past ``wedged_after``); and it logs at
WARNING, once when each begins and once when it ends: a reconnect, Kafka not answering (for
``BROKER_WARN_AFTER`` seconds, counted from when it stopped answering), the slot holding more
WAL than ``[capture] slot_warn_bytes``. ``snapshot_rows(kind, table, read, expected)`` is the
hook for any copy of table rows (``kind`` ``snapshot`` today; incremental snapshots and
backfills report the same way).

``Probe`` serves ``GET /metrics`` (Prometheus text format), ``GET /health`` (200 while the
process runs and its capture thread gives signs of life) and ``GET /ready`` (200, or 503 with the
reason) on ``[capture] metrics_host:metrics_port`` — 127.0.0.1 unless configured, off when the port
is 0 — and starts and stops the threads that feed it from beside capture's (the slot watch).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from capture.changes import UNIX_FROM_PG_MICROS, ChangeSink
from capture.config import CaptureConfig
from capture.producer import ChangeProducer, producer_settings
from tables.errors import FatalError
from tables.logs import Episode, facts
from tables.wire import lsn_text

if TYPE_CHECKING:  # prometheus_client reads /proc when imported: imported when metrics are made, not at import
    from prometheus_client import Counter, Gauge
    from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("headwater.capture")
BROKER_WARN_AFTER = 5.0  # seconds Kafka must not answer before it is logged (and /ready says so)
PHASES = ("starting", "snapshot", "streaming", "reconnecting", "stopping")


# attribute, type, name, help, labels: every metric capture exposes (names are a contract: here only).
# "known": a gauge with no sample until capture knows its value.
FAMILIES: tuple[tuple[str, str, str, str, tuple[str, ...]], ...] = (
    ("confirmed_lsn", "known", "headwater_capture_confirmed_lsn",
     "LSN the slot was last confirmed up to (every commit below it is in Kafka)", ()),
    ("server_lsn", "known", "headwater_capture_server_lsn", "the server's WAL position as last reported", ()),
    ("retained", "known", "headwater_capture_slot_retained_bytes",
     "WAL the server keeps for the slot (current position minus the slot's restart_lsn)", ()),
    ("slot_lag", "known", "headwater_capture_slot_lag_bytes",
     "current WAL position minus the slot's confirmed LSN", ()),
    ("behind", "known", "headwater_capture_behind_source_seconds",
     "when the last captured transaction arrived, how long after its commit (Debezium's MilliSecondsBehindSource)",
     ()),
    ("last_commit", "known", "headwater_capture_last_commit_timestamp_seconds",
     "commit time of the last captured transaction (Unix time)", ()),
    ("events", "counter", "headwater_capture_events",
     "changes Kafka acknowledged on the raw topic (a change sent again after a reconnect counts again)",
     ("table", "op")),
    ("transactions", "counter", "headwater_capture_transactions",
     "source transactions whose changes Kafka acknowledged", ()),
    ("queue", "gauge", "headwater_capture_producer_queue_messages",
     "messages in the producer's queue, not yet acknowledged by Kafka", ()),
    ("queue_max", "gauge", "headwater_capture_producer_queue_max_messages",
     "the producer queue's capacity (queue.buffering.max.messages)", ()),
    ("delivery_errors", "counter", "headwater_capture_delivery_errors",
     "messages Kafka refused or that timed out (each ends the session or the snapshot)", ()),
    ("heartbeats", "counter", "headwater_capture_heartbeats", "heartbeats written to keep the slot moving", ()),
    ("reconnects", "counter", "headwater_capture_reconnects",
     "sessions started again after a transient failure (PostgreSQL or Kafka)", ()),
    ("streaming", "gauge", "headwater_capture_streaming", "1 while capture streams from the slot", ()),
    ("phase", "phase", "headwater_capture_phase",
     "1 for what capture does now: starting, snapshot, streaming, reconnecting or stopping", ("phase",)),
    ("broker_up", "known", "headwater_capture_broker_reachable",
     "1 while Kafka answers, 0 once it has not for 5 s (no sample before the first check)", ()),
    ("last_report", "known", "headwater_capture_last_report_timestamp_seconds",
     "when capture's own thread last gave a sign of life (Unix time; /health fails when it is too old)", ()),
    ("rows_read", "gauge", "headwater_capture_snapshot_rows_read",
     "rows copied by the running or last snapshot, per table (kind: snapshot, backfill)", ("kind", "table")),
    ("rows_expected", "gauge", "headwater_capture_snapshot_rows_expected",
     "rows the snapshot expects to copy (PostgreSQL's estimate, or the rows copied if more)", ("kind", "table")),
)  # fmt: skip
NAMES = {attribute: name + ("_total" if kind == "counter" else "") for attribute, kind, name, _, _ in FAMILIES}


def wedged_after(cfg: CaptureConfig) -> float | None:
    """Seconds capture's thread may give no sign before ``/health`` fails: the longest it may rightly wait —
    on librdkafka, for ``message.timeout.ms`` — and a minute more. None when messages never time out."""
    settings = producer_settings(cfg)
    timeout = float(settings.get("delivery.timeout.ms", settings.get("message.timeout.ms", 300000)))
    return None if timeout <= 0 else max(timeout / 1000, 60.0) + 60.0


class CaptureMetrics:
    """Capture's metric families, its phase for ``/ready``, and its once-per-episode lines."""

    events: Counter
    transactions: Counter
    queue: Gauge
    queue_max: Gauge
    delivery_errors: Counter
    heartbeats: Counter
    reconnects: Counter
    streaming: Gauge
    rows_read: Gauge
    rows_expected: Gauge

    def __init__(self, cfg: CaptureConfig, version: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Info, PlatformCollector, ProcessCollector

        self.cfg = cfg
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        Info("headwater_capture", "what this capture reads and writes", registry=r).info(
            {"slot": cfg.slot, "publication": cfg.publication, "topic": cfg.changes_topic, "version": version}
        )
        kinds = {"counter": Counter, "gauge": Gauge}
        for attribute, kind, name, doc, labels in FAMILIES:
            if kind in kinds:
                setattr(self, attribute, kinds[kind](name, doc, labels, registry=r))
        self.known: dict[str, float] = {}  # the "known" gauges' values, once known
        r.register(_Collector(self))
        self.phase, self.reason = "starting", "starting"
        self.broker = Episode(after=BROKER_WARN_AFTER)
        self.broker_lock = threading.Lock()  # capture's thread and, during the snapshot, capture.kafkawatch
        self.slot_high = Episode()
        self.outage = Episode()  # a reconnect: from the first failure until streaming again
        self.failures = 0  # failed attempts in the current reconnect episode
        self.held: deque[tuple[int, Tally[tuple[str, str, str]], int]] = deque()  # sent, not yet acknowledged
        self.errors_counted: tuple[ChangeProducer | None, int] = (None, 0)  # (producer, its errors counted)
        self.wedged_after = wedged_after(cfg)
        self.beat_at = time.monotonic()

    # ---- what capture does ---------------------------------------------------------------
    def ready(self) -> str | None:
        """None when capture streams and Kafka answers; else why not (the body of a 503)."""
        if self.phase != "streaming":
            return self.reason
        if self.broker.announced:
            return f"Kafka at {self.cfg.bootstrap} does not answer"
        return None

    def beat(self) -> None:
        """Capture's own thread is alive: it reports, waits on Kafka with a look every second, or copies."""
        self.beat_at = time.monotonic()
        self.known["last_report"] = time.time()

    def silent_for(self) -> float:
        """Seconds since capture's own thread last gave a sign of life."""
        return time.monotonic() - self.beat_at

    def _enter(self, phase: str, reason: str) -> None:
        self.phase, self.reason = phase, reason
        self.streaming.set(1 if phase == "streaming" else 0)
        self.beat()

    def snapshot_rows(self, kind: str, table: str, read: int, expected: int) -> None:
        """Progress of a copy of ``table``'s rows (the snapshot; later incremental snapshots and backfills)."""
        self.rows_read.labels(kind, table).set(read)
        self.rows_expected.labels(kind, table).set(max(read, expected))
        self.beat()

    def snapshot(self, started: bool) -> None:
        self._enter(*(("snapshot", "copying the snapshot") if started else ("starting", "starting")))

    def stream_started(self) -> None:
        """The session streams: a reconnect episode (if any) ends here."""
        self._enter("streaming", "streaming")
        now = time.monotonic()
        lasted = self.outage.lasted(now)
        if self.outage.update(False, now) == "ended":
            log.warning(
                "reconnected after %.0f s and %d failed attempts: streaming from slot %s again",
                lasted,
                self.failures,
                self.cfg.slot,
                extra=facts(slot=self.cfg.slot, seconds=round(lasted, 1)),
            )
        self.failures = 0

    def session_failed(self, exc: BaseException, delay: float) -> None:
        """A transient failure: the first of an episode at WARNING, the retries at INFO."""
        self._enter("reconnecting", f"reconnecting after: {exc}")
        self.failures += 1
        self.reconnects.inc()
        if self.outage.update(True, time.monotonic()) == "began":
            log.warning("%s; reconnecting (retrying every 1-30 s; logged again once streaming)", exc,
                        extra=facts(slot=self.cfg.slot, error=type(exc).__name__))  # fmt: skip
        else:
            log.info("still failing (%s); retrying in %.0f s", exc, delay)

    def stopped(self) -> None:
        self._enter("stopping", "stopping")

    # ---- per status interval, and while waiting on Kafka ------------------------------------
    def count(self, sink: ChangeSink, producer: ChangeProducer) -> None:
        """Take what was counted since the last call — changes by (schema, table, op) (the writer's and the
        sink's: snapshot reads, retractions), transactions — and add what Kafka acknowledged since."""
        counts = sink.writer.take_counts()
        counts.update(sink.tally)
        sink.tally.clear()
        if counts or sink.transactions:
            self.held.append((producer.sent, counts, sink.transactions))
            sink.transactions = 0
        acked = producer.acknowledged()
        while self.held and self.held[0][0] <= acked:
            _, done, transactions = self.held.popleft()
            for (schema, table, op), n in done.items():
                self.events.labels(f"{schema}.{table}", op).inc(n)
            if transactions:
                self.transactions.inc(transactions)

    def session_ended(self, sink: ChangeSink | None, producer: ChangeProducer) -> None:
        """The session's producer is done: count what it had acknowledged; the rest is sent again (or lost)."""
        if sink is not None:
            self.count(sink, producer)
        self.held.clear()
        self.delivered(producer)

    def delivered(self, producer: ChangeProducer) -> None:
        """Add ``producer``'s failed deliveries since the last call."""
        counted, before = self.errors_counted
        new = producer.delivery_errors - (before if counted is producer else 0)
        if new > 0:
            self.delivery_errors.inc(new)
        self.errors_counted = (producer, producer.delivery_errors)

    def positions(self, confirmed: int, server: int) -> None:
        self.known["confirmed_lsn"] = confirmed
        if server:
            self.known["server_lsn"] = server

    def commit_seen(self, pg_time: int, seen_monotonic: float) -> None:
        """The last captured commit (PostgreSQL µs) and when it arrived (monotonic)."""
        if not pg_time:
            return
        committed = (pg_time + UNIX_FROM_PG_MICROS) / 1e6
        arrived = time.time() - (time.monotonic() - seen_monotonic)
        self.known["last_commit"] = committed
        self.known["behind"] = max(arrived - committed, 0.0)

    def watch_producer(self, producer: ChangeProducer, now: float) -> None:
        """The producer's queue and failed deliveries, and whether Kafka answers (from capture's thread, every
        second: from the loop, and from a send or flush that waits on Kafka)."""
        waiting = producer.waiting()
        self.queue.set(waiting)
        self.queue_max.set(producer.queue_max)
        self.delivered(producer)
        self.kafka(producer.silence(now), waiting, now)
        self.beat()

    def kafka(self, silence: tuple[float, str] | None, waiting: int, now: float) -> None:
        """Whether Kafka answers now (``silence``: since when it does not, and how that shows); logs the
        episode's beginning and end."""
        since, detail = silence if silence is not None else (None, "")
        with self.broker_lock:
            change = self.broker.update(silence is not None, now, since)
            lasted = self.broker.lasted(now)
        self.known["broker_up"] = 0 if self.broker.announced else 1
        if change == "began":
            waits = ("the snapshot's rows wait in its senders (it fails if Kafka stays away past their "
                     "message.timeout.ms)" if self.phase == "snapshot" else
                     f"{waiting} messages wait, nothing is lost: capture confirms nothing past them")  # fmt: skip
            log.warning("Kafka at %s does not answer (%s, for %.0f s); %s and goes on once Kafka is back",
                        self.cfg.bootstrap, detail, lasted, waits,
                        extra=facts(topic=self.cfg.changes_topic, seconds=round(lasted, 1)))  # fmt: skip
        elif change == "ended":
            log.warning("Kafka at %s answers again", self.cfg.bootstrap, extra=facts(topic=self.cfg.changes_topic))

    def slot(self, retained: int, lag: int, confirmed: int, current: int) -> None:
        """The slot as PostgreSQL shows it (``capture.slotwatch``, in every phase), with a WARNING when its WAL
        passes ``slot_warn_bytes`` and when it is back under."""
        self.known.update(retained=retained, slot_lag=lag)
        if self.phase != "streaming" or "confirmed_lsn" not in self.known:  # while streaming, the loop's are newer
            self.known.update(confirmed_lsn=confirmed, server_lsn=current)
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


class _Collector:
    """The "known" gauges (a sample once known) and the phase, read when Prometheus scrapes."""

    def __init__(self, metrics: CaptureMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        known, phase = dict(self.metrics.known), self.metrics.phase
        for attribute, kind, name, doc, labels in FAMILIES:
            if kind == "known":
                family = GaugeMetricFamily(name, doc)
                if attribute in known:
                    family.add_metric([], known[attribute])
                yield family
            elif kind == "phase":
                family = GaugeMetricFamily(name, doc, labels=labels)
                for each in PHASES:
                    family.add_metric([each], 1 if each == phase else 0)
                yield family


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    """No line per request (a scrape every few seconds would fill the log)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Beside(Protocol):
    """A thread that runs beside capture's own (``capture.slotwatch.SlotWatch``)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class Probe:
    """``/metrics``, ``/health`` and ``/ready`` over HTTP (see the module promise), and the threads that feed
    it from beside capture's own (``beside``: started with it, after capture forked its snapshot workers)."""

    def __init__(self, cfg: CaptureConfig, metrics: CaptureMetrics, beside: list[Beside] | None = None) -> None:
        from prometheus_client import make_wsgi_app

        self.cfg, self.metrics, self.beside = cfg, metrics, beside or []
        self.prometheus = make_wsgi_app(metrics.registry)
        self.server: _Server | None = None
        self.started = False

    def start(self) -> None:
        """Start the threads beside and listen (once; a port of 0 turns the HTTP side off). A port in use is a
        ``FatalError`` naming it."""
        if self.started:
            return
        self.started = True
        for thread in self.beside:
            thread.start()
        if not self.cfg.metrics_port:
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
        for thread in self.beside:
            thread.stop()
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return list(self.prometheus(environ, start_response))
        if path == "/health":
            return self.health(start_response)
        if path == "/ready":
            reason = self.metrics.ready()
            return answer(start_response, 503 if reason else 200, {"ready": reason is None, "reason": reason})
        return answer(start_response, 404, {"error": "not found: try /metrics, /health or /ready"})

    def health(self, start_response: Callable[..., Any]) -> list[bytes]:
        """200 while capture's thread gives signs of life; 503 once it has been silent past ``wedged_after``."""
        m = self.metrics
        silent, limit = m.silent_for(), m.wedged_after
        wedged = limit is not None and silent > limit
        body = {"status": "wedged" if wedged else "alive", "phase": m.phase, "silent_seconds": round(silent, 1)}
        return answer(start_response, 503 if wedged else 200, body)


STATUS = {200: "200 OK", 404: "404 Not Found", 503: "503 Service Unavailable"}


def answer(start_response: Callable[..., Any], status: int, body: dict[str, Any]) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(STATUS[status], [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]

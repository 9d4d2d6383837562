"""The stream workers' metrics, and the lines they log once per episode.

Promise: ``StreamsMetrics`` is the one place the workers' metric names are written (Prometheus
conventions: ``headwater_streams_..._total`` counters, ``_bytes``, ``_seconds``), in a registry of
its own with the process's CPU, memory and file descriptors; the endpoint serves it at
``/metrics``. Counters are added per batch, never per message (``fanned``, ``applied``). What the
engine already knows — how far each reader is in the raw topic, the table partitions' rows and
offsets, the published cut, what Redis shows — is read when Prometheus scrapes (``Sources``), so
it costs nothing on the hot paths; each stage (fan-out, views, Redis mirror) counts the seconds it
was busy and the CPU its thread spent (``spent``), so its capacity is what it handled over them.
``CutWatch`` is the age of the views' cut: 0 while the cut holds everything the views applied,
else the seconds since it last moved with changes waiting; past ``[streams] cut_warn_after`` it
logs a WARNING once, and once more when the cut moves again.
``Watcher`` runs the workers' periodic checks (the cut's age, Kafka unreachable) on a thread of
its own, every second, so they are made even while a feed is stuck. Nothing here imports Faust.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tables.logs import KAFKA_GATE, Episode, facts
from tables.wire import lsn_text

if TYPE_CHECKING:  # prometheus_client reads /proc when imported: imported when metrics are made, not at import
    from prometheus_client import Counter
    from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("headwater.streams")
KAFKA_WARN_AFTER = 5.0  # seconds of librdkafka connection failures before a WARNING
KAFKA_QUIET = 15.0  # seconds without a failure that end the episode (librdkafka retries at most every 10 s)


@dataclass
class Sources:
    """What the collector reads at scrape time (the engine fills these in; each returns current values)."""

    raw: Callable[[], Mapping[str, tuple[int, int]]] = dict  # reader -> (next raw offset, end as fetched)
    tables: Callable[[], Mapping[tuple[str, int], Any]] = dict  # (topic, partition) -> tablefeed.Progress
    cut: Callable[[], int | None] = lambda: None  # the views' last published cut
    redis: Callable[[], Mapping[str, tuple[int, int]]] = dict  # view -> (cut Redis shows, newest cut seen)
    extra: list[Callable[[], Iterator[GaugeMetricFamily]]] = field(default_factory=list)


class StreamsMetrics:
    """The workers' metric families (see the module promise)."""

    def __init__(self, cut_warn_after: float = 300.0) -> None:
        from prometheus_client import CollectorRegistry, Counter, PlatformCollector, ProcessCollector

        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.sources = Sources()
        self.cut = CutWatch(cut_warn_after)
        r.register(_Collector(self.sources, self.cut))
        self.changes = Counter("headwater_streams_fanout_changes", "raw changes the fan-out handled", registry=r)
        self.records = Counter("headwater_streams_fanout_records", "records the fan-out wrote to the table topics "
                               "(rows and tombstones)", registry=r)  # fmt: skip
        self.duplicates = Counter("headwater_streams_fanout_duplicates", "changes capture sent twice, dropped",
                                  registry=r)  # fmt: skip
        self.replayed = Counter("headwater_streams_fanout_replayed", "records found already written by an earlier "
                                "run of the fan-out, not written again", registry=r)  # fmt: skip
        self.skipped = Counter("headwater_streams_fanout_skipped", "raw changes with nothing to write (snapshot "
                               "markers, tables without key)", registry=r)  # fmt: skip
        self.dead_letters = Counter("headwater_streams_dead_letters", "raw messages that could not be decoded, sent "
                                    "to <prefix>.changes.dlq", registry=r)  # fmt: skip
        self.view_changes = Counter("headwater_streams_view_changes", "raw changes applied to the views' state",
                                    registry=r)  # fmt: skip
        self.view_rows = Counter("headwater_streams_view_rows_published", "view rows written to the view topics",
                                 registry=r)  # fmt: skip
        self.requests = Counter("headwater_streams_http_requests", "endpoint requests answered, by page and status",
                                ["page", "status"], registry=r)  # fmt: skip
        self.redis_errors = Counter("headwater_streams_redis_errors", "times the Redis mirror found Redis away",
                                    registry=r)  # fmt: skip
        self.redis_records = Counter("headwater_streams_redis_records", "view records the Redis mirror read and "
                                     "staged", registry=r)  # fmt: skip
        self.busy = Counter("headwater_streams_busy_seconds", "seconds each stage spent handling batches (not "
                            "waiting for them): its capacity is what it handled divided by this",
                            ["stage"], registry=r)  # fmt: skip
        self.cpu = Counter("headwater_streams_cpu_seconds", "CPU seconds each stage's thread spent handling "
                           "batches (busy time without waiting for a core or the GIL)", ["stage"],
                           registry=r)  # fmt: skip
        self._fanned: tuple[Any, tuple[int, ...]] = (None, ())  # (the fan-out's counters, their values added)
        self._spent: dict[str, tuple[Any, Any]] = {}  # stage -> its busy and CPU counters

    def fanned(self, counters: Any) -> None:
        """Add the fan-out's counters (``streams.fanout.Counters``) since the last batch."""
        now = (counters.changes, counters.written, counters.duplicates, counters.replayed, counters.skipped,
               counters.dead_letters)  # fmt: skip
        source, added = self._fanned
        if source is not counters:  # a new FanOut (after a rebalance) counts from 0
            added = (0,) * len(now)
        for counter, new, old in zip(self._families(), now, added, strict=True):
            if new > old:
                counter.inc(new - old)
        self._fanned = (counters, now)

    def _families(self) -> tuple[Counter, ...]:
        return self.changes, self.records, self.duplicates, self.replayed, self.skipped, self.dead_letters

    def spent(self, stage: str, since: tuple[float, float]) -> float:
        """Count a stage's work begun at ``since`` (``clock()``): busy and CPU seconds; the busy seconds."""
        wall, cpu = time.monotonic() - since[0], time.thread_time() - since[1]
        counters = self._spent.get(stage)
        if counters is None:
            counters = self._spent[stage] = (self.busy.labels(stage), self.cpu.labels(stage))
        counters[0].inc(wall)
        counters[1].inc(cpu)
        return wall

    def applied(self, changes: int, rows: int) -> None:
        """A batch of the views: raw changes applied, view rows written."""
        self.view_changes.inc(changes)
        if rows:
            self.view_rows.inc(rows)


def clock() -> tuple[float, float]:
    """Where a piece of work begins: (monotonic, this thread's CPU) seconds (``StreamsMetrics.spent``)."""
    return time.monotonic(), time.thread_time()


class CutWatch:
    """The age of the views' cut (see the module promise); ``observe`` is called every second or so."""

    def __init__(self, warn_after: float) -> None:
        self.warn_after = warn_after
        self.cut: int | None = None
        self.behind_since: float | None = None
        self.stalled = Episode()

    def age(self, now: float | None = None) -> float:
        since = self.behind_since
        return 0.0 if since is None else (time.monotonic() if now is None else now) - since

    def observe(self, cut: int | None, behind: bool, now: float) -> None:
        """The cut published now, and whether the views hold changes it does not."""
        if cut != self.cut:
            self.cut, self.behind_since = cut, (now if behind else None)
        elif not behind:
            self.behind_since = None
        elif self.behind_since is None:
            self.behind_since = now
        change = self.stalled.update(self.warn_after > 0 and self.age(now) >= self.warn_after, now)
        where = facts(lsn=cut) if cut is not None else {}
        if change == "began":
            log.warning("the views' cut has not moved for %.0f s (at %s) while changes wait to be published "
                        "(cut_warn_after = %.0f s): readers and Redis see older data", self.age(now),
                        "none yet" if cut is None else lsn_text(cut), self.warn_after, extra=where)  # fmt: skip
        elif change == "ended":
            log.warning("the views' cut moves again (now at %s)", "none" if cut is None else lsn_text(cut),
                        extra=where)  # fmt: skip


class KafkaWatch:
    """librdkafka's connection failures (``tables.logs.KAFKA_GATE``, where they are kept out of the log):
    a WARNING once they have gone on for ``after`` seconds, another once none came for ``quiet`` seconds."""

    def __init__(self, servers: str, after: float = KAFKA_WARN_AFTER, quiet: float = KAFKA_QUIET) -> None:
        self.servers, self.after, self.quiet = servers, after, quiet
        self.since: float | None = None  # when the current streak of failures began (as first seen)
        self.announced = False

    def check(self, now: float) -> None:
        count, at, detail = KAFKA_GATE.last()
        if count and now - at < self.quiet:
            self.since = at if self.since is None else self.since
            if not self.announced and at - self.since >= self.after:
                self.announced = True
                log.warning("Kafka at %s unreachable for %.0f s (%s); the workers wait and go on when it is back",
                            self.servers, at - self.since, detail, extra=facts(error="broker unreachable"))
            return
        if self.announced:
            log.warning("Kafka at %s answers again (no connection failure for %.0f s)", self.servers, self.quiet)
        self.since, self.announced = None, False


class Watcher(threading.Thread):
    """Calls each check with the monotonic time, every ``every`` seconds, until ``stopping`` is set."""

    def __init__(self, checks: list[Callable[[float], None]], every: float = 1.0) -> None:
        super().__init__(name="headwater-watch", daemon=True)
        self.checks, self.every = checks, every
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.every):
            for check in self.checks:
                try:
                    check(time.monotonic())
                except Exception:  # a check that fails must not end the others
                    log.exception("a periodic check failed")


class _Collector:
    """The gauges read from the engine when Prometheus scrapes (a ``prometheus_client`` collector)."""

    def __init__(self, sources: Sources, cut: CutWatch) -> None:
        self.sources, self.cut = sources, cut

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._raw()
        yield from self._tables()
        yield from self._views()
        for extra in self.sources.extra:
            yield from extra()

    def _raw(self) -> Iterator[GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        offset = GaugeMetricFamily("headwater_streams_raw_offset", "next raw-topic offset each reader of the raw "
                                   "topic handles (on the worker that owns it)", labels=["reader"])  # fmt: skip
        end = GaugeMetricFamily("headwater_streams_raw_end_offset", "the raw topic's end as the reader last fetched "
                                "it", labels=["reader"])  # fmt: skip
        lag = GaugeMetricFamily("headwater_streams_raw_lag_messages", "raw changes not yet handled by the reader "
                                "(end minus offset)", labels=["reader"])  # fmt: skip
        for reader, (at, high) in self.sources.raw().items():
            offset.add_metric([reader], at)
            end.add_metric([reader], high)
            lag.add_metric([reader], max(high - at, 0))
        yield from (offset, end, lag)

    def _tables(self) -> Iterator[GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        labels = ["topic", "partition"]
        rows = GaugeMetricFamily("headwater_streams_table_rows", "rows in the table store, per partition held here",
                                 labels=labels)  # fmt: skip
        offset = GaugeMetricFamily("headwater_streams_table_offset", "next table-topic offset read into the store",
                                   labels=labels)  # fmt: skip
        lag = GaugeMetricFamily("headwater_streams_table_lag_messages", "table-topic records not yet in the store "
                                "(end as last fetched minus offset)", labels=labels)  # fmt: skip
        loaded = GaugeMetricFamily("headwater_streams_table_loaded", "1 once the partition is read to the end its "
                                   "last fetch reported (recovery done)", labels=labels)  # fmt: skip
        for (topic, partition), p in sorted(self.sources.tables().items()):
            at = [topic, str(partition)]
            rows.add_metric(at, p.rows)
            offset.add_metric(at, p.offset)
            lag.add_metric(at, max(p.end - p.offset, 0))
            loaded.add_metric(at, 1 if p.current else 0)
        yield from (rows, offset, lag, loaded)

    def _views(self) -> Iterator[GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        cut = self.sources.cut()
        lsn = GaugeMetricFamily("headwater_streams_view_cut_lsn", "commit LSN of the views' last published cut")
        if cut is not None:
            lsn.add_metric([], cut)
        yield lsn
        yield GaugeMetricFamily("headwater_streams_view_cut_age_seconds", "seconds the views have held changes their "
                                "cut does not (0: the cut holds everything applied)", value=self.cut.age())
        shown = GaugeMetricFamily("headwater_streams_redis_cut_lsn", "the cut Redis shows, per view", labels=["view"])
        lag = GaugeMetricFamily("headwater_streams_redis_lag_bytes", "newest cut minus the cut Redis shows (WAL "
                                "bytes), per view", labels=["view"])  # fmt: skip
        for view, (applied, newest) in sorted(self.sources.redis().items()):
            shown.add_metric([view], applied)
            lag.add_metric([view], max(newest - applied, 0))
        yield from (shown, lag)

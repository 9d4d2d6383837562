"""The stream workers' metrics, and the lines they log once per episode.

Promise: ``StreamsMetrics`` is the one place the workers' metric names are written (Prometheus
conventions: ``headwater_streams_..._total`` counters, ``_bytes``, ``_seconds``), in a registry of
its own with the process's CPU, memory and file descriptors; the endpoint serves it at
``/metrics``. Counters are added per batch, never per message (``fanned``, ``applied``). What the
engine already knows — how far each reader is in the raw topic, the table partitions' rows and
offsets, the published cut, what Redis shows — is read when Prometheus scrapes (``Sources``), so
it costs nothing on the hot paths; each stage (fan-out, views, Redis mirror) counts the seconds it
was busy and the CPU its thread spent (``spent``), so its capacity is what it handled over them.
The views' cut is the raw partition's owner's (which makes the cuts), elsewhere a worker's own last
point while it keeps view partitions. ``CutWatch`` is the age of the views' cut: 0 while the cut
holds everything the views applied, else the seconds since it last moved with changes waiting; past
``[streams] cut_warn_after`` it logs a WARNING once (with no cut yet: a first build, which readers see
none of until it is whole), and once more when the cut moves again.
``KafkaWatch`` judges whether Kafka answers the workers' readers from librdkafka's own
statistics (``settings(name, ...)`` adds them to a reader): no broker connection up, or requests
unanswered for ``STALL_AFTER`` seconds past the fetch wait, in every reader that reports; a WARNING
once it has lasted ``KAFKA_WARN_AFTER`` seconds and once when Kafka answers again. ``Watcher`` runs
the workers' periodic checks (the cut's age, Kafka) on a thread of its own, every second, so they
are made even while a feed is stuck. Nothing here imports Faust.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tables.logs import Episode, facts
from tables.wire import lsn_text

if TYPE_CHECKING:  # prometheus_client reads /proc when imported: imported when metrics are made, not at import
    from prometheus_client import Counter
    from prometheus_client.core import GaugeMetricFamily

log = logging.getLogger("headwater.streams")
KAFKA_WARN_AFTER = 5.0  # seconds Kafka must not answer the readers before a WARNING
STALL_AFTER = 2.0  # seconds past the fetch wait a request may go unanswered before the broker counts as silent
STATS_EVERY_MS = 1000  # librdkafka statistics of each reader
STALE_AFTER = 5.0  # a reader whose last statistics are older says nothing (busy in its handler, or stopped)

# the workers' series (the rest are written once, where they are made below)
FANOUT_CHANGES = "headwater_streams_fanout_changes"
RAW_LAG = "headwater_streams_raw_lag_messages"
TABLE_ROWS = "headwater_streams_table_rows"
CUT_AGE = "headwater_streams_view_cut_age_seconds"


@dataclass
class Sources:
    """What the collector reads at scrape time (the engine fills these in; each returns current values)."""

    raw: Callable[[], Mapping[str, tuple[int, int]]] = dict  # reader -> (next raw offset, end as fetched)
    tables: Callable[[], Mapping[tuple[str, int], Any]] = dict  # (topic, partition) -> tablefeed.Progress
    cut: Callable[[], int | None] = lambda: None  # the views' last published cut (None: no views, or not here)
    cut_age: Callable[[], float | None] = lambda: None  # its age (``CutWatch``), None where the views do not run
    redis: Callable[[], Mapping[str, tuple[int, int]]] = dict  # view -> (cut Redis shows, newest cut seen)
    extra: list[Callable[[], Iterator[GaugeMetricFamily]]] = field(default_factory=list)


class StreamsMetrics:
    """The workers' metric families (see the module promise)."""

    def __init__(self, cut_warn_after: float = 300.0, servers: str = "") -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram, PlatformCollector, ProcessCollector

        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.sources = Sources()
        self.cut = CutWatch(cut_warn_after)
        self.kafka = KafkaWatch(servers)
        r.register(_Collector(self.sources, self.kafka))
        self.changes = Counter(FANOUT_CHANGES, "raw changes the fan-out handled", registry=r)
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
        self.view_strays = Counter("headwater_streams_view_strays", "view rows another worker wrote to this worker's "
                                   "view partitions (a zombie's, or while this one was out of the group)",
                                   registry=r)  # fmt: skip
        self.fanout_strays = Counter("headwater_streams_fanout_strays", "table-topic records another writer put "
                                     "among the fan-out's (a zombie's); the keys they touched are written again",
                                     registry=r)  # fmt: skip
        self.requests = Counter("headwater_streams_http_requests", "endpoint requests answered, by page and status",
                                ["page", "status"], registry=r)  # fmt: skip
        self.redis_errors = Counter("headwater_streams_redis_errors", "times the Redis mirror found Redis away",
                                    registry=r)  # fmt: skip
        self.redis_records = Counter("headwater_streams_redis_records", "view records the Redis mirror read and "
                                     "staged", registry=r)  # fmt: skip
        self.redis_apply = Histogram("headwater_streams_redis_apply_seconds", "seconds one cut's application took "
                                     "in Redis (one script: Redis answers no other client meanwhile)",
                                     buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)  # fmt: skip
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

    def reset(self) -> None:
        """The views stopped here (the raw partition went to another worker): nothing waits here any more."""
        if self.stalled.announced:
            log.warning("the views' cut is no longer watched here: the raw partition went to another worker")
        self.cut, self.behind_since, self.stalled = None, None, Episode()

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
        if change == "began":
            self._began(cut, now)
        elif change == "ended":
            log.warning("the views' cut moves again (now at %s)", "none" if cut is None else lsn_text(cut),
                        extra=facts(lsn=cut) if cut is not None else {})  # fmt: skip

    def _began(self, cut: int | None, now: float) -> None:
        if cut is None:  # a first build: a big view takes minutes (the 720k shop's: ~5)
            log.warning("the views have no cut yet after %.0f s while changes wait to be published (cut_warn_after = "
                        "%.0f s): readers and Redis see none of their rows until every partition is published once; "
                        "the 'views at raw offset' lines show the build going on", self.age(now),
                        self.warn_after)  # fmt: skip
        else:
            log.warning("the views' cut has not moved for %.0f s (at %s) while changes wait to be published "
                        "(cut_warn_after = %.0f s): readers and Redis see older data", self.age(now), lsn_text(cut),
                        self.warn_after, extra=facts(lsn=cut))  # fmt: skip


def silence(brokers: Mapping[str, Any], stall: float) -> tuple[float, str] | None:
    """From one librdkafka statistics' ``brokers``: (seconds, what shows it) when no broker answers — no
    connection up, or every connection up with requests unanswered for over ``stall`` seconds — else None."""
    real = [b for b in brokers.values() if b.get("source") in ("configured", "learned")]
    up = [b for b in real if b.get("state") == "UP"]
    if not up:
        states = ", ".join(sorted({str(b.get("state")) for b in real})) or "none known"
        return 0.0, f"no broker connection up ({states})"
    waiting = [b.get("rxidle", -1) / 1e6 for b in up if b.get("waitresp_cnt", 0) > 0]
    if len(waiting) < len(up) or min(waiting) <= stall:
        return None
    return min(waiting), f"no answer to requests for {min(waiting):.0f} s"


class KafkaWatch:
    """Whether Kafka answers the workers' readers (see the module promise): each reader reports its
    librdkafka statistics under a name (``seen``, on its own thread); ``check`` judges every second."""

    def __init__(self, servers: str, after: float = KAFKA_WARN_AFTER) -> None:
        self.servers = servers
        self.lock = threading.Lock()
        self.readers: dict[str, tuple[float, float | None, str]] = {}  # name -> (seen at, silent since, detail)
        self.episode = Episode(after)
        self.known = False  # judged at least once (before that, the reachable gauge has no sample)

    def settings(self, name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
        """``settings`` with librdkafka's statistics every second, reported here as ``name``."""
        stall = STALL_AFTER + float(settings.get("fetch.wait.max.ms", 500)) / 1000
        return {"statistics.interval.ms": STATS_EVERY_MS, **settings,
                "stats_cb": functools.partial(self.seen, name, stall)}  # fmt: skip

    def seen(self, name: str, stall: float, stats: str, now: float | None = None) -> None:
        """One reader's statistics (JSON), on its thread."""
        now = time.monotonic() if now is None else now
        found = silence(json.loads(stats).get("brokers") or {}, stall)
        with self.lock:
            before = self.readers.get(name)
            if found is None:
                self.readers[name] = (now, None, "")
            else:
                kept = before[1] if before is not None and before[1] is not None else now - found[0]
                self.readers[name] = (now, kept, found[1])

    def check(self, now: float) -> None:
        """Judge by the readers that reported lately: Kafka does not answer when none of them is answered."""
        with self.lock:
            fresh = [r for r in self.readers.values() if now - r[0] < STALE_AFTER]
        if not fresh:
            return  # nobody to judge by: the episode stays as it is
        silent = [r for r in fresh if r[1] is not None]
        since = min(r[1] for r in silent) if len(silent) == len(fresh) else None  # type: ignore[type-var]
        change = self.episode.update(since is not None, now, since)
        self.known = True
        if change == "began":
            lasted = self.episode.lasted(now)
            log.warning("Kafka at %s does not answer the workers' readers (%s, for %.0f s); they wait and go on "
                        "when it is back", self.servers, silent[0][2], lasted,
                        extra=facts(seconds=round(lasted, 1), error="broker unreachable"))  # fmt: skip
        elif change == "ended":
            log.warning("Kafka at %s answers the workers' readers again", self.servers)

    def reachable(self) -> int | None:
        """1 while Kafka answers, 0 once it has not for ``after`` seconds, None before the first judgement."""
        return None if not self.known else 0 if self.episode.announced else 1


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

    def __init__(self, sources: Sources, kafka: KafkaWatch) -> None:
        self.sources, self.kafka = sources, kafka

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        yield from self._raw()
        yield from self._tables()
        yield from self._views()
        reachable = GaugeMetricFamily("headwater_streams_broker_reachable", "1 while Kafka answers this worker's "
                                      "readers, 0 once it has not for 5 s (no sample before it is known)")  # fmt: skip
        if (up := self.kafka.reachable()) is not None:
            reachable.add_metric([], up)
        yield reachable
        for extra in self.sources.extra:
            yield from extra()

    def _raw(self) -> Iterator[GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        offset = GaugeMetricFamily("headwater_streams_raw_offset", "next raw-topic offset each reader of the raw "
                                   "topic handles (on the worker that owns it)", labels=["reader"])  # fmt: skip
        end = GaugeMetricFamily("headwater_streams_raw_end_offset", "the raw topic's end as the reader last fetched "
                                "it", labels=["reader"])  # fmt: skip
        lag = GaugeMetricFamily(RAW_LAG, "raw changes not yet handled by the reader "
                                "(end minus offset)", labels=["reader"])  # fmt: skip
        for reader, (at, high) in self.sources.raw().items():
            offset.add_metric([reader], at)
            end.add_metric([reader], high)
            lag.add_metric([reader], max(high - at, 0))
        yield from (offset, end, lag)

    def _tables(self) -> Iterator[GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        labels = ["topic", "partition"]
        rows = GaugeMetricFamily(TABLE_ROWS, "rows in the table store, per partition held here",
                                 labels=labels)  # fmt: skip
        offset = GaugeMetricFamily("headwater_streams_table_offset", "next table-topic offset read into the store",
                                   labels=labels)  # fmt: skip
        lag = GaugeMetricFamily("headwater_streams_table_lag_messages", "table-topic records not yet in the store "
                                "(end as last fetched minus offset)", labels=labels)  # fmt: skip
        loaded = GaugeMetricFamily("headwater_streams_table_loaded", "1 once the partition was read to its end "
                                   "since it was assigned here (recovery done)", labels=labels)  # fmt: skip
        for (topic, partition), p in sorted(self.sources.tables().items()):
            at = [topic, str(partition)]
            rows.add_metric(at, p.rows)
            offset.add_metric(at, p.offset)
            lag.add_metric(at, max(p.end - p.offset, 0))
            loaded.add_metric(at, 1 if p.loaded else 0)
        yield from (rows, offset, lag, loaded)

    def _views(self) -> Iterator[GaugeMetricFamily]:
        from prometheus_client.core import GaugeMetricFamily

        cut = self.sources.cut()
        lsn = GaugeMetricFamily("headwater_streams_view_cut_lsn", "commit LSN of the views' last published cut "
                                 "(on the raw partition's owner; elsewhere this worker's last point)")  # fmt: skip
        if cut is not None:
            lsn.add_metric([], cut)
        yield lsn
        age = GaugeMetricFamily(CUT_AGE, "seconds the views have held changes their cut does not (0: the cut holds "
                                "everything applied), on each worker keeping view partitions")  # fmt: skip
        if (seconds := self.sources.cut_age()) is not None:
            age.add_metric([], seconds)
        yield age
        shown = GaugeMetricFamily("headwater_streams_redis_cut_lsn", "the cut Redis shows, per view", labels=["view"])
        lag = GaugeMetricFamily("headwater_streams_redis_lag_bytes", "newest cut minus the cut Redis shows (WAL "
                                "bytes), per view", labels=["view"])  # fmt: skip
        for view, (applied, newest) in sorted(self.sources.redis().items()):
            shown.add_metric([view], applied)
            lag.add_metric([view], max(newest - applied, 0))
        yield from (shown, lag)

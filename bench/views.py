"""Views under load: commit -> view row latency, the sustained rate, each stage's capacity and CPU per worker.

On the bench stack (seeded sample shop), ``headwater capture`` and ``--workers N`` ``faust -A
streams worker`` processes (one consumer group) keep the README's ``orders_enriched`` view (orders
⋈ customers ⋈ items ⋈ products) with the Redis mirror on. Each bench transaction sets one
order's ``note`` to a unique token and touches that order's customer (so the join is
exercised); its start time is when ``COMMIT`` returned. The load comes from ``--connections C``
processes, each committing on its own connection for its own orders (no two wait on one row
lock), so the pipeline and not the driver bounds the rate. Observers record when the token
first shows up:

* on the view topic — a librdkafka consumer reading it from its end (fetch wait 5 ms);
* in Redis — a keyspace-notification subscriber reading the rows' ``doc`` (those notified together in one
  round trip);
* and, to tell capture's share apart, on the raw change topic (the order's new row).

Each observer is a process of its own and takes its times there (``CLOCK_MONOTONIC``, the clock of the
commit times too), so none waits for another's GIL; their CPU is printed with the others'.

1. the sustainable rate: a burst of ``--burst`` transactions committed as fast as the connections
   can, with ``synchronous_commit`` off (on this machine a WAL flush per commit held PostgreSQL
   to ~1,000 transactions/s, below the pipeline); rate = burst / time from the first commit until
   the view topic showed the last transaction of every connection. The driver's own commit rate
   is printed next to it: when the two are close, the driver (or PostgreSQL) was the bound, not
   the pipeline.
2. a steady load at half that rate (or ``--rate``) for ``--seconds``; p50 / p99 / max latency;
3. a drain of ``--drain`` transactions committed while capture is stopped (``SIGSTOP``; PostgreSQL keeps
   the WAL for its slot): let go, capture writes them to the raw topic faster than the stages read it, so
   each stage works through a backlog without waiting for work — its capacity, where the other phases'
   small batches and frequent points cost each change more (after the steady load, so its figures compare with
   runs from before this phase).

For every phase the workers' ``/metrics`` are read before and after: each stage's *capacity* is
what it handled divided by the seconds it was busy handling it (``headwater_streams_busy_seconds``:
changes/s at 100% busy, for the fan-out, the views and the Redis mirror), and by the CPU seconds its
thread spent (``headwater_streams_cpu_seconds``: busy time without the waits for a core or the GIL,
which the other stages of the same process and the other processes on the machine cause), and
each process's CPU-seconds (``/proc/<pid>/stat`` utime + stime, every thread) per 1,000
transactions, the broker's among them, whose share of a core is also printed for every ``BROKER_EVERY`` seconds
of the steady load (the local broker's reads cost more as its partitions' batches pile up). The machine's load
average is printed before and after (other work on the same cores skews every figure).

Orders are taken round-robin, so one batch rarely updates an order twice; a token
overwritten before it was published is counted as superseded, not as a latency.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx
import psycopg2
import redis
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client.parser import text_string_to_metric_families

from bench import capture
from bench.fanout import spawn_worker
from capture.producer import DEFAULTS, TANSU_LINGER_MS
from headwater import shop, stack
from streams.clients import TANSU_FOLLOW_WAIT_MS, VIEW_ROWS_LINGER_MS
from tables import topics
from tables.registry import Registry

PORT = 26067  # worker i listens on PORT + i
PREFIX = "views"  # the topic prefix on the bench stack's own broker (on a Kafka of your own: ``run_prefix``)
VIEW = "orders_enriched"
READY = "ready"  # an observer process's first message: it reads from here on
TICKS = os.sysconf("SC_CLK_TCK")
BROKER = "broker"  # the broker's name among the processes whose CPU is printed
BROKER_EVERY = 10.0  # seconds between two looks at the broker's CPU during the steady load
Procs = dict[str, subprocess.Popen[bytes]]  # name -> process
STAGES = {"fanout": "headwater_streams_fanout_changes_total", "views": "headwater_streams_view_changes_total",
          "mirror": "headwater_streams_redis_records_total"}  # fmt: skip


class Seen:
    """When each token was first seen by one observer (times taken in the observer's process)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.lock = threading.Lock()

    def mark(self, tokens: Iterable[tuple[str, float]]) -> None:
        with self.lock:
            for token, at in tokens:
                if token.startswith("bench-"):
                    self.at.setdefault(token, at)

    def take(self, conn: Connection) -> None:
        """Marks what an observer process sends until it ends (its end of the pipe closed)."""
        while True:
            try:
                self.mark(conn.recv())
            except EOFError:
                return


@dataclass(frozen=True)
class Where:
    """What an observer process reads (picklable: passed to a spawned process)."""

    bootstrap: str
    registry_url: str
    redis_url: str
    prefix: str = PREFIX  # the pipeline's topic prefix

    @property
    def raw(self) -> str:
        return topics.changes_topic(self.prefix)

    @property
    def topic(self) -> str:
        return topics.view_topic(self.prefix, VIEW)

    @property
    def redis_view(self) -> str:
        return topics.view_key(self.prefix, VIEW)


def run_prefix(bootstrap: str, clock: Callable[[], float] = time.time) -> str:
    """The run's topic prefix: ``PREFIX`` on the bench stack's own broker (made afresh for each run), one of its own
    on a Kafka of yours (``bootstrap``), which keeps what earlier runs made (the time and the process: two runs
    started in the same second differ)."""
    return f"hwbench-{int(clock())}-{os.getpid()}" if bootstrap else PREFIX


def observe(what: str, where: Where, out: Connection, stop: EventType) -> None:
    """One observer, in a process of its own: ``what`` is ``"raw"``, ``"view"`` (topics) or ``"redis"``. It sends
    ``READY`` once it reads, then lists of (token, when it was seen). A process of its own, so that no observer
    waits for another's GIL before it takes its time (three threads of the benchmark's process did: the raw topic's
    decoding held the GIL the Redis observer needed)."""
    try:
        if what == "redis":
            follow_redis(where, out, stop)
        else:
            follow_topic(where, where.raw if what == "raw" else where.topic, out, stop)
    finally:
        out.close()


def follow_topic(where: Where, topic: str, out: Connection, stop: EventType) -> None:
    """Sends each token seen on ``topic`` (a view row's note, or on the raw topic an order's new note) with the
    time the batch holding it came (every message of a batch was on the topic by then)."""
    consumer = Consumer({"bootstrap.servers": where.bootstrap, "group.id": "bench-view-latency",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 5})  # fmt: skip
    decoder = Registry(where.registry_url)
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, consumer.get_watermark_offsets(TopicPartition(topic, p))[1])
                     for p in partitions])  # fmt: skip
    out.send(READY)
    try:
        while not stop.is_set() and alive():
            messages = consumer.consume(1000, 0) or consumer.consume(1, 0.05)  # (n, t) waits out t unless n come
            now, tokens = time.monotonic(), []
            for msg in messages:
                if msg.error() is None and msg.value() is not None:
                    value = decoder.decode(msg.value())
                    if topic == where.raw:
                        value = decoder.decode(value["after"]) if value["table"] == "orders" else {}
                    if value.get("note"):
                        tokens.append((value["note"], now))
            if tokens:
                out.send(tokens)
    finally:
        consumer.close()


def follow_redis(where: Where, out: Connection, stop: EventType) -> None:
    """Sends each token Redis shows: the keyspace notifications waiting are taken together and their rows read
    in one round trip, each token timed when that read returned (a read per notification, one after another,
    timed the last rows of a big cut up to a round trip per row late)."""
    client = redis.Redis.from_url(where.redis_url)
    client.config_set("notify-keyspace-events", "Kh")
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe(f"__keyspace@0__:{where.redis_view}:*")
    out.send(READY)
    try:
        while not stop.is_set() and alive():
            message = pubsub.get_message(timeout=0.05)
            keys: dict[str, None] = {}
            while message is not None:  # every notification waiting, up to 1,000 rows a read
                keys[message["channel"].decode().split(":", 1)[1]] = None
                message = pubsub.get_message(timeout=0.0) if len(keys) < 1000 else None
            if not keys:
                continue
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.hget(key, "doc")
            docs = pipe.execute()
            now = time.monotonic()
            notes = (json.loads(doc).get("note") for doc in docs if doc is not None)
            out.send([(note, now) for note in notes if note])
    finally:
        pubsub.close()


def alive() -> bool:
    """Whether the benchmark's process (an observer's parent) still runs: an observer of a killed one stops."""
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def ready(conn: Connection) -> bool:
    """Whether an observer said it reads within 60 s (False too when it died first)."""
    try:
        return conn.poll(60) and conn.recv() == READY
    except EOFError:
        return False


@contextmanager
def observers(where: Where) -> Iterator[tuple[dict[str, int], Seen, Seen, Seen]]:
    """The three observers, each in a process of its own, reading once this returns: (their pids by name, the
    raw topic's, the view topic's and Redis's ``Seen``); stopped and their last tokens taken afterwards."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs: dict[str, Any] = {}
    seen, takers = [], []
    try:
        for name, what in (("raw obs", "raw"), ("view obs", "view"), ("redis obs", "redis")):
            mine, theirs = ctx.Pipe(duplex=False)
            procs[name] = ctx.Process(target=observe, args=(what, where, theirs, stop), daemon=True)
            procs[name].start()
            theirs.close()
            if not ready(mine):
                procs[name].join(1)
                raise RuntimeError(f"the benchmark's observer of {what} did not start reading within 60 s (exit code "
                                   f"{procs[name].exitcode}: None if it still runs)")  # fmt: skip
            seen.append(Seen())
            takers.append(threading.Thread(target=seen[-1].take, args=(mine,)))
            takers[-1].start()
        yield {name: proc.pid for name, proc in procs.items()}, seen[0], seen[1], seen[2]
    finally:
        stop.set()
        for proc in procs.values():
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        for taker in takers:
            taker.join()


CHANGES_PER_TX = 2  # raw changes a bench transaction makes (``commit``: its order and that order's customer)


def commit(cur: Any, order: int, token: str) -> float:
    cur.execute("UPDATE orders SET note = %s WHERE id = %s RETURNING customer_id", (token, order))
    customer = cur.fetchone()[0]
    cur.execute("UPDATE customers SET profile = jsonb_build_object('last', %s) WHERE id = %s", (token, customer))
    cur.connection.commit()
    return time.monotonic()


def connection_load(dsn: str, orders: list[int], numbers: list[int], rate: float | None, tag: str,
                    start_at: float) -> dict[str, tuple[float, int]]:  # fmt: skip
    """One connection's share of a load (run in a process of its own) on its own ``orders``, round-robin:
    token -> (commit time, order)."""
    conn = psycopg2.connect(dsn)
    committed: dict[str, tuple[float, int]] = {}
    time.sleep(max(start_at - time.monotonic(), 0))  # CLOCK_MONOTONIC: the same clock in every process
    with conn.cursor() as cur:
        if rate is None:  # a burst: PostgreSQL's WAL flush per commit would bound it, not the pipeline
            cur.execute("SET synchronous_commit TO off")
        for done, n in enumerate(numbers):
            token, order = f"bench-{tag}-{n}", orders[done % len(orders)]
            committed[token] = (commit(cur, order, token), order)
            if rate:
                delay = start_at + (done + 1) / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
    conn.close()
    return committed


def run_load(dsn: str, orders: list[int], count: int, rate: float | None, tag: str,
             connections: int) -> tuple[dict[str, tuple[float, int]], list[str]]:  # fmt: skip
    """``count`` transactions from ``connections`` processes (in all ``rate`` per second, or as fast as they
    can): token -> (commit time, order), and each connection's last token. Connection i commits transactions
    i, i + C, ... on orders i, i + C, ... (its own: no token is overwritten by another connection's)."""
    shares = [list(range(i, count, connections)) for i in range(connections)]
    each = None if rate is None else rate / connections
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(connections) as pool:
        start_at = time.monotonic() + 2.0  # every process has imported and connected by then
        work = [(dsn, orders[i::connections], share, each, tag, start_at) for i, share in enumerate(shares) if share]
        parts = pool.starmap(connection_load, work)
    committed = {token: at for part in parts for token, at in part.items()}
    return committed, [f"bench-{tag}-{share[-1]}" for share in shares if share]


def wait_seen(seen: Seen, token: str, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with seen.lock:
            if token in seen.at:
                return seen.at[token]
        time.sleep(0.01)
    raise RuntimeError(f"{token} did not reach the view within {timeout:.0f} s")


def latencies(committed: dict[str, tuple[float, int]], seen: Seen) -> tuple[list[float], int]:
    """ms from each commit until its own token was seen (those overwritten before: counted, not timed)."""
    found = sorted((seen.at[t] - c) * 1000 for t, (c, _) in committed.items() if t in seen.at)
    return found, len(committed) - len(found)


def until_shown(committed: dict[str, tuple[float, int]], seen: Seen) -> tuple[list[float], int]:
    """ms from each commit until its token or a later one of the same order was seen: when a reader first
    sees a state that includes the transaction (a cut is a prefix in commit order, so a later token of
    the order implies this one). Tokens overwritten before they were published count too, with the time
    their successor took; leaving them out (``latencies``) keeps only those that got through quickly."""
    by_order: dict[int, list[tuple[float, str]]] = {}
    for token, (at, order) in committed.items():
        by_order.setdefault(order, []).append((at, token))
    found = []
    for commits in by_order.values():
        first = math.inf
        for at, token in sorted(commits, reverse=True):
            first = min(first, seen.at.get(token, math.inf))
            if first < math.inf:
                found.append((first - at) * 1000)
    return sorted(found), 0


def describe(name: str, values: list[float], superseded: int) -> str:
    if not values:
        return f"  {name}: nothing seen"
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    counted = f"{len(values)} rows, {superseded} superseded" if superseded else f"{len(values)} commits"
    return (f"  {name}: p50 {pick(0.5):6.1f} ms   p90 {pick(0.9):6.1f} ms   p99 {pick(0.99):6.1f} ms   "
            f"max {values[-1]:6.1f} ms   ({counted})")  # fmt: skip


def wait_published(where: Where, timeout: float = 300) -> None:
    """Until the workers published the view (Redis shows a cut)."""
    client = redis.Redis.from_url(where.redis_url)
    deadline = time.monotonic() + timeout
    while client.hget(where.redis_view, "cut_lsn") is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the view was not published within {timeout:.0f} s")
        time.sleep(0.5)


# ---- what the processes spent -----------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (``/proc/<pid>/stat`` fields 14 and 15), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def scrape(port: int) -> dict[str, float]:
    """A worker's counters: each stage's items and busy seconds (``<stage>`` and ``<stage>_busy``)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for stage, name in STAGES.items():
                if sample.name == name:
                    values[stage] = sample.value
            if sample.name == "headwater_streams_busy_seconds_total":
                values[f"{sample.labels['stage']}_busy"] = sample.value
            if sample.name == "headwater_streams_cpu_seconds_total":
                values[f"{sample.labels['stage']}_cpu"] = sample.value
    return values


@dataclass
class Sample:
    """The processes' CPU-seconds and the workers' counters at one moment."""

    at: float
    cpu: dict[str, float]
    counters: list[dict[str, float]] = field(default_factory=list)


def sample(procs: Procs, workers: int, others: Mapping[str, int] | None = None) -> Sample:
    """Now: each process's CPU-seconds (``procs``, and ``others`` by pid) and each worker's counters."""
    pids = {**{name: p.pid for name, p in procs.items()}, **(others or {})}
    return Sample(time.monotonic(), {name: cpu_seconds(pid) for name, pid in pids.items()},
                  [scrape(PORT + i) for i in range(workers)])  # fmt: skip


def gained(old: Mapping[str, float], new: Mapping[str, float], counter: str) -> float:
    """How much one worker's ``counter`` grew between two of its samples (0 where it does not export it)."""
    return new.get(counter, 0) - old.get(counter, 0)


def per_cpu(old: Mapping[str, float], new: Mapping[str, float], stage: str) -> float:
    """Items a stage handled per CPU-second of its thread between two of a worker's samples."""
    return gained(old, new, stage) / max(gained(old, new, f"{stage}_cpu"), 1e-6)


def stage_lines(before: Sample, after: Sample, hidden: Collection[int] = ()) -> list[str]:
    """Per worker (but the ``hidden`` ones) and stage: items handled, seconds busy (share of the span), capacity
    at 100% busy, and the stage thread's CPU seconds with the capacity they give (items per CPU-second)."""
    span = after.at - before.at
    lines = []
    for i, (old, new) in enumerate(zip(before.counters, after.counters, strict=True)):
        for stage in () if i in hidden else STAGES:
            items, busy = gained(old, new, stage), gained(old, new, f"{stage}_busy")
            if items <= 0 or busy <= 0:
                continue
            lines.append(f"    worker {i} {stage:6}: {items:8.0f} in {busy:6.2f} s busy ({busy / span:4.0%}): "
                         f"capacity {items / busy:7.0f}/s; {gained(old, new, f'{stage}_cpu'):6.2f} CPU-s: "
                         f"{per_cpu(old, new, stage):7.0f}/CPU-s")  # fmt: skip
    return lines


def cpu_lines(before: Sample, after: Sample, transactions: int) -> list[str]:
    lines = []
    for name, start in before.cpu.items():
        used = after.cpu[name] - start
        lines.append(f"    {name:9}: {used:6.2f} CPU-s = {1000 * used / transactions:5.2f} CPU-s per 1,000 tx "
                     f"({used / (after.at - before.at):4.0%} of a core)")  # fmt: skip
    return lines


def load_text() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


# ---- the pipeline -------------------------------------------------------------------------
@contextmanager
def pipeline(cfg: stack.StackConfig, dsn: str, work: Path, workers: int, prefix: str = PREFIX) -> Iterator[Procs]:
    """Capture and ``workers`` stream workers (one group), stopped afterwards; name -> process."""
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE PUBLICATION bench FOR TABLE customers, products, orders, order_items")
    conn.close()
    config = work / "views.toml"
    config.write_text(shop.VIEWS_TOML)
    log = (work / "capture-views.log").open("ab")
    argv = capture.capture_argv(cfg, prefix, "bench_views", work / "state-views")
    procs = {"capture": subprocess.Popen(argv, env={**capture.os.environ, "HEADWATER_CAPTURE_DSN": dsn}, stdout=log,
                                         stderr=subprocess.STDOUT)}  # fmt: skip
    try:
        capture.wait_confirmed(dsn, "bench_views", procs["capture"])
        for i in range(workers):
            (work / f"worker{i}").mkdir()
            procs[f"worker {i}"] = start_worker(cfg, work, i, prefix)
        yield procs
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # never left running
                proc.kill()
                proc.wait(timeout=60)
        for i in range(workers):
            for line in (work / f"worker{i}" / "worker.log").read_text(errors="replace").splitlines()[-400:]:
                if any(said in line for said in SHOWN) and "streams worker st" not in line:  # not its start, stop
                    print(f"  worker {i}:", line.split("] ")[-1])


SHOWN = ("views at raw offset", "fan-out at raw offset", " WARNING ", " ERROR ")  # of the workers' last log lines


def start_worker(cfg: stack.StackConfig, work: Path, i: int, prefix: str = PREFIX) -> subprocess.Popen[bytes]:
    """Worker ``i`` of ``pipeline`` (home ``work/worker<i>``, port ``PORT + i``), also when a fault restarts it."""
    return spawn_worker(cfg, work / f"worker{i}", prefix, PORT + i, work / "views.toml")


@dataclass
class Phase:
    """One load: what was committed, and the samples around it."""

    committed: dict[str, tuple[float, int]]  # token -> (commit time, order)
    before: Sample
    after: Sample
    broker: list[float] = field(default_factory=list)  # the broker's share of a core, each BROKER_EVERY s of the load


@contextmanager
def broker_shares(pid: int | None, read: Callable[[int], float] = cpu_seconds,
                  clock: Callable[[], float] = time.monotonic) -> Iterator[list[float]]:  # fmt: skip
    """The broker's share of a core (``read``: a process's CPU-seconds) in each ``BROKER_EVERY`` seconds while the
    block runs, filled as it runs; none without a broker process, and no more once it ended."""
    shares: list[float] = []
    if pid is None:
        yield shares
        return
    done = threading.Event()

    def watch() -> None:
        try:
            last = clock(), read(pid)
            while not done.wait(BROKER_EVERY):
                now = clock(), read(pid)
                shares.append((now[1] - last[1]) / max(now[0] - last[0], 1e-9))
                last = now
        except OSError:  # the broker ended (the load's own checks say what went wrong)
            return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield shares
    finally:
        done.set()
        watcher.join()


def broker_line(shares: list[float]) -> str:
    """The report's line of the broker's shares of a core (``broker_shares``)."""
    return f"  the broker's share of a core, each {BROKER_EVERY:.0f} s of the load: " + " ".join(
        f"{share:.2f}" for share in shares)


def burst_phase(cfg: stack.StackConfig, dsn: str, orders: list[int], procs: Procs, workers: int,
                burst: int, connections: int, topic_seen: Seen,
                watching: Mapping[str, int]) -> tuple[Phase, float, float]:  # fmt: skip
    """The burst: the phase, the sustained rate and the driver's own commit rate (transactions/s)."""
    print(f"burst: {burst} transactions as fast as {connections} connections commit ...", flush=True)
    before = sample(procs, workers, watching)
    fast, lasts = run_load(dsn, orders, burst, None, "burst", connections)
    times = [at for at, _ in fast.values()]
    first = min(times)
    done = max(wait_seen(topic_seen, token) for token in lasts)
    phase = Phase(fast, before, sample(procs, workers, watching))
    return phase, burst / (done - first), burst / (max(times) - first)


def drain_phase(dsn: str, orders: list[int], procs: Procs, workers: int, count: int, connections: int,
                topic_seen: Seen, watching: Mapping[str, int]) -> Phase:  # fmt: skip
    """``count`` transactions committed while capture is stopped, then drained (step 3 of the promise): the phase
    from capture's release until every stage is done with them (``settled``). PostgreSQL drops a stopped capture's
    replication connection after ``wal_sender_timeout`` (60 s by default): keep the commits shorter than that."""
    print(f"drain: {count} transactions committed while capture is stopped, then drained ...", flush=True)
    stopped = procs["capture"]
    stopped.send_signal(signal.SIGSTOP)
    try:
        committed, lasts = run_load(dsn, orders, count, None, "drain", connections)
        before = sample(procs, workers, watching)
    finally:
        stopped.send_signal(signal.SIGCONT)
    for token in lasts:
        wait_seen(topic_seen, token)
    return Phase(committed, before, settled(before, procs, workers, watching, CHANGES_PER_TX * count))


def settled(before: Sample, procs: Procs, workers: int, watching: Mapping[str, int], changes: int,
            every: float = 1.0, timeout: float = 300) -> Sample:  # fmt: skip
    """A sample once the fan-out routed ``changes`` more changes than at ``before`` and then no stage of any worker
    handled anything for ``every`` seconds (the fan-out may still be working through the backlog when the view topic
    shows its end, and counts a batch only once it is done). Items, not busy or CPU seconds: the mirror's loop spends
    some of those every second when idle."""
    last, deadline = sample(procs, workers, watching), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(every)
        now = sample(procs, workers, watching)
        if routed(before, last) >= changes and items(now) == items(last):
            return last
        last = now
    raise RuntimeError(f"the drain's stages were not done within {timeout:.0f} s (the fan-out routed "
                       f"{routed(before, last):.0f} of {changes} changes): see the workers' logs")


def items(at: Sample) -> list[list[float]]:
    """Each worker's items handled, stage by stage."""
    return [[counters.get(stage, 0) for stage in STAGES] for counters in at.counters]


def routed(before: Sample, after: Sample) -> float:
    """Changes the fan-out (on whichever worker holds the raw partition) routed between two samples."""
    return sum(gained(old, new, "fanout") for old, new in zip(before.counters, after.counters, strict=True))


def ratio_lines(phase: Phase) -> list[str]:
    """Each worker's views against the fan-out (on the raw partition's owner), changes per CPU-second."""
    pairs = list(zip(phase.before.counters, phase.after.counters, strict=True))
    fanout = max((per_cpu(old, new, "fanout") for old, new in pairs), default=0.0)
    views = [per_cpu(old, new, "views") for old, new in pairs]
    return [f"    worker {i} views / fan-out, changes per CPU-s: {rate / fanout:.2f}"
            for i, rate in enumerate(views) if fanout > 0 and rate > 0]


def steady_phase(dsn: str, orders: list[int], procs: Procs, workers: int, rate: float, seconds: float,
                 connections: int, seen: tuple[Seen, Seen], watching: Mapping[str, int]) -> Phase:  # fmt: skip
    before = sample(procs, workers, watching)
    with broker_shares(watching.get(BROKER)) as broker:
        committed, lasts = run_load(dsn, orders, int(rate * seconds), rate, "steady", connections)
    for token in lasts:
        for observer in seen:
            wait_seen(observer, token)
    time.sleep(1)
    return Phase(committed, before, sample(procs, workers, watching), broker)


def main(seconds: float = 20.0, burst: int = 6000, rate_steady: float | None = None, workers: int = 1,
         connections: int = 4, bootstrap: str = "", drain: int = 20_000) -> None:  # fmt: skip
    print(f"views bench: {workers} worker(s), {connections} connections, {broker_text(bootstrap)}; {load_text()}",
          flush=True)  # fmt: skip
    prefix = run_prefix(bootstrap)
    schemas = f"{prefix}._schemas" if bootstrap else ""  # on a Kafka of yours, deleted with the run's topics
    with run_topics(bootstrap, prefix), capture.seeded_stack(bootstrap, schemas) as (cfg, dsn, work):
        where = Where(cfg.bootstrap, cfg.registry_url, cfg.redis_url, prefix)
        conn = psycopg2.connect(dsn)
        with conn.cursor() as cur:
            cur.execute("SELECT id FROM orders ORDER BY id")
            orders = [row[0] for row in cur.fetchall()]
        conn.close()
        with pipeline(cfg, dsn, work, workers, prefix) as procs:
            wait_published(where)
            with observers(where) as (watching, raw_seen, topic_seen, redis_seen):
                broker = stack.Broker(cfg).pid()  # None on a Kafka of yours (not this run's process): not measured
                watching = {**watching, **({BROKER: broker} if broker else {})}
                run_load(dsn, orders, connections, None, "warm", connections)
                wait_seen(topic_seen, f"bench-warm-{connections - 1}")
                fast, rate, driver = burst_phase(cfg, dsn, orders, procs, workers, burst, connections, topic_seen,
                                                 watching)  # fmt: skip
                steady = rate_steady or rate / 2
                time.sleep(15)  # let every stage (fan-out, tables, views, mirror) drain the burst
                print(f"  sustained {rate:.0f} transactions/s end to end (the driver committed at {driver:.0f}/s)",
                      flush=True)  # fmt: skip
                print(f"steady load at {steady:.0f}/s for {seconds:.0f} s ...", flush=True)
                slow = steady_phase(dsn, orders, procs, workers, steady, seconds, connections, (topic_seen, redis_seen),
                                    watching)  # fmt: skip
                drained = None  # after the steady load, whose figures stay comparable with runs before the drain
                if drain:
                    drained = drain_phase(dsn, orders, procs, workers, drain, connections, topic_seen, watching)
    report(fast, drained, slow, (rate, driver, steady), rate_steady is not None, (raw_seen, topic_seen, redis_seen))
    print(profile_text("kafka" if bootstrap else "tansu"))


def broker_text(bootstrap: str) -> str:
    return f"the Kafka at {bootstrap} (kafka profile)" if bootstrap else "the stack's Tansu broker (tansu profile)"


@contextmanager
def run_topics(bootstrap: str, prefix: str) -> Iterator[None]:
    """On a Kafka of your own (``bootstrap``), what the run made there is deleted after it: the topics under its
    prefix (the registry's ``<prefix>._schemas`` among them) and the workers' Faust app's (``bench-<prefix>-...``),
    and that app's consumer group; what could not be is named."""
    try:
        yield
    finally:
        if bootstrap:
            app = f"bench-{prefix}"  # the workers' Faust app: its topics and its consumer group
            done, said = drop_topics(bootstrap, (topics.under(prefix), f"{app}-"))
            print(f"  {said}; {drop_group(bootstrap, app) if done else f'its group {app} is left too'}")


def drop_topics(bootstrap: str, starts: tuple[str, ...]) -> tuple[bool, str]:
    """Delete the topics whose names start with one of ``starts``: whether it did, and what was done or what is left
    to do by hand (the run's own error, if any, stays the one raised)."""
    what = ", ".join(f"{start}*" for start in starts)
    try:
        admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
        names = [name for name in admin.list_topics(timeout=10).topics if name.startswith(starts)]
        for future in (admin.delete_topics(names, operation_timeout=30).values() if names else ()):
            future.result(timeout=60)
    except Exception as exc:
        return False, f"could not delete this run's topics ({what}) from {bootstrap}: {exc}; delete them by hand"
    return True, f"deleted this run's {len(names)} topics ({what}) from {bootstrap}"


def drop_group(bootstrap: str, group: str) -> str:
    """Delete consumer group ``group`` (one never made is no error): what was done, or what is left to do."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})  # held until its futures are done
    try:
        for future in admin.delete_consumer_groups([group]).values():
            future.result(timeout=30)
    except Exception as exc:
        if isinstance(exc, KafkaException) and exc.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
            return f"no group {group} to delete"
        return f"could not delete group {group}: {exc}; delete it by hand"
    return f"deleted group {group}"


def report(fast: Phase, drained: Phase | None, slow: Phase, rates: tuple[float, float, float], given: bool,
           seen: tuple[Seen, Seen, Seen]) -> None:  # fmt: skip
    """The three phases' figures (``rates``: the sustained, the driver's and the steady load's)."""
    raw_seen, topic_seen, redis_seen = seen
    rate, driver, steady = rates
    committed = slow.committed
    share = f"{steady / rate:.0%} of" if given else "half of"
    print(f"\nburst: {len(fast.committed)} transactions, sustained {rate:.0f}/s (driver {driver:.0f}/s)")
    print("  stages (changes, or records for the mirror):")
    print("\n".join(stage_lines(fast.before, fast.after)))
    print("  CPU:")
    print("\n".join(cpu_lines(fast.before, fast.after, len(fast.committed))))
    print(f"\nview orders_enriched: commit -> view row, {len(committed)} transactions at {steady:.0f}/s "
          f"({share} the {rate:.0f}/s sustained)")  # fmt: skip
    print(describe("raw topic (capture only)", *latencies(committed, raw_seen)))
    print(describe("view topic              ", *latencies(committed, topic_seen)))
    print(describe("Redis                   ", *latencies(committed, redis_seen)))
    print("  until it or a later state of its order showed (every commit, overwritten ones too):")
    print(describe("view topic              ", *until_shown(committed, topic_seen)))
    print(describe("Redis                   ", *until_shown(committed, redis_seen)))
    print("  stages:")
    print("\n".join(stage_lines(slow.before, slow.after)))
    print("  CPU:")
    print("\n".join(cpu_lines(slow.before, slow.after, len(committed))))
    if slow.broker:
        print(broker_line(slow.broker))
    if drained is not None:
        drain_report(drained)
    print(f"  {load_text()} (after)")


def drain_report(drained: Phase) -> None:
    span = drained.after.at - drained.before.at
    print(f"\ndrain: {len(drained.committed)} transactions committed while capture was stopped; every stage done "
          f"within {span:.1f} s of its release (looked at every second)")  # fmt: skip
    print("  stages (changes, or records for the mirror), each working through a backlog:")
    print("\n".join(stage_lines(drained.before, drained.after)))
    print("\n".join(ratio_lines(drained)))
    print("  CPU:")
    print("\n".join(cpu_lines(drained.before, drained.after, len(drained.committed))))


def profile_text(profile: str) -> str:
    """The footer: what capture, the workers and the observers ran with (``profile``: tansu or kafka)."""
    linger = TANSU_LINGER_MS if profile == "tansu" else DEFAULTS["linger.ms"]
    fetch = (f"Faust fetch wait 10 ms, its readers' {TANSU_FOLLOW_WAIT_MS} ms" if profile == "tansu"
             else "librdkafka's default fetch wait")  # fmt: skip
    return "\n".join([
        f"  capture: librdkafka idempotent acks=all, {profile} profile (linger {linger} ms);",
        f"  worker: {profile} profile ({fetch}), batch wait 5 ms,",
        f"  view rows by librdkafka idempotent acks=all linger {VIEW_ROWS_LINGER_MS} ms (points, fragments, cuts: "
        "0 ms);",
        "  observers (each a process of its own) fetch wait 5 ms; the burst commits with synchronous_commit off, the",
        "  steady load with it on" + ("" if profile == "tansu" else "; the broker's CPU is not counted (a Kafka of "
                                       "your own: not a process of this run)"),
    ])  # fmt: skip

"""The shop's view at a real size: 720k rows joined, mirrored into Redis, under the shop's load.

On the bench stack the sample shop is seeded with ``--customers`` customers and ``--orders``
orders (``headwater demo seed --customers 20000 --orders 200000``: about 720,000 rows), then
``headwater capture`` and ``--workers`` ``faust -A streams worker`` processes (one group, 1 unless
said) keep the shop's ``orders_enriched`` view (``headwater.shop.VIEWS_TOML``) with the Redis mirror
on. Printed: the time until Redis holds every view row, each worker's peak RSS (target 1 GB) while
the view is built and while the shop's workload (``demo load``) runs at ``--rate`` for ``--seconds``,
each worker's CPU-seconds building the view and from the load's start until Redis is equal, the broker's share of a
core in each ``bench.views.BROKER_EVERY`` seconds of the load (``bench.views.broker_shares``), the view documents' size
in Redis (target under 1 KB) and Redis' memory, how long after the load ended Redis and the
endpoint (a sample) equalled the view's SQL in PostgreSQL, then whether the whole view topic does
(read once: on the local broker reading it takes minutes), and every table topic's latest state
against its table. ``--fault pause`` stops the worker that owns the raw partition (``kill -STOP``)
20 s into the load for 20 s, past its group session, then lets it go on (a zombie for a moment);
``--fault kill`` kills it (``kill -9``) 20 s in and starts it again at once. Each worker's warnings
about another writer's records are counted.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg2
import redis

from bench import capture, fanout, views
from bench.tables import Peak, rss_mb
from bench.views import cpu_seconds
from headwater import shop, stack
from headwater.reconcile import (
    compare,
    compare_docs,
    endpoint_view_docs,
    latest_rows,
    latest_view_docs,
    redis_view_docs,
    view_docs_sql,
)
from tables.registry import Registry
from tables.topics import view_key
from tables.views import TableShape, parse_views

VIEW = "orders_enriched"
FAULTS = ("pause", "kill")


def redis_rows(client: redis.Redis) -> int:
    return max(int(client.dbsize()) - 1, 0)  # the view's rows and its one meta hash


def wait_rows(client: redis.Redis, rows: int, timeout: float = 3600) -> float:
    started = time.monotonic()
    while redis_rows(client) < rows:
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"Redis holds {redis_rows(client)} of {rows} view rows after {timeout:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - started


def doc_sizes(client: redis.Redis, sample: int = 2000) -> tuple[float, int]:
    """Mean and largest size in bytes of the ``doc`` of a sample of view rows."""
    sizes = []
    for n, name in enumerate(client.scan_iter(match=f"views:{VIEW}:*", count=1000)):
        if n >= sample:
            break
        sizes.append(int(client.hstrlen(name, "doc")))
    return sum(sizes) / max(len(sizes), 1), max(sizes, default=0)


def expected_docs(dsn: str, sql: str) -> Any:
    conn = psycopg2.connect(dsn)
    try:
        return view_docs_sql(conn, sql)
    finally:
        conn.close()


def problems(cfg: Any, expected: Any) -> list[str]:
    """Redis (every row) and 500 endpoint rows against the view's SQL (its rows: ``expected``)."""
    found = compare_docs(expected, redis_view_docs(cfg.redis_url, "views", VIEW)[0], "redis")
    sample = sorted(random.Random(5).sample(sorted(expected), min(500, len(expected))))
    endpoint = endpoint_view_docs(f"http://127.0.0.1:{views.PORT}", VIEW, sample)
    return found + compare_docs({k: expected[k] for k in sample}, endpoint, "endpoint")


def topic_problems(cfg: Any, dsn: str, sql: str) -> tuple[float, list[str]]:
    """The whole view topic against the view's SQL, and the seconds its reading took (the local broker
    serves a topic of several hundred thousand records at a few thousand a second)."""
    started = time.monotonic()
    topic = latest_view_docs(cfg.bootstrap, f"views.views.{VIEW}", Registry(cfg.registry_url), timeout=3600)
    return time.monotonic() - started, compare_docs(expected_docs(dsn, sql), topic, "topic")


def converge(cfg: Any, dsn: str, sql: str, timeout: float = 900, every: float = 60,
             settled: float = 5) -> tuple[float, list[str]]:  # fmt: skip
    """Seconds from the load's end until Redis and the endpoint equal the view's SQL, and what differed last.
    PostgreSQL stands still after the load, so its view is read once; Redis and the endpoint are compared once
    Redis has shown the same cut for ``settled`` s (once per cut), or every ``every`` s: a check of 720k rows
    every 2 s, or at each new cut while the workers catch up, took a third to three quarters of a core and 2 GB
    beside the pipeline it timed (2026-11-28)."""
    started, expected = time.monotonic(), expected_docs(dsn, sql)
    client, looked, since = redis.Redis.from_url(cfg.redis_url), -every, time.monotonic()
    seen: Any = None
    try:
        while True:
            try:
                cut, now = client.hget(view_key("views", VIEW), "cut_lsn"), time.monotonic()
                if cut != seen:
                    seen, since = cut, now
                if (now - since >= settled and looked < since) or now - looked >= every:
                    looked, found = now, problems(cfg, expected)
            except redis.RedisError as exc:  # Redis held by a long cut (the mirror says so): asked again
                found = [f"Redis did not answer: {exc!r}"]
            if not found or time.monotonic() - started > timeout:
                return time.monotonic() - started, found
            time.sleep(1)
    finally:
        client.close()


@dataclass
class Run:
    """What one run measured; per worker lists are in the workers' order."""

    built: float = 0.0
    build_peak: list[float] = field(default_factory=list)
    load_peak: list[float] = field(default_factory=list)
    after: list[float] = field(default_factory=list)
    build_cpu: list[float] = field(default_factory=list)
    load_cpu: list[float] = field(default_factory=list)
    mean: float = 0.0
    largest: int = 0
    memory: float = 0.0
    lag: float = 0.0
    found: list[str] = field(default_factory=list)
    reading: float = 0.0
    on_topic: list[str] = field(default_factory=list)
    tables: dict[str, int] = field(default_factory=dict)  # table -> rows in PostgreSQL
    on_tables: list[str] = field(default_factory=list)
    fault: str = "none"
    warnings: list[str] = field(default_factory=list)
    stages: list[str] = field(default_factory=list)  # each worker's stages, from the load's start until equal
    slow_cuts: list[str] = field(default_factory=list)  # cuts whose application held Redis over a second
    broker: list[float] = field(default_factory=list)  # the broker's share of a core, each views.BROKER_EVERY s


@dataclass
class Workers:
    """The stream workers by number: the process running now (a fault may replace one) and the CPU-seconds of
    the processes it replaced."""

    procs: views.Procs
    count: int
    spawn: Callable[[int], Any]
    gone_cpu: dict[int, float] = field(default_factory=dict)

    def pid(self, i: int) -> int:
        return self.procs[f"worker {i}"].pid

    def cpu(self) -> list[float]:
        return [cpu_seconds(self.pid(i)) + self.gone_cpu.get(i, 0.0) for i in range(self.count)]

    def raw_owner(self, timeout: float = 60) -> int:
        """The worker running the fan-out (it holds the raw partition): its ``/fanout/`` has counters."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in range(self.count):
                if fanout._poll(views.PORT + i, "/fanout/", lambda a: int("changes" in a)):
                    return i
            time.sleep(0.5)
        raise RuntimeError(f"no worker runs the fan-out after {timeout:.0f} s")

    def kill(self, i: int) -> None:
        """``kill -9`` worker ``i`` and start it again at once (same home, port and settings)."""
        proc = self.procs[f"worker {i}"]
        self.gone_cpu[i] = self.gone_cpu.get(i, 0.0) + cpu_seconds(proc.pid)
        proc.kill()
        proc.wait(timeout=60)
        self.procs[f"worker {i}"] = self.spawn(i)


def inject(fault: str, workers: Workers, at: float = 20.0, hold: float = 20.0) -> str:
    """``fault`` done to the raw partition's owner ``at`` seconds from now: what was done."""
    time.sleep(at)
    i = workers.raw_owner()
    started = time.strftime("%H:%M:%S")
    if fault == "kill":
        workers.kill(i)
        return f"worker {i} (the raw partition's owner) killed (kill -9) at {started}, {at:g} s into the load, " \
               f"and started again at once"  # fmt: skip
    os.kill(workers.pid(i), signal.SIGSTOP)
    try:
        time.sleep(hold)
    finally:
        os.kill(workers.pid(i), signal.SIGCONT)
    return f"worker {i} (the raw partition's owner) stopped (kill -STOP) at {started}, {at:g} s into the load, " \
           f"for {hold:g} s"  # fmt: skip


def main(customers: int, orders: int, seconds: float, rate: float, workers: int = 1, fault: str | None = None) -> None:
    if fault is not None and fault not in FAULTS:
        raise SystemExit(f"--fault {fault!r}: choose one of {', '.join(FAULTS)}")
    with capture.seeded_stack() as (cfg, dsn, work):
        print(f"seeding the shop: {customers} customers, {orders} orders ...", flush=True)
        conn = psycopg2.connect(dsn)
        started = time.monotonic()
        counts = shop.seed(conn, shop.Scale(customers=customers, orders=orders), rng_seed=2)  # on top of the small shop
        seeded = time.monotonic() - started
        with conn.cursor() as cur:
            cur.execute("SELECT (SELECT count(*) FROM orders), (SELECT count(*) FROM customers) + "
                        "(SELECT count(*) FROM products) + (SELECT count(*) FROM orders) + "
                        "(SELECT count(*) FROM order_items)")  # fmt: skip
            order_rows, rows = cur.fetchone()  # type: ignore[misc]
        conn.close()
        with views.pipeline(cfg, dsn, work, workers=workers) as procs:
            spawn = functools.partial(views.start_worker, cfg, work)
            run = measure(cfg, dsn, Workers(procs, workers, spawn), order_rows, seconds, rate, fault)
            run.warnings = worker_warnings(work, workers, "another w")  # records another writer put among its own
            run.slow_cuts = worker_warnings(work, workers, "Redis mirror: applying")
    print(f"\nshop view {VIEW}: {rows} rows ({order_rows} orders; seeded in {seeded:.1f} s: {counts}), "
          f"{workers} worker(s)")  # fmt: skip
    report(run, seconds, rate)


def worker_warnings(work: Path, workers: int, needle: str) -> list[str]:
    """The workers' warnings holding ``needle``, ``worker i: <message>``."""
    found = []
    for i in range(workers):
        for line in (work / f"worker{i}" / "worker.log").read_text(errors="replace").splitlines():
            if "WARNING" in line and needle in line:
                found.append(f"worker {i}: {line.partition('headwater.streams: ')[2][:300] or line[:300]}")
    return found


def measure(cfg: Any, dsn: str, workers: Workers, order_rows: int, seconds: float, rate: float,
            fault: str | None = None) -> Run:  # fmt: skip
    """Build the view, load the shop (with ``fault`` done to a worker), wait until Redis and the endpoint equal
    the SQL, read the view topic and the table topics."""
    shapes = {f"public.{t}": TableShape(f"public.{t}", (), tuple(k)) for t, k in shop.KEYS.items()}
    sql = parse_views(tomllib.loads(shop.VIEWS_TOML), shop.VIEWS_TOML)[0].sql(shapes)
    client, run = redis.Redis.from_url(cfg.redis_url), Run()
    peaks, cpu = [Peak(functools.partial(workers.pid, i)) for i in range(workers.count)], workers.cpu()
    run.built = wait_rows(client, order_rows)
    run.build_peak = [p.take() for p in peaks]
    run.build_cpu = [now - then for now, then in zip(workers.cpu(), cpu, strict=True)]
    run.mean, run.largest = doc_sizes(client)
    run.memory = int(client.info("memory")["used_memory"]) / 2**20
    print(f"  view built: {run.built:.1f} s; peak RSS {', '.join(f'{p:.0f}' for p in run.build_peak)} MB; "
          f"loading the shop at {rate:g} tx/s for {seconds:g} s ...", flush=True)  # fmt: skip
    cpu, stages = workers.cpu(), counters(workers.count)
    with views.broker_shares(stack.Broker(cfg).pid()) as broker:
        run.fault = load(dsn, rate, seconds, fault, workers)
    run.broker = list(broker)
    run.load_peak = [p.take() for p in peaks]
    run.lag, run.found = converge(cfg, dsn, sql)
    run.stages = views.stage_lines(stages, counters(workers.count), hidden=workers.gone_cpu)
    run.stages += [f"    worker {i}: restarted by the fault; its stages' counters began again, not shown"
                   for i in workers.gone_cpu]  # fmt: skip
    run.load_cpu = [now - then for now, then in zip(workers.cpu(), cpu, strict=True)]
    run.after = [max(p.take(), rss_mb(workers.pid(i))) for i, p in enumerate(peaks)]
    print(f"  Redis and the endpoint {'equal the SQL' if not run.found else 'differ'} {run.lag:.1f} s after the load "
          f"ended; reading the view topic and the table topics ...", flush=True)  # fmt: skip
    run.reading, run.on_topic = topic_problems(cfg, dsn, sql)
    run.tables, run.on_tables = table_problems(cfg, dsn)
    for p in peaks:
        p.stop.set()
    return run


def counters(workers: int) -> views.Sample:
    """The workers' stage counters (items, busy and CPU seconds) now."""
    return views.Sample(time.monotonic(), {}, [views.scrape(views.PORT + i) for i in range(workers)])


def load(dsn: str, rate: float, seconds: float, fault: str | None, workers: Workers) -> str:
    """The shop's load, with ``fault`` done to the raw partition's owner meanwhile: what was done."""
    done: list[str] = []
    doer = threading.Thread(target=lambda: done.append(inject(fault, workers)), daemon=True) if fault else None
    if doer is not None:
        doer.start()
    try:
        shop.Workload(psycopg2.connect(dsn), rng_seed=3).run(rate=rate, duration=seconds)
    finally:  # a worker the fault restarts is in ``procs`` before the pipeline stops them all
        if doer is not None:
            doer.join(timeout=120)
    return done[0] if done else ("none" if fault is None else f"{fault}: not done (the load ended first?)")


def table_problems(cfg: Any, dsn: str) -> tuple[dict[str, int], list[str]]:
    """Every table topic's latest state (``views.<table>``) against its table: rows in each, differences."""
    decode, conn = Registry(cfg.registry_url), psycopg2.connect(dsn)
    counts, found = {}, []
    try:
        for table, key in shop.KEYS.items():
            counts[table], problems = compare(conn, table, key, latest_rows(cfg.bootstrap, f"views.{table}", decode,
                                                                           timeout=600))  # fmt: skip
            found += problems
    finally:
        conn.close()
    return counts, found


def report(run: Run, seconds: float, rate: float) -> None:
    def each(values: list[float], unit: str) -> str:
        return " and ".join(f"{v:.{1 if unit == 'CPU-s' else 0}f}" for v in values) + f" {unit}"

    print(f"  Redis holds every view row {run.built:.1f} s after capture confirmed the snapshot")
    print(f"  worker RSS: peak {each(run.build_peak, 'MB')} building, {each(run.load_peak, 'MB')} under the load, "
          f"{each(run.after, 'MB')} after (target <= 1 GB)")  # fmt: skip
    print(f"  worker CPU: {each(run.build_cpu, 'CPU-s')} building, {each(run.load_cpu, 'CPU-s')} from the load's "
          f"start until Redis was equal")  # fmt: skip
    if run.broker:
        print(views.broker_line(run.broker))
    print(f"  documents in Redis: mean {run.mean:.0f} B, largest {run.largest} B of a 2,000-row sample "
          f"(target < 1 KB); Redis used_memory {run.memory:.0f} MB")  # fmt: skip
    print("  each worker's stages from the load's start until Redis was equal:", *run.stages, sep="\n")
    print(f"  fault during the load: {run.fault}")
    verdict = "equal" if not run.found else f"{len(run.found)} differences, first: {run.found[0]}"
    print(f"  {rate:g} tx/s for {seconds:g} s, then Redis (every row) and 500 endpoint rows against the view's "
          f"SQL: {verdict} {run.lag:.1f} s after the load ended")  # fmt: skip
    verdict = "equal" if not run.on_topic else f"{len(run.on_topic)} differences, first: {run.on_topic[0]}"
    print(f"  then the whole view topic against the SQL: {verdict} (read in {run.reading:.0f} s)")
    verdict = "equal" if not run.on_tables else f"{len(run.on_tables)} differences, first: {run.on_tables[0]}"
    sizes = ", ".join(f"{table} {rows:,}" for table, rows in run.tables.items())
    print(f"  every table topic's latest state against its table ({sizes} rows): {verdict}")
    print(f"  warnings of records another writer put among a worker's: {len(run.warnings)}")
    for line in run.warnings[:8]:
        print(f"    {line}")
    print(f"  cuts whose application held Redis over a second: {len(run.slow_cuts)}")
    for line in run.slow_cuts[:8]:
        print(f"    {line}")

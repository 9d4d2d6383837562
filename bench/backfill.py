"""Backfills under a steady load against ``COPY`` of the same table, in one run (``./dev bench capture``).

Two tables, each on a stack of its own: the shop's ``orders`` grown to ``--rows`` rows (as the
snapshot benchmark grows it) under the shop's own transaction mix (``headwater demo load``:
new orders, status changes, orders moved, customers deleted with their orders, ...), and
pgbench's ``pgbench_accounts`` (``pgbench -i -s SCALE``: SCALE x 100,000 narrow rows) under
``pgbench -R RATE``. Capture streams every table of the set (no snapshot); then ``headwater
snapshot TABLE`` backfills the table while the load goes on. Printed, from one run each:
- ``COPY (SELECT * FROM TABLE) TO STDOUT`` (psql to /dev/null), idle and under the same load
  (median of 3 each), and the backfill's rate (capture's own figure: from the backfill's start
  to its end, every chunk written; the last acknowledged) as a share of each;
- capture's CPU seconds (every thread, and by thread) while it ran, and how busy every core was;
- the lag of the load's changes before the backfill, during it and after the backfills — every 50 ms, how far the
  raw topic's newest change lies behind its commit (the load commits every few ms, and the
  topic is in commit order): the stream goes on while the table is chunked. Sampling asks for the
  topic's end only; the change at each end is read after the run, one at a time, not the million
  messages a full consumer would read on the same cores;
- then a small table of the same set backfilled, with the time its retraction's read of the whole
  raw topic (by then the big table's million rows and the load's changes) took. After it the lag
  is the stream's own producer's again (on the local broker it lingers 50 ms; a backfill's chunks 5 ms).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg2
from confluent_kafka import Consumer, TopicPartition

from bench import capture
from bench.tables import pgbench
from capture.backfill import UNFINISHED, Backfill
from capture.state import State
from headwater import shop, stack
from tables.registry import Registry

SLOT, PREFIX = "bench_backfill", "bf"
SAMPLE_EVERY = 0.05  # seconds between looks at the raw topic's newest change
USAGE_EVERY = 0.1  # seconds between looks at the machine's and capture's CPU


@dataclass(frozen=True)
class Scenario:
    """A table to backfill, the tables captured with it, how its data is made and what loads it."""

    table: str
    include: str
    prepare: Callable[[stack.StackConfig, str], None]
    load: Callable[[stack.StackConfig], list[str]]
    what: str
    small: str  # a small table of the set, backfilled after ``table``: mostly the read of the raw topic's keys


def grow_orders(rows: int) -> Callable[[stack.StackConfig, str], None]:
    def prepare(cfg: stack.StackConfig, dsn: str) -> None:
        conn = psycopg2.connect(dsn)
        conn.autocommit = True
        with conn.cursor() as cur:  # 50 orders a customer: the load deletes a customer with their orders
            cur.execute("INSERT INTO customers (email, name, region) SELECT 'bench' || g || '@example.com',"
                        " 'Bench ' || g, 'north' FROM generate_series(1, %s) g", (rows // 50,))  # fmt: skip
            cur.execute("INSERT INTO orders (customer_id, status, total, note) SELECT c.id, 'paid', g / 100.0,"
                        " 'note ' || g FROM generate_series(1, %s) g JOIN customers c ON c.email = 'bench' ||"
                        " (1 + g %% %s) || '@example.com'", (rows, rows // 50))  # fmt: skip
            cur.execute("VACUUM ANALYZE")
        conn.close()

    return prepare


def shop_load(rate: float) -> Callable[[stack.StackConfig], list[str]]:
    return lambda cfg: [sys.executable, "-m", "headwater.cli", "demo", "load", "--rate", f"{rate:g}", "--duration",
                        "3600", "--postgres-port", str(cfg.postgres_port)]  # fmt: skip


def pgbench_data(scale: int) -> Callable[[stack.StackConfig, str], None]:
    return lambda cfg, dsn: print(pgbench(cfg, "-i", "-s", str(scale), "-q"), end="")


def pgbench_load(rate: float) -> Callable[[stack.StackConfig], list[str]]:
    return lambda cfg: [str(capture.bindir() / "pgbench"), "-h", cfg.host, "-p", str(cfg.postgres_port), "-U",
                        cfg.postgres_user, "-n", "-c", "2", "-j", "1", "-R", f"{rate:g}", "-T", "3600",
                        cfg.database]  # fmt: skip


def scenarios(rows: int, scale: int, rate: float | None) -> list[Scenario]:
    shop_rate, pgbench_rate = rate or 100.0, rate or 200.0
    return [
        Scenario("public.orders", ",".join(f"public.{t}" for t in shop.TABLES), grow_orders(rows),
                 shop_load(shop_rate), f"the shop's orders grown by {rows}, under headwater demo load --rate"
                 f" {shop_rate:g}", "public.products"),
        Scenario("public.pgbench_accounts", "public.pgbench_accounts,public.pgbench_branches,public.pgbench_tellers",
                 pgbench_data(scale), pgbench_load(pgbench_rate), f"pgbench -s {scale}, under pgbench -R"
                 f" {pgbench_rate:g}", "public.pgbench_tellers"),
    ]  # fmt: skip


@dataclass
class Lags:
    """Samples of how far the raw topic's newest change lies behind its commit, in ms, with the wall time of
    each sample."""

    seen: list[tuple[float, float]] = field(default_factory=list)  # filled once the load stopped
    cpu: float = 0.0  # the sampling thread's CPU seconds while the load ran (the reads after it left out)

    def between(self, start: float, end: float) -> list[float]:
        return sorted(lag for at, lag in self.seen if start <= at <= end)


def follow(cfg: stack.StackConfig, lags: Lags, stop: threading.Event) -> None:
    """Every ``SAMPLE_EVERY`` seconds, the newest change of the raw topic: now minus its commit time. The load
    commits every few ms, and the topic is in commit order (a chunk at its high watermark's commit), so this
    is the lag of the changes committed last. (The local broker's reported end is the last batch's first
    offset + 1: that batch's first change, at most one linger older than its last.) While the load runs only
    the topic's end is asked for; the change there is read once ``stop`` is set: reading it at once fetched the
    batch it is in, during a backfill up to 4 MiB of lz4 every 50 ms, which cost the machine ~7% of its CPU in the
    very interval measured (bench/RESULTS.md, 2026-11-28)."""
    tp = TopicPartition(f"{PREFIX}.changes", 0)
    consumer = Consumer({"bootstrap.servers": cfg.bootstrap, "group.id": "bench-backfill-lag",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 5})  # fmt: skip
    ends: list[tuple[float, int]] = []
    started = time.thread_time()
    try:
        while not stop.wait(SAMPLE_EVERY):
            ends.append((time.time(), consumer.get_watermark_offsets(tp, timeout=5, cached=False)[1]))
        lags.cpu = time.thread_time() - started
        commits = commit_times(consumer, tp, {end - 1 for _, end in ends if end > 0}, Registry(cfg.registry_url))
        lags.seen.extend((at, (at - commits[end - 1]) * 1000) for at, end in ends if end - 1 in commits)
    finally:
        consumer.close()


def commit_times(consumer: Consumer, tp: TopicPartition, offsets: set[int], decoder: Registry) -> dict[int, float]:
    """The commit time (epoch seconds) of the change at each of ``offsets``."""
    found: dict[int, float] = {}
    try:
        for offset in sorted(offsets):
            consumer.assign([TopicPartition(tp.topic, tp.partition, offset)])
            message = next((m for m in consumer.consume(1, timeout=5) if m.error() is None and m.value()), None)
            if message is not None and message.offset() == offset:
                found[offset] = decoder.decode(message.value())["commit_time"].timestamp()
    finally:
        consumer.unassign()
        decoder.close()
    return found


def copy_seconds(dsn: str, table: str, times: int = 3) -> float:
    """Median seconds of ``COPY (SELECT * FROM table) TO STDOUT``, psql to /dev/null."""
    psql = [str(capture.bindir() / "psql"), dsn, "-qc", f"COPY (SELECT * FROM {table}) TO STDOUT"]  # noqa: S608
    return statistics.median(capture.sh(psql, stdout=subprocess.DEVNULL) for _ in range(times))


def count(dsn: str, table: str) -> int:
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute(f"SELECT count(*) FROM {table}")  # noqa: S608 - the scenario's own table
        found = int(cur.fetchone()[0])  # type: ignore[index]
    conn.close()
    return found


def backfilled(work: Path) -> Backfill:
    """The backfill, once capture's state says it is done (saved after Kafka acknowledged its last chunk)."""
    while True:
        state = State(work / "state-backfill", SLOT)
        try:
            found = state.backfills()
        finally:
            state.close()
        if found and found[-1].status not in UNFINISHED:
            return found[-1]
        time.sleep(0.1)


def ask(work: Path, table: str) -> None:
    argv = [sys.executable, "-m", "headwater.cli", "snapshot", table, "--slot", SLOT, "--state-dir",
            str(work / "state-backfill"), "--wait", "60"]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, timeout=120)


def stat_seconds(stat: Path) -> tuple[str, float] | None:
    """The name and the user + system CPU seconds so far in a ``/proc/.../stat`` file (None: the process or
    thread ended)."""
    try:
        head, _, rest = stat.read_text().rpartition(")")
    except OSError:
        return None
    fields = rest.split()
    return head.partition("(")[2], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process so far (its threads included)."""
    found = stat_seconds(Path(f"/proc/{pid}/stat"))
    if found is None:
        raise RuntimeError(f"process {pid} ended")
    return found[1]


def thread_seconds(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads by name (librdkafka's are ``rdk:...``; ``main`` is the first)."""
    seconds: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        found = stat_seconds(task / "stat")
        if found is not None:
            name = "main" if task.name == str(pid) else found[0]
            seconds[name] = seconds.get(name, 0.0) + found[1]
    return seconds


def process_seconds(capture_pid: int) -> dict[int, tuple[str, float]]:
    """Every process on the machine: its name (``capture``, ``bench`` for this one, else the kernel's: ``postgres``,
    ``tansu...``, a kernel worker's without its current work) and its CPU seconds so far."""
    seconds: dict[int, tuple[str, float]] = {}
    for proc in Path("/proc").iterdir():
        found = stat_seconds(proc / "stat") if proc.name.isdigit() else None
        if found is not None:
            pid = int(proc.name)
            name = {capture_pid: "capture", os.getpid(): "bench"}.get(pid) or found[0].partition("-")[0]
            seconds[pid] = (name, found[1])
    return seconds


def machine_seconds() -> tuple[float, float]:
    """(busy, all) CPU seconds of every core so far (``/proc/stat``): how full the machine was."""
    ticks = [int(t) for t in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), sum(ticks) / os.sysconf("SC_CLK_TCK")


@dataclass
class Usage:
    """Every ``USAGE_EVERY`` seconds: the wall time, the machine's (busy, all) CPU seconds and capture's CPU
    seconds by thread (threads that end keep their last sample)."""

    seen: list[tuple[float, tuple[float, float], dict[str, float], dict[int, tuple[str, float]]]] = field(
        default_factory=list)  # fmt: skip

    def sample(self, pid: int) -> None:
        self.seen.append((time.time(), machine_seconds(), thread_seconds(pid), process_seconds(pid)))

    def between(self, start: float, end: float) -> tuple[tuple[float, float], dict[str, float], dict[str, float]]:
        """The machine's (busy, all) CPU seconds, capture's by thread and every process's by name, from the last
        sample at or before ``start`` to the first at or after ``end``."""
        first = max((s for s in self.seen if s[0] <= start), key=lambda s: s[0], default=self.seen[0])
        last = min((s for s in self.seen if s[0] >= end), key=lambda s: s[0], default=self.seen[-1])
        machine = (last[1][0] - first[1][0], last[1][1] - first[1][1])
        return machine, spent(first[2], last[2]), by_name(first[3], last[3])


def by_name(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """The CPU seconds each process spent from ``before`` to ``after``, summed by name, largest first."""
    seconds: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        seconds[name] = seconds.get(name, 0.0) + cpu - before.get(pid, (name, 0.0))[1]
    return spent({}, seconds)


def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The CPU seconds of each name from ``before`` to ``after``, largest first (names that spent none left out)."""
    grown = {name: cpu - before.get(name, 0.0) for name, cpu in after.items() if cpu - before.get(name, 0.0) > 0}
    return dict(sorted(grown.items(), key=lambda item: -item[1]))


def watch_usage(pid: int, usage: Usage, stop: threading.Event) -> None:
    usage.sample(pid)
    while not stop.wait(USAGE_EVERY):
        usage.sample(pid)


@dataclass
class Run:
    """What one scenario measured."""

    scenario: Scenario
    rows: int = 0
    idle: float = 0.0
    loaded: float = 0.0
    cpu: float = 0.0
    usage: Usage = field(default_factory=Usage)
    before: tuple[float, float] = (0.0, 0.0)
    after: tuple[float, float] = (0.0, 0.0)  # the load's last 5 s, after the backfills
    lags: Lags = field(default_factory=Lags)
    done: Backfill | None = None
    raw: int = 0  # the raw topic's changes as the small table's backfill started
    again: Backfill | None = None  # the large table re-snapshotted, after the small one


def run(cfg: stack.StackConfig, dsn: str, work: Path, scenario: Scenario, chunk: int | None = None) -> Run:
    """One scenario on a running stack (``cfg``)."""
    print(f"backfill of {scenario.table}: {scenario.what} ...", flush=True)
    scenario.prepare(cfg, dsn)
    measured = Run(scenario, rows=count(dsn, scenario.table), idle=copy_seconds(dsn, scenario.table))
    extra = ["--backfill-chunk-rows", str(chunk)] if chunk else []
    argv = capture.capture_argv(cfg, PREFIX, SLOT, work / "state-backfill", "--include", scenario.include,
                                "--skip-snapshot", *extra)  # fmt: skip
    argv[argv.index("--publication") + 1] = SLOT
    cap = subprocess.Popen(argv, env={**os.environ, "HEADWATER_CAPTURE_DSN": dsn},
                           stdout=(work / "capture-backfill.log").open("ab"), stderr=subprocess.STDOUT)  # fmt: skip
    stop = threading.Event()
    follower = threading.Thread(target=follow, args=(cfg, measured.lags, stop), daemon=True)
    sampler = threading.Thread(target=watch_usage, args=(cap.pid, measured.usage, stop), daemon=True)
    load = None
    try:
        capture.wait_confirmed(dsn, SLOT, cap)
        follower.start()
        load = subprocess.Popen(scenario.load(cfg), env={**os.environ, "PGPASSWORD": cfg.postgres_password.reveal()},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(6.0)
        measured.before = (time.time() - 5.0, time.time())
        measured.loaded = copy_seconds(dsn, scenario.table)
        cpu = cpu_seconds(cap.pid)
        sampler.start()
        ask(work, scenario.table)
        measured.done = backfilled(work)
        measured.cpu = cpu_seconds(cap.pid) - cpu
        measured.raw = raw_changes(cfg)
        ask(work, scenario.small)
        backfilled(work)
        ask(work, scenario.table)  # again: the topic holds its keys now, so its retraction reads and checks them
        measured.again = backfilled(work)
        time.sleep(5.0)
        measured.after = (time.time() - 5.0, time.time())
    finally:
        if load is not None:
            load.terminate()
            load.wait()
        stop.set()
        follower.join(timeout=300)  # it reads the change at every end it saw
        if sampler.is_alive():
            sampler.join(timeout=30)
        cap.terminate()
        cap.wait(timeout=120)
    if follower.is_alive():
        raise RuntimeError("the lag sampler did not read the changes it saw within 300 s: no lag to report")
    return measured


def raw_changes(cfg: stack.StackConfig) -> int:
    consumer = Consumer({"bootstrap.servers": cfg.bootstrap, "group.id": "bench-backfill-end"})
    try:
        return int(consumer.get_watermark_offsets(TopicPartition(f"{PREFIX}.changes", 0), timeout=10)[1])
    finally:
        consumer.close()


def logged(log: Path, table: str, backfill: int | None = None) -> tuple[int, int, float] | None:
    """(backfill id, rows, seconds) of backfill #``backfill`` (else the first) of ``table`` capture's log says is
    done."""
    which = r"\d+" if backfill is None else str(backfill)
    found = re.findall(rf"backfill #({which}) of {re.escape(table)} done: (\d+) rows in ([\d.]+) s", log.read_text())
    return (int(found[0][0]), int(found[0][1]), float(found[0][2])) if found else None


def report(measured: Run, log: Path) -> None:
    done, table = measured.done, measured.scenario.table
    found, small = logged(log, table, done.id if done else None), logged(log, measured.scenario.small)
    if done is None or done.status != "done" or found is None or small is None:
        raise RuntimeError(f"the backfill of {table} did not finish: {done.describe() if done else 'not asked'}")
    assert done.started_at is not None and done.finished_at is not None
    _, rows, seconds = found
    idle, loaded, lags = measured.idle, measured.loaded, measured.lags
    print(f"\nbackfill of {table} ({measured.rows} rows; {measured.scenario.what}):")
    print(f"  COPY ... TO STDOUT (psql -> /dev/null), idle:       {idle:7.2f} s  {measured.rows / idle:9.0f} rows/s")
    print(f"  COPY ... TO STDOUT, under the same load:           {loaded:7.2f} s  {measured.rows / loaded:9.0f} rows/s")
    print(f"  headwater backfill (-> Kafka, Avro, acknowledged): {seconds:7.2f} s  {rows / seconds:9.0f} rows/s"
          f"  ({rows} rows written, {done.dropped} read and left to the stream)")  # fmt: skip
    print(f"  ratio: {loaded / seconds * rows / measured.rows:.0%} of COPY under load,"
          f" {idle / seconds * rows / measured.rows:.0%} of COPY idle (target >= 30%)")  # fmt: skip
    print(f"  capture's CPU while it ran (every thread): {measured.cpu:.1f} s"
          f" = {measured.cpu / rows * 1e6:.2f} CPU-s per million rows")  # fmt: skip
    (busy, total), threads, processes = measured.usage.between(done.started_at, done.finished_at)
    print(f"  from the backfill's start to its end (±{USAGE_EVERY * 1000:.0f} ms): the machine's cores {busy:.1f}"
          f" of {total:.1f} CPU-s busy ({busy / total:.0%})")  # fmt: skip
    print(f"    capture {sum(threads.values()):.2f} CPU-s: {named(threads)}")
    print(f"    by process: {named(processes, 5)}")
    every = f"{SAMPLE_EVERY * 1000:.0f} ms"
    print(f"  lag: how far the raw topic's newest change lies behind its commit (sampled every {every}):")
    print(describe("before the backfill (5 s)", lags.between(*measured.before)))
    print(describe(f"during the backfill ({done.finished_at - done.started_at:.1f} s)",
                   lags.between(done.started_at, done.finished_at)))  # fmt: skip
    print(describe("after the backfills (5 s; the stream's own producer again)", lags.between(*measured.after)))
    print(f"  (the sampler's CPU: {lags.cpu:.2f} s)")
    reads = re.findall(rf"the raw topic holds \d+ changes from before backfill #{small[0]} \(\d+ keys of its tables,"
                       r" read in ([\d.]+) s\)", log.read_text())  # fmt: skip
    print(f"  then {measured.scenario.small} ({small[1]} rows), with {measured.raw} changes on the raw topic to read"
          f" for its retraction: {small[2]:.2f} s (the read: {reads[-1] if reads else '?'} s)")  # fmt: skip
    again(measured, log)


def again(measured: Run, log: Path) -> None:
    """The large table's re-snapshot: its time, the keys' read, and how many keys its chunks left out."""
    done, table, text = measured.again, measured.scenario.table, log.read_text()
    if done is None or done.status != "done" or done.started_at is None or done.finished_at is None:
        raise RuntimeError(f"the re-snapshot of {table} did not finish: {done.describe() if done else 'not asked'}")
    read = re.findall(rf"the raw topic holds (\d+) changes from before backfill #{done.id} \((\d+) keys of its tables,"
                      r" read in ([\d.]+) s\)", text)  # fmt: skip
    told = re.findall(rf"backfill #{done.id}: (\d+) of the (\d+) keys .* \((\d+) of them before the keys were known\);"
                      r" looking for the other (\d+)", text)  # fmt: skip
    if not read or not told:
        raise RuntimeError(f"capture's log does not say how backfill #{done.id}'s keys were read and checked")
    (changes, _, seconds), (left, held, early, looked) = read[-1], told[-1]
    print(f"  then {table} again ({done.rows} rows; {held} of its keys on the raw topic, among {changes} changes):"
          f" {done.finished_at - done.started_at:.2f} s; the keys read in {seconds} s; {left} of them left out as its"
          f" chunks read them ({early} before the keys were known), {looked} looked up, {done.retracted} retracted")


def named(seconds: dict[str, float], most: int = 8) -> str:
    return ", ".join(f"{name} {cpu:.2f} s" for name, cpu in list(seconds.items())[:most])


def describe(name: str, values: list[float]) -> str:
    if not values:
        return f"    {name}: no sample"
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return (f"    {name}: {len(values)} samples, p50 {pick(0.5):.0f} ms, p99 {pick(0.99):.0f} ms,"
            f" max {values[-1]:.0f} ms")  # fmt: skip


def main(rows: int, scale: int, rate: float | None) -> None:
    for scenario in scenarios(rows, scale, rate):
        with capture.seeded_stack() as (cfg, dsn, work):
            measured = run(cfg, dsn, work, scenario)
            report(measured, work / "capture-backfill.log")

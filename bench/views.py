"""End-to-end latency of a view: PostgreSQL commit -> the view row on its topic and in Redis.

On the bench stack (seeded sample shop), ``headwater capture`` and ``faust -A streams
worker`` keep the README's ``orders_enriched`` view (orders ⋈ customers ⋈ items ⋈ products)
with the Redis mirror on. Each bench transaction sets one order's ``note`` to a unique
token and touches that order's customer (so the join is exercised); its start time is
when ``COMMIT`` returned. Observers record when the token first shows up:

* on the view topic — a librdkafka consumer reading it from its end (fetch wait 5 ms);
* in Redis — a keyspace-notification subscriber reading the row's ``doc``;
* and, to tell capture's share apart, on the raw change topic (the order's new row).

1. the sustainable rate: a burst of transactions committed as fast as one connection
   can; rate = burst / time until the view topic shows the last of them;
2. a steady load at half that rate (or ``--rate``) for ``--seconds``; p50 / p99 / max latency of both.

Orders are taken round-robin, so one batch rarely updates an order twice; a token
overwritten before it was published is counted as superseded, not as a latency.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg2
import redis
from confluent_kafka import Consumer, TopicPartition

from bench import capture
from bench.fanout import spawn_worker
from headwater import shop, stack
from tables.registry import Registry

PORT = 26067
TOPIC = "views.views.orders_enriched"
RAW = "views.changes"


class Seen:
    """When each token was first seen by one observer."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self.lock = threading.Lock()

    def mark(self, token: str | None) -> None:
        if token and token.startswith("bench-"):
            with self.lock:
                self.at.setdefault(token, time.monotonic())


def follow_topic(cfg: stack.StackConfig, topic: str, seen: Seen, stop: threading.Event) -> None:
    """Marks each token seen on ``topic``: a view row's note, or (raw topic) an order's new note."""
    consumer = Consumer({"bootstrap.servers": cfg.bootstrap, "group.id": "bench-view-latency",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 5})  # fmt: skip
    decoder = Registry(cfg.registry_url)
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, consumer.get_watermark_offsets(TopicPartition(topic, p))[1])
                     for p in partitions])  # fmt: skip
    try:
        while not stop.is_set():
            for msg in consumer.consume(1000, timeout=0.05):
                if msg.error() is None and msg.value() is not None:
                    value = decoder.decode(msg.value())
                    if topic == RAW:
                        value = decoder.decode(value["after"]) if value["table"] == "orders" else {}
                    seen.mark(value.get("note"))
    finally:
        consumer.close()


def follow_redis(cfg: stack.StackConfig, seen: Seen, stop: threading.Event) -> None:
    client = redis.Redis.from_url(cfg.redis_url)
    client.config_set("notify-keyspace-events", "Kh")
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.psubscribe("__keyspace@0__:views:orders_enriched:*")
    try:
        while not stop.is_set():
            message = pubsub.get_message(timeout=0.05)
            if message is None:
                continue
            key = message["channel"].decode().split(":", 1)[1]
            doc = client.hget(key, "doc")
            if doc is not None:
                seen.mark(json.loads(doc).get("note"))
    finally:
        pubsub.close()


def commit(cur: Any, order: int, token: str) -> float:
    cur.execute("UPDATE orders SET note = %s WHERE id = %s RETURNING customer_id", (token, order))
    customer = cur.fetchone()[0]
    cur.execute("UPDATE customers SET profile = jsonb_build_object('last', %s) WHERE id = %s", (token, customer))
    cur.connection.commit()
    return time.monotonic()


def run_load(dsn: str, orders: list[int], count: int, rate: float | None, tag: str) -> dict[str, float]:
    """``count`` transactions (at ``rate`` per second, or as fast as possible); token -> commit time."""
    conn = psycopg2.connect(dsn)
    committed: dict[str, float] = {}
    started = time.monotonic()
    with conn.cursor() as cur:
        for n in range(count):
            token = f"bench-{tag}-{n}"
            committed[token] = commit(cur, orders[n % len(orders)], token)
            if rate:
                delay = started + (n + 1) / rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
    conn.close()
    return committed


def wait_seen(seen: Seen, token: str, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with seen.lock:
            if token in seen.at:
                return seen.at[token]
        time.sleep(0.01)
    raise RuntimeError(f"{token} did not reach the view within {timeout:.0f} s")


def latencies(committed: dict[str, float], seen: Seen) -> tuple[list[float], int]:
    found = sorted((seen.at[t] - c) * 1000 for t, c in committed.items() if t in seen.at)
    return found, len(committed) - len(found)


def describe(name: str, values: list[float], superseded: int) -> str:
    if not values:
        return f"  {name}: nothing seen"
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return (f"  {name}: p50 {pick(0.5):6.1f} ms   p90 {pick(0.9):6.1f} ms   p99 {pick(0.99):6.1f} ms   "
            f"max {values[-1]:6.1f} ms   "
            f"({len(values)} rows, {superseded} superseded)")  # fmt: skip


def wait_published(cfg: stack.StackConfig, timeout: float = 300) -> None:
    """Until the worker published the view (Redis shows a cut)."""
    client = redis.Redis.from_url(cfg.redis_url)
    deadline = time.monotonic() + timeout
    while client.hget("views:orders_enriched", "cut_lsn") is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the view was not published within {timeout:.0f} s")
        time.sleep(0.5)


@contextmanager
def pipeline(cfg: stack.StackConfig, dsn: str, work: Path) -> Iterator[subprocess.Popen[bytes]]:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE PUBLICATION bench FOR TABLE customers, products, orders, order_items")
    conn.close()
    config = work / "views.toml"
    config.write_text(shop.VIEWS_TOML)
    log = (work / "capture-views.log").open("ab")
    argv = capture.capture_argv(cfg, "views", "bench_views", work / "state-views")
    capture_proc = subprocess.Popen(argv, env={**capture.os.environ, "HEADWATER_CAPTURE_DSN": dsn}, stdout=log,
                                    stderr=subprocess.STDOUT)  # fmt: skip
    capture.wait_confirmed(dsn, "bench_views", capture_proc)
    worker = spawn_worker(cfg, work, "views", PORT, config)
    try:
        yield worker
    finally:
        for proc in (worker, capture_proc):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # never left running
                proc.kill()
                proc.wait(timeout=60)
        for line in (work / "worker.log").read_text(errors="replace").splitlines():
            if "views at raw offset" in line or "fan-out at raw offset" in line:
                print("  worker:", line.split("] ")[-1])


def main(seconds: float = 20.0, burst: int = 2000, rate_steady: float | None = None) -> None:
    with capture.seeded_stack() as (cfg, dsn, work):
        conn = psycopg2.connect(dsn)
        with conn.cursor() as cur:
            cur.execute("SELECT id FROM orders ORDER BY id")
            orders = [row[0] for row in cur.fetchall()]
        conn.close()
        raw_seen, topic_seen, redis_seen, stop = Seen(), Seen(), Seen(), threading.Event()
        with pipeline(cfg, dsn, work):
            wait_published(cfg)
            observers = [threading.Thread(target=follow_topic, args=(cfg, TOPIC, topic_seen, stop)),
                         threading.Thread(target=follow_topic, args=(cfg, RAW, raw_seen, stop)),
                         threading.Thread(target=follow_redis, args=(cfg, redis_seen, stop))]  # fmt: skip
            for thread in observers:
                thread.start()
            try:
                time.sleep(1)
                run_load(dsn, orders, 1, None, "warm")
                wait_seen(topic_seen, "bench-warm-0")
                print(f"burst: {burst} transactions as fast as one connection commits ...", flush=True)
                fast = run_load(dsn, orders, burst, None, "burst")
                first = min(fast.values())
                rate = burst / (wait_seen(topic_seen, f"bench-burst-{burst - 1}") - first)
                steady = rate_steady or rate / 2
                time.sleep(15)  # let every agent (fan-out, tables, views) drain the burst
                print(f"  sustained {rate:.0f} transactions/s end to end; steady load at {steady:.0f}/s for "
                      f"{seconds:.0f} s ...", flush=True)  # fmt: skip
                committed = run_load(dsn, orders, int(steady * seconds), steady, "steady")
                last = max(committed, key=lambda t: committed[t])
                wait_seen(topic_seen, last)
                wait_seen(redis_seen, last)
                time.sleep(1)
            finally:
                stop.set()
                for thread in observers:
                    thread.join()
    share = f"{steady / rate:.0%} of" if rate_steady else "half of"
    print(f"\nview orders_enriched: commit -> view row, {len(committed)} transactions at {steady:.0f}/s "
          f"({share} the {rate:.0f}/s sustained)")  # fmt: skip
    print(describe("raw topic (capture only)", *latencies(committed, raw_seen)))
    print(describe("view topic              ", *latencies(committed, topic_seen)))
    print(describe("Redis                   ", *latencies(committed, redis_seen)))
    print("  capture: librdkafka idempotent acks=all linger 5 ms; worker: tansu profile (Faust fetch wait 10 ms),")
    print("  batch wait 5 ms, view rows by librdkafka idempotent acks=all linger 1 ms; observers fetch wait 5 ms")

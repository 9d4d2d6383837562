"""Fan-out throughput against a plain aiokafka consume-and-produce loop, on one raw topic, in one run.

A backlog of sample-shop transactions is captured into ``stream.changes`` (as in the
capture benchmark). Then, on the same broker:

1. baseline: one aiokafka consumer reads the raw topic, decodes each change with
   fastavro and sends its row image to ``base.<table>`` (same partition count as the
   table topics) with one aiokafka producer (acks=all, linger 5 ms; aiokafka's
   idempotence is refused by Tansu), then waits for every acknowledgement;
2. ours: ``faust -A streams worker`` (as users run it, table agent and endpoint
   included) fans the same raw topic out into the table topics.

Both rates are changes / seconds from the first change consumed to the last written
and acknowledged (group joins and start-up left out). The time until the worker's
Faust tables hold every row (they are fed from the table topics) is printed too.

Then the row images (``[capture] raw_images``): one more backlog captured four times, framed,
nested, nested, framed (``bench.capture.images_streaming``), and a worker fanning out each raw
topic in turn; and the decoding alone, ``streams.fanrun.decode`` over every message of each
topic in this process, in µs per change.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka.admin import AdminClient, NewTopic

from bench import capture
from headwater import shop, stack
from headwater.reconcile import latest_rows
from streams.fanrun import decode
from tables.change import ChangeReader
from tables.kafka import read_topic
from tables.registry import Registry

PARTITIONS = 4


async def plain_loop(cfg: stack.StackConfig, total: int) -> float:
    decoder = Registry(cfg.registry_url)  # writer schemas fetched once per id
    consumer = AIOKafkaConsumer("stream.changes", bootstrap_servers=cfg.bootstrap, group_id="bench-plain",
                                auto_offset_reset="earliest", enable_auto_commit=False)  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=cfg.bootstrap, acks="all", linger_ms=5)
    await consumer.start()
    await producer.start()
    seen, started, pending = 0, 0.0, []
    try:
        while seen < total:
            batches = await consumer.getmany(timeout_ms=500, max_records=5000)
            for records in batches.values():
                if not started:
                    started = time.monotonic()
                for record in records:
                    seen += 1
                    change = decoder.decode(record.value)
                    if change["key"] is None:
                        continue
                    after = None if change["op"] == "DELETE" else change["after"]
                    pending.append(await producer.send(f"base.{change['table']}", after, key=change["key"]))
            if len(pending) > 20000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        return time.monotonic() - started
    finally:
        await producer.stop()
        await consumer.stop()


def spawn_worker(cfg: stack.StackConfig, work: Path, prefix: str, port: int, config: Path | None = None,
                 ) -> subprocess.Popen[bytes]:  # fmt: skip
    """``faust -A streams worker`` on the bench stack, as users run it (log in ``work/worker.log``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_") or k.startswith("HEADWATER_STREAMS_")}
    env.update({
        "HEADWATER_STACK_KAFKA_PORT": str(cfg.kafka_port), "HEADWATER_STACK_REGISTRY_PORT": str(cfg.registry_port),
        "HEADWATER_STACK_REDIS_PORT": str(cfg.redis_port), "HEADWATER_STREAMS_TOPIC_PREFIX": prefix,
        "HEADWATER_STREAMS_APP_ID": f"bench-{prefix}", "HEADWATER_STREAMS_STATE_DIR": str(work / f"streams-{prefix}"),
        "PYTHONPATH": str(Path.cwd()), **({"HEADWATER_CONFIG": str(config)} if config else {}),
        **({"HEADWATER_STACK_KAFKA_BOOTSTRAP": cfg.kafka_bootstrap} if cfg.kafka_bootstrap else {}),
    })  # fmt: skip
    argv = [sys.executable, "-m", "faust", "-A", "streams", "worker", "-l", "info", "--web-port", str(port)]
    log = (work / "worker.log").open("ab")
    return subprocess.Popen(argv, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT)


def faust_worker(cfg: stack.StackConfig, work: Path, total: int) -> tuple[float, float, int]:
    """Seconds until the fan-out counted ``total`` changes, then until the worker's tables held
    every live key of the table topics, and that number of rows."""
    port = 26066
    proc = spawn_worker(cfg, work, "stream", port)
    try:
        started, fanned, rows = 0.0, 0.0, 0
        while True:
            if proc.poll() is not None:
                tail = (work / "worker.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"worker exited with {proc.returncode}:\n{tail}")
            done = _poll(port, "/fanout/", lambda a: int(a.get("changes", 0)))
            if done and not started:
                started = time.monotonic()
            if done >= total and not fanned:
                fanned = time.monotonic() - started
                rows = live_keys(cfg)
            if fanned and _poll(port, "/tables/", lambda a: sum(t["rows_here"] for t in a["tables"])) >= rows:
                return fanned, time.monotonic() - started, rows
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        for line in (work / "worker.log").read_text(errors="replace").splitlines():
            if "fan-out at raw offset" in line:
                print("  worker:", line.split("] ")[-1])


def live_keys(cfg: stack.StackConfig) -> int:
    """Keys the table topics hold a row for (latest record per key not a tombstone)."""
    topics = AdminClient({"bootstrap.servers": cfg.bootstrap}).list_topics(timeout=10).topics
    decoder = Registry(cfg.registry_url)  # writer schemas fetched once per id
    return sum(len(latest_rows(cfg.bootstrap, f"stream.{t}", decoder)) for t in shop.TABLES if f"stream.{t}" in topics)


def _poll(port: int, path: str, value: Callable[[Any], int]) -> int:
    try:
        return value(httpx.get(f"http://127.0.0.1:{port}{path}", timeout=2).json())
    except (httpx.HTTPError, ValueError, KeyError):
        return 0


def fanout_seconds(cfg: stack.StackConfig, work: Path, prefix: str, total: int, port: int) -> float:
    """Seconds from the first raw change the worker's fan-out counted to ``total`` (its /fanout/ counters)."""
    proc = spawn_worker(cfg, work, prefix, port)
    try:
        started = 0.0
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}: see {work / 'worker.log'}")
            done = _poll(port, "/fanout/", lambda a: int(a.get("changes", 0)))
            if done and not started:
                started = time.monotonic()
            if done >= total:
                return time.monotonic() - started
            time.sleep(0.02)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def decode_micros(cfg: stack.StackConfig, topic: str) -> tuple[float, int]:
    """µs per message of the fan-out's decoding (``streams.fanrun.decode``: images framed) over a whole raw
    topic (its first 200,000), best of three passes (the first also fetches the schemas), and the messages decoded."""
    values = [r.value for r in read_topic(cfg.bootstrap, topic, timeout=600) if r.value is not None][:200_000]
    read = ChangeReader(Registry(cfg.registry_url))
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for value in values:
            decode(read, value)
        best = min(best, time.perf_counter() - started)
    return best / len(values) * 1e6, len(values)


def images(cfg: stack.StackConfig, dsn: str, changes: int, work: Path) -> None:
    """The fan-out of the same backlog with framed and with nested row images (see the module's promise)."""
    streamed = capture.images_streaming(cfg, dsn, changes, work)
    seconds = {run: fanout_seconds(cfg, work, run, streamed[run][1], 26070 + n) for n, run in enumerate(capture.RUNS)}
    print(f"\nfan-out of {streamed[capture.RUNS[0]][1]} raw changes by row images (a worker each, in turn)")
    for run in capture.RUNS:
        micros, count = decode_micros(cfg, f"{run}.changes")
        print(f"  {run:<7}: {seconds[run]:.1f} s ({streamed[run][1] / seconds[run]:,.0f} changes/s); decoding alone"
              f" {micros:.1f} µs/change ({count} changes, {streamed[run][2]:.1f} bytes each)")  # fmt: skip
    best = {m: min(s for r, s in seconds.items() if capture.mode_of(r) == m) for m in capture.IMAGES}
    print(f"  best of two: nested at {best['framed'] / best['nested']:.0%} of framed")


def main(changes: int) -> None:
    with capture.seeded_stack() as (cfg, dsn, work):
        _, _, produced = capture.streaming(cfg, dsn, changes, work)
        admin = AdminClient({"bootstrap.servers": cfg.bootstrap})
        for future in admin.create_topics([NewTopic(f"base.{t}", PARTITIONS, 1) for t in shop.TABLES]).values():
            future.result()
        plain = asyncio.run(plain_loop(cfg, produced))
        ours, tables, rows = faust_worker(cfg, work, produced)
        images(cfg, dsn, changes, work)
    print(f"\nfan-out of {produced} raw changes into {PARTITIONS}-partition table topics")
    print(f"  plain aiokafka loop (decode, send, acks=all):     {plain:7.1f} s  {produced / plain:9.0f} changes/s")
    print(f"  faust -A streams worker (fan-out, dedupe, tables): {ours:7.1f} s  {produced / ours:9.0f} changes/s")
    print(f"  ratio: {plain / ours:.0%} of the plain loop")
    print(f"  the worker's Faust tables held all {rows} rows after {tables:.1f} s (they trail the fan-out)")
    print("  producers: plain = aiokafka acks=all linger 5 ms; ours = librdkafka idempotent acks=all linger 5 ms,")
    print("  Faust changelogs as aiokafka batches them (tansu profile: end offsets found by fetching)")

"""Capture throughput against PostgreSQL's own tools, on one backlog, in one run.

1. Streaming: two slots are created at the same point; a backlog of small sample-shop
   transactions (inserts, updates, deletes over four tables) is written; then
   ``pg_recvlogical`` (pgoutput, same publication) drains one slot to /dev/null and
   ``headwater capture`` drains the other into the raw topic (Avro, registry,
   acks=all, idempotent producer). Rate = changes / seconds until the slot confirmed
   the backlog's last commit.
2. Snapshot: ``COPY (SELECT ...) TO STDOUT`` of the captured tables to /dev/null
   against headwater's snapshot of the same tables (rows to the raw topic, acked).
3. Row images (``[capture] raw_images``): a second backlog drained by four slots created at the
   same point, one after the other: framed images (the default), nested, nested, framed, each
   into its own raw topic (``framed1.changes``, ``nested2.changes``, ..., which ``bench/fanout.py``
   fans out); then the snapshot of step 2 again with each, in the same order. Rates and the raw
   messages' mean size, each mode against the other in the same run.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg2

from capture import slot
from capture.config import CaptureConfig
from capture.producer import DEFAULTS, SnapshotSender, ensure_changes_topic
from capture.state import snapshot_done
from headwater import shop, stack
from tables.kafka import read_topic
from tables.wire import parse_lsn

BACKLOG_SQL = """
DO $$
DECLARE i int; o bigint; c bigint;
BEGIN
  FOR i IN 1..%(txs)s LOOP
    SELECT id INTO c FROM customers ORDER BY random() LIMIT 1;
    INSERT INTO orders (customer_id, status, total) VALUES (c, 'pending', 0) RETURNING id INTO o;
    INSERT INTO order_items (order_id, line_no, product_id, quantity, unit_price)
      SELECT o, g, p.id, 1 + g %% 3, p.price FROM generate_series(1, 4) g
      JOIN LATERAL (SELECT id, price FROM products ORDER BY random() LIMIT 1) p ON true;
    UPDATE orders SET total = (SELECT sum(quantity * unit_price) FROM order_items WHERE order_id = o),
                      status = 'paid' WHERE id = o;
    UPDATE customers SET region = 'north' WHERE id = c;
    DELETE FROM order_items WHERE order_id = o AND line_no = 4;
    COMMIT;
  END LOOP;
END $$;
"""
CHANGES_PER_TX = 8  # 1 + 4 inserts, 2 updates, 1 delete


def bindir() -> Path:
    return stack.Postgres.bindir()


def sh(argv: list[str], **kwargs: object) -> float:
    start = time.monotonic()
    subprocess.run(argv, check=True, **kwargs)  # type: ignore[call-overload]
    return time.monotonic() - start


def current_lsn(dsn: str) -> int:
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT pg_current_wal_lsn()::text")
        value = parse_lsn(cur.fetchone()[0])  # type: ignore[index]
    conn.close()
    return value


def wait_confirmed(dsn: str, slot_name: str, proc: subprocess.Popen[bytes]) -> float:
    """Seconds until capture confirmed everything written so far (no sync transaction added)."""
    return slot.wait_caught_up(dsn, slot_name, timeout=3600, alive=lambda: proc.poll() is None, sync=False)


def capture_argv(cfg: stack.StackConfig, prefix: str, slot: str, state: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "headwater.cli", "capture", "--slot", slot, "--publication", "bench",
        "--topic-prefix", prefix, "--state-dir", str(state), "--bootstrap", cfg.bootstrap,
        "--registry-url", cfg.registry_url, "--heartbeat-interval", "0",
        "--metrics-port", "0",  # counted as always, not served: a demo's capture may hold the default port
        # the bench stack is a local stack on other ports: what auto picks on one (or on a Kafka of your own)
        "--broker-profile", "kafka" if cfg.kafka_bootstrap else "tansu",
        *extra,
    ]  # fmt: skip


def streaming(cfg: stack.StackConfig, dsn: str, changes: int, work: Path) -> tuple[float, float, int]:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE PUBLICATION bench FOR TABLE customers, products, orders, order_items")
        cur.execute("SELECT pg_create_logical_replication_slot('bench_recvlogical', 'pgoutput')")
    env = {**os.environ, "HEADWATER_CAPTURE_DSN": dsn}
    log = (work / "capture-stream.log").open("ab")
    # our slot, created by capture itself (no snapshot), at the same point as pg_recvlogical's
    proc = subprocess.Popen(capture_argv(cfg, "stream", "bench_capture", work / "state-stream", "--skip-snapshot"),
                            env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    wait_confirmed(dsn, "bench_capture", proc)
    proc.terminate()
    proc.wait()
    txs = changes // CHANGES_PER_TX
    print(f"writing a backlog of {txs} transactions ({txs * CHANGES_PER_TX} changes) ...", flush=True)
    started = time.monotonic()
    with conn.cursor() as cur:
        cur.execute(BACKLOG_SQL % {"txs": txs})
    target = current_lsn(dsn)
    print(f"  written in {time.monotonic() - started:.1f} s", flush=True)

    recv = [
        str(bindir() / "pg_recvlogical"), "-d", dsn, "--slot", "bench_recvlogical", "--start", "--no-loop",
        "-o", "proto_version=1", "-o", "publication_names=bench", "-E", f"{target >> 32:X}/{target & 0xFFFFFFFF:X}",
        "-f", "/dev/null",
    ]  # fmt: skip
    recv_seconds = sh(recv)
    proc = subprocess.Popen(capture_argv(cfg, "stream", "bench_capture", work / "state-stream"),
                            env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    ours_seconds = wait_confirmed(dsn, "bench_capture", proc)
    proc.terminate()
    proc.wait()
    produced = sum(1 for _ in read_topic(cfg.bootstrap, "stream.changes", timeout=600))
    conn.close()
    return recv_seconds, ours_seconds, produced


def snapshot(cfg: stack.StackConfig, dsn: str, rows: int, work: Path) -> tuple[float, float, int, float]:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO orders (customer_id, status, total, note) SELECT 1 + g %% 200, 'paid', g / 100.0,"
            " 'note ' || g FROM generate_series(1, %s) g",
            (rows,),
        )
        cur.execute("VACUUM ANALYZE")
        cur.execute("SELECT sum(n_live_tup) FROM pg_stat_user_tables")
        total = int(cur.fetchone()[0])  # type: ignore[index]
    copy = "; ".join(f"COPY (SELECT * FROM {t}) TO STDOUT" for t in shop.TABLES)  # noqa: S608 - fixed names
    copy_seconds = sh([str(bindir() / "psql"), dsn, "-qc", copy], stdout=subprocess.DEVNULL)
    env = {**os.environ, "HEADWATER_CAPTURE_DSN": dsn}
    ours = timed_snapshot(capture_argv(cfg, "snap", "bench_snapshot", work / "state-snap"), env,
                          work / "capture-snapshot.log")  # fmt: skip
    conn.close()
    return copy_seconds, ours, total, _snapshot_phase(work / "capture-snapshot.log")


def timed_snapshot(argv: list[str], env: dict[str, str], log: Path) -> float:
    """Seconds from starting capture (``argv``, its output appended to ``log``) until its state records the
    snapshot done; capture is stopped then."""
    state, slot_name = Path(argv[argv.index("--state-dir") + 1]), argv[argv.index("--slot") + 1]
    start = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        while not snapshot_done(state, slot_name):
            if proc.poll() is not None:
                raise RuntimeError(f"capture exited with {proc.returncode}: see {log}")
            time.sleep(0.05)
        return time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait()


def _snapshot_phase(log: Path) -> float:
    """Seconds capture itself reports for the snapshot (the copy's start to the last acknowledgement:
    without the process start, the checks, the slot and the schemas before it)."""
    found = re.findall(r"snapshot done: \d+ rows from \d+ tables in ([\d.]+) s", log.read_text())
    if not found:
        raise RuntimeError(f"no 'snapshot done' line in {log}")
    return float(found[-1])


def _produce(bootstrap: str, prefix: str, count: int, size: int) -> None:
    # the snapshot's producer, with capture's settings; one Python call per message here
    sender = SnapshotSender.open(CaptureConfig(bootstrap=bootstrap, topic_prefix=prefix))
    if sender is None:
        raise RuntimeError("confluent-kafka's librdkafka not found")
    value, key, send = b"v" * size, b"k" * 16, sender.handle.send
    for _ in range(count):
        send(value, key)
    sender.flush(600)  # raises unless every message was acknowledged
    sender.close()


def kafka_alone(cfg: stack.StackConfig, messages: int, workers: int, size: int = 110) -> float:
    """Seconds for ``workers`` processes to produce ``messages`` pre-encoded messages (the snapshot's
    producer and settings, no database, no encoding): the ceiling of one message per row here."""
    ensure_changes_topic(CaptureConfig(bootstrap=cfg.bootstrap, topic_prefix="ceiling"))  # capture's producer
    ctx = multiprocessing.get_context("spawn")  # does not make topics (allow.auto.create.topics = false)
    procs = [ctx.Process(target=_produce, args=(cfg.bootstrap, "ceiling", messages // workers, size))
             for _ in range(workers)]  # fmt: skip
    start = time.monotonic()
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"producer process exited with {proc.exitcode}")
    return time.monotonic() - start


@contextlib.contextmanager
def seeded_stack(kafka_bootstrap: str = "", registry_topic: str = "") -> Iterator[tuple[stack.StackConfig, str, Path]]:
    """The benchmarks' own stack (fixed ports) with a small sample shop; removed afterwards. ``kafka_bootstrap``: a
    Kafka of your own instead of the stack's broker; ``registry_topic``: where the registry keeps its schemas."""
    work = Path(tempfile.mkdtemp(prefix="headwater-bench-"))
    work.chmod(0o755)
    pg, kafka, registry, redis = 55432, 29092, 28081, 26379
    cfg = stack.StackConfig(data_dir=work / "stack", postgres_port=pg, kafka_port=kafka, registry_port=registry,
                            redis_port=redis, kafka_bootstrap=kafka_bootstrap,
                            registry_topic=registry_topic)  # fmt: skip
    try:
        with stack.running(cfg):
            dsn = cfg.dsn()
            conn = psycopg2.connect(dsn)
            shop.install(conn)
            shop.seed(conn, shop.Scale(customers=200, products=50, orders=100))
            conn.close()
            yield cfg, dsn, work
    finally:
        shutil.rmtree(work, ignore_errors=True)


IMAGES = ("framed", "nested")
RUNS = ("framed1", "nested2", "nested3", "framed4")  # each a raw topic's prefix; its mode is the name's letters


def mode_of(run: str) -> str:
    return run.rstrip("0123456789")


def images_streaming(cfg: stack.StackConfig, dsn: str, changes: int, work: Path) -> dict[str, tuple[float, int, float]]:
    """One backlog drained by framed and nested captures (``RUNS``: slots made at the same point, drained one
    after the other): per run, (seconds, changes on its raw topic, mean value bytes)."""
    env = {**os.environ, "HEADWATER_CAPTURE_DSN": dsn}
    log = (work / "capture-images.log").open("ab")
    for run in RUNS:  # each slot made by capture itself, before the backlog
        argv = capture_argv(cfg, run, f"bench_{run}", work / f"state-{run}", "--skip-snapshot", "--raw-images",
                            mode_of(run))  # fmt: skip
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_confirmed(dsn, f"bench_{run}", proc)
        proc.terminate()
        proc.wait()
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(BACKLOG_SQL % {"txs": changes // CHANGES_PER_TX})
    conn.close()
    out = {}
    for run in RUNS:
        argv = capture_argv(cfg, run, f"bench_{run}", work / f"state-{run}", "--raw-images", mode_of(run))
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        seconds = wait_confirmed(dsn, f"bench_{run}", proc)
        proc.terminate()
        proc.wait()
        sizes = [len(r.value or b"") for r in read_topic(cfg.bootstrap, f"{run}.changes", timeout=600)]
        out[run] = (seconds, len(sizes), sum(sizes) / max(len(sizes), 1))
        _drop_slot(dsn, f"bench_{run}")
    return out


def images_snapshot(cfg: stack.StackConfig, dsn: str, work: Path) -> tuple[dict[str, list[tuple[float, float]]], int]:
    """The snapshot with each mode, framed, nested, nested, framed: per mode, (from process start, phase); and
    the rows copied."""
    env = {**os.environ, "HEADWATER_CAPTURE_DSN": dsn}
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("VACUUM ANALYZE")
        cur.execute("SELECT sum(n_live_tup) FROM pg_stat_user_tables")  # as snapshot() counts them
        rows = int(cur.fetchone()[0])  # type: ignore[index]
    conn.close()
    out: dict[str, list[tuple[float, float]]] = {m: [] for m in IMAGES}
    for n, mode in enumerate(map(mode_of, RUNS)):
        name, state, log = f"bench_snap_{n}", work / f"state-snap-{n}", work / f"capture-snap-{n}.log"
        seconds = timed_snapshot(capture_argv(cfg, f"snap{n}", name, state, "--raw-images", mode), env, log)
        out[mode].append((seconds, _snapshot_phase(log)))
        _drop_slot(dsn, name)
    return out, rows


def _drop_slot(dsn: str, name: str) -> None:
    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pg_drop_replication_slot(%s)", (name,))
    conn.close()


def print_images(streamed: dict[str, tuple[float, int, float]], snaps: dict[str, list[tuple[float, float]]],
                 rows: int) -> None:  # fmt: skip
    print(f"\nrow images on the raw topic ([capture] raw_images), each mode against the other ({rows} rows snapshot):")
    for run, (seconds, count, size) in streamed.items():
        print(f"  streaming {run:<7}: {seconds:7.1f} s  {count / seconds:9.0f} changes/s  {size:6.1f} bytes/message")
    best = {m: min(s for r, (s, _, _) in streamed.items() if mode_of(r) == m) for m in IMAGES}
    print(f"  streaming, best of two: nested at {best['framed'] / best['nested']:.0%} of framed")
    for mode, runs in snaps.items():
        shown = ", ".join(f"{total:.1f} s (phase {phase:.1f} s, {rows / phase:,.0f} rows/s)" for total, phase in runs)
        print(f"  snapshot {mode:<6}: {shown}")
    best = {m: min(p for _, p in runs) for m, runs in snaps.items()}
    print(f"  snapshot phase, best of two: nested at {best['framed'] / best['nested']:.0%} of framed")


def main(changes: int, rows: int) -> None:
    with seeded_stack() as (cfg, dsn, work):
        recv, ours, produced = streaming(cfg, dsn, changes, work)
        copy, snap, total, phase = snapshot(cfg, dsn, rows, work)
        alone = kafka_alone(cfg, total, workers=2)
        streamed, (snaps, snap_rows) = images_streaming(cfg, dsn, changes, work), images_snapshot(cfg, dsn, work)
    print(f"\nproducer settings: {', '.join(f'{k}={v}' for k, v in DEFAULTS.items())}")
    print(f"streaming backlog: {produced} changes on the raw topic")
    print(f"  pg_recvlogical (pgoutput -> /dev/null): {recv:7.1f} s  {produced / recv:9.0f} changes/s")
    print(f"  headwater capture (-> Kafka, Avro):     {ours:7.1f} s  {produced / ours:9.0f} changes/s")
    print(f"  ratio: {recv / ours:.0%} of pg_recvlogical")
    print(f"snapshot: {total} rows")
    print(f"  COPY ... TO STDOUT (psql -> /dev/null): {copy:7.1f} s  {total / copy:9.0f} rows/s")
    print(f"  headwater snapshot (-> Kafka, Avro):    {snap:7.1f} s  {total / snap:9.0f} rows/s")
    print(f"  ratio: {copy / snap:.0%} of COPY")
    print(
        f"  the snapshot phase alone (capture's own log: the copy's start to the last ack): {phase:.1f} s"
        f"  {total / phase:9.0f} rows/s = {copy / phase:.0%} of COPY"
    )
    print(f"  Kafka alone (2 processes producing {total} pre-encoded 110-byte messages, same settings):")
    print(
        f"                                          {alone:7.1f} s  {total / alone:9.0f} messages/s"
        f" = {copy / alone:.0%} of COPY (the broker path alone, one message per row)"
    )
    print_images(streamed, snaps, snap_rows)

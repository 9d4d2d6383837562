"""The README's first command: the whole pipeline on the local stack, and what it produced.

Promise: ``run`` brings the stack up, seeds the sample shop, starts ``headwater
capture`` in the background (stopped again by ``headwater stack down``), runs the
shop workload, waits until capture confirmed everything, then shows the raw topic
(counts, the last changes decoded) and reconciles it against PostgreSQL. Then a stream
worker (``faust -A streams worker``, also in the background) fans the changes out:
the demo shows a row from its query endpoint and reconciles every table topic and
every row the endpoint answers against PostgreSQL. Each later stage of the pipeline
extends this same command.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psycopg2
from confluent_kafka.admin import AdminClient

from capture import slot
from capture.config import CaptureConfig
from capture.decoder import lsn_text
from headwater import process, shop
from headwater.errors import FatalError
from headwater.reconcile import apply_changes, compare, compare_endpoint, latest_rows
from headwater.stack import StackConfig
from headwater.topics import AvroDecoder, read_topic


def capture_pidfile(cfg: StackConfig) -> Path:
    return cfg.data_dir.resolve() / "run" / "capture.pid"


def start_capture(stack: StackConfig, capture: CaptureConfig, passthrough: list[str]) -> int:
    """``headwater capture`` in the background; reused when already running."""
    pidfile = capture_pidfile(stack)
    pid = process.recorded_pid(pidfile)
    if pid is not None:
        print(f"capture already running (pid {pid})")
        return pid
    _reset_if_broker_forgot(stack, capture)
    log = stack.data_dir.resolve() / "logs" / "capture.log"
    argv = [sys.executable, "-m", "headwater.cli", "capture", *passthrough, "--state-dir", str(capture.state_dir)]
    pid = process.spawn(argv, log=log, pidfile=pidfile, cwd=Path.cwd())
    print(f"started headwater capture (pid {pid}, log {log})")
    return pid


def _reset_if_broker_forgot(stack: StackConfig, capture: CaptureConfig) -> None:
    """Tansu keeps topics in memory: after a broker restart the slot's history is gone from Kafka."""
    topics = AdminClient({"bootstrap.servers": capture.bootstrap}).list_topics(timeout=10).topics
    if capture.changes_topic in topics:
        return
    conn = psycopg2.connect(capture.dsn.reveal())
    try:
        if slot.find(conn, capture.slot) is not None:
            print(f"the broker lost {capture.changes_topic} when it stopped (in-memory): starting capture over")
            slot.drop(conn, capture.slot)
    finally:
        conn.close()
    shutil.rmtree(capture.state_dir, ignore_errors=True)


def wait_caught_up(capture: CaptureConfig, pid: int, timeout: float = 120.0) -> None:
    """Until the slot confirmed a commit made now, i.e. Kafka holds everything before it."""
    try:
        slot.wait_caught_up(
            capture.dsn.reveal(),
            capture.slot,
            timeout=timeout,
            alive=lambda: process.is_running(pid),
            state_dir=capture.state_dir,
        )
    except FatalError as exc:
        raise FatalError(f"{exc}; see .headwater/logs/capture.log") from exc


def show_changes(capture: CaptureConfig) -> None:
    decode = AvroDecoder(capture.registry_url)
    changes = [decode(r.value) for r in read_topic(capture.bootstrap, capture.changes_topic)]
    ops = Counter(c["op"] for c in changes)
    print(f"  {len(changes)} changes: " + ", ".join(f"{op} {n}" for op, n in sorted(ops.items())))
    print("  the last three, decoded:")
    for change in changes[-3:]:
        shown: dict[str, Any] = {k: change[k] for k in ("op", "table", "position", "tx_size")}
        shown["commit_lsn"] = lsn_text(change["commit_lsn"])
        shown["key"] = decode(change["key"])
        if change["after"] is not None:
            row = decode(change["after"])
            shown["after"] = {k: (v[:40] + "..." if isinstance(v, str) and len(v) > 40 else v) for k, v in row.items()}
        print("  " + json.dumps(shown, default=str))
    print("\n== reconciliation: the raw topic applied in order, against PostgreSQL")
    state = apply_changes(changes, decode)
    conn = psycopg2.connect(capture.dsn.reveal())
    try:
        for table, key in shop.KEYS.items():
            count, problems = compare(conn, table, key, state.get(table, {}))
            verdict = "equal" if not problems else f"{len(problems)} differences, e.g. {problems[0]}"
            print(f"  {table:<12} {count:>6} rows in PostgreSQL: {verdict}")
    finally:
        conn.close()


def start_worker(stack: StackConfig, env: dict[str, str], port: int) -> int:
    """``faust -A streams worker`` in the background (after capture registered the tables); reused if running."""
    pidfile = stack.data_dir.resolve() / "run" / "streams.pid"
    pid = process.recorded_pid(pidfile)
    if pid is not None:
        print(f"stream worker already running (pid {pid})")
        return pid
    log = stack.data_dir.resolve() / "logs" / "streams.log"
    argv = [sys.executable, "-m", "faust", "-A", "streams", "worker", "-l", "info", "--web-port", str(port)]
    pid = process.spawn(argv, log=log, pidfile=pidfile, cwd=Path.cwd(), env={**os.environ, **env})
    print(f"started faust -A streams worker (pid {pid}, log {log}, endpoint on port {port})")
    return pid


def show_streams(capture: CaptureConfig, pid: int, url: str, timeout: float = 120.0) -> None:
    """Wait until the table topics and the endpoint equal PostgreSQL; show a row and the verdicts."""
    decode = AvroDecoder(capture.registry_url)
    conn = psycopg2.connect(capture.dsn.reveal())
    deadline = time.monotonic() + timeout
    try:
        while True:
            verdicts = _stream_verdicts(conn, capture, decode, url)
            done = all(not problems for _, _, problems in verdicts)
            if done or time.monotonic() > deadline or not process.is_running(pid):
                break
            time.sleep(1.0)
        with conn.cursor() as cur:
            cur.execute("SELECT max(id) FROM orders")
            order = cur.fetchone()
        conn.commit()
    finally:
        conn.close()
    if order and order[0] is not None:
        print(f"  GET {url}/tables/orders/{order[0]}")
        print("  " + httpx.get(f"{url}/tables/orders/{order[0]}", timeout=10).text[:600])
    print("\n== reconciliation: each table topic (latest value per key) and the endpoint, against PostgreSQL")
    for name, count, problems in verdicts:
        verdict = "equal" if not problems else f"{len(problems)} differences, e.g. {problems[0]}"
        print(f"  {name:<28} {count:>6} rows in PostgreSQL: {verdict}")
    if not done:
        raise FatalError("the stream worker did not catch up; see .headwater/logs/streams.log")


def _stream_verdicts(
    conn: Any, capture: CaptureConfig, decode: AvroDecoder, url: str
) -> list[tuple[str, int, list[str]]]:
    out = []
    for table, key in shop.KEYS.items():
        topic = f"{capture.topic_prefix}.{table}"
        try:
            rows = latest_rows(capture.bootstrap, topic, decode)
        except Exception as exc:
            out.append((topic, 0, [f"not readable yet: {exc}"]))
            continue
        count, problems = compare(conn, table, key, rows)
        out.append((topic, count, problems))
        try:
            count, problems = compare_endpoint(conn, table, key, url, table)
        except httpx.HTTPError as exc:
            problems = [f"endpoint not answering yet: {exc}"]
        out.append((f"endpoint /tables/{table}", count, problems))
    return out

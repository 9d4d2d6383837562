"""The README's first command: the whole pipeline on the local stack, and what it produced.

Promise: ``run`` brings the stack up, seeds the sample shop, starts ``headwater
capture`` in the background (stopped again by ``headwater stack down``), runs the
shop workload, waits until capture confirmed everything, then shows the raw topic
(counts, the last changes decoded) and reconciles it against PostgreSQL. Then a stream
worker (``faust -A streams worker``, also in the background) fans the changes out:
the demo shows a row from its query endpoint and reconciles every table topic and
every row the endpoint answers against PostgreSQL. The worker also keeps the views (the
user's ``[views]``, or the shop's ``orders_enriched``): the demo shows a view row from Redis
and the endpoint and reconciles each view's topic, endpoint and Redis against the view's own
SQL in PostgreSQL. Last, ``show_analytics`` runs the ``shop-report`` Spark job on the view at
its newest cut and holds its numbers against the same report computed by PostgreSQL.
``show_metrics`` prints where capture's and the worker's metrics are and a few of their values.
Each later stage of the pipeline extends this same command.
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
import redis
from confluent_kafka.admin import AdminClient

from analytics.config import AnalyticsConfig
from capture import metrics as capture_metrics
from capture import slot
from capture.config import CaptureConfig
from headwater import process, shop
from headwater.reconcile import (
    apply_changes,
    compare,
    compare_docs,
    compare_endpoint,
    endpoint_view_docs,
    keyed_rows,
    latest_rows,
    latest_view_docs,
    redis_view_docs,
    view_docs_sql,
)
from streams import metrics as streams_metrics
from streams.config import StreamsConfig
from tables.change import ChangeReader
from tables.config import StackConfig, config_path, read_file
from tables.errors import FatalError
from tables.kafka import read_topic
from tables.registry import Registry
from tables.topics import table_topic_of, view_key
from tables.wire import lsn_text


def capture_pidfile(cfg: StackConfig) -> Path:
    return cfg.data_dir.resolve() / "run" / "capture.pid"


def worker_pidfile(cfg: StackConfig) -> Path:
    return cfg.data_dir.resolve() / "run" / "streams.pid"


def start_capture(stack: StackConfig, capture: CaptureConfig, passthrough: list[str], env: dict[str, str]) -> int:
    """``headwater capture`` in the background with ``passthrough`` flags and ``env`` (the stack's settings
    given as flags); reused when already running."""
    pidfile = capture_pidfile(stack)
    pid = process.recorded_pid(pidfile)
    if pid is not None:
        print(f"capture already running (pid {pid})")
        return pid
    reset_if_broker_forgot(capture)
    log = stack.data_dir.resolve() / "logs" / "capture.log"
    argv = [sys.executable, "-m", "headwater.cli", "capture", *passthrough, "--state-dir", str(capture.state_dir)]
    pid = process.spawn(argv, log=log, pidfile=pidfile, cwd=Path.cwd(), env={**os.environ, **env})
    print(f"started headwater capture (pid {pid}, log {log})")
    return pid


def reset_if_broker_forgot(capture: CaptureConfig) -> None:
    """Tansu keeps topics in memory (the registry's schemas too): after a broker restart the slot's history
    is gone from Kafka, and capture starts over. (The stream worker drops its own state of the lost topics
    when it starts: ``streams.sources``.)"""
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


def wait_reported(capture: CaptureConfig, url: str, timeout: float = 15.0) -> None:
    """Until capture's metrics at ``url`` reported the slot's confirmed position and count the load's streamed
    changes (``events_total`` other than READ): capture counts a change once Kafka acknowledged every message sent
    before the report that took its count, so its counts can trail the confirmed position by a report or more on a
    busy machine. After ``timeout`` it says what it waited for and goes on (the demo then shows what capture
    counted)."""
    conn = psycopg2.connect(capture.dsn.reveal())
    try:
        found = slot.find(conn, capture.slot)
    finally:
        conn.close()
    if found is None or found.confirmed_lsn is None:
        return
    deadline, samples, confirmed = time.monotonic() + timeout, [], 0.0
    while time.monotonic() < deadline:
        try:
            samples = _samples(url)
        except httpx.HTTPError:
            return  # the metrics do not answer: nothing to wait for
        confirmed = _value(samples, capture_metrics.NAMES["confirmed_lsn"])
        if confirmed >= found.confirmed_lsn and _streamed(samples):
            return
        time.sleep(0.2)
    said = {what: _value(samples, capture_metrics.NAMES[what]) for what in ("queue", "delivery_errors", "reconnects")}
    print(f"  after {timeout:g} s capture's metrics report confirmed LSN {confirmed:.0f} (the slot: "
          f"{found.confirmed_lsn}) and {'some' if _streamed(samples) else 'no'} streamed change counted; "
          + ", ".join(f"{what} {n:.0f}" for what, n in said.items()))  # fmt: skip


def _streamed(samples: list[Any]) -> bool:
    """Whether capture counted a streamed change (an event other than a snapshot's READ)."""
    name = capture_metrics.NAMES["events"]
    return any(s.name == name and s.labels.get("op") != "READ" and s.value > 0 for s in samples)


def _value(samples: list[Any], name: str) -> float:
    return max((s.value for s in samples if s.name == name), default=0.0)


def _samples(url: str) -> list[Any]:
    """Every sample the Prometheus metrics at ``url``/metrics expose (``httpx.HTTPError`` when they do not answer)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def show_changes(capture: CaptureConfig) -> None:
    decode = Registry(capture.registry_url)
    read = ChangeReader(decode)  # images framed, whichever raw_images capture writes
    changes = [read(r.value) for r in read_topic(capture.bootstrap, capture.changes_topic) if r.value is not None]
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


CAPTURE_SHOWN = tuple(capture_metrics.NAMES[a] for a in ("events", "confirmed_lsn", "behind", "retained"))
STREAMS_SHOWN = (streams_metrics.FANOUT_CHANGES + "_total", streams_metrics.RAW_LAG, streams_metrics.TABLE_ROWS,
                 streams_metrics.CUT_AGE)  # fmt: skip


def show_metrics(url: str, names: tuple[str, ...], each: int = 4, focus: dict[str, str] | None = None) -> None:
    """Where the metrics are (``url``: /metrics, /health, /ready) and up to ``each`` samples of each of ``names``:
    those whose labels include ``focus`` first, then in label order (the exposition's order is the order in
    which label sets were first counted, which differs from run to run)."""
    try:
        samples = _samples(url)
        ready = httpx.get(url + "/ready", timeout=10).json()
    except httpx.HTTPError as exc:
        print(f"  {url}/metrics does not answer: {exc}")
        return
    print(f"  Prometheus metrics at {url}/metrics; GET {url}/ready: {'ready' if ready['ready'] else ready['reason']}")
    for name in names:
        found = sorted((s for s in samples if s.name == name), key=lambda s: _shown_first(s.labels, focus or {}))
        for sample in found[:each]:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            print(f"  {name}{{{labels}}} {sample.value:g}" if labels else f"  {name} {sample.value:g}")
        if len(found) > each:
            print(f"  ... and {len(found) - each} more {name}")


def _shown_first(labels: dict[str, str], focus: dict[str, str]) -> tuple[bool, list[tuple[str, str]]]:
    return not focus.items() <= labels.items(), sorted(labels.items())


def start_worker(stack: StackConfig, env: dict[str, str], port: int) -> int:
    """``faust -A streams worker`` in the background (after capture registered the tables); reused if running."""
    pidfile = worker_pidfile(stack)
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
    decode = Registry(capture.registry_url)
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


def _stream_verdicts(conn: Any, capture: CaptureConfig, decode: Registry, url: str) -> list[tuple[str, int, list[str]]]:
    out = []
    for table, key in shop.KEYS.items():
        topic = table_topic_of(capture.topic_prefix, table)
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


def worker_config(explicit: str | None, stack: StackConfig) -> str:
    """The config file for the demo's worker: the user's, plus the shop's view when it declares none."""
    path = config_path(explicit, os.environ)
    data, text = read_file(path) if path else ({}, "")
    if data.get("views"):
        return str(path)
    out = stack.data_dir.resolve() / "demo.toml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n" + shop.VIEWS_TOML)
    return str(out)


def show_views(streams: StreamsConfig, env: dict[str, str], capture: CaptureConfig, url: str,
               timeout: float = 120.0) -> None:  # fmt: skip
    """Wait until each view's topic, endpoint and Redis equal the view's SQL in PostgreSQL; show a row."""
    from streams.catalog import discover
    from streams.config import load_views
    from streams.viewtopic import shapes_of

    schemas = Registry(streams.registry_url)
    shapes, _ = shapes_of(discover(streams, schemas), schemas)
    conn = psycopg2.connect(capture.dsn.reveal())
    try:
        for spec in load_views({**os.environ, **env}):
            sql = spec.sql(shapes)
            deadline = time.monotonic() + timeout
            while True:
                verdicts = _view_verdicts(conn, streams, spec.name, sql, url)
                done = all(not problems for _, _, problems in verdicts)
                if done or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            _show_view_row(streams, spec.name, url, verdicts)
            if not done:
                raise FatalError(f"view {spec.name} did not catch up; see .headwater/logs/streams.log")
    finally:
        conn.close()


Verdicts = list[tuple[str, int, list[str]]]


def _view_verdicts(conn: Any, streams: StreamsConfig, view: str, sql: str, url: str) -> Verdicts:
    expected = view_docs_sql(conn, sql)
    try:
        topic = latest_view_docs(streams.bootstrap, streams.view_topic(view), Registry(streams.registry_url))
        redis_rows, _ = redis_view_docs(streams.redis_url, streams.topic_prefix, view)
        endpoint = endpoint_view_docs(url, view, sorted(expected))
    except Exception as exc:  # not made or not answering yet
        return [(view, len(expected), [f"not readable yet: {exc}"])]
    return [
        (streams.view_topic(view), len(expected), compare_docs(expected, topic, "topic")),
        (f"endpoint /views/{view}", len(expected), compare_docs(expected, endpoint, "endpoint")),
        (f"Redis {view_key(streams.topic_prefix, view)}:*", len(expected), compare_docs(expected, redis_rows, "redis")),
    ]


def _show_view_row(streams: StreamsConfig, view: str, url: str, verdicts: Verdicts) -> None:
    listing = httpx.get(f"{url}/views/", timeout=10).json()
    print(f"  published up to commit LSN {listing.get('cut_lsn')} (the last cut on {streams.cuts_topic})")
    _, cut = redis_view_docs(streams.redis_url, streams.topic_prefix, view)
    client = redis.Redis.from_url(streams.redis_url)
    try:
        names = sorted(client.scan_iter(match=f"{view_key(streams.topic_prefix, view)}:*", count=1000))
        if names:
            name = names[-1].decode()
            print(f"  Redis HGETALL {name}  (Redis shows the view at cut {lsn_text(cut or 0)})")
            fields: dict[Any, Any] = client.hgetall(name)
            print("  " + json.dumps({k.decode(): v.decode() for k, v in fields.items()})[:600])
            key = name.rsplit(":", 1)[1]
            print(f"  GET {url}/views/{view}/{key}")
            print("  " + httpx.get(f"{url}/views/{view}/{key}", timeout=10).text[:600])
    finally:
        client.close()
    print(f"\n== reconciliation: view {view} (topic latest per key, endpoint, Redis) against its SQL in PostgreSQL")
    for name, count, problems in verdicts:
        verdict = "equal" if not problems else f"{len(problems)} differences, e.g. {problems[0]}"
        print(f"  {name:<40} {count:>6} rows in PostgreSQL: {verdict}")


def show_analytics(cfg: AnalyticsConfig, dsn: str, timeout: float = 120.0) -> None:
    """Run the shop report on Spark once the view is at rest; compare it with PostgreSQL's."""
    from analytics.jobs import REPORT_SQL, shop_report, show, view_at_rest
    from analytics.session import spark_session

    deadline = time.monotonic() + timeout
    while not view_at_rest(cfg):
        if time.monotonic() > deadline:
            raise FatalError("the view orders_enriched has no cut covering its topic; see .headwater/logs/streams.log")
        time.sleep(0.5)
    spark = spark_session(cfg, "headwater demo")
    try:
        (result,) = shop_report(spark, cfg)
        print(show(result, 12))
        got = {tuple(r[:3]): tuple(r[3:]) for r in result.frame.collect()}
    finally:
        spark.stop()
    conn = psycopg2.connect(dsn)
    try:
        expected = keyed_rows(conn, REPORT_SQL, 3)
    finally:
        conn.close()
    print("\n== reconciliation: the Spark report against the same query in PostgreSQL (analytics.jobs.REPORT_SQL)")
    differ = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
    verdict = "equal" if not differ else f"{len(differ)} groups differ, e.g. {differ[0]}"
    print(f"  shop-report  {len(expected):>6} groups in PostgreSQL: {verdict}")
    if differ:
        raise FatalError("the Spark report does not match PostgreSQL's", hint="see the groups above")

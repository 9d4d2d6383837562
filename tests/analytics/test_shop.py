"""The sample shop through the whole pipeline, read back by Spark: tables, the enriched view, the report — with
orders and order_items backfilled again under load on the way, whose rows Spark reads as it reads snapshot rows."""

from __future__ import annotations

import signal
import stat
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from pyspark.sql import Row, SparkSession

from analytics.config import AnalyticsConfig
from analytics.jobs import JOBS, REPORT_SQL, REPORT_VIEW, read, report_cut, view_at_rest
from headwater import shop
from headwater.cli import main
from headwater.reconcile import apply_changes, assert_table_matches, compare, compare_docs, keyed_rows, view_docs_sql
from streams.rows import to_json
from tables.config import StackConfig
from tables.kafka import read_topic
from tables.registry import Registry
from tests.analytics.test_reader import error_of
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.streams import Worker
from tests.streams.test_views import SQL, VIEWS, start, views_reconciled
from tests.streams.test_workers import reconciled, wait_for

pytestmark = pytest.mark.slow


def plain(value: Any) -> Any:
    """A collected Spark value with instants made UTC-aware (Spark hands out naive local times)."""
    if isinstance(value, Row):
        return plain(value.asDict(recursive=True))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, datetime) and value.tzinfo is None:
        return value.astimezone(UTC)
    return value


def test_spark_reads_every_table_the_view_at_its_cut_and_the_report_as_postgres_has_them(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    spark: SparkSession, analytics_config: Callable[..., AnalyticsConfig], capsys: pytest.CaptureFixture[str],
    shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    capture, worker = start(shop_db, pg_database, capture_factory, worker_factory)
    cfg = analytics_config(capture.cfg.topic_prefix)
    earlier: tuple[Any, Any] | None = None
    for transactions in (300, 600):  # the view at rest twice: the first cut is read again at the end
        writer = shop_writer(rate=250)
        wait_for(lambda: writer.work.committed >= transactions, 60)  # noqa: B023 - waited for at once
        if earlier is not None:  # the second time, orders and their items backfilled again under the writes
            capture.snapshot("orders", "order_items", "--wait", "30")
            capture.wait_backfilled(pg_database, count=2, timeout=120)
        writer.stop()
        capture.wait_caught_up(pg_database)
        views_reconciled(shop_db, capture, worker, None)
        assert wait_for(lambda: view_at_rest(cfg), 60, every=0.5), worker.tail()
        earlier = earlier or (report_cut(cfg), view_docs_sql(shop_db, SQL))
    worker.kill(signal.SIGTERM)  # at rest: the two cores are Spark's from here
    capture.stop()

    for table in shop.TABLES:
        rows = [plain(r) for r in read(spark, cfg, table=table, mode="latest").collect()]
        count, problems = compare(shop_db, table, shop.KEYS[table], dict(enumerate(rows)))
        assert not problems, "\n".join(problems[:20])
        assert count == len(rows) > 0
    changes = {r["_op"]: r["count"] for r in read(spark, cfg, table="orders").groupBy("_op").count().collect()}
    on_topic = read_topic(cfg.bootstrap, f"{cfg.topic_prefix}.orders")
    assert sum(changes.values()) == len(on_topic)
    assert changes["DELETE"] == sum(1 for r in on_topic if r.value is None) > 0
    raw = [c for c in capture.changes() if c["table"] == "orders" and c["op"] == "READ"]  # snapshot, then backfill
    backfilled = sum(1 for c in raw if c["backfill"] is not None)
    assert changes["READ"] == len(raw) and 0 < backfilled < len(raw), (changes, backfilled, len(raw))

    view = read(spark, cfg, view=REPORT_VIEW, cut="latest").drop("hw_commit_lsn").collect()
    docs = {(str(r.id),): to_json(plain(r)) for r in view}
    expected = view_docs_sql(shop_db, SQL)
    assert not compare_docs(expected, docs, "spark"), compare_docs(expected, docs, "spark")[:10]
    assert sum(len(d["items"]) for d in expected.values()) > 100

    assert earlier is not None
    first_cut, first_docs = earlier
    assert first_cut.commit_lsn < report_cut(cfg).commit_lsn and first_docs != expected
    then = read(spark, cfg, view=REPORT_VIEW, cut=first_cut.lsn).drop("hw_commit_lsn").collect()
    then_docs = {(str(r.id),): to_json(plain(r)) for r in then}
    assert not compare_docs(first_docs, then_docs, "spark"), compare_docs(first_docs, then_docs, "spark")[:10]

    assert not cfg.output.exists()
    results = JOBS["tables"](spark, cfg)
    assert stat.S_IMODE(cfg.output.stat().st_mode) == 0o700, "table data readable by others"
    for table in shop.TABLES:
        stored = pq.read_table(cfg.output / "tables" / f"{cfg.topic_prefix}.{table}")
        assert stored.num_rows == shop.counts(shop_db)[table]
    assert len(results) == len(shop.TABLES)

    argv = ["analytics", "shop-report", "--bootstrap", cfg.bootstrap, "--registry-url", cfg.registry_url,
            "--topic-prefix", cfg.topic_prefix, "--output", str(cfg.output / "cli"), "--rows", "5"]  # fmt: skip
    assert main(argv) == 0  # the command, in this process: it uses the running session (the demo test runs it anew)
    out = capsys.readouterr().out
    assert f"from {cfg.topic_prefix}.views.{REPORT_VIEW} at commit LSN" in out
    assert "day" in out and "revenue" in out and "written to" in out
    written = pq.read_table(cfg.output / "cli" / "shop-report").to_pylist()
    report = {(r["day"], r["region"], r["category"]): (r["revenue"], r["orders"], r["units"]) for r in written}
    assert report == keyed_rows(shop_db, REPORT_SQL, 3)
    assert len(report) >= 10  # days x regions x categories (the workload deletes many seeded orders)


def test_the_report_on_a_pipeline_without_the_view_says_how_to_get_it(
    spark: SparkSession, analytics_config: Callable[..., AnalyticsConfig], unique_name: str
) -> None:
    failure = error_of(lambda: JOBS["shop-report"](spark, analytics_config(unique_name)))
    assert f"topic {unique_name}.views.{REPORT_VIEW}" in str(failure)
    assert "no cut of this view" in str(failure) and "README 'Views'" in str(failure)


def test_the_shop_with_nested_raw_images_and_a_schema_change_reconciles_everywhere(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    spark: SparkSession, analytics_config: Callable[..., AnalyticsConfig], local_stack: StackConfig,
    shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    """``raw_images = "nested"``: raw topic, table topics, endpoint, view (topic, endpoint, Redis) and Spark all
    equal PostgreSQL, across a column added mid-stream inside a transaction that changes rows before and after."""
    capture = capture_factory(pg_database, raw_images="nested").start()
    capture.wait_caught_up(pg_database)
    worker = worker_factory(capture.cfg.topic_prefix, views=VIEWS).start()
    writer = shop_writer(rate=200)
    wait_for(lambda: writer.work.committed >= 200, 60)
    with shop_db, shop_db.cursor() as cur:  # one transaction: rows of the old shape, the new column, rows of the new
        cur.execute("LOCK TABLE customers IN ACCESS EXCLUSIVE MODE")  # ALTER's lock first: no deadlock
        cur.execute("UPDATE customers SET name = name || '.' WHERE id % 10 = 1")
        cur.execute("ALTER TABLE customers ADD COLUMN loyalty int")
        cur.execute("UPDATE customers SET loyalty = id % 7 WHERE id % 10 = 2")
    wait_for(lambda: writer.work.committed >= 400, 60)
    writer.stop()
    with shop_db, shop_db.cursor() as cur:
        cur.execute("UPDATE customers SET loyalty = 9, region = 'north' WHERE id % 10 = 3")
    capture.wait_caught_up(pg_database)

    registry = Registry(capture.cfg.registry_url)
    raw = capture.cfg.changes_topic
    subject = f"{raw}-headwater.public.customers.Change"  # the table's change record: a version per shape
    assert httpx.get(f"{capture.cfg.registry_url}/subjects/{subject}/versions").json() == [1, 2]
    updates = [c for c in map(registry.decode, (r.value for r in read_topic(capture.cfg.bootstrap, raw)))
               if c["op"] == "UPDATE"]  # fmt: skip
    assert updates and all(isinstance(c["after"], dict) for c in updates)  # nested, read in one decode
    state = apply_changes(capture.changes(), registry)
    for table in shop.TABLES:
        assert_table_matches(shop_db, table, shop.KEYS[table], state.get(table, {}))
    assert any(row.get("loyalty") == 9 for row in state["customers"].values())
    reconciled(shop_db, capture, [worker])  # table topics and the endpoint
    views_reconciled(shop_db, capture, worker, local_stack.redis_url)
    cfg = analytics_config(capture.cfg.topic_prefix)
    assert wait_for(lambda: view_at_rest(cfg), 60, every=0.5), worker.tail()
    worker.kill(signal.SIGTERM)
    capture.stop()
    for table in shop.TABLES:
        rows = [plain(r) for r in read(spark, cfg, table=table, mode="latest").collect()]
        assert not compare(shop_db, table, shop.KEYS[table], dict(enumerate(rows)))[1]
    view = read(spark, cfg, view=REPORT_VIEW, cut="latest").drop("hw_commit_lsn").collect()
    docs = {(str(r.id),): to_json(plain(r)) for r in view}
    assert not compare_docs(view_docs_sql(shop_db, SQL), docs, "spark")
    failure = error_of(lambda: read(spark, cfg, topic=raw).count())  # one schema per table: no one DataFrame
    assert "registers a schema per record type" in str(failure) and "raw_images = 'framed'" in str(failure)

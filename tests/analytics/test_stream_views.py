"""A view read as a stream while the shop's workload runs: every batch ends at a published cut, the batches add
up to the view, and the streaming shop report equals PostgreSQL's after each run."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQueryListener

from analytics.config import AnalyticsConfig
from analytics.jobs import REPORT_SQL, REPORT_VIEW, read, report_cut, view_at_rest
from analytics.streamjobs import run
from headwater.cli import main
from headwater.reconcile import compare_docs, keyed_rows, view_docs_sql
from streams.rows import to_json
from tables.kafka import read_topic
from tables.topics import cuts_topic, view_topic
from tables.views import decode_cut
from tests.analytics.test_shop import plain
from tests.analytics.test_stream import job_argv, stream
from tests.plugins.capture import Capture, ShopWriter
from tests.plugins.streams import Worker
from tests.streams.test_views import SQL, start, views_reconciled
from tests.streams.test_workers import wait_for

pytestmark = pytest.mark.slow
META = ("_op", "_partition", "_offset", "_commit_lsn", "_batch", "hw_commit_lsn")


class Batches(StreamingQueryListener):
    """The progress of every batch that read rows, as Spark reports it."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = json.loads(event.progress.json)  # its offsets are JSON objects here
        if progress["numInputRows"] > 0:
            with self.lock:
                self.seen.append(progress)

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass


def docs(rows: DataFrame) -> dict[tuple[str, ...], Any]:
    """View rows as PostgreSQL's join gives them: key -> JSON document."""
    return {(str(r.id),): to_json(plain(r)) for r in rows.drop(*META).collect()}


def state_up_to(batches: DataFrame, last: int) -> DataFrame:
    """The view as the stream's batches up to ``last`` leave it: each key's newest row, deleted keys gone."""
    upto = batches.where(F.col("_batch") <= last)
    newest = upto.withColumn("_n", F.row_number().over(Window.partitionBy("id").orderBy(F.desc("_batch"),
                                                                                          F.desc("_offset"))))
    return newest.where((F.col("_n") == 1) & (F.col("_op") != "DELETE")).drop("_n")


def report_matches(cfg: AnalyticsConfig, shop_db: Any, out: str) -> None:
    """The streaming report's Parquet is PostgreSQL's report, at the view's newest cut."""
    written = pq.read_table(cfg.output / "shop-report-stream" / "report").to_pylist()
    report = {(r["day"], r["region"], r["category"]): (r["revenue"], r["orders"], r["units"]) for r in written}
    assert report == keyed_rows(shop_db, REPORT_SQL, 3) and len(report) >= 10
    assert f"at commit LSN {report_cut(cfg).lsn}" in out


def test_a_view_stream_ends_every_batch_at_a_cut_and_its_batches_add_up_to_the_view_at_each(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    spark: SparkSession, analytics_config: Callable[..., AnalyticsConfig], tmp_path: Path,
    shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    capture, worker = start(shop_db, pg_database, capture_factory, worker_factory)
    cfg = analytics_config(capture.cfg.topic_prefix)
    listener = Batches()
    spark.streams.addListener(listener)
    kept = tmp_path / "batches"

    def keep(batch: DataFrame, batch_id: int) -> None:
        batch.withColumn("_batch", F.lit(batch_id)).write.mode("append").parquet(str(kept))

    frame = stream(spark, cfg, view=REPORT_VIEW, metadata="true", maxOffsetsPerTrigger="100")
    begin = lambda: (frame.writeStream.foreachBatch(keep).option("checkpointLocation", str(tmp_path / "checkpoint"))  # noqa: E731
                     .trigger(processingTime="300 milliseconds").start())  # fmt: skip
    ran = ThreadPoolExecutor(1).submit(run, spark, {"view": begin})  # as the jobs run theirs, until stopped here
    try:  # the stream running (its source's worker can take seconds to start on a busy machine), then the writes
        assert wait_for(lambda: any(q.lastProgress for q in spark.streams.active), 60, every=0.2), ran
        writer = shop_writer(rate=120)  # while the stream runs
        wait_for(lambda: writer.work.committed >= 300, 60)
        writer.stop()
        capture.wait_caught_up(pg_database)
        views_reconciled(shop_db, capture, worker, None)
        assert wait_for(lambda: view_at_rest(cfg), 60, every=0.5), worker.tail()
        newest = report_cut(cfg).commit_lsn
        caught_up = lambda: listener.seen and listener.seen[-1]["sources"][0]["endOffset"]["cut"][  # noqa: E731
            "commit_lsn"] == newest
        assert wait_for(caught_up, 120, every=0.5), [(p["batchId"], p["numInputRows"], p["sources"][0]["endOffset"])
                                                     for p in listener.seen[-3:]] + [newest]  # fmt: skip
    finally:
        for query in spark.streams.active:
            query.stop()
        spark.streams.removeListener(listener)
    ran.result(60)  # raises the query's failure

    topic = view_topic(cfg.topic_prefix, REPORT_VIEW)
    published = [decode_cut(r.value) for r in read_topic(cfg.bootstrap, cuts_topic(cfg.topic_prefix)) if r.value]
    cuts = {int(c["commit_lsn"]): {str(e["partition"]): e["offset"] for e in c["ends"]}
            for c in published if c["topic"] == topic}  # fmt: skip
    ends = [p["sources"][0]["endOffset"] for p in listener.seen]
    # bounded: several batches, and one over the bound (100) only where no cut lay inside it. How many depends on
    # how many view records the workers' cuts coalesced: a CI leg got 316 records in 4 batches, the fewest possible
    assert len(ends) >= 2, ends
    before = 0
    for end in ends:  # every batch ends exactly at a cut the workers published
        lsn = end["cut"]["commit_lsn"]
        assert lsn in cuts and {p: end[topic][p] for p in cuts[lsn]} == cuts[lsn], end
        if sum(end[topic].values()) - sum(cuts.get(before, {}).values()) > 100:
            assert not [c for c in cuts if before < c < lsn], (end, sorted(cuts))
        before = lsn
    assert sum(p["numInputRows"] for p in listener.seen) > 300

    batches = spark.read.parquet(str(kept))
    middle = listener.seen[len(listener.seen) // 2]
    then = docs(read(spark, cfg, view=REPORT_VIEW, cut=middle["sources"][0]["endOffset"]["cut"]["lsn"]))
    assert not compare_docs(then, docs(state_up_to(batches, middle["batchId"])), "stream")  # the view at that cut
    now = view_docs_sql(shop_db, SQL)
    assert not compare_docs(now, docs(state_up_to(batches, listener.seen[-1]["batchId"])), "stream")
    assert then != now


def test_the_streaming_shop_report_equals_postgres_after_each_run(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker],
    spark: SparkSession, analytics_config: Callable[..., AnalyticsConfig], capsys: pytest.CaptureFixture[str],
    shop_writer: Callable[..., ShopWriter],
) -> None:  # fmt: skip
    capture, worker = start(shop_db, pg_database, capture_factory, worker_factory)
    cfg = analytics_config(capture.cfg.topic_prefix)
    views_reconciled(shop_db, capture, worker, None)
    assert wait_for(lambda: view_at_rest(cfg), 60, every=0.5), worker.tail()
    assert main(job_argv(cfg, "shop-report-stream", "--batch-records", "150")) == 0  # the seeded shop, in batches
    report_matches(cfg, shop_db, capsys.readouterr().out)

    writer = shop_writer(rate=150)
    wait_for(lambda: writer.work.committed >= 200, 60)
    writer.stop()
    capture.wait_caught_up(pg_database)
    views_reconciled(shop_db, capture, worker, None)
    assert wait_for(lambda: view_at_rest(cfg), 60, every=0.5), worker.tail()
    assert main(job_argv(cfg, "shop-report-stream")) == 0  # on from its checkpoint
    out = capsys.readouterr().out
    report_matches(cfg, shop_db, out)
    assert "view rows this run)" in out and "(0 view rows this run)" not in out
    assert main(job_argv(cfg, "shop-report-stream")) == 0  # nothing new: the report stays
    out = capsys.readouterr().out
    report_matches(cfg, shop_db, out)
    assert "(0 view rows this run)" in out

"""The streaming jobs ``headwater analytics <job>`` runs: Structured Streaming queries kept in Parquet.

Promise: each job reads Headwater topics as streams through the ``headwater`` data source,
keeps its offsets in a checkpoint under ``cfg.output/checkpoints/<job>``, and by default
catches up with what the topics hold now and stops (``trigger(availableNow=True)``, in
batches of at most ``cfg.batch_records`` messages when set); with ``cfg.follow`` it runs a
micro-batch every ``cfg.stream_interval`` s until interrupted. Run again, a job goes on
after its last committed batch. ``changes``: every table topic's changes appended to
Parquet under ``cfg.output/changes/<topic>`` (Spark's file sink: every message once, even
when a run is killed; metadata columns included). ``shop-report-stream``: the shop report
kept up to date from the ``orders_enriched`` view read cut by cut — each micro-batch
replaces the changed orders' part of the report in a state (Parquet, one directory per
batch; the one before is kept, so a replayed batch computes the same) and rewrites the
report from it, so after every batch the report is the view's at that batch's cut.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path

from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import DataStreamWriter, StreamingQuery
from pyspark.sql.streaming.listener import StreamingQueryProgress
from pyspark.sql.window import Window

from analytics.config import AnalyticsConfig
from analytics.jobs import REPORT_VIEW, Result, contributions, output, report_of, table_topics
from tables.errors import FatalError
from tables.registry import shown

CHECKPOINTS = "checkpoints"
# Spark gives a streaming source's Python worker a hard-coded 10 s to connect back (PythonWorkerFactory's
# createSimpleWorker, no setting); on a loaded machine a query fails so while it starts. ``run`` starts it again
# after a pause. The worker compiles pyspark from Spark's pyspark.zip on every start (1.2 s on an idle 2-core
# machine); with CI's 2 cores busy with other tests, it once took more than 10 s three times in a row.
WORKER_START = "Python worker failed to connect back"
START_ATTEMPTS = 5
START_PAUSE = 3.0  # seconds before a query that failed to start is started again
log = logging.getLogger("headwater.analytics")


def stream(spark: SparkSession, cfg: AnalyticsConfig, **options: str) -> DataFrame:
    """A Headwater topic as a streaming DataFrame, bounded per batch by ``cfg.batch_records``."""
    opts = {**cfg.source_options(), **options}
    if cfg.batch_records:
        opts["maxOffsetsPerTrigger"] = str(cfg.batch_records)
    return spark.readStream.format("headwater").options(**opts).load()


def start(writer: DataStreamWriter, cfg: AnalyticsConfig, job: str, name: str) -> StreamingQuery:
    """The query, checkpointed under the job's directory: availableNow, or every interval with ``follow``."""
    writer = writer.option("checkpointLocation", str(cfg.output / CHECKPOINTS / job / name)).queryName(f"{job} {name}")
    if cfg.follow:
        return writer.trigger(processingTime=f"{cfg.stream_interval} seconds").start()
    return writer.trigger(availableNow=True).start()


def _starter(writer: DataStreamWriter, cfg: AnalyticsConfig, job: str, name: str) -> Callable[[], StreamingQuery]:
    return lambda: start(writer, cfg, job, name)


def run(spark: SparkSession, starts: Mapping[str, Callable[[], StreamingQuery]],
        timeout: float | None = None) -> dict[str, StreamingQuery]:
    """Each query started and waited for until it stopped by itself, then none left running; one that Spark failed to
    start is started again from its checkpoint (at most ``START_ATTEMPTS`` times in all); any other failure is raised.
    ``timeout`` (s, for tests): a ``TimeoutError`` when the queries have not all stopped by then."""
    manager, queries = spark.streams, {name: begin() for name, begin in starts.items()}
    manager.resetTerminated()  # queries this session ran before do not count
    left, until = START_ATTEMPTS - 1, None if timeout is None else time.monotonic() + timeout
    try:
        while any(q.isActive for q in queries.values()):
            _await_any(spark, until)
            left -= _start_again(queries, starts, left)
        _start_again(queries, starts, 0)  # one that failed after the last wait is raised
        return queries
    finally:
        for q in queries.values():
            q.stop()


def _await_any(spark: SparkSession, until: float | None) -> None:
    wait = None if until is None else max(1, math.ceil(until - time.monotonic()))
    with suppress(StreamingQueryException):  # the failed query is found by its exception()
        if not spark.streams.awaitAnyTermination(wait) and until is not None and time.monotonic() >= until:
            raise TimeoutError("streaming queries still running past their timeout")
    spark.streams.resetTerminated()


def _start_again(queries: dict[str, StreamingQuery], starts: Mapping[str, Callable[[], StreamingQuery]],
                 left: int) -> int:
    """How many failed queries were started again; a failure that is not Spark's start-up timeout, or one past
    ``left`` restarts, is raised."""
    used = 0
    for name, query in list(queries.items()):
        error = None if query.isActive else query.exception()
        if error is None:
            continue
        if not failed_to_start(error) or used >= left:
            raise error
        log.warning("the query %s failed to start (%s); starting it again from its checkpoint in %.0f s", name,
                    WORKER_START, START_PAUSE)  # fmt: skip
        time.sleep(START_PAUSE)
        queries[name], used = starts[name](), used + 1
    return used


def failed_to_start(error: BaseException | None) -> bool:
    """Whether a query's failure is Spark's timeout for starting its source's Python worker (nothing was read)."""
    return error is not None and WORKER_START in str(error)


def read_in(progress: Sequence[StreamingQueryProgress]) -> int:
    """Messages a query read, by its progress reports."""
    return sum(p.numInputRows for p in progress)


# ---- changes --------------------------------------------------------------------------------
def changes(spark: SparkSession, cfg: AnalyticsConfig) -> list[Result]:
    topics = table_topics(cfg)
    if not topics:
        raise FatalError(f"no table topics under the prefix {cfg.topic_prefix!r} in {shown(cfg.registry_url)}",
                         hint="run capture first, or set topic_prefix in [pipeline] or [analytics]")  # fmt: skip
    frames = {t: stream(spark, cfg, topic=t, metadata="true") for t in topics}
    paths = {t: output(cfg) / "changes" / t for t in topics}
    starts = {t: _starter(f.writeStream.format("parquet").option("path", str(paths[t])), cfg, "changes", t)
              for t, f in frames.items()}  # fmt: skip
    queries = run(spark, starts)
    out = []
    for topic, query in queries.items():
        kept = _parquet(spark, paths[topic], frames[topic])
        title = f"{topic}: {read_in(query.recentProgress)} changes this run, {kept.count()} in Parquet"
        out.append(Result(title, kept.orderBy(F.desc("_commit_lsn")).limit(5), paths[topic]))
    return out


def _parquet(spark: SparkSession, path: Path, like: DataFrame) -> DataFrame:
    """A file sink's rows (through its log: each message once), or none if it never wrote a batch."""
    if not (path / "_spark_metadata").exists():
        return spark.createDataFrame([], like.schema)
    return spark.read.parquet(str(path))


# ---- shop-report-stream ---------------------------------------------------------------------
class ReportKeeper:
    """``apply(batch, id)`` moves the report's state and the report to the batch's cut (foreachBatch)."""

    def __init__(self, spark: SparkSession, home: Path) -> None:
        self.spark, self.home = spark, home
        self.states = home / "state"
        self.report = home / "report"

    def apply(self, batch: DataFrame, batch_id: int) -> None:
        newest = batch.withColumn("_n", F.row_number().over(Window.partitionBy("id").orderBy(F.desc("_offset"))))
        newest = newest.where("_n = 1")  # a key's rows are in one partition: its last offset is its last version
        parts = contributions(newest.where(F.col("_op") != "DELETE"))
        before = self.state_before(batch_id)
        if before is not None:
            kept = self.spark.read.parquet(str(before)).join(newest.select("id"), "id", "left_anti")
            parts = kept.unionByName(parts)
        target = self.states / str(batch_id)
        parts.write.mode("overwrite").parquet(str(target))
        report_of(self.spark.read.parquet(str(target))).write.mode("overwrite").parquet(str(self.report))
        for old in self._batches():
            if old < batch_id and self.states / str(old) != before:
                shutil.rmtree(self.states / str(old))

    def state_before(self, batch_id: int) -> Path | None:
        earlier = [b for b in self._batches() if b < batch_id]
        return self.states / str(max(earlier)) if earlier else None

    def _batches(self) -> list[int]:
        found = self.states.iterdir() if self.states.is_dir() else iter(())
        return sorted(int(p.name) for p in found if p.name.isdigit())


def shop_report_stream(spark: SparkSession, cfg: AnalyticsConfig) -> list[Result]:
    home = output(cfg) / "shop-report-stream"
    keeper = ReportKeeper(spark, home)
    frame = stream(spark, cfg, view=REPORT_VIEW, metadata="true")
    begin = _starter(frame.writeStream.foreachBatch(keeper.apply), cfg, "shop-report-stream", REPORT_VIEW)
    query = run(spark, {REPORT_VIEW: begin})[REPORT_VIEW]
    reached = home / "cut.json"
    ends = [json.loads(p.sources[0].endOffset) for p in query.recentProgress if p.sources]
    if ends and "cut" in ends[-1]:
        reached.write_text(json.dumps(ends[-1]["cut"]))
    if not keeper.report.exists():
        raise FatalError(f"the view {REPORT_VIEW} has no cut yet: there is no report to keep",
                         hint="cuts are published by a streams worker running the view (see README 'Views')")
    cut = json.loads(reached.read_text())["lsn"] if reached.exists() else "?"
    title = (f"revenue by day, region and category, kept from the view {REPORT_VIEW} cut by cut: at commit LSN {cut}"
             f" ({read_in(query.recentProgress)} view rows this run)")  # fmt: skip
    return [Result(title, spark.read.parquet(str(keeper.report)).orderBy("day", "region", "category"), keeper.report)]


STREAM_JOBS: dict[str, Callable[[SparkSession, AnalyticsConfig], list[Result]]] = {
    "changes": changes,
    "shop-report-stream": shop_report_stream,
}  # described in analytics.config.JOB_HELP

"""Structured Streaming on topics written here: availableNow in bounded batches, starting offsets, restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from analytics.config import AnalyticsConfig
from analytics.session import sweep
from analytics.source import register
from analytics.streamjobs import WORKER_START, run
from headwater.cli import main
from tables.config import StackConfig
from tests.analytics.test_reader import V1, Things, error_of, framed
from tests.plugins.streams import REPO
from tests.streams.test_workers import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def many(local_stack: StackConfig, topic_factory: Callable[..., str]) -> Iterator[Things]:
    made = Things(local_stack, topic_factory("many", partitions=3))
    yield made
    del made.producer
    made.registrar.close()


def put(things: Things, first: int, count: int) -> None:
    """Rows ``first`` .. ``first + count - 1`` (v1 ``thing`` records), round robin over 3 partitions."""
    for n in range(first, first + count):
        things.put(n, framed(things.v1, V1, {"id": n, "name": f"n{n}"}), n % 3)
    assert things.producer.flush(30) == 0


def stream(spark: SparkSession, cfg: AnalyticsConfig, **options: str) -> DataFrame:
    return spark.readStream.format("headwater").options(**cfg.source_options(), **options).load()


def to_parquet(frame: DataFrame, where: Path, *, available_now: bool = True) -> StreamingQuery:
    writer = frame.writeStream.format("parquet").option("path", str(where / "out"))
    writer = writer.option("checkpointLocation", str(where / "checkpoint"))
    return (writer.trigger(availableNow=True) if available_now else writer.trigger(processingTime="200 milliseconds")
            ).start()  # fmt: skip


def finished(spark: SparkSession, start: Callable[[], StreamingQuery], timeout: float = 120) -> list[dict[str, Any]]:
    """The batches of a query that must stop by itself, as their progress reports (run as the jobs run theirs)."""
    query = run(spark, {"query": start}, timeout)["query"]
    return [p for p in query.recentProgress if p["numInputRows"] > 0]


def offsets_in(spark: SparkSession, where: Path) -> Counter[tuple[int, int]]:
    """How often each (partition, offset) is in a file sink (read through its log, as Spark reads it)."""
    rows = spark.read.parquet(str(where)).select("_partition", "_offset").collect()
    return Counter((r._partition, r._offset) for r in rows)


def test_available_now_reads_what_is_there_in_bounded_batches_and_stops_and_a_rerun_reads_only_the_new(
    spark: SparkSession, many: Things, analytics_config: Callable[..., AnalyticsConfig], tmp_path: Path
) -> None:
    cfg = analytics_config("")
    put(many, 0, 600)
    frame = stream(spark, cfg, topic=many.topic, metadata="true", maxOffsetsPerTrigger="100")
    assert frame.isStreaming and frame.columns == ["id", "name", "_op", "_partition", "_offset", "_commit_lsn"]
    batches = finished(spark, lambda: to_parquet(frame, tmp_path))
    assert len(batches) == 6 and all(b["numInputRows"] <= 100 for b in batches)
    assert sum(b["numInputRows"] for b in batches) == 600
    seen = offsets_in(spark, tmp_path / "out")
    assert set(seen.values()) == {1} and sorted(seen) == sorted((n % 3, n // 3) for n in range(600))
    end = json.loads(batches[-1]["sources"][0]["endOffset"])
    assert end == {many.topic: {"0": 200, "1": 200, "2": 200}}  # Spark's Kafka source's offset form

    put(many, 600, 90)  # the same query again: only what came after its checkpoint
    again_frame = stream(spark, cfg, topic=many.topic, metadata="true")
    again = finished(spark, lambda: to_parquet(again_frame, tmp_path))
    assert sum(b["numInputRows"] for b in again) == 90
    seen = offsets_in(spark, tmp_path / "out")
    assert set(seen.values()) == {1} and len(seen) == 690
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    assert sorted(r.id for r in rows) == list(range(690)) and {r._op for r in rows} == {"UPSERT"}


def test_a_query_whose_source_worker_starts_too_slowly_for_spark_is_started_again_and_reads_every_message_once(
    spark: SparkSession, many: Things, analytics_config: Callable[..., AnalyticsConfig], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    cfg = analytics_config("")
    put(many, 0, 60)
    slowed = tmp_path / "slowed"  # Spark waits 10 s for the streaming source's worker: its first start takes 12
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/sh
case "$*" in *python_streaming_source_runner*) [ -e {slowed} ] || {{ touch {slowed}; sleep 12; }} ;; esac
exec {sys.executable} "$@"
""")
    python.chmod(0o700)
    context, real = spark.sparkContext, spark.sparkContext.pythonExec
    context.pythonExec = str(python)
    register(spark)  # the data source's Python function names the interpreter to start
    try:
        frame = stream(spark, cfg, topic=many.topic, metadata="true")
        batches = finished(spark, lambda: to_parquet(frame, tmp_path))
    finally:
        context.pythonExec = real
        register(spark)
    assert slowed.exists() and f"failed to start ({WORKER_START})" in caplog.text
    assert sum(b["numInputRows"] for b in batches) == 60
    assert offsets_in(spark, tmp_path / "out") == Counter((n % 3, n // 3) for n in range(60))


def test_starting_offsets_earliest_latest_and_per_partition(
    spark: SparkSession, many: Things, analytics_config: Callable[..., AnalyticsConfig], tmp_path: Path
) -> None:
    cfg = analytics_config("")
    put(many, 0, 30)  # 10 per partition
    chosen = json.dumps({many.topic: {"0": 4, "1": -1, "2": -2}})
    chosen_start = stream(spark, cfg, topic=many.topic, metadata="true", startingOffsets=chosen)
    finished(spark, lambda: to_parquet(chosen_start, tmp_path / "chosen"))
    assert sorted(offsets_in(spark, tmp_path / "chosen" / "out")) == [(0, o) for o in range(4, 10)] + [(2, o)
                                                                                                for o in range(10)]
    late_start = stream(spark, cfg, topic=many.topic, metadata="true", startingOffsets="latest")
    assert finished(spark, lambda: to_parquet(late_start, tmp_path / "late")) == []
    put(many, 30, 6)
    late_frame = stream(spark, cfg, topic=many.topic, metadata="true")
    late = finished(spark, lambda: to_parquet(late_frame, tmp_path / "late"))
    assert sum(b["numInputRows"] for b in late) == 6  # the checkpoint began at the ends as they were
    assert sorted(offsets_in(spark, tmp_path / "late" / "out")) == sorted((p, o) for p in range(3) for o in (10, 11))


def test_a_stream_refuses_batch_options_and_bad_offsets_with_the_fix(
    spark: SparkSession, many: Things, analytics_config: Callable[..., AnalyticsConfig], tmp_path: Path
) -> None:
    cfg = analytics_config("")
    put(many, 0, 3)
    latest = error_of(lambda: finished(spark, lambda: to_parquet(stream(spark, cfg, topic=many.topic, mode="latest"),
                                                                 tmp_path / "a")))  # fmt: skip
    assert "a stream reads changes" in str(latest) and "foreachBatch" in str(latest)
    bad = json.dumps({"other": {"0": 1}})
    bad_start = stream(spark, cfg, topic=many.topic, startingOffsets=bad)
    wrong = error_of(lambda: finished(spark, lambda: to_parquet(bad_start, tmp_path / "b")))
    assert f"topic {many.topic}" in str(wrong) and '"0": 23, "1": -2' in str(wrong)
    missing = json.dumps({many.topic: {"7": 1}})
    missing_start = stream(spark, cfg, topic=many.topic, startingOffsets=missing)
    nope = error_of(lambda: finished(spark, lambda: to_parquet(missing_start, tmp_path / "c")))
    assert "partition 7, which the topic does not have" in str(nope)


def job_argv(cfg: AnalyticsConfig, job: str, *extra: str) -> list[str]:
    return ["analytics", job, "--bootstrap", cfg.bootstrap, "--registry-url", cfg.registry_url, "--topic-prefix",
            cfg.topic_prefix, "--output", str(cfg.output), "--rows", "3", *extra]  # fmt: skip


def committed_batches(checkpoint: Path) -> int:
    commits = checkpoint / "commits"
    return sum(1 for p in commits.iterdir() if p.name.isdigit()) if commits.is_dir() else 0


def test_the_changes_job_killed_mid_run_and_run_again_writes_every_change_once(
    spark: SparkSession, many: Things, analytics_config: Callable[..., AnalyticsConfig], unique_name: str,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    cfg = analytics_config(unique_name)
    put(many, 0, 30_000)
    argv = job_argv(cfg, "changes", "--follow", "--batch-records", "1500", "--stream-interval", "0.1",
                    "--master", "local[1]")  # fmt: skip
    log = (tmp_path / "job.log").open("wb")
    job = subprocess.Popen([sys.executable, "-m", "headwater.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True, cwd=REPO)  # fmt: skip
    checkpoint = cfg.output / "checkpoints" / "changes" / many.topic
    try:
        assert wait_for(lambda: committed_batches(checkpoint) >= 3 or job.poll() is not None, 180, every=0.1)
        put(many, 30_000, 3_000)  # written while it runs
        os.killpg(job.pid, signal.SIGKILL)  # the driver and its JVM, in the middle of a batch or between two
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(60)
        log.close()
        sweep(Path(tempfile.gettempdir()))  # the killed job's scratch (a job started later would sweep it)
    sink = cfg.output / "changes" / many.topic
    before = spark.read.parquet(str(sink)).count()
    assert 0 < before < 33_000, (tmp_path / "job.log").read_text()[-3000:]

    assert main(job_argv(cfg, "changes")) == 0  # catch up and stop, in this process's Spark session
    assert f"{many.topic}: {33_000 - before} changes this run, 33000 in Parquet" in capsys.readouterr().out
    seen = offsets_in(spark, sink)
    assert set(seen.values()) == {1} and sorted(seen) == sorted((n % 3, n // 3) for n in range(33_000))

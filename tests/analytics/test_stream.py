"""Structured Streaming on topics written here: availableNow in bounded batches, starting offsets, restarts."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from analytics.config import AnalyticsConfig
from tables.config import StackConfig
from tests.analytics.test_reader import Things, error_of, framed

pytestmark = pytest.mark.slow


@pytest.fixture
def many(local_stack: StackConfig, topic_factory: Callable[..., str]) -> Iterator[Things]:
    made = Things(local_stack, topic_factory("many", partitions=3))
    yield made
    del made.producer
    made.registrar.close()


def put(things: Things, first: int, count: int) -> None:
    """Rows ``first`` .. ``first + count - 1`` (v1 ``thing`` records), round robin over 3 partitions."""
    from tests.analytics.test_reader import V1

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


def finished(query: StreamingQuery, timeout: float = 120) -> list[dict[str, Any]]:
    """The batches of a query that must stop by itself, as their progress reports."""
    assert query.awaitTermination(timeout), "an availableNow query did not stop"
    assert query.exception() is None, query.exception()
    return [p for p in query.recentProgress if p["numInputRows"] > 0]


def offsets_in(spark: SparkSession, where: Path) -> Counter[tuple[int, int]]:
    rows = spark.read.parquet(str(where / "out")).select("_partition", "_offset").collect()
    return Counter((r._partition, r._offset) for r in rows)


def test_available_now_reads_what_is_there_in_bounded_batches_and_stops_and_a_rerun_reads_only_the_new(
    spark: SparkSession, many: Things, analytics_config: Callable[..., AnalyticsConfig], tmp_path: Path
) -> None:
    cfg = analytics_config("")
    put(many, 0, 600)
    frame = stream(spark, cfg, topic=many.topic, metadata="true", maxOffsetsPerTrigger="100")
    assert frame.isStreaming and frame.columns == ["id", "name", "_op", "_partition", "_offset", "_commit_lsn"]
    batches = finished(to_parquet(frame, tmp_path))
    assert len(batches) == 6 and all(b["numInputRows"] <= 100 for b in batches)
    assert sum(b["numInputRows"] for b in batches) == 600
    seen = offsets_in(spark, tmp_path)
    assert set(seen.values()) == {1} and sorted(seen) == sorted((n % 3, n // 3) for n in range(600))
    end = json.loads(batches[-1]["sources"][0]["endOffset"])
    assert end == {many.topic: {"0": 200, "1": 200, "2": 200}}  # Spark's Kafka source's offset form

    put(many, 600, 90)  # the same query again: only what came after its checkpoint
    again = finished(to_parquet(stream(spark, cfg, topic=many.topic, metadata="true"), tmp_path))
    assert sum(b["numInputRows"] for b in again) == 90
    seen = offsets_in(spark, tmp_path)
    assert set(seen.values()) == {1} and len(seen) == 690
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    assert sorted(r.id for r in rows) == list(range(690)) and {r._op for r in rows} == {"UPSERT"}


def test_starting_offsets_earliest_latest_and_per_partition(
    spark: SparkSession, many: Things, analytics_config: Callable[..., AnalyticsConfig], tmp_path: Path
) -> None:
    cfg = analytics_config("")
    put(many, 0, 30)  # 10 per partition
    chosen = json.dumps({many.topic: {"0": 4, "1": -1, "2": -2}})
    finished(to_parquet(stream(spark, cfg, topic=many.topic, metadata="true", startingOffsets=chosen),
                        tmp_path / "chosen"))  # fmt: skip
    assert sorted(offsets_in(spark, tmp_path / "chosen")) == [(0, o) for o in range(4, 10)] + [(2, o)
                                                                                                for o in range(10)]
    assert finished(to_parquet(stream(spark, cfg, topic=many.topic, startingOffsets="latest"), tmp_path / "late")) == []
    put(many, 30, 6)
    late = finished(to_parquet(stream(spark, cfg, topic=many.topic, metadata="true"), tmp_path / "late"))
    assert sum(b["numInputRows"] for b in late) == 6  # the checkpoint began at the ends as they were
    assert sorted(offsets_in(spark, tmp_path / "late")) == sorted((p, o) for p in range(3) for o in (10, 11))


def test_a_stream_refuses_batch_options_and_bad_offsets_with_the_fix(
    spark: SparkSession, many: Things, analytics_config: Callable[..., AnalyticsConfig], tmp_path: Path
) -> None:
    cfg = analytics_config("")
    put(many, 0, 3)
    latest = error_of(lambda: finished(to_parquet(stream(spark, cfg, topic=many.topic, mode="latest"), tmp_path / "a")))
    assert "a stream reads changes" in str(latest) and "foreachBatch" in str(latest)
    bad = json.dumps({"other": {"0": 1}})
    wrong = error_of(lambda: finished(to_parquet(stream(spark, cfg, topic=many.topic, startingOffsets=bad),
                                                 tmp_path / "b")))  # fmt: skip
    assert f"topic {many.topic}" in str(wrong) and '"0": 23, "1": -2' in str(wrong)
    missing = json.dumps({many.topic: {"7": 1}})
    nope = error_of(lambda: finished(to_parquet(stream(spark, cfg, topic=many.topic, startingOffsets=missing),
                                                tmp_path / "c")))  # fmt: skip
    assert "partition 7, which the topic does not have" in str(nope)

"""The Spark session users' jobs run in: its scratch files stay private to its owner."""

from __future__ import annotations

import stat
from pathlib import Path

from pyspark.sql import SparkSession


def test_spark_scratch_files_go_to_a_directory_only_its_owner_reads(spark: SparkSession) -> None:
    """Shuffle blocks (table rows) and the driver JVM's temporary files land in the session's own directory,
    mode 0700, not in the shared /tmp where Spark's default leaves them world-readable."""
    local = Path(spark.conf.get("spark.local.dir") or "")
    assert local.name.startswith("headwater-spark-"), local
    assert stat.S_IMODE(local.stat().st_mode) == 0o700
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    assert Path(jvm.System.getProperty("java.io.tmpdir")) == local
    frame = spark.range(20_000).selectExpr("id % 97 AS k", "id AS v").groupBy("k").sum("v")
    assert frame.count() == 97  # a shuffle: Spark's block manager writes under spark.local.dir
    assert any(p.name.startswith("blockmgr-") for p in local.iterdir()), sorted(p.name for p in local.iterdir())

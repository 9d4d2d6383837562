"""A local Spark session for the analytics tests, and settings pointing it at the test stack.

``spark`` starts one ``local[2]`` session per test session (the JVM takes seconds to
start) through the same ``analytics.session`` code users run, and stops it at the end
(and removes its scratch directory).
``analytics_config(prefix)`` is an ``AnalyticsConfig`` for the test stack and a prefix.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from analytics.config import AnalyticsConfig
from analytics.session import spark_session
from tables.config import StackConfig


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = spark_session(AnalyticsConfig(master="local[2]"), "headwater-tests")
    scratch = session.conf.get("spark.local.dir")
    yield session
    session.stop()
    if scratch:  # removed at exit too, but an xdist worker process ends without running atexit
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def analytics_config(local_stack: StackConfig, tmp_path: Path) -> Callable[..., AnalyticsConfig]:
    def make(prefix: str, **overrides: object) -> AnalyticsConfig:
        settings: dict[str, object] = {
            "bootstrap": local_stack.bootstrap, "registry_url": local_stack.registry_url, "topic_prefix": prefix,
            "master": "local[2]", "output": tmp_path / "analytics-output", **overrides,
        }  # fmt: skip
        return AnalyticsConfig(**settings)  # type: ignore[arg-type]

    return make

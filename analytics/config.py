"""The analytics settings ([analytics] in headwater.toml, HEADWATER_ANALYTICS_*, flags).

Promise: one frozen, validated object, loaded like every other component's
(``tables.config.load_component``): the broker, Kafka client settings, registry and topic prefix
come from ``[pipeline]`` unless ``[analytics]`` sets its own, and broker and registry nobody sets
are the local stack's. Kafka SASL/TLS go through ``kafka`` (librdkafka names, secret values print
as ``***``), Spark settings through ``spark``; ``follow``, ``stream_interval`` and
``batch_records`` shape the streaming jobs. ``source_options`` turns it into the data source's
options.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tables.config import (
    InvalidSetting,
    Loaded,
    Settings,
    StackConfig,
    check_shared,
    config_path,
    load_component,
    masked_repr,
    setting,
)

JOB_HELP = {  # the jobs of analytics.jobs.JOBS, named here so the command line does not import Spark
    "shop-report": "sample shop: revenue by day, customer region and product category (Parquet too)",
    "tables": "latest state of every table topic, as Parquet",
    "changes": "streaming: every table topic's changes appended to Parquet, each once (catch up and stop, or --follow)",
    "shop-report-stream": "streaming: the shop report kept up to date from the view, cut by cut (Parquet)",
}


@dataclass(frozen=True)
class AnalyticsConfig:
    """Where the topics are and how Spark runs (see the README's Analytics section)."""

    bootstrap: str = setting("", "Kafka bootstrap servers (default: [pipeline] bootstrap, else the local stack's)")
    registry_url: str = setting("", "schema registry URL (default: [pipeline] registry_url, else the local stack's)")
    topic_prefix: str = setting("headwater", "the capture's topic prefix (default: [pipeline]'s, else headwater)")
    master: str = setting("local[*]", "Spark master: local[*], local[N], spark://host:port, yarn, k8s://...")
    output: Path = setting(Path("analytics-output"), "directory the jobs write their Parquet into")
    kafka: Settings = setting(Settings(), "librdkafka settings of the readers, over [pipeline] kafka (sasl.*, ssl.*)")
    spark: Settings = setting(Settings(), "Spark settings for the session (spark.executor.memory=4g, ...)")
    task_records: int = setting(1_000_000, "most messages one Spark task reads; bigger partitions are split")
    timeout: float = setting(300.0, "seconds a task may take to reach its planned end before it fails")
    follow: bool = setting(False, "streaming jobs keep running (a micro-batch every stream_interval s) until "
                                  "interrupted, instead of catching up and stopping")  # fmt: skip
    stream_interval: float = setting(10.0, "streaming jobs with follow: seconds between micro-batches")
    batch_records: int = setting(0, "streaming jobs: most messages one micro-batch reads (0: no bound); "
                                    "a view's batch still ends at a cut")  # fmt: skip

    __repr__ = masked_repr

    def __post_init__(self) -> None:
        check_shared(self.topic_prefix, self.registry_url)
        if self.task_records < 1:
            raise InvalidSetting("task_records", f"must be at least 1, got {self.task_records}")
        if self.timeout <= 0:
            raise InvalidSetting("timeout", "must be a positive number of seconds")
        if self.stream_interval <= 0:
            raise InvalidSetting("stream_interval", "must be a positive number of seconds")
        if self.batch_records < 0:
            raise InvalidSetting("batch_records", f"must be 0 (no bound) or more, got {self.batch_records}")
        if not self.master:
            raise InvalidSetting("master", "must name a Spark master, e.g. local[*]")

    def source_options(self) -> dict[str, str]:
        """The ``headwater`` data source's options for these settings."""
        options = {"bootstrap": self.bootstrap, "registry": self.registry_url, "prefix": self.topic_prefix,
                   "task_records": str(self.task_records), "timeout": str(self.timeout)}  # fmt: skip
        options.update({f"kafka.{k}": v for k, v in self.kafka.items()})
        return options


def load_analytics(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    local: StackConfig | None = None,
) -> Loaded[AnalyticsConfig]:
    """[analytics] over [pipeline] (config file, environment, ``flags``), with where each value came from."""
    env = os.environ if environ is None else environ
    return load_component(
        AnalyticsConfig, "analytics", path=config_path(explicit, env), environ=env, flags=flags, local=local
    )


def load_analytics_config(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    local: StackConfig | None = None,
) -> AnalyticsConfig:
    """The analytics' effective settings (see ``load_analytics``)."""
    return load_analytics(explicit, environ, flags, local).config

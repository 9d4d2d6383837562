"""The stream workers' settings ([streams] in headwater.toml, HEADWATER_STREAMS_*, faust flags).

Promise: one frozen, validated object, loaded the same way as every other component's
(``tables.config.load_component``): the broker, Kafka client settings, registry, Redis and topic
prefix come from ``[pipeline]`` unless ``[streams]`` sets its own; what nobody sets is the local
stack's, and ``state_dir`` is ``<[stack] data_dir>/streams``. Kafka SASL/TLS go through ``kafka``
(librdkafka names, secret values print as ``***``). The broker profile ``auto`` is ``tansu``
exactly when the broker is the local stack's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tables.config import (
    BROKER_PROFILE_HELP,
    InvalidSetting,
    Loaded,
    OnBroker,
    Settings,
    Source,
    check_port,
    check_profile,
    check_shared,
    config_path,
    load_component,
    masked_repr,
    on_local_stack,
    read_file,
    resolve_profile,
    setting,
)
from tables.topics import (
    changes_topic,
    cuts_topic,
    debezium_prefix,
    dlq_topic,
    fragments_topic,
    points_topic,
    progress_topic,
    view_topic,
)
from tables.views import ViewSpec, parse_views

APP_ID = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class StreamsConfig(OnBroker):
    """How the Faust workers read the raw topic and what they build (see the README's table)."""

    app_id: str = setting("headwater-streams", "Faust app id: consumer group and changelog topic prefix")
    bootstrap: str = setting("", "Kafka bootstrap servers (default: [pipeline] bootstrap, else the local stack's)")
    registry_url: str = setting("", "schema registry URL (default: [pipeline] registry_url, else the local stack's)")
    topic_prefix: str = setting("headwater", "the capture's topic prefix (default: [pipeline]'s, else headwater)")
    tables: str = setting("", "comma-separated schema.table to serve (default: every table capture registered)")
    discover_every: float = setting(5.0, "seconds between two looks at the registry for tables capture started "
                                         "capturing since the worker started (0: only at start)")  # fmt: skip
    partitions: int = setting(4, "partitions of the per-table topics and of the tables' changelogs")
    replication_factor: int = setting(1, "replication factor of the topics the workers create")
    topic_config: Settings = setting(Settings(), "extra settings for the per-table topics (e.g. min.insync.replicas)")
    broker_profile: str = setting("auto", BROKER_PROFILE_HELP)
    kafka: Settings = setting(Settings(), "librdkafka-style client settings, over [pipeline] kafka (sasl.*, ssl.*)")
    table_standby_replicas: int = setting(0, "standby copies of each table partition kept by other workers")
    web_host: str = setting("127.0.0.1", "address the query endpoint binds to and advertises")
    web_port: int = setting(6066, "port of the query endpoint (faust worker --web-port overrides it)")
    canonical_url: str = setting("", "URL other workers use to reach this one (default http://web_host:web_port)")
    group_instance_id: str = setting(
        "",
        "static group membership (KIP-345): a stable id unique to this worker; a restart takes its "
        "partitions back at once, a stop holds them for the session (10 s); empty: off",
    )
    batch_size: int = setting(2000, "raw changes the fan-out handles per batch")
    batch_wait: float = setting(0.005, "seconds an agent waits to fill a batch (latency against per-batch work)")
    state_dir: Path = setting(Path(".headwater/streams"), "Faust's data directory (default: <data_dir>/streams)")
    redis_url: str = setting("", "Redis of the views (default: [pipeline]'s, else the local stack's; 'none': off)")
    view_point_interval: float = setting(
        0.02,
        "seconds at least between two points the views publish at (the raw "
        "partition's owner waits longer while publications take longer)",
    )
    view_cache_rows: int = setting(20_000, "rows the views keep decoded in memory, with as many encoded rows, "
                                   "joined rows' encodings with everything under them, and collected key lists "
                                   "(the rest are read from their store when needed)")  # fmt: skip
    redis_fill_rows: int = setting(10_000, "view rows the mirror writes per Redis script while it fills a view "
                                   "Redis shows no cut of yet (a cut's own rows go in one script)")  # fmt: skip
    cut_warn_after: float = setting(300.0, "seconds the views' cut may stand still with changes waiting before a "
                                    "WARNING (0: never)")  # fmt: skip
    stop_timeout: float = setting(30.0, "seconds Faust's own shutdown may take once the worker's readers and "
                                  "stores are closed; past them the process exits")  # fmt: skip
    debezium: bool = setting(False, "also write every change as Debezium's PostgreSQL connector would, to "
                                    "<debezium_prefix>.<schema>.<table> (README 'Debezium-format topics')")  # fmt: skip
    debezium_prefix: str = setting("", "prefix of the Debezium-format topics, Debezium's topic.prefix and "
                                       "source.name (default: <topic_prefix>.debezium)")  # fmt: skip
    debezium_database: str = setting("", "source.db of the Debezium-format events: the captured database's name "
                                         "(default with the local stack: its database)")  # fmt: skip
    debezium_transactions: bool = setting(False, "with debezium: each event's transaction block and BEGIN/END "
                                                 "records on <debezium_prefix>.transaction")  # fmt: skip

    __repr__ = masked_repr

    def __post_init__(self) -> None:
        check_shared(self.topic_prefix, self.registry_url, self.redis_url)
        for key in ("app_id", "group_instance_id"):
            value = getattr(self, key)
            if (value or key == "app_id") and not APP_ID.match(value):
                raise InvalidSetting(key, f"must be letters, digits, '.', '_' or '-', got {value!r}")
        check_profile(self.broker_profile)
        for key in ("partitions", "replication_factor", "batch_size", "view_cache_rows", "redis_fill_rows"):
            if getattr(self, key) < 1:
                raise InvalidSetting(key, f"must be at least 1, got {getattr(self, key)}")
        if self.table_standby_replicas < 0:
            raise InvalidSetting("table_standby_replicas", "must be 0 or more")
        if self.cut_warn_after < 0:
            raise InvalidSetting("cut_warn_after", "must be 0 (never) or a number of seconds")
        if self.discover_every < 0:
            raise InvalidSetting("discover_every", "must be 0 (only at start) or a number of seconds")
        if self.view_point_interval < 0:
            raise InvalidSetting("view_point_interval", "must be 0 or a number of seconds")
        if self.stop_timeout <= 0:
            raise InvalidSetting("stop_timeout", f"must be a positive number of seconds, got {self.stop_timeout}")
        if self.batch_wait <= 0:
            raise InvalidSetting("batch_wait", "must be a positive number of seconds")
        check_port("web_port", self.web_port)
        for name in self.table_names:
            if "." not in name:
                raise InvalidSetting("tables", f"{name!r}: write tables as schema.table")

    @property
    def changes_topic(self) -> str:
        return changes_topic(self.topic_prefix)

    @property
    def dbz_prefix(self) -> str:
        """The Debezium-format topics' prefix: ``debezium_prefix``, else ``<topic_prefix>.debezium``."""
        return self.debezium_prefix or debezium_prefix(self.topic_prefix)

    @property
    def dlq_topic(self) -> str:
        """Where raw messages that cannot be decoded go, with their offset and the reason."""
        return dlq_topic(self.topic_prefix)

    @property
    def progress_topic(self) -> str:
        """The fan-out's checkpoint: how far the raw topic is fully written to the table topics."""
        return progress_topic(self.topic_prefix)

    @property
    def cuts_topic(self) -> str:
        """Where the workers publish how far each view is complete (a commit LSN and the view topic's ends)."""
        return cuts_topic(self.topic_prefix)

    @property
    def points_topic(self) -> str:
        """Where the raw partition's owner announces the raw topic's end and the views' publication points."""
        return points_topic(self.topic_prefix)

    @property
    def fragments_topic(self) -> str:
        """Where each worker reports the view partitions it published at a point."""
        return fragments_topic(self.topic_prefix)

    def view_topic(self, view: str) -> str:
        return view_topic(self.topic_prefix, view)

    @property
    def table_names(self) -> list[str]:
        return [t.strip() for t in self.tables.split(",") if t.strip()]


def load_streams(environ: Mapping[str, str] | None = None, explicit: str | None = None) -> Loaded[StreamsConfig]:
    """[streams] over [pipeline] (config file and environment), with where each value came from;
    ``broker_profile = auto`` resolved against the local stack's broker, and on the local stack an
    unset ``debezium_database`` is its database."""
    env = os.environ if environ is None else environ
    loaded = load_component(StreamsConfig, "streams", path=config_path(explicit, env), environ=env)
    if on_local_stack(loaded) and loaded.local is not None and not loaded.config.debezium_database:
        loaded = loaded.replace("debezium_database", loaded.local.database, Source("stack", "database"))
    return resolve_profile(loaded)


def load_streams_config(environ: Mapping[str, str] | None = None) -> StreamsConfig:
    """The stream workers' effective settings (see ``load_streams``)."""
    return load_streams(environ).config


def load_views(environ: Mapping[str, str] | None = None) -> list[ViewSpec]:
    """The ``[views.<name>]`` specs of the config file (syntax checked; tables are checked at start-up)."""
    path = config_path(None, dict(os.environ if environ is None else environ))
    if path is None:
        return []
    data, text = read_file(path)
    return parse_views(data, text, path)

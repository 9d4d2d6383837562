"""The capture agent's settings ([capture] in headwater.toml, HEADWATER_CAPTURE_*, flags).

Promise: one frozen, validated object. The broker, Kafka client settings, registry and topic
prefix come from ``[pipeline]`` unless ``[capture]`` sets its own (``producer`` takes
``[pipeline] kafka``, merged key by key); the DSN, broker and registry nobody sets are the local
stack's and ``state_dir`` is ``<[stack] data_dir>/capture`` (``load_capture``). The DSN is a
``Secret`` (never printed); PostgreSQL TLS goes through the DSN (``sslmode=...``), Kafka SASL/TLS
through ``producer`` settings (librdkafka names), whose secret values print as ``***``.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tables.config import (
    BROKER_PROFILE_HELP,
    InvalidSetting,
    Loaded,
    OnBroker,
    Secret,
    Settings,
    StackConfig,
    check_dsn,
    check_port,
    check_profile,
    check_shared,
    config_path,
    load_component,
    masked_repr,
    resolve_profile,
    setting,
)
from tables.topics import changes_topic

NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
SIGNAL_TABLE = re.compile(r"^([A-Za-z_][A-Za-z0-9_$]*\.)?[A-Za-z_][A-Za-z0-9_$]*$")


@dataclass(frozen=True)
class CaptureConfig(OnBroker):
    """How to read PostgreSQL and where to write (see the README's configuration table)."""

    dsn: Secret = setting(Secret(""), "libpq connection string or URL (default: the local stack's database)")
    slot: str = setting("headwater", "logical replication slot (created on first use)")
    publication: str = setting("headwater", "publication (created for the chosen tables if missing)")
    include: str = setting("public.*", "comma-separated schema.table patterns to capture")
    exclude: str = setting("", "comma-separated schema.table patterns to leave out")
    topic_prefix: str = setting("headwater", "prefix of every topic (default: [pipeline] topic_prefix, else headwater)")
    format: str = setting("avro", "avro (Confluent wire format, schemas in the registry) or json")
    raw_images: str = setting(
        "framed", "row images in the raw topic (avro): framed (Confluent-framed bytes) or nested (Avro records)"
    )
    allow_unkeyed: bool = setting(False, "capture tables without primary key or replica identity index")
    skip_snapshot: bool = setting(False, "stream only, without the initial consistent snapshot")
    on_error: str = setting("log", "on a transient error: log and retry, or exit non-zero")
    bootstrap: str = setting("", "Kafka bootstrap servers (default: [pipeline] bootstrap, else the local stack's)")
    registry_url: str = setting("", "schema registry URL (default: [pipeline] registry_url, else the local stack's)")
    producer: Settings = setting(
        Settings(), "librdkafka settings of its clients, over [pipeline] kafka (SASL, TLS, ...)"
    )
    broker_profile: str = setting("auto", BROKER_PROFILE_HELP)
    topic_config: Settings = setting(Settings(), "settings for topics Headwater creates (e.g. retention.ms)")
    replication_factor: int = setting(1, "replication factor of topics Headwater creates")
    heartbeat_interval: float = setting(10.0, "seconds between heartbeats that keep the slot moving (0: off)")
    status_interval: float = setting(1.0, "seconds between status reports to PostgreSQL")
    snapshot_workers: int = setting(2, "worker processes copying tables in parallel during the snapshot")
    snapshot_chunk_pages: int = setting(2000, "heap pages per snapshot chunk (big tables are split)")
    max_tx_memory: int = setting(64 * 1024 * 1024, "bytes of a transaction kept in memory before spilling to disk")
    backfill_chunk_rows: int = setting(16384, "rows per chunk of a backfill (incremental snapshot)")
    signal_table: str = setting("", "schema.table whose INSERTs are backfill signals (empty: none; see README)")
    state_dir: Path = setting(
        Path(".headwater/capture"), "checkpoint, TOAST cache, spills (default: <data_dir>/capture)"
    )
    metrics_host: str = setting("127.0.0.1", "address of the metrics port (/metrics, /health, /ready)")
    metrics_port: int = setting(9188, "port of /metrics, /health and /ready (0: none)")
    slot_warn_bytes: int = setting(
        1024**3, "WAL retained behind the slot above which capture logs a WARNING (0: never)"
    )

    __repr__ = masked_repr

    def __post_init__(self) -> None:
        check_dsn("dsn", self.dsn.reveal())
        check_shared(self.topic_prefix, self.registry_url)
        check_profile(self.broker_profile)
        for key in ("slot", "publication"):
            if not NAME.match(getattr(self, key)):
                raise InvalidSetting(
                    key, f"must be a lower-case identifier ([a-z_][a-z0-9_]*), got {getattr(self, key)!r}"
                )
        if self.format not in ("avro", "json"):
            raise InvalidSetting("format", f"must be 'avro' or 'json', got {self.format!r}")
        if self.raw_images not in ("framed", "nested"):
            raise InvalidSetting("raw_images", f"must be 'framed' or 'nested', got {self.raw_images!r}")
        if self.format == "json" and self.raw_images == "nested":
            raise InvalidSetting("raw_images", "applies to format = 'avro' (the json format always nests row images)")
        if self.on_error not in ("log", "exit"):
            raise InvalidSetting("on_error", f"must be 'log' or 'exit', got {self.on_error!r}")
        if self.metrics_port:
            check_port("metrics_port", self.metrics_port)
        if self.slot_warn_bytes < 0:
            raise InvalidSetting("slot_warn_bytes", "must be 0 (never) or a number of bytes")
        if self.snapshot_workers < 1:
            raise InvalidSetting("snapshot_workers", "must be at least 1")
        if not self.patterns(self.include):
            raise InvalidSetting("include", "needs at least one schema.table pattern")
        if not 1 <= self.backfill_chunk_rows <= 1_000_000:
            raise InvalidSetting("backfill_chunk_rows", f"must be 1 to 1000000, got {self.backfill_chunk_rows}")
        if self.signal_table and not SIGNAL_TABLE.match(self.signal_table):
            raise InvalidSetting("signal_table", f"must be schema.table or table, got {self.signal_table!r}")

    @property
    def signal(self) -> tuple[str, str] | None:
        """(schema, table) of the signal table, or None."""
        if not self.signal_table:
            return None
        schema, _, name = self.signal_table.rpartition(".")
        return schema or "public", name

    @staticmethod
    def patterns(text: str) -> list[str]:
        return [p.strip() for p in text.split(",") if p.strip()]

    def wants(self, schema: str, table: str) -> bool:
        """True if ``schema.table`` matches an include pattern and no exclude pattern."""
        name = f"{schema}.{table}"
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns(self.include)) and not any(
            fnmatch.fnmatchcase(name, p) for p in self.patterns(self.exclude)
        )

    @property
    def changes_topic(self) -> str:
        return changes_topic(self.topic_prefix)

    @property
    def nested(self) -> bool:
        """Row images go into the raw topic as nested Avro records (``raw_images = "nested"``)."""
        return self.format == "avro" and self.raw_images == "nested"


def load_capture(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    local: StackConfig | None = None,
) -> Loaded[CaptureConfig]:
    """[capture] over [pipeline] (config file, environment, ``flags``), with where each value came from;
    ``broker_profile = auto`` resolved against the local stack's broker."""
    env = os.environ if environ is None else environ
    path = config_path(explicit, env)
    return resolve_profile(load_component(
        CaptureConfig, "capture", path=path, environ=env, flags=flags, local=local, renames={"producer": "kafka"}
    ))


def load_capture_config(
    explicit: str | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    local: StackConfig | None = None,
) -> CaptureConfig:
    """The capture agent's effective settings (see ``load_capture``)."""
    return load_capture(explicit, environ, flags, local).config

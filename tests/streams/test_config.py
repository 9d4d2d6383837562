"""Stream worker settings: validation naming the key, the broker profile in one place, secrets masked."""

from __future__ import annotations

import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import faust
import pytest
from faust.types import TP

from capture.encoder import AvroWriter
from streams import clients, profile
from streams.catalog import KeyCodec
from streams.config import StreamsConfig, load_streams_config
from streams.errors import KeyError400
from tables.config import Settings, load
from tables.errors import ConfigError
from tests.plugins.streams import REPO

pytestmark = pytest.mark.unit


def test_profile_follows_the_broker_and_only_tansu_gets_its_settings(tmp_path: Path) -> None:
    local = load_streams_config({"HEADWATER_CONFIG": str(write(tmp_path, "[stack]\nkafka_port = 29092\n"))})
    assert (local.bootstrap, local.broker_profile) == ("127.0.0.1:29092", "tansu")
    assert profile.faust_settings(local)["broker_session_timeout"] == 6.0
    assert profile.app_class(local) is profile.TansuApp
    real = load_streams_config({"HEADWATER_STREAMS_BOOTSTRAP": "kafka1:9092,kafka2:9092"})
    assert real.broker_profile == "kafka"
    settings = profile.faust_settings(real)
    assert {k: settings[k] for k in profile.TANSU_FAUST if k in settings} != profile.TANSU_FAUST
    assert profile.app_class(real) is profile.App
    assert settings["broker"] == ["kafka://kafka1:9092", "kafka://kafka2:9092"]
    forced = load_streams_config({"HEADWATER_STREAMS_BOOTSTRAP": "x:1", "HEADWATER_STREAMS_BROKER_PROFILE": "tansu"})
    assert forced.tansu


def test_on_kafka_a_dead_worker_holds_its_partitions_10_s_and_static_membership_is_asked_for() -> None:
    real = {"HEADWATER_STREAMS_BOOTSTRAP": "kafka1:9092"}
    settings = profile.faust_settings(load_streams_config(real))
    assert (settings["broker_session_timeout"], settings["broker_heartbeat_interval"]) == (10.0, 3.0)
    assert "consumer_group_instance_id" not in settings
    static = load_streams_config({**real, "HEADWATER_STREAMS_GROUP_INSTANCE_ID": "orders-worker-0"})
    assert profile.faust_settings(static)["consumer_group_instance_id"] == "orders-worker-0"
    with pytest.raises(ConfigError, match="group_instance_id"):
        load_streams_config({**real, "HEADWATER_STREAMS_GROUP_INSTANCE_ID": "a b"})


def test_readers_fetch_little_at_once_except_the_table_feed_on_the_local_broker() -> None:
    tansu = load_streams_config({"HEADWATER_STREAMS_BOOTSTRAP": "x:1", "HEADWATER_STREAMS_BROKER_PROFILE": "tansu"})
    kafka = load_streams_config({"HEADWATER_STREAMS_BOOTSTRAP": "x:1", "HEADWATER_STREAMS_BROKER_PROFILE": "kafka"})
    fetch = {(cfg.broker_profile, feed): clients.reader_settings(cfg, table_feed=feed)["fetch.max.bytes"]
             for cfg in (tansu, kafka) for feed in (False, True)}  # fmt: skip
    assert fetch == {("tansu", False): 1 << 20, ("tansu", True): 16 << 20, ("kafka", False): 1 << 20,
                     ("kafka", True): 1 << 20}  # fmt: skip
    assert clients.reader_settings(tansu)["fetch.wait.max.ms"] == 10  # a read to an end
    assert clients.reader_settings(tansu, follows=True)["fetch.wait.max.ms"] == 100  # a reader at the tail
    assert "fetch.wait.max.ms" not in clients.reader_settings(kafka)
    assert "fetch.wait.max.ms" not in clients.reader_settings(kafka, follows=True)
    waits = load_streams_config({"HEADWATER_STREAMS_BOOTSTRAP": "x:1", "HEADWATER_STREAMS_BROKER_PROFILE": "tansu",
                                 "HEADWATER_STREAMS_KAFKA": "fetch.wait.max.ms=10"})  # fmt: skip
    assert clients.reader_settings(waits, follows=True)["fetch.wait.max.ms"] == "10"  # the user's own setting wins
    big = load_streams_config({"HEADWATER_STREAMS_BOOTSTRAP": "x:1", "HEADWATER_STREAMS_BROKER_PROFILE": "kafka",
                               "HEADWATER_STREAMS_KAFKA": "message.max.bytes=8000000"})  # fmt: skip
    assert clients.reader_settings(big)["fetch.max.bytes"] == 8000000  # librdkafka refuses less
    mine = load_streams_config({"HEADWATER_STREAMS_BOOTSTRAP": "x:1", "HEADWATER_STREAMS_KAFKA": "fetch.max.bytes=99"})
    assert clients.reader_settings(mine)["fetch.max.bytes"] == "99"  # the user's own setting wins


def test_web_endpoint_binds_to_localhost_by_default() -> None:
    settings = profile.faust_settings(load_streams_config({}))
    assert settings["web_bind"] == "127.0.0.1" and settings["web_host"] == "127.0.0.1"


def test_sasl_settings_pass_through_and_stay_masked() -> None:
    kafka = Settings({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "SCRAM-SHA-256",
                      "sasl.username": "me", "sasl.password": "TopSecret9"})  # fmt: skip
    cfg = StreamsConfig(kafka=kafka)
    assert "TopSecret9" not in repr(cfg)
    credentials = profile.faust_credentials(dict(cfg.kafka))
    assert isinstance(credentials, faust.SASLCredentials) and credentials.username == "me"
    assert clients.producer_settings(cfg)["sasl.password"] == "TopSecret9"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("partitions = 0", "partitions"),
        ('broker_profile = "redpanda"', "broker_profile"),
        ('app_id = "no spaces"', "app_id"),
        ("web_port = 70000", "web_port"),
        ('tables = "customers"', "tables"),
        ("table_standby_replicas = -1", "table_standby_replicas"),
        ("discover_every = -1", "discover_every"),
        ("view_cache_rows = 0", "view_cache_rows"),
        ("redis_fill_rows = 0", "redis_fill_rows"),
        ("stop_timeout = 0", "stop_timeout"),
    ],
)
def test_bad_settings_name_file_line_and_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, f"[streams]\n# comment\n{text}\n")
    with pytest.raises(ConfigError) as caught:
        load(StreamsConfig, "streams", path=path, environ={})
    assert f"line 3, key '{key}'" in str(caught.value)


KEY_SCHEMA = {"type": "record", "name": "k", "fields": [
    {"name": "order_id", "type": "long"}, {"name": "code", "type": "string"},
    {"name": "amount", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9, "scale": 2}}]}  # fmt: skip


def test_url_keys_encode_to_the_bytes_capture_writes() -> None:
    codec = KeyCodec(42, KEY_SCHEMA)
    expected = AvroWriter(KEY_SCHEMA, 42).encode([7, "a b", Decimal("1.50")])
    assert codec.encode_text("7,a b,1.5") == expected
    for bad in ("7,a", "x,a,1", "7,a,NaN"):
        with pytest.raises(KeyError400):
            codec.encode_text(bad)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "headwater.toml"
    path.write_text(text)
    return path


class _Thread:
    """Records which partitions Faust's slow-stream check was asked about."""

    def __init__(self) -> None:
        self.asked: list[Any] = []

    def verify_event_path(self, now: float, tp: Any) -> None:
        self.asked.append(tp)


def test_faust_does_not_check_the_streams_of_topics_the_engine_reads_itself() -> None:
    consumer = object.__new__(profile._DirectConsumer)
    consumer.app = SimpleNamespace(direct=frozenset({"shop.changes", "shop.orders"}))  # type: ignore[assignment]
    consumer._thread = thread = _Thread()  # type: ignore[assignment]
    for topic in ("shop.changes", "shop.orders", "shop-streams-other"):
        consumer.verify_event_path(0.0, TP(topic, 0))
    assert thread.asked == [TP("shop-streams-other", 0)]


def test_a_bad_log_setting_ends_the_worker_with_its_message_not_a_traceback(tmp_path: Path) -> None:
    """Checked when the app is built, before Faust sets up its logging (where it would be a traceback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HEADWATER_")}
    env.update(HEADWATER_LOG_LEVEL="loud", HEADWATER_STACK_DATA_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "faust", "-A", "streams", "worker", "--web-port", "0"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert "HEADWATER_LOG_LEVEL: unknown log level 'loud'" in done.stderr and "Traceback" not in done.stderr

"""Capture settings: validation with the key named, secrets masked, pass-through settings parsed."""

from __future__ import annotations

from pathlib import Path

import pytest

from capture.config import CaptureConfig
from capture.producer import DEFAULTS, TANSU_LINGER_MS, librdkafka_settings, producer_settings
from tables.config import Secret, Settings, load
from tables.errors import ConfigError

pytestmark = pytest.mark.unit


def test_secrets_are_masked_in_repr() -> None:
    cfg = CaptureConfig(
        dsn=Secret("host=db password=TopSecret1"),
        producer=Settings({"sasl.username": "me", "sasl.password": "TopSecret2", "security.protocol": "SASL_SSL"}),
    )
    shown = repr(cfg)
    assert "TopSecret1" not in shown and "TopSecret2" not in shown
    assert "SASL_SSL" in shown and "sasl.username" in shown


def test_producer_settings_from_toml_table_and_from_text(tmp_path: Path) -> None:
    path = tmp_path / "h.toml"
    path.write_text('[capture]\nproducer = { "linger.ms" = 5, "enable.idempotence" = true }\n')
    cfg = load(CaptureConfig, "capture", path=path, environ={})
    assert dict(cfg.producer) == {"linger.ms": "5", "enable.idempotence": "true"}
    cfg = load(CaptureConfig, "capture", environ={"HEADWATER_CAPTURE_PRODUCER": "a=1;b=two"})
    assert dict(cfg.producer) == {"a": "1", "b": "two"}
    with pytest.raises(ConfigError, match="key=value"):
        load(CaptureConfig, "capture", environ={"HEADWATER_CAPTURE_PRODUCER": "nonsense"})


def test_on_the_local_broker_the_streams_producer_lingers_longer_unless_told() -> None:
    tansu = CaptureConfig(broker_profile="tansu")
    assert producer_settings(CaptureConfig(broker_profile="kafka"), stream=True)["linger.ms"] == DEFAULTS["linger.ms"]
    assert producer_settings(tansu, stream=True)["linger.ms"] == TANSU_LINGER_MS
    assert librdkafka_settings(tansu)["linger.ms"] == str(DEFAULTS["linger.ms"])  # the chunks' C senders
    mine = CaptureConfig(broker_profile="tansu", producer=Settings({"linger.ms": "2"}))
    assert producer_settings(mine, stream=True)["linger.ms"] == "2"


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('format = "xml"', "format"),
        ('on_error = "panic"', "on_error"),
        ('slot = "Bad-Slot"', "slot"),
        ('include = " , "', "include"),
        ("snapshot_workers = 0", "snapshot_workers"),
        ("backfill_chunk_rows = 0", "backfill_chunk_rows"),
        ('signal_table = "a.b.c"', "signal_table"),
        ('broker_profile = "local"', "broker_profile"),
        ('signal_table = "signals; DROP TABLE x"', "signal_table"),
    ],
)
def test_bad_values_name_key_and_line(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "h.toml"
    path.write_text(f"[capture]\n\n{text}\n")
    with pytest.raises(ConfigError) as info:
        load(CaptureConfig, "capture", path=path, environ={})
    assert info.value.key == key and info.value.line == 3


def test_table_patterns() -> None:
    cfg = CaptureConfig(include="public.*,shop.orders", exclude="public.audit_*")
    assert cfg.wants("public", "orders") and cfg.wants("shop", "orders")
    assert not cfg.wants("public", "audit_log") and not cfg.wants("shop", "customers")
    assert cfg.changes_topic == "headwater.changes"


def test_the_signal_table_reads_as_schema_and_table() -> None:
    assert CaptureConfig(signal_table="ops.Signals").signal == ("ops", "Signals")
    assert CaptureConfig(signal_table="headwater_signal").signal == ("public", "headwater_signal")
    assert CaptureConfig().signal is None and CaptureConfig().backfill_chunk_rows == 16384

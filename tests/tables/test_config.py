"""Configuration: file, environment and flags, typed and validated, secrets masked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tables.config import Secret, StackConfig, load
from tables.errors import ConfigError

pytestmark = pytest.mark.unit


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "headwater.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_file_env_flags_in_that_order(tmp_path: Path) -> None:
    path = write(tmp_path, '[stack]\npostgres_port = 6000\nkafka_port = 6001\nhost = "127.0.0.2"\n')
    env = {"HEADWATER_STACK_KAFKA_PORT": "7001", "HEADWATER_STACK_REDIS_PORT": "7002"}
    cfg = load(StackConfig, "stack", path=path, environ=env, flags={"redis_port": "8002"})
    assert (cfg.postgres_port, cfg.kafka_port, cfg.redis_port, cfg.host) == (6000, 7001, 8002, "127.0.0.2")
    assert cfg.registry_port == StackConfig().registry_port


def test_config_is_frozen() -> None:
    cfg = StackConfig()
    with pytest.raises(AttributeError):
        cfg.postgres_port = 1  # type: ignore[misc]


def test_broken_toml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[stack]\npostgres_port = 6000\nkafka_port = = 7\n")
    with pytest.raises(ConfigError) as info:
        load(StackConfig, "stack", path=path, environ={})
    assert info.value.line == 3 and str(path) in str(info.value) and "line 3" in str(info.value)


def test_unknown_key_names_key_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[stack]\n\npostgres_prot = 6000\n")
    with pytest.raises(ConfigError) as info:
        load(StackConfig, "stack", path=path, environ={})
    assert (info.value.key, info.value.line) == ("postgres_prot", 3)
    assert "postgres_port" in str(info.value)  # the hint lists the known settings


def test_wrong_type_names_key_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[stack]\nkafka_port = "not a port"\n')
    with pytest.raises(ConfigError) as info:
        load(StackConfig, "stack", path=path, environ={})
    assert (info.value.key, info.value.line) == ("kafka_port", 2)
    assert "integer" in str(info.value)


def test_out_of_range_and_clashing_ports(tmp_path: Path) -> None:
    path = write(tmp_path, "[stack]\nredis_port = 70000\n")
    with pytest.raises(ConfigError) as info:
        load(StackConfig, "stack", path=path, environ={})
    assert (info.value.key, info.value.line) == ("redis_port", 2)
    with pytest.raises(ConfigError, match="must differ"):
        load(StackConfig, "stack", environ={}, flags={"kafka_port": "5000", "redis_port": "5000"})


def test_unknown_section_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, "[stak]\nkafka_port = 1\n")
    with pytest.raises(ConfigError) as info:
        load(StackConfig, "stack", path=path, environ={})
    assert info.value.line == 1 and "stak" in str(info.value)


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="HEADWATER_STACK_POSTGRES_PORT"):
        load(StackConfig, "stack", environ={"HEADWATER_STACK_POSTGRES_PORT": "five"})


def test_secrets_never_print(tmp_path: Path) -> None:
    path = write(tmp_path, '[stack]\npostgres_password = "hunter2-secret"\n')
    cfg = load(StackConfig, "stack", path=path, environ={})
    assert cfg.postgres_password == Secret("hunter2-secret")
    for shown in (repr(cfg), str(cfg), cfg.display_dsn(), str(cfg.postgres_password)):
        assert "hunter2-secret" not in shown
    assert "hunter2-secret" in cfg.dsn()  # only the driver gets it

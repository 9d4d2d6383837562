"""Configuration: file, environment and flags, typed and validated, secrets masked; one [pipeline] for all."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from analytics.config import load_analytics, load_analytics_config
from capture.config import load_capture, load_capture_config
from streams.config import load_streams, load_streams_config
from tables.config import (
    PipelineConfig,
    Secret,
    StackConfig,
    display,
    load,
    load_component,
    load_traced,
)
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


@pytest.mark.parametrize("value", ["kafka.example.com", "host:port", ":9092", "a:9092,b", "a:70000"])
def test_a_kafka_of_your_own_that_is_not_host_port_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, f'[stack]\nkafka_bootstrap = "{value}"\n')
    with pytest.raises(ConfigError, match=r"host:port\[,host:port\.\.\.\]") as info:
        load(StackConfig, "stack", path=path, environ={})
    assert (info.value.key, info.value.line) == ("kafka_bootstrap", 2)


@pytest.mark.parametrize("value", ["my schemas", "..", "t" * 250])
def test_a_registry_topic_that_is_no_topic_name_is_refused_naming_the_key(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, f'[stack]\nregistry_topic = "{value}"\n')
    with pytest.raises(ConfigError, match="must be a Kafka topic name") as info:
        load(StackConfig, "stack", path=path, environ={})
    assert (info.value.key, info.value.line) == ("registry_topic", 2)


def test_a_stack_on_a_kafka_of_your_own_gives_every_component_that_kafka_and_the_kafka_profile(tmp_path: Path) -> None:
    path = write(tmp_path, '[stack]\nkafka_bootstrap = "k1:9092, k2:9093"\n')
    local = load(StackConfig, "stack", path=path, environ={})
    assert local.bootstrap == "k1:9092, k2:9093"
    streams = load_streams({"HEADWATER_CONFIG": str(path)})
    assert (streams.config.bootstrap, streams.config.broker_profile) == ("k1:9092, k2:9093", "kafka")
    assert streams.source("bootstrap") == "local stack ([stack] kafka_bootstrap)"
    assert streams.source("broker_profile") == "default, auto: the local stack runs on a Kafka of your own"
    assert streams.config.debezium_database == local.database  # still the local stack's
    assert load_capture(str(path), {}).config.broker_profile == "kafka"


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


# ---- one configuration: [pipeline] under every component ------------------------------------
PIPELINE = """\
[stack]
data_dir = "{data}"

[pipeline]
bootstrap = "kafka1.example.com:9093,kafka2.example.com:9093"
registry_url = "https://svc:RegistrySecret1@registry.example.com"
redis_url = "redis://:RedisSecret2@redis.example.com:6380/1"
topic_prefix = "pgb"

[pipeline.kafka]
security.protocol = "SASL_SSL"
sasl.mechanism = "SCRAM-SHA-256"
"sasl.username" = "svc"
"sasl.password" = "KafkaSecret3"
"""
SHARED_KAFKA = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-256",
                "sasl.username": "svc", "sasl.password": "KafkaSecret3"}  # fmt: skip


def pipeline_file(tmp_path: Path, extra: str = "") -> Path:
    return write(tmp_path, PIPELINE.format(data=tmp_path / "data") + extra)


def test_every_component_reads_one_pipeline_file(tmp_path: Path) -> None:
    path = pipeline_file(tmp_path)
    capture = load_capture_config(str(path), {})
    streams = load_streams_config({"HEADWATER_CONFIG": str(path)})
    analytics = load_analytics_config(str(path), {})
    for cfg in (capture, streams, analytics):
        assert cfg.bootstrap == "kafka1.example.com:9093,kafka2.example.com:9093"
        assert cfg.registry_url == "https://svc:RegistrySecret1@registry.example.com"
        assert cfg.topic_prefix == "pgb"
    assert dict(capture.producer) == dict(streams.kafka) == dict(analytics.kafka) == SHARED_KAFKA
    assert streams.redis_url == "redis://:RedisSecret2@redis.example.com:6380/1"
    assert streams.broker_profile == "kafka"  # auto: not the local stack's broker
    assert (capture.changes_topic, streams.changes_topic) == ("pgb.changes", "pgb.changes")
    assert analytics.source_options()["kafka.sasl.password"] == "KafkaSecret3"
    assert capture.state_dir == tmp_path / "data" / "capture" and streams.state_dir == tmp_path / "data" / "streams"
    assert capture.dsn == Secret(StackConfig(data_dir=tmp_path / "data").dsn())  # only capture reads PostgreSQL


def test_a_components_own_setting_wins_and_kafka_settings_merge_key_by_key(tmp_path: Path) -> None:
    path = pipeline_file(
        tmp_path,
        '\n[capture]\nbootstrap = "capture-only:9092"\nproducer = { "linger.ms" = 5, "sasl.username" = "cap" }\n'
        '\n[analytics]\ntopic_prefix = "mirror"\n',
    )
    capture = load_capture(str(path), {})
    assert capture.config.bootstrap == "capture-only:9092" and capture.source("bootstrap") == f"{path}:17"
    assert dict(capture.config.producer) == {**SHARED_KAFKA, "sasl.username": "cap", "linger.ms": "5"}
    assert capture.source("producer") == f"{path}:10, {path}:18"
    assert capture.config.topic_prefix == "pgb" and capture.source("topic_prefix") == f"{path}:8"
    assert load_analytics_config(str(path), {}).topic_prefix == "mirror"
    assert load_streams_config({"HEADWATER_CONFIG": str(path)}).bootstrap.startswith("kafka1.")


def test_precedence_default_pipeline_section_pipeline_env_section_env_flag(tmp_path: Path) -> None:
    path = write(tmp_path, '[pipeline]\ntopic_prefix = "p-file"\n[capture]\ntopic_prefix = "c-file"\n')
    layers = [
        ({}, {}, "c-file", f"{path}:4"),
        ({"HEADWATER_PIPELINE_TOPIC_PREFIX": "p-env"}, {}, "p-env", "HEADWATER_PIPELINE_TOPIC_PREFIX"),
        ({"HEADWATER_PIPELINE_TOPIC_PREFIX": "p-env", "HEADWATER_CAPTURE_TOPIC_PREFIX": "c-env"}, {}, "c-env",
         "HEADWATER_CAPTURE_TOPIC_PREFIX"),
        ({"HEADWATER_CAPTURE_TOPIC_PREFIX": "c-env"}, {"topic_prefix": "flag"}, "flag", "--topic-prefix"),
    ]  # fmt: skip
    for environ, flags, value, source in layers:
        loaded = load_capture(str(path), environ, flags)
        assert (loaded.config.topic_prefix, loaded.source("topic_prefix")) == (value, source)
    only_pipeline = write(tmp_path, '[pipeline]\ntopic_prefix = "p-file"\n')
    assert load_capture(str(only_pipeline), {}).source("topic_prefix") == f"{only_pipeline}:2"
    assert load_capture(None, {}).source("topic_prefix") == "default"


def test_what_nothing_sets_is_the_local_stacks_in_one_place(tmp_path: Path) -> None:
    path = write(tmp_path, f'[stack]\ndata_dir = "{tmp_path / "d"}"\nkafka_port = 29092\nredis_port = 29379\n')
    local = load(StackConfig, "stack", path=path, environ={})
    streams = load_streams({"HEADWATER_CONFIG": str(path)})
    assert (streams.config.bootstrap, streams.config.broker_profile) == ("127.0.0.1:29092", "tansu")
    assert streams.config.redis_url == local.redis_url and streams.config.registry_url == local.registry_url
    assert streams.source("bootstrap") == "local stack ([stack] host, kafka_port)"
    assert streams.source("broker_profile") == "default, auto: the broker is the local stack's"
    capture = load_capture(str(path), {})
    assert capture.config.dsn == Secret(local.dsn()) and capture.config.state_dir == tmp_path / "d" / "capture"
    assert capture.source("state_dir") == "local stack ([stack] data_dir)"
    assert load_analytics_config(str(path), {}).bootstrap == "127.0.0.1:29092"
    explicit = load_capture(str(path), {"HEADWATER_CAPTURE_STATE_DIR": "mine"})
    assert explicit.config.state_dir == Path("mine")  # only the default follows data_dir
    same = load_streams({"HEADWATER_CONFIG": str(path), "HEADWATER_PIPELINE_BOOTSTRAP": "127.0.0.1:29092"})
    assert same.config.broker_profile == "tansu"  # the local stack's broker, however it was named
    assert (capture.config.broker_profile, capture.source("broker_profile")) == (
        "tansu", "default, auto: the broker is the local stack's")  # fmt: skip
    elsewhere = load_capture(str(path), {"HEADWATER_PIPELINE_BOOTSTRAP": "kafka.example.com:9092"})
    assert elsewhere.config.broker_profile == "kafka"
    pinned = write(tmp_path, '[stack]\nkafka_port = 29092\n[pipeline]\nbroker_profile = "kafka"\n')
    assert load_capture(str(pinned), {}).config.broker_profile == "kafka"  # written once, for every component
    assert load_streams({"HEADWATER_CONFIG": str(pinned)}).config.broker_profile == "kafka"
    assert load_capture(None, {}).config.state_dir == Path(".headwater/capture")  # data_dir's default


@pytest.mark.parametrize(
    ("text", "key", "says"),
    [
        ('topic_prefix = "no spaces"', "topic_prefix", "letters, digits"),
        ('registry_url = "registry:8081"', "registry_url", "http/https URL"),
        ('redis_url = "localhost:6379"', "redis_url", "redis/rediss/unix URL"),
        ("bootstrap = 9092", "bootstrap", "expected a string"),
        ('broker_profile = "redpanda"', "broker_profile", "one of auto, tansu, kafka"),
        ('bootsrap = "x:1"', "bootsrap", "known settings: bootstrap"),
    ],
)
def test_a_bad_pipeline_setting_names_file_line_and_key_for_every_component(
    tmp_path: Path, text: str, key: str, says: str
) -> None:
    path = write(tmp_path, f"[pipeline]\n# shared\n{text}\n")
    loaders = (lambda: load_capture(str(path), {}), lambda: load_streams({"HEADWATER_CONFIG": str(path)}),
               lambda: load_analytics(str(path), {}))  # fmt: skip
    for loader in loaders:
        with pytest.raises(ConfigError) as info:
            loader()
        assert (info.value.path, info.value.line, info.value.key) == (str(path), 3, key)
        assert says in str(info.value) and "\n" not in info.value.message


def test_shared_secrets_never_print(tmp_path: Path) -> None:
    path = pipeline_file(tmp_path)
    loaded = [load_capture(str(path), {}), load_streams({"HEADWATER_CONFIG": str(path)}), load_analytics(str(path), {})]
    pipeline = load_component(PipelineConfig, "pipeline", path=path, environ={})
    shown = " ".join(repr(x.config) + str(x.config) for x in [*loaded, pipeline])
    shown += " ".join(display(getattr(x.config, f)) for x in loaded for f in ("registry_url", "bootstrap"))
    for secret in ("RegistrySecret1", "RedisSecret2", "KafkaSecret3"):
        assert secret not in shown
    assert "https://svc:***@registry.example.com" in shown and "redis://:***@redis.example.com" in shown
    with pytest.raises(ConfigError) as info:  # a malformed pass-through value is not echoed
        load_capture(None, {"HEADWATER_PIPELINE_KAFKA": "sasl.password=KafkaSecret3,oops"})
    assert "KafkaSecret3" not in str(info.value) and "HEADWATER_PIPELINE_KAFKA" in str(info.value)
    with pytest.raises(ConfigError, match="unix URL") as info:
        load_streams({"HEADWATER_PIPELINE_REDIS_URL": "http://u:RedisSecret2@[bad"})
    assert "RedisSecret2" not in str(info.value) and "HEADWATER_PIPELINE_REDIS_URL" in str(info.value)


def test_pipeline_sources_and_settings_from_environment(tmp_path: Path) -> None:
    env = {"HEADWATER_PIPELINE_KAFKA": "security.protocol=SSL", "HEADWATER_STREAMS_KAFKA": "client.id=w1"}
    streams = load_streams(env)
    assert dict(streams.config.kafka) == {"security.protocol": "SSL", "client.id": "w1"}
    assert streams.source("kafka") == "HEADWATER_PIPELINE_KAFKA, HEADWATER_STREAMS_KAFKA"
    assert streams.source("app_id") == "default"
    traced = load_traced(
        StackConfig, "stack", environ={"HEADWATER_STACK_KAFKA_PORT": "7001"}, flags={"redis_port": "8"}
    )
    assert (traced.source("kafka_port"), traced.source("redis_port"), traced.source("host")) == (
        "HEADWATER_STACK_KAFKA_PORT", "--redis-port", "default")  # fmt: skip


def test_the_readmes_real_services_files_move_every_component(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    example, secured = re.findall(
        r"```toml\n(.*?)```", readme.split("## Pointing Headwater at real services")[1], re.S
    )[:2]
    path = write(tmp_path, example + "\n" + secured)
    env = {"HEADWATER_CONFIG": str(path), "HEADWATER_PIPELINE_KAFKA": "sasl.password=pw"}
    capture, streams, analytics = (
        load_capture_config(None, env),
        load_streams_config(env),
        load_analytics_config(None, env),
    )
    for cfg in (capture, streams, analytics):
        assert (cfg.bootstrap, cfg.registry_url, cfg.topic_prefix) == (
            "127.0.0.1:9092",
            "http://127.0.0.1:8081",
            "shop",
        )
    assert capture.dsn.reveal().startswith("postgresql://headwater:headwater@127.0.0.1:5432/shop")
    assert (streams.redis_url, streams.broker_profile) == ("redis://127.0.0.1:6379/0", "kafka")
    kafka = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "headwater",
             "sasl.password": "pw"}  # fmt: skip
    assert dict(capture.producer) == dict(streams.kafka) == dict(analytics.kafka) == kafka

"""Reading options and settings: validation, defaults, secrets kept out of reprs, splitting (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from analytics.config import JOB_HELP, AnalyticsConfig, load_analytics_config
from analytics.jobs import JOBS
from analytics.plan import Request, Slice, split
from analytics.streamjobs import STREAM_JOBS
from tables.errors import ConfigError, HeadwaterError

pytestmark = pytest.mark.unit
BASE = {"bootstrap": "127.0.0.1:9", "registry": "http://127.0.0.1:8"}


def test_topics_are_named_by_topic_table_or_view_with_the_prefix() -> None:
    assert Request.from_options({**BASE, "topic": "any.thing"}).topic == "any.thing"
    assert Request.from_options({**BASE, "table": "public.orders"}).topic == "headwater.orders"
    assert Request.from_options({**BASE, "table": "shop.items", "prefix": "p"}).topic == "p.shop.items"
    view = Request.from_options({**BASE, "view": "orders_enriched", "cut": "0/1A7A908"})
    assert (view.topic, view.mode, view.cut) == ("headwater.views.orders_enriched", "latest", 0x1A7A908)
    assert Request.from_options({**BASE, "view": "v", "CUT": "latest"}).cut == -1  # option names ignore case


@pytest.mark.parametrize(("options", "words"), [
    ({"topic": "t", "mode": "newest"}, "unknown mode 'newest'"),
    ({"topic": "t", "cut": "yesterday"}, "is not a commit LSN"),
    ({"topic": "t", "cut": "latest", "mode": "changes"}, "a cut is a state"),
    ({"topic": "t", "metadata": "yes"}, "metadata must be true or false"),
    ({"topic": "t", "task_records": "0"}, "task_records must be at least 1"),
    ({"topic": "t", "config": "/nowhere.toml"}, "config file /nowhere.toml does not exist"),
    ({}, "set exactly one of the options topic, table or view"),
    ({"topic": "t", "view": "v"}, "set exactly one"),
])  # fmt: skip
def test_bad_options_say_what_to_fix(options: dict[str, str], words: str) -> None:
    with pytest.raises(HeadwaterError, match=words):
        Request.from_options({**BASE, **options})


def test_kafka_settings_pass_through_and_secrets_stay_out_of_reprs(tmp_path: Path) -> None:
    req = Request.from_options({**BASE, "topic": "t", "kafka.security.protocol": "SASL_SSL",
                                "kafka.sasl.password": "hunter2"})  # fmt: skip
    assert req.kafka["security.protocol"] == "SASL_SSL" and req.kafka["sasl.password"] == "hunter2"
    assert "hunter2" not in repr(req)
    config = tmp_path / "headwater.toml"
    config.write_text('[analytics]\nmaster = "local[1]"\nkafka = { "sasl.password" = "hunter2" }\n')
    cfg = load_analytics_config(str(config), {})
    assert cfg.master == "local[1]" and "hunter2" not in repr(cfg)
    assert Request.from_options({"topic": "t", "config": str(config)}).kafka["sasl.password"] == "hunter2"


def test_a_bad_analytics_setting_names_file_line_and_key(tmp_path: Path) -> None:
    config = tmp_path / "headwater.toml"
    config.write_text('[analytics]\nmaster = "local[1]"\ntask_records = 0\n')
    with pytest.raises(ConfigError, match=r"line 3, key 'task_records': must be at least 1"):
        load_analytics_config(str(config), {})
    with pytest.raises(ConfigError, match="HEADWATER_ANALYTICS_TIMEOUT"):
        load_analytics_config(None, {"HEADWATER_ANALYTICS_TIMEOUT": "soon"})


def test_partitions_split_into_ranges_of_at_most_task_records() -> None:
    assert split("t", 2, 10, 35, 10) == [Slice("t", 2, 10, 20), Slice("t", 2, 20, 30), Slice("t", 2, 30, 35)]
    assert split("t", 0, 5, 5, 10) == []
    assert split("t", 0, 0, 35, None) == [Slice("t", 0, 0, 35)]  # latest mode: the whole partition


def test_every_job_the_command_offers_exists() -> None:
    assert set(JOB_HELP) == set(JOBS) | set(STREAM_JOBS)
    assert AnalyticsConfig().master == "local[*]"

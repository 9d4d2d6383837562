"""Which topics a worker's local state was read from: a topic made again drops the state read from the old one."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from streams.sources import Sources, adopt, drop_stale, stale
from streams.store import TableStore

pytestmark = pytest.mark.unit


def test_stale_names_topics_whose_id_changed_or_that_are_gone() -> None:
    recorded = {"raw": "A", "t1": "B", "t2": "C"}
    found = stale(recorded, {"raw": "A", "t1": "B2", "t3": "D"})
    assert found == {"t1": "topic id B, now B2", "t2": "topic id C, and the topic is gone"}
    assert stale({}, {"raw": "A"}) == {}, "nothing recorded: state from before the file is taken as it is"


def test_sources_are_recorded_whole_and_readable_by_their_owner_only(tmp_path: Path) -> None:
    sources = Sources(tmp_path / "state" / "app-sources.json")
    assert sources.recorded() == {}
    sources.record({"t": "B", "raw": "A"})
    assert sources.recorded() == {"raw": "A", "t": "B"}
    assert stat.S_IMODE(sources.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(sources.path.parent.stat().st_mode) == 0o700
    assert [p.name for p in sources.path.parent.iterdir()] == ["app-sources.json"], "no spare file left"


def test_a_broken_file_is_said_and_the_state_taken_as_it_is(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "app-sources.json"
    path.write_text("{not json")
    assert Sources(path).recorded() == {}
    assert "could not read" in caplog.text and str(path) in caplog.text


def test_drop_stale_rebuilds_views_of_a_new_raw_topic_and_rereads_new_table_topics(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    sources, views = Sources(tmp_path / "app-sources.json"), tmp_path / "app-views"
    tables = TableStore(tmp_path / "app-tables").open()
    for topic in ("p.orders", "p.customers"):
        tables.apply(topic, 0, [(0, b"k", b"v", 1, 0)], 1)
    tables.close()
    views.mkdir()
    (views / "CURRENT").write_text("state")
    drop_stale(sources, {"p.raw": "R1", "p.orders": "O1", "p.customers": "C1"}, "p.raw", tables, views)
    assert views.exists() and sources.recorded()["p.raw"] == "R1", "first start: nothing to compare"
    drop_stale(sources, {"p.raw": "R1", "p.orders": "O1", "p.customers": "C1"}, "p.raw", tables, views)
    assert views.exists(), "same topics: the state stays"
    drop_stale(sources, {"p.raw": "R2", "p.orders": "O2", "p.customers": "C1"}, "p.raw", tables, views)
    assert not views.exists()
    tables.open()
    assert tables.offset("p.orders", 0) == 0 and list(tables.keys("p.orders", 0)) == []
    assert tables.offset("p.customers", 0) == 1, "a table topic that is the same keeps its rows"
    tables.close()
    assert sources.recorded() == {"p.raw": "R2", "p.orders": "O2", "p.customers": "C1"}
    assert "views are rebuilt from the new topic's start" in caplog.text and "topic id R1, now R2" in caplog.text
    assert "p.orders is not the table topic the table store read (topic id O1, now O2)" in caplog.text


@pytest.mark.parametrize("store_open", [True, False])
def test_tables_served_while_running_join_the_record_and_drop_state_of_an_older_topic(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, store_open: bool,
) -> None:  # fmt: skip
    sources = Sources(tmp_path / "app-sources.json")
    tables = TableStore(tmp_path / "app-tables").open()
    for topic in ("p.late", "p.orders"):
        tables.apply(topic, 0, [(0, b"k", b"v", 1, 0)], 1)
    sources.record({"p.raw": "R1", "p.orders": "O1", "p.late": "L1"})  # served in an earlier run
    if not store_open:
        tables.close()
    adopt(sources, {"p.late": "L2", "p.fresh": "F1"}, tables)
    assert (tables.db is not None) == store_open, "the store is left open or closed as it was"
    if not store_open:
        tables.open()
    assert tables.offset("p.late", 0) == 0, "made again since: read from its start"
    assert tables.offset("p.orders", 0) == 1, "the topics not adopted keep their rows"
    tables.close()
    assert sources.recorded() == {"p.raw": "R1", "p.orders": "O1", "p.late": "L2", "p.fresh": "F1"}
    assert "p.late is not the table topic the table store read (topic id L1, now L2)" in caplog.text
    assert "p.fresh" not in caplog.text, "a topic never read before drops nothing"

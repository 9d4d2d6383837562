"""The workers' table store on disk (RocksDB): rows, counts and offsets written together."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from streams.rows import unpack
from streams.store import TableStore

pytestmark = pytest.mark.unit


def test_apply_keeps_the_latest_row_per_key_with_count_and_offset(tmp_path: Path) -> None:
    store = TableStore(tmp_path / "tables").open()
    assert store.offset("t", 0) == 0 and store.count("t", 0) == 0
    count = store.apply("t", 0, [(0, b"a", b"A1", 10, 0), (1, b"b", b"B1", 10, 1), (2, b"a", b"A2", 11, 0)], 3)
    assert count == 2 and store.offset("t", 0) == 3
    assert unpack(store.get("t", 0, b"a") or b"") == (11, 0, b"A2")
    count = store.apply("t", 0, [(3, b"b", None, 12, 0), (4, b"c", b"C", 12, 1), (5, b"zz", None, 12, 2)], 6)
    assert count == 2 and store.get("t", 0, b"b") is None and list(store.keys("t", 0)) == [b"a", b"c"]
    assert store.get("t", 1, b"a") is None and store.get("u", 0, b"a") is None, "partitions and topics apart"
    store.close()
    again = TableStore(tmp_path / "tables").open()
    assert again.offset("t", 0) == 6 and again.count("t", 0) == 2 and again.get("t", 0, b"c") is not None
    again.close()


def test_forget_drops_one_partition_only(tmp_path: Path) -> None:
    store = TableStore(tmp_path / "tables").open()
    for partition in (0, 1, 255, 256):
        store.apply("t", partition, [(0, b"\xff\xff", b"v", 1, 0), (1, b"k", b"v", 1, 1)], 2)
    store.forget("t", 255)
    assert store.offset("t", 255) == 0 and store.count("t", 255) == 0 and list(store.keys("t", 255)) == []
    for partition in (0, 1, 256):
        assert store.count("t", partition) == 2 and list(store.keys("t", partition)) == [b"k", b"\xff\xff"]
    store.close()


def test_forget_topic_drops_every_partition_of_that_topic_only(tmp_path: Path) -> None:
    store = TableStore(tmp_path / "tables").open()
    for topic in ("p.orders", "p.orders_x", "p.order"):
        for partition in (0, 3):
            store.apply(topic, partition, [(0, b"k", b"v", 1, 0)], 1)
    store.forget_topic("p.orders")
    assert [store.count("p.orders", p) + store.offset("p.orders", p) for p in (0, 3)] == [0, 0]
    assert list(store.keys("p.orders", 3)) == []
    for topic in ("p.orders_x", "p.order"):  # a name the forgotten one starts with, and one it starts
        assert [store.count(topic, p) for p in (0, 3)] == [1, 1] and store.offset(topic, 3) == 1
    store.close()


def test_the_store_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    store = TableStore(tmp_path / "tables").open()
    store.close()
    assert stat.S_IMODE((tmp_path / "tables").stat().st_mode) == 0o700


def test_a_closed_store_says_so(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="not open"):
        TableStore(tmp_path / "tables").offset("t", 0)

"""The workers' RocksDB databases: one shared block cache, on first open and every open after."""

from __future__ import annotations

from pathlib import Path

import pytest

from streams import rocks

pytestmark = pytest.mark.unit


def test_a_database_opened_again_reads_through_the_shared_block_cache(tmp_path: Path) -> None:
    db = rocks.open_db(tmp_path / "db")
    for n in range(2_000):
        db[b"k%06d" % n] = b"v" * 100
    db.flush()
    db.close()
    again = rocks.open_db(tmp_path / "db")  # RocksDB wrote an OPTIONS file: the second open may read it
    assert again.property_value("rocksdb.block-cache-capacity") == str(rocks.BLOCK_CACHE), "not a cache of its own"
    assert [again.get(b"k%06d" % n) for n in (0, 999, 1_999)] == [b"v" * 100] * 3
    again.close()


def test_a_scratch_database_starts_empty_is_owner_only_and_is_gone_after_its_block(tmp_path: Path) -> None:
    where = tmp_path / "rekey" / "latest"
    left = rocks.open_db(where)  # what a crashed worker left
    left[b"z"] = b"9"
    left.close()
    with rocks.scratch(where) as db:
        assert list(db.items()) == []
        db[b"b"], db[b"a"] = b"2", b"1"
        assert list(db.items()) == [(b"a", b"1"), (b"b", b"2")], "in key order"
        assert where.stat().st_mode & 0o077 == 0
    assert not where.exists()

"""The workers' RocksDB databases: one shared block cache, on first open and every open after."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from sortedcontainers import SortedDict

from streams import rocks
from streams.fanout import Change, FanOut, Rekey, rekey_moves

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


def test_scratch_databases_start_empty_are_owner_only_and_are_gone_after_their_block(tmp_path: Path) -> None:
    under = tmp_path / "app-scratch"
    under.mkdir()
    left = rocks.open_db(under / "crashed")  # what a crashed worker left, still open (its lock held)
    left[b"z"] = b"9"
    with rocks.scratch(under) as db, rocks.scratch(under) as other:
        assert list(db.items()) == [] and list(other.items()) == []
        db[b"b"], db[b"a"] = b"2", b"1"
        assert list(db.items()) == [(b"a", b"1"), (b"b", b"2")], "in key order"
        assert list(other.items()) == []
        assert under.stat().st_mode & 0o077 == 0
        assert all(p.stat().st_mode & 0o077 == 0 for p in under.iterdir())
    assert [p.name for p in under.iterdir()] == ["crashed"]
    left.close()
    rocks.clear(under)
    assert not under.exists()


def test_a_rekeys_moves_over_scratch_databases_are_those_over_sorted_maps(tmp_path: Path) -> None:
    rng = random.Random(7)
    old, new = b"\0\0\0\0\x04", b"\0\0\0\0\x0b"
    topic = [(rng.choice((old, new)) + bytes([rng.randrange(40)]), rng.choice((None, b"row%d" % i)), (i, 0))
             for i in range(400)]  # fmt: skip
    fan = FanOut(partitions=4, frames={"t": old})
    rekey = fan.route(Change("UPDATE", "public", "t", "t", 9, 0, new + b"\x05", None, b"own"), 500)
    assert isinstance(rekey, Rekey)
    reframe = lambda k: None if k[5] == 13 else new + k[5:]  # noqa: E731
    in_memory, stuck = rekey_moves(rekey, topic, reframe, SortedDict(), SortedDict())
    with rocks.scratch(tmp_path) as latest, rocks.scratch(tmp_path) as target:
        on_disk, stuck_on_disk = rekey_moves(rekey, topic, reframe, latest, target)
        assert list(on_disk) == list(in_memory) and stuck_on_disk == stuck

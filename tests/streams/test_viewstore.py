"""The views' state store: reads see uncommitted writes, a commit is all or nothing, a crash keeps the last commit."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from streams.viewstore import MemoryViewStore, ViewStore

pytestmark = pytest.mark.unit


@pytest.fixture(params=["rocksdb", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> MemoryViewStore:
    return ViewStore(tmp_path / "views").open() if request.param == "rocksdb" else MemoryViewStore()


def test_reads_and_scans_see_uncommitted_writes_in_key_order(store: MemoryViewStore) -> None:
    store[b"r\x1fb"] = b"2"
    store.commit()
    store[b"r\x1fa"] = b"1"
    store[b"r\x1fc"] = b"3"
    store.pop(b"r\x1fb")
    assert store.get(b"r\x1fa") == b"1" and store.get(b"r\x1fb") is None and b"r\x1fc" in store
    assert list(store.scan(b"r\x1f")) == [(b"r\x1fa", b"1"), (b"r\x1fc", b"3")]
    store.commit()
    assert list(store.scan(b"r\x1f")) == [(b"r\x1fa", b"1"), (b"r\x1fc", b"3")]
    assert list(store.scan(b"s\x1f")) == [] and store.pop(b"nothing", b"x") == b"x"


def test_only_committed_writes_survive_a_close_and_reopen(tmp_path: Path) -> None:
    store = ViewStore(tmp_path / "views").open()
    store[b"k1"] = b"kept"
    store.commit()
    store[b"k2"] = b"lost"
    store.pop(b"k1")
    store.close()  # as a kill would: nothing after the last commit
    again = ViewStore(tmp_path / "views").open()
    assert again.get(b"k1") == b"kept" and again.get(b"k2") is None
    mode = stat.S_IMODE((tmp_path / "views").stat().st_mode)
    assert mode == 0o700, oct(mode)
    again.close()
    again[b"k3"] = b"after close"
    with pytest.raises(RuntimeError, match=r"the view store at .* is not open"):
        again.commit()

"""The views' join state on disk: rows of the joined tables, join indexes, published rows, progress.

Promise: a ``ViewStore`` is a bytes-to-bytes map with prefix scans whose writes are held in
memory until ``commit`` writes them all in one atomic RocksDB write — so after any crash the
state is exactly as of the last commit (the materializer commits at the points it publishes at, when idle, and
between points once 20,000 writes or a second have piled up: ``streams.materializer.commit_due``; its progress
marks go in every commit). Reads and scans see the uncommitted
writes (kept sorted, so a scan is a range of them). ``open`` makes the database (rocksdict) in a
directory only its owner can read (``<state_dir>/<app_id>-views``); its memory is RocksDB's
block cache and write buffers — fixed sizes — plus the writes not yet committed (about 20,000 and one batch's at
most), whatever the number of rows. ``MemoryViewStore`` is the same over a dict (the join engine's tests). No I/O
until ``open``.

The state is local to a worker (no changelog): a worker that takes the views over without
state of its own rebuilds it from the raw topic (see ``streams.materializer``); one that had it
resumes from its own progress — the state is a prefix of what it applied, which the
materializer's recovery is built for.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from rocksdict import WriteBatch
from sortedcontainers import SortedDict

from streams.rocks import Database

_GONE = None  # an uncommitted delete
_ABSENT = b"\x00absent"  # sentinel: not among the uncommitted writes


class MemoryViewStore:
    """The view store over a dict: same contract, nothing on disk."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.pending: SortedDict = SortedDict()  # key -> value, None for a delete; sorted: scans are ranges

    def open(self) -> MemoryViewStore:
        return self

    def close(self) -> None:
        self.pending.clear()

    def get(self, key: bytes, default: bytes | None = None) -> bytes | None:
        found = self.pending.get(key, _ABSENT)  # one lookup: the endpoint reads while a feed thread writes
        if found is not _ABSENT:
            return default if found is None else found
        stored = self._stored(key)
        return default if stored is None else stored

    def __getitem__(self, key: bytes) -> bytes:
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        return found

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self.get(key) is not None

    def __setitem__(self, key: bytes, value: bytes) -> None:
        self.pending[key] = value

    def pop(self, key: bytes, default: bytes | None = None) -> bytes | None:
        found = self.get(key)
        self.pending[key] = _GONE
        return default if found is None else found

    def scan(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with ``prefix``, uncommitted writes included, in key order."""
        pending = {k: self.pending[k] for k in self._pending_under(prefix)}
        if not pending:
            yield from self._scan_stored(prefix)
            return
        merged = {k: v for k, v in self._scan_stored(prefix) if k not in pending}
        merged.update((k, v) for k, v in pending.items() if v is not None)
        yield from sorted(merged.items())

    def _pending_under(self, prefix: bytes) -> list[bytes]:
        """The uncommitted keys starting with ``prefix`` (a range of the sorted map, not a pass over it)."""
        out = []
        for key in self.pending.irange(minimum=prefix):
            if not key.startswith(prefix):
                break
            out.append(key)
        return out

    def commit(self) -> None:
        for key, value in self.pending.items():
            if value is None:
                self.data.pop(key, None)
            else:
                self.data[key] = value
        self.pending = SortedDict()

    def _stored(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def _scan_stored(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        return iter(sorted((k, v) for k, v in self.data.items() if k.startswith(prefix)))


class ViewStore(Database, MemoryViewStore):
    """The view store in one RocksDB database; ``commit`` is one atomic write batch."""

    what = "view store"

    def __init__(self, path: Path) -> None:
        MemoryViewStore.__init__(self)
        Database.__init__(self, path)

    def open(self) -> ViewStore:
        Database.open(self)
        return self

    def close(self) -> None:
        MemoryViewStore.close(self)
        Database.close(self)

    def commit(self) -> None:
        if not self.pending:
            return
        batch = WriteBatch(raw_mode=True)
        for key, value in self.pending.items():
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
        self._db.write(batch)
        self.pending = SortedDict()  # a new map: a reader holding the old one still finds every write

    def _stored(self, key: bytes) -> bytes | None:
        found: bytes | None = self._db.get(key)
        return found

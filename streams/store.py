"""The workers' table state on disk: the latest row of every key of the table-topic partitions a worker holds.

Promise: one RocksDB database (rocksdict) per worker, in ``<state_dir>/tables`` (owner-only),
holding per table-topic partition its rows (key bytes as on the topic -> ``streams.rows.pack``-ed
row), its row count and the offset it was read up to. ``apply`` writes one batch of records —
rows, tombstones (the key is deleted), the new count and offset — in one atomic write, so after
any crash the rows and the offset agree, and a (re)started worker reads each partition on from
its own offset: the compacted table topic is the table's changelog (Kafka Streams' source-topic
changelog optimization), no second copy is written. ``forget`` drops a partition (its topic
was compacted past the stored offset, or it must be read again from the start). Memory is
RocksDB's block cache and write buffers — fixed sizes below — whatever the number of rows.
No I/O until ``open``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

from rocksdict import BlockBasedOptions, Cache, Options, Rdict, WriteBatch

from streams.rows import pack

BLOCK_CACHE = 32 << 20  # bytes of decompressed blocks kept for reads
WRITE_BUFFER = 16 << 20  # per memtable; at most WRITE_BUFFERS of them
WRITE_BUFFERS = 3
_COUNT = struct.Struct(">q")
Record = tuple[int, bytes, bytes | None, int, int]  # (offset, key, value or None, commit_lsn, position)


def _prefix(kind: bytes, topic: str, partition: int) -> bytes:
    return kind + topic.encode() + b"\x00" + partition.to_bytes(4, "big")


class TableStore:
    """Rows, counts and read offsets of table-topic partitions, in one RocksDB database."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db: Rdict | None = None

    def open(self) -> TableStore:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.chmod(0o700)
        options = Options(raw_mode=True)
        options.create_if_missing(True)
        table = BlockBasedOptions()
        table.set_block_cache(Cache(BLOCK_CACHE))
        options.set_block_based_table_factory(table)
        options.set_write_buffer_size(WRITE_BUFFER)
        options.set_max_write_buffer_number(WRITE_BUFFERS)
        self.db = Rdict(str(self.path / "rocksdb"), options)
        return self

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    @property
    def _db(self) -> Rdict:
        if self.db is None:
            raise RuntimeError(f"the table store at {self.path} is not open")
        return self.db

    def offset(self, topic: str, partition: int) -> int:
        """The next offset to read of this partition (0: nothing read yet)."""
        found = self._db.get(_prefix(b"o", topic, partition))
        return 0 if found is None else _COUNT.unpack(found)[0]

    def count(self, topic: str, partition: int) -> int:
        found = self._db.get(_prefix(b"n", topic, partition))
        return 0 if found is None else _COUNT.unpack(found)[0]

    def get(self, topic: str, partition: int, key: bytes) -> bytes | None:
        """The packed row of ``key`` (``streams.rows.unpack``), None if the partition holds none."""
        found: bytes | None = self._db.get(_prefix(b"r", topic, partition) + key)
        return found

    def apply(self, topic: str, partition: int, records: Iterable[Record], next_offset: int) -> int:
        """Write ``records`` (in offset order; a None value deletes) and the offset read up to, at once.
        Returns the partition's row count after them."""
        db, rows = self._db, _prefix(b"r", topic, partition)
        latest: dict[bytes, bytes | None] = {}
        for _, key, value, lsn, position in records:
            latest[key] = None if value is None else pack(lsn, position, value)
        count = self.count(topic, partition)
        batch = WriteBatch(raw_mode=True)
        for key, packed in latest.items():
            existed = db.get(rows + key) is not None
            if packed is None:
                batch.delete(rows + key)
                count -= existed
            else:
                batch.put(rows + key, packed)
                count += not existed
        batch.put(_prefix(b"n", topic, partition), _COUNT.pack(count))
        batch.put(_prefix(b"o", topic, partition), _COUNT.pack(next_offset))
        db.write(batch)
        return count

    def keys(self, topic: str, partition: int) -> Iterator[bytes]:
        """Every key the partition holds, in byte order."""
        prefix = _prefix(b"r", topic, partition)
        it = self._db.iter()
        it.seek(prefix)
        while it.valid():
            key: bytes = it.key()
            if not key.startswith(prefix):
                return
            yield key[len(prefix) :]
            it.next()

    def forget(self, topic: str, partition: int) -> None:
        """Drop the partition's rows, count and offset (it is read again from the start)."""
        db = self._db
        for kind in (b"r", b"n", b"o"):  # each key of partition p sorts before partition p + 1's prefix
            db.delete_range(_prefix(kind, topic, partition), _prefix(kind, topic, partition + 1))

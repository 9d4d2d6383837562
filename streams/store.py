"""The workers' table state on disk: the latest row of every key of the table-topic partitions a worker holds.

Promise: one RocksDB database (rocksdict) per worker, in ``<state_dir>/<app_id>-tables`` (owner-only),
holding per table-topic partition its rows (key bytes as on the topic -> ``streams.rows.pack``-ed
row), its row count and the offset it was read up to. ``apply`` writes one batch of records —
rows, tombstones (the key is deleted), the new count and offset — in one atomic write, so after
any crash the rows and the offset agree, and a (re)started worker reads each partition on from
its own offset: the compacted table topic is the table's changelog (Kafka Streams' source-topic
changelog optimization), no second copy is written. ``forget`` drops a partition (its topic
was compacted past the stored offset, or it must be read again from the start), ``forget_topic`` every
partition of a topic (one of that name made again: ``streams.sources``). Memory is
RocksDB's block cache and write buffers — fixed sizes (``streams.rocks``) — whatever the number of rows.
No I/O until ``open``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator

from rocksdict import WriteBatch

from streams.rocks import Database
from streams.rows import pack

_COUNT = struct.Struct(">q")
Record = tuple[int, bytes, bytes | None, int, int]  # (offset, key, value or None, commit_lsn, position)


def _prefix(kind: bytes, topic: str, partition: int) -> bytes:
    return kind + topic.encode() + b"\x00" + partition.to_bytes(4, "big")


class TableStore(Database):
    """Rows, counts and read offsets of table-topic partitions, in one RocksDB database."""

    what = "table store"

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
        found: list[bytes | None] = db.get([rows + key for key in latest]) or []  # one multi-get: which keys exist
        for (key, packed), old in zip(latest.items(), found, strict=True):
            existed = old is not None
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
        for key, _ in self._scan_stored(prefix):
            yield key[len(prefix) :]

    def forget(self, topic: str, partition: int) -> None:
        """Drop the partition's rows, count and offset (it is read again from the start)."""
        db = self._db
        for kind in (b"r", b"n", b"o"):  # each key of partition p sorts before partition p + 1's prefix
            db.delete_range(_prefix(kind, topic, partition), _prefix(kind, topic, partition + 1))

    def forget_topic(self, topic: str) -> None:
        """Drop every partition of ``topic`` (a topic of that name made again: read from the start)."""
        db, name = self._db, topic.encode()
        for kind in (b"r", b"n", b"o"):
            db.delete_range(kind + name + b"\x00", kind + name + b"\x01")

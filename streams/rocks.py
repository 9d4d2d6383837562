"""Opening the workers' RocksDB databases (rocksdict) with bounded memory, owner-only on disk.

Promise: ``open_db(path)`` opens (creating if missing) a database under ``path`` — a directory
made readable by its owner only — in raw (bytes) mode. Every database of a worker shares one
block cache (``BLOCK_CACHE``), which also holds the files' index and filter blocks (by default
RocksDB keeps those outside it, for every open file: memory that grows with the rows); each has
at most ``WRITE_BUFFERS`` memtables of ``WRITE_BUFFER`` bytes. So a worker's RocksDB memory is
bounded by those sizes whatever the number of rows. Bloom filters (10 bits a key) let a lookup
of a key a file does not hold skip reading it: the table store asks for every key it writes.
Index and filter blocks are partitioned (two-level index, partitioned filters, ``METADATA_BLOCK``
bytes a partition) and their top level pinned in the cache: whole, a big file's filter (10 bits a
key: ~1 MB for 700k keys) was evicted by data blocks once a database outgrew the cache, and every
lookup read and checksummed it again. Measured on 1.5M keys (200 MB) with the 32 MB cache: a
lookup 87-107 µs whole, 17-27 µs partitioned (of a key no file holds: 60-77 µs, 6 µs); py-spy had
put half a view publication's time under load in that read (``bench/RESULTS.md``, 2026-11-26).

``Database`` is what both stores share: open on demand, close once, scan by key prefix. ``scratch(under)``
is a throwaway database (no write-ahead log, removed after use; ``clear`` removes what a crash left): work
too big for memory, such as a re-key's view of a whole table topic.

A database opened again gets these options too: rocksdict, given options but no column families,
takes the default column family's from the OPTIONS file RocksDB wrote — with a block cache of its
own (8 MB, rocksdict's default) instead of the shared one, and any option changed since ignored —
so the default column family is named with the options here.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rocksdict import BlockBasedIndexType, BlockBasedOptions, Cache, Options, Rdict, WriteOptions

BLOCK_CACHE = 32 << 20  # bytes of decompressed blocks kept for reads, shared by a worker's databases
WRITE_BUFFER = 16 << 20  # per memtable
WRITE_BUFFERS = 2  # memtables per database: one filling, one being flushed
METADATA_BLOCK = 4096  # bytes of an index or filter partition
_cache: Cache | None = None


def shared_cache() -> Cache:
    global _cache
    if _cache is None:
        _cache = Cache(BLOCK_CACHE)
    return _cache


def db_options(partitioned: bool = True) -> Options:
    """A worker database's options (see the module promise); ``partitioned`` False: whole index and
    filter blocks, as before 2026-11-26 (``bench/lookups.py``'s baseline)."""
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    table = BlockBasedOptions()
    table.set_block_cache(shared_cache())
    table.set_cache_index_and_filter_blocks(True)
    table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    table.set_bloom_filter(10, False)
    if partitioned:
        table.set_index_type(BlockBasedIndexType.two_level_index_search())
        table.set_partition_filters(True)
        table.set_metadata_block_size(METADATA_BLOCK)
        table.set_pin_top_level_index_and_filter(True)
    options.set_block_based_table_factory(table)
    options.set_write_buffer_size(WRITE_BUFFER)
    options.set_max_write_buffer_number(WRITE_BUFFERS)
    return options


def open_db(path: Path, options: Options | None = None) -> Rdict:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    options = options or db_options()
    return Rdict(str(path / "rocksdb"), options, column_families={"default": options})


@contextmanager
def scratch(under: Path) -> Iterator[Rdict]:
    """An empty database in a new directory under ``under`` (both owner-only) for the ``with`` block, without a
    write-ahead log (nothing in it outlives the block), removed after it. A new directory each time: a database a
    failed use left open (its lock held) or a crash left behind is never the one given (``clear`` removes those)."""
    under.mkdir(mode=0o700, parents=True, exist_ok=True)
    under.chmod(0o700)
    path = Path(tempfile.mkdtemp(dir=under))
    db = open_db(path)
    unlogged = WriteOptions()
    unlogged.disable_wal = True  # type: ignore[method-assign,assignment]  # a property; the stub says a method
    db.set_write_options(unlogged)
    try:
        yield db
    finally:
        db.close()
        shutil.rmtree(path, ignore_errors=True)


def clear(under: Path) -> None:
    """Remove what scratch databases under ``under`` a crash left (at start, before any is in use)."""
    shutil.rmtree(under, ignore_errors=True)


class Database:
    """A worker's RocksDB database: opened on demand, closed once, scanned by key prefix."""

    what = "store"  # how errors name it

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db: Rdict | None = None

    def open(self) -> Database:
        if self.db is None:
            self.db = open_db(self.path)
        return self

    def close(self) -> None:
        if self.db is not None:
            self.db.close()
            self.db = None

    @property
    def _db(self) -> Rdict:
        if self.db is None:
            raise RuntimeError(f"the {self.what} at {self.path} is not open")
        return self.db

    def _scan_stored(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Every stored (key, value) whose key starts with ``prefix``, in key order."""
        it = self._db.iter()
        it.seek(prefix)
        while it.valid():
            key: bytes = it.key()
            if not key.startswith(prefix):
                return
            yield key, it.value()
            it.next()

"""A worker's RocksDB lookups in a database many times its block cache: partitioned index and filters
against whole ones, in one run.

Two databases of ``--rows`` random keys shaped like the view store's row keys (120-byte values;
1M keys: ~130 MB against the 32 MB cache) are written through ``streams.rocks.open_db``: one with
the worker's options, one with the same options but whole (unpartitioned) index and filter blocks
(the baseline: what the worker used before 2026-11-26). Then each is opened again and read at
random: keys it holds (a view publication's reads) and keys it does not (the table store asks for
every key it writes), three rounds of 50,000 each. Printed: µs a lookup, and the ratio.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path

from rocksdict import Rdict

from streams import rocks

ROUNDS, SAMPLE = 3, 50_000


def build(path: Path, rows: int, partitioned: bool) -> list[bytes]:
    """Write ``rows`` random keys (the same ones for either arm) and flush; their keys."""
    rng = random.Random(2)
    keys = [b"r\x00public.orders\x00[%d]" % rng.randrange(10**12) for _ in range(rows)]
    db = rocks.open_db(path, rocks.db_options(partitioned))
    for key in keys:
        db[key] = rng.randbytes(120)
    db.flush()
    db.close()
    return keys


def timed(db: Rdict, keys: list[bytes]) -> float:
    """µs a lookup over ``keys``."""
    started = time.perf_counter()
    for key in keys:
        db.get(key)
    return (time.perf_counter() - started) / len(keys) * 1e6


def arm(path: Path, keys: list[bytes], partitioned: bool) -> tuple[list[float], list[float]]:
    """Lookups of held keys and of absent ones, per round, with the database opened again."""
    db = rocks.open_db(path, rocks.db_options(partitioned))
    rng = random.Random(1)
    held, absent = [], []
    for _ in range(ROUNDS):
        sample = rng.sample(keys, SAMPLE)
        held.append(timed(db, sample))
        absent.append(timed(db, [key + b"x" for key in sample]))
    db.close()
    return held, absent


def figures(name: str, values: list[float]) -> str:
    return f"{name} " + ", ".join(f"{v:.1f}" for v in values) + " µs"


def main(rows: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="headwater-bench-lookups-"))
    try:
        print(f"lookups: {rows:,} keys, {rocks.BLOCK_CACHE >> 20} MB block cache, {ROUNDS} rounds of {SAMPLE:,}")
        results = {}
        for partitioned in (False, True):
            keys = build(work / str(partitioned), rows, partitioned)
            results[partitioned] = arm(work / str(partitioned), keys, partitioned)
        for partitioned, label in ((False, "whole (baseline)"), (True, "partitioned (the worker's)")):
            held, absent = results[partitioned]
            print(f"  {label:28s}: {figures('held', held)}; {figures('absent', absent)}")
        (base_held, base_absent), (held, absent) = results[False], results[True]
        print(f"  partitioned against whole: held keys {min(base_held) / min(held):.1f}x faster, "
              f"absent keys {min(base_absent) / min(absent):.1f}x (best rounds)")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)

"""Handing memory the worker freed back to the system, so its RSS follows what it holds.

Promise: ``Trimmer`` is a daemon thread that asks the C library to return free memory
(glibc's ``malloc_trim(0)``) every ``every`` seconds, until ``stop``. Why, measured with
heaptrack and /proc/<pid>/smaps on pgbench's data set (``./dev bench tables``): the worker's
readers, RocksDB and the producer allocate and free on a dozen threads, and glibc keeps what
they free in per-thread arenas (64 MB each) — a worker that had loaded 1M rows held 212 MB,
and 150 MB right after one ``malloc_trim``; loading 5M rows its RSS crept from 214 MB to
291 MB while what it held stayed the same. Fewer arenas (``MALLOC_ARENA_MAX=2``) did not
help. A trim takes a few milliseconds (64 ms at worst, seen mid-load). Where the C library
has no ``malloc_trim`` (musl, macOS) the thread is not started. No I/O at import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from collections.abc import Callable

log = logging.getLogger("headwater.streams")
EVERY = 5.0  # seconds between trims


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


class Trimmer(threading.Thread):
    """Returns the worker's free memory to the system every ``every`` seconds."""

    def __init__(self, every: float = EVERY) -> None:
        super().__init__(name="headwater-malloc-trim", daemon=True)
        self.every = every
        self.stopping = threading.Event()
        self.trim = malloc_trim()
        self.trims = 0

    def start(self) -> None:
        """Start trimming (once; a second call, or a C library without ``malloc_trim``, starts nothing)."""
        if self.trim is None:
            log.info("the C library has no malloc_trim: freed memory stays with the worker until reused")
            self.stopping.set()
        elif not self.is_alive() and not self.stopping.is_set():
            super().start()

    def run(self) -> None:
        assert self.trim is not None
        while not self.stopping.wait(self.every):
            self.trim(0)
            self.trims += 1

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=10)

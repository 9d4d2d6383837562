"""The worker's memory trimmer: it trims on its own thread until stopped, and starts once."""

from __future__ import annotations

import time

import pytest

from streams.memory import Trimmer, malloc_trim

pytestmark = pytest.mark.unit


def test_glibc_has_malloc_trim_and_the_trimmer_trims_until_stopped() -> None:
    assert malloc_trim() is not None  # this project's machines run glibc
    trimmer = Trimmer(every=0.02)
    trimmer.start()
    trimmer.start()  # a second rebalance: nothing more
    deadline = time.monotonic() + 5
    while trimmer.trims < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    trimmer.stop()
    assert trimmer.trims >= 3 and not trimmer.is_alive()
    done = trimmer.trims
    time.sleep(0.1)
    assert trimmer.trims == done


def test_without_malloc_trim_nothing_starts() -> None:
    trimmer = Trimmer(every=0.02)
    trimmer.trim = None
    trimmer.start()
    assert not trimmer.is_alive() and trimmer.stopping.is_set()

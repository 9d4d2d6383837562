"""The table feed's progress as the endpoint reads it (``streams.tablefeed``), without a broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from streams.store import TableStore
from streams.tablefeed import Progress, TableFeed

pytestmark = pytest.mark.unit


def test_a_partition_just_given_is_not_current_until_its_end_is_known(tmp_path: Path) -> None:
    """Before the feed asked the broker where the partition ends, a key missing from the store may exist: the
    endpoint must answer 503, not 404 (it answered 404 during a rebalance)."""
    feed = TableFeed(TableStore(tmp_path), {}, [("t", 0)], batch_size=1, wait=0.1, on_fatal=print)
    assert not feed.progress[("t", 0)].current
    assert Progress(offset=0, end=0).current and not Progress(offset=0, end=3).current

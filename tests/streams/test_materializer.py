"""The views' commit policy between points, as a pure function."""

from __future__ import annotations

import pytest

from streams.materializer import COMMIT_AFTER_S, COMMIT_PENDING, commit_due

pytestmark = pytest.mark.unit


def test_a_batch_commits_only_once_its_writes_pile_up_or_a_point_is_long_in_coming() -> None:
    assert not commit_due(1, 0.0)  # the next point commits it (every batch did, a RocksDB write each 5 ms)
    assert not commit_due(COMMIT_PENDING - 1, COMMIT_AFTER_S / 2)
    assert commit_due(COMMIT_PENDING, 0.0)
    assert commit_due(1, COMMIT_AFTER_S)
    assert not commit_due(0, 10 * COMMIT_AFTER_S)  # nothing to write

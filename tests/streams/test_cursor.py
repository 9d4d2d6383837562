"""The raw-topic cursor: what a reader handles of a batch, and what it says about holes (pure)."""

from __future__ import annotations

import logging

import pytest

from streams.cursor import Cursor


def batch(*offsets: int) -> list[tuple[int, bytes | None, bytes | None]]:
    return [(o, b"k%d" % o, b"v%d" % o) for o in offsets]


def test_handled_offsets_are_dropped_and_the_rest_kept_in_order() -> None:
    cursor = Cursor("t.changes", "fan-out", lambda: 0)
    cursor.reset(3)
    assert [o for o, _, _ in cursor.admit(batch(1, 2, 3, 4))] == [3, 4]
    assert cursor.next == 5
    assert cursor.admit(batch(4)) == []  # read again after a restart: nothing new
    assert [o for o, _, _ in cursor.admit(batch(5, 6))] == [5, 6]


def test_a_hole_retention_made_is_logged_as_loss(caplog: pytest.LogCaptureFixture) -> None:
    cursor = Cursor("t.changes", "views", lambda: 8)
    cursor.reset(2)
    with caplog.at_level(logging.INFO, "headwater.streams"):
        assert [o for o, _, _ in cursor.admit(batch(8, 9))] == [8, 9]
    assert "t.changes offsets 2..7 were deleted (retention) before the views handled them" in caplog.text
    assert cursor.next == 10


def test_a_hole_without_records_is_no_loss(caplog: pytest.LogCaptureFixture) -> None:
    cursor = Cursor("t.changes", "fan-out", lambda: 0)
    cursor.reset(2)
    with caplog.at_level(logging.INFO, "headwater.streams"):
        assert [o for o, _, _ in cursor.admit(batch(2, 5))] == [2, 5]
    assert "no records at offsets 3..4" in caplog.text
    assert "deleted" not in caplog.text

"""The Redis mirror's choice of the cut to apply next, as a pure rule (its Redis side is tested with the views)."""

from __future__ import annotations

from typing import Any

import pytest

from streams.config import StreamsConfig
from streams.mirror import RedisMirror
from tables.registry import Registry

pytestmark = pytest.mark.unit


def cut(lsn: int, *ends: tuple[int, int]) -> dict[str, Any]:
    return {"view": "v", "commit_lsn": lsn, "topic": "t", "ends": [{"partition": p, "offset": o} for p, o in ends]}


def test_a_cut_handed_over_then_read_from_the_cuts_topic_is_kept_once_and_cuts_never_go_back() -> None:
    """The assembler hands the mirror each cut as it makes it, and the mirror reads it again on the cuts topic:
    the second is the same cut (not applied again); an older one changes nothing; one at the same LSN with other
    ends (rows written again at that point) or a newer one replaces it."""
    mirror = RedisMirror(StreamsConfig(redis_url="redis://127.0.0.1:1"), {}, Registry("http://127.0.0.1:1"))
    handed = cut(10, (0, 5), (1, 7))
    mirror.take(handed)
    handed["applied"] = True  # what sync marks once Redis shows it
    mirror.take(cut(10, (0, 5), (1, 7)))  # the same, from the cuts topic
    assert mirror.cuts["v"] is handed
    mirror.take(cut(9, (0, 4), (1, 7)))
    assert mirror.cuts["v"] is handed
    again = cut(10, (0, 6), (1, 7))
    mirror.take(again)
    assert mirror.cuts["v"] is again
    newer = cut(11, (0, 6), (1, 8))
    mirror.take(newer)
    assert mirror.cuts["v"] is newer

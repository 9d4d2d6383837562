"""The Redis mirror's choice of the cut to apply next, as a pure rule, and a cut never moving back in Redis (the rest
of its Redis side is tested with the views)."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from headwater.stack import StackConfig
from streams.config import StreamsConfig
from streams.mirror import RedisMirror
from tables.registry import Registry
from tables.topics import view_key


def cut(lsn: int, *ends: tuple[int, int]) -> dict[str, Any]:
    return {"view": "v", "commit_lsn": lsn, "topic": "t", "ends": [{"partition": p, "offset": o} for p, o in ends]}


@pytest.mark.unit
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


def test_a_cut_older_than_the_one_redis_shows_changes_nothing_there(
    local_stack: StackConfig, unique_name: str
) -> None:
    """A cut handed over is shown before the cuts topic holds it; a mirror started again after a crash in between
    reads an older last cut there. Applying that one changes nothing in Redis."""
    cfg = StreamsConfig(redis_url=local_stack.redis_url, topic_prefix=unique_name)
    mirror = RedisMirror(cfg, {}, Registry(local_stack.registry_url))
    client, meta = redis.Redis.from_url(local_stack.redis_url), view_key(unique_name, "v")
    client.hset(meta, mapping={"offsets": '{"0": 5}', "cut_lsn": 10, "cut": "0/A"})
    mirror.held["v"], mirror.read["v"] = '{"0": 5}', {0: 5}
    mirror.take(cut(9, (0, 4)))
    mirror.sync("v")
    assert client.hmget(meta, "cut_lsn", "cut", "offsets") == [b"10", b"0/A", b'{"0": 5}']
    assert "v" not in mirror.applied and mirror.held["v"] == '{"0": 5}'
    mirror.take(cut(11, (0, 5)))
    mirror.sync("v")
    assert client.hmget(meta, "cut_lsn", "cut") == [b"11", b"0/B"] and mirror.applied["v"] == 11

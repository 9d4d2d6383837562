"""The Redis mirror's choice of the cut to apply next, as a pure rule, the rows handed over by the views beside it
taken only in order, and a cut never moving back in Redis (the rest of its Redis side is tested with the views)."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass
class Copy:
    """A view record as the consumer gives it back."""

    at: int

    def topic(self) -> str:
        return "t"

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self.at

    def error(self) -> None:
        return None


class Consumer:
    def __init__(self, *messages: Copy) -> None:
        self.messages = list(messages)

    def consume(self, count: int, wait: float) -> list[Copy]:
        out, self.messages = self.messages, []
        return out


@pytest.mark.unit
def test_rows_handed_over_are_taken_only_where_they_follow_what_was_read_and_their_copies_are_passed_over() -> None:
    """The views beside the mirror hand it each point's rows as Kafka acknowledged them. A row is taken only as the
    next record of its partition: another writer's records before it, or an earlier point's rows not handed over,
    are read from the topic first (and the rows after them with them). The topic's copies are then passed over."""
    mirror = RedisMirror(StreamsConfig(redis_url="redis://127.0.0.1:1"), {}, Registry("http://127.0.0.1:1"))
    mirror.topics, mirror.read = {"t": "v"}, {"v": {0: 5, 1: 2}}
    mirror.hand(10, [("t", 0, 5, b"a", b"A"), ("t", 1, 4, b"b", b"B"), ("t", 0, 6, b"c", None)])
    mirror.hand(11, [("t", 0, 8, b"d", b"D")])  # offset 7 never came handed
    read: dict[str, list[Any]] = {}
    mirror._take_handed(read)
    assert read == {}  # not reading yet (``_assign`` sets where from)
    mirror.assigned = True
    mirror.hand(10, [("t", 0, 5, b"a", b"A"), ("t", 1, 4, b"b", b"B"), ("t", 0, 6, b"c", None)])
    mirror.hand(11, [("t", 0, 8, b"d", b"D")])
    mirror._take_handed(read)
    assert read == {"v": [(0, 5, b"a", 10, b"A"), (0, 6, b"c", 10, None)]}
    assert mirror.read["v"] == {0: 7, 1: 2}
    assert mirror._consume(Consumer(Copy(5), Copy(6))) == 2  # the copies: nothing staged (Redis is unreachable here)
    assert mirror.read["v"] == {0: 7, 1: 2}


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

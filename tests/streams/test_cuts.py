"""A worker's share of the cuts: records of another writer found among its own rows by their offsets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest

from streams.cuts import HAND_ROWS, Cuts, Delivered, Delivery, Ends, Point

pytestmark = pytest.mark.unit
TOPIC = "p.views.v"


@dataclass
class Acked:
    """What a delivery report tells of a row Kafka acknowledged: where it landed."""

    part: int
    at: int

    def topic(self) -> str:
        return TOPIC

    def partition(self) -> int:
        return self.part

    def offset(self) -> int:
        return self.at

    def key(self) -> bytes:
        return b"k%d" % self.at

    def value(self) -> bytes:
        return b"v%d" % self.at


def handed(known: dict[int, int], rows: dict[int, list[int]]) -> tuple[Cuts, Ends]:
    """One point whose rows Kafka put at ``rows`` (partition -> offsets), each partition's end ``known`` before it:
    the cuts, and the ends its fragment names."""
    out: list[Ends] = []
    cuts = Cuts(cast(Any, None), {"v": TOPIC}, lambda point, ends: out.append(ends))
    cuts.reached("v", known)
    point = Point(lsn=7, offset=70, parts=[("v", p) for p in sorted({*known, *rows})], seconds=0.1)
    for partition, offsets in rows.items():
        for offset in offsets:
            point.delivered.outstanding += 1
            point.delivered.delivered(None, Acked(partition, offset))
    cuts._hand_on(point)
    return cuts, out[0]


def test_rows_right_after_the_known_end_are_this_workers_alone() -> None:
    cuts, ends = handed({0: 10, 1: 4}, {0: [10, 11, 12], 1: [4]})
    assert ends == [("v", 0, 13), ("v", 1, 5)]
    assert cuts.strays() == []
    assert cuts.end("v", 0) == 13


def test_records_of_another_writer_before_this_workers_rows_leave_the_partition_out_of_the_fragment() -> None:
    cuts, ends = handed({0: 10, 1: 4}, {0: [14, 15], 1: [4, 5]})  # offsets 10-13 are someone else's
    assert ends == [("v", 1, 6)]  # no cut can be made over them until the rows they got wrong are written again
    assert cuts.strays() == [("v", 0, 10)]
    assert cuts.strays() == []  # taken once
    assert cuts.end("v", 0) == 16  # the next point's rows are checked from after these


def test_records_of_another_writer_among_this_workers_rows_are_found_too() -> None:
    cuts, ends = handed({0: 10}, {0: [10, 11, 13]})
    assert ends == []
    assert cuts.strays() == [("v", 0, 10)]


def test_a_partition_without_rows_at_a_point_keeps_its_end_and_is_not_suspected() -> None:
    cuts, ends = handed({0: 10, 1: 4}, {1: [4]})
    assert ends == [("v", 0, 10), ("v", 1, 5)]
    assert cuts.strays() == []


def test_a_partition_that_ends_past_this_workers_last_row_has_another_writers_records_at_its_tail() -> None:
    cuts, _ = handed({0: 10, 1: 4}, {0: [10, 11], 1: [4]})
    ends = {(TOPIC, 0): 12, (TOPIC, 1): 7, (TOPIC, 2): 3, ("p.views.other", 0): 50}  # 2: never read, not this view's
    assert cuts.tails(ends) == [("v", 1, 5)]
    assert cuts.tails(ends) == []  # found once until taken
    assert cuts.strays() == [("v", 1, 5)]


def test_the_local_brokers_end_of_this_workers_own_last_batch_is_not_taken_for_another_writers() -> None:
    cuts, _ = handed({0: 10}, {0: [10, 11, 12, 13]})  # one batch of four: the broker may say base + 1 = 11
    assert cuts.tails({(TOPIC, 0): 11}) == [] and cuts.tails({(TOPIC, 0): 14}) == []


class Idle:
    """A producer with nothing in flight."""

    def __len__(self) -> int:
        return 0


def test_the_ends_are_looked_at_only_while_every_row_written_is_in_a_point_handed_on() -> None:
    cuts = Cuts(cast(Any, Idle()), {"v": TOPIC}, lambda point, ends: None)
    assert cuts.settled()
    cuts.current.outstanding += 1  # a row on its way
    assert not cuts.settled()
    cuts.current.delivered(None, Acked(0, 3))  # acknowledged, but in no point yet (a publication cut short)
    assert not cuts.settled()
    cuts.point(lsn=7, offset=70, parts=[("v", 0)], seconds=0.1)  # nothing outstanding: handed on at once
    assert cuts.settled() and cuts.end("v", 0) == 4
    cuts.pending.append(Point(lsn=8, offset=80, parts=[("v", 0)], seconds=0.1))  # a point whose rows are awaited
    assert not cuts.settled()


def test_a_points_rows_go_to_the_mirror_beside_before_its_fragment_and_a_large_points_do_not() -> None:
    """``on_rows`` (the Redis mirror on the raw owner) gets a point's rows as Kafka has them before ``done`` writes its
    fragment (the cut comes of that); a point of more than ``HAND_ROWS`` rows is read from the topic instead."""
    seen: list[tuple[str, object]] = []
    cuts = Cuts(cast(Any, None), {"v": TOPIC}, lambda point, ends: seen.append(("done", point.lsn)))
    cuts.on_rows = lambda lsn, rows: seen.append(("rows", (lsn, rows)))
    for lsn, count in ((7, 2), (8, HAND_ROWS + 1), (9, HAND_ROWS)):
        point = Point(lsn=lsn, offset=lsn * 10, parts=[("v", 0)], seconds=0.1, delivered=Delivered(HAND_ROWS))
        for offset in range(count):
            point.delivered.outstanding += 1
            point.delivered.delivered(None, Acked(0, 100 * lsn + offset))
        cuts._hand_on(point)
    first: list[Delivery] = [(TOPIC, 0, 700, b"k700", b"v700"), (TOPIC, 0, 701, b"k701", b"v701")]
    assert seen[:3] == [("rows", (7, first)), ("done", 7), ("done", 8)]
    assert seen[3][0] == "rows" and len(seen[3][1][1]) == HAND_ROWS and seen[4] == ("done", 9)  # type: ignore[index]
    assert cuts._delivered().keep == HAND_ROWS
    cuts.on_rows = None
    assert cuts._delivered().rows is None  # nobody beside: nothing kept

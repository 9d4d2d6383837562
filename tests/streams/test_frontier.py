"""The workers' agreement, pure: valid points, the barrier, where a point lands, cuts from fragments, the pace."""

from __future__ import annotations

import random

import pytest

from streams.frontier import PATIENCE, PATIENCE_FLOOR, Assembly, Cut, HandOff, Pace, Points

pytestmark = pytest.mark.unit


def test_a_record_below_an_earlier_end_is_invalid_everywhere_and_moves_nothing() -> None:
    points = Points()
    assert points.read(10, False) and points.barrier == 10
    assert not points.read(7, True)  # a writer left over from a rebalance, behind: ignored, no request
    assert points.barrier == 10 and not points.requests
    assert points.read(10, True)  # the same end again is valid (an idle owner asking for a point)
    assert points.read(25, True) and list(points.requests) == [10, 25]


def test_a_worker_never_applies_past_the_barrier() -> None:
    points = Points()
    assert not points.allows(0)
    points.read(5, False)
    assert points.allows(4) and not points.allows(5)


def test_a_point_lands_on_the_first_consistent_offset_at_or_after_its_end_minus_one() -> None:
    points = Points()
    points.read(10, True)
    assert not points.resolves(8)  # a consistent point before raw_end - 1: too early
    assert points.resolves(9)  # raw_end - 1 itself ends a transaction: here
    points.read(20, True)
    points.read(30, True)
    # offsets 19..29 end no transaction: both requests land on the first consistent point after them
    assert points.resolves(31) and not points.requests


def test_every_worker_reading_the_same_records_publishes_at_the_same_offsets() -> None:
    rng = random.Random(5)
    ends = sorted(rng.sample(range(1, 2000), 300))
    records = [(x, rng.random() < 0.3) for x in ends]
    records[100:100] = [(ends[50], True), (3, True)]  # stale and duplicate records among them
    consistent = {o for o in range(2000) if rng.random() < 0.4}

    def publications(batch: int) -> list[int]:
        points, out, offset, read = Points(), [], 0, 0
        while offset < 2000:
            for record in records[read : read + batch]:  # the points topic arrives in batches of any size
                points.read(*record)
            read += batch
            while offset < 2000 and (points.allows(offset) or read >= len(records)):
                if offset in consistent and points.resolves(offset):
                    out.append(offset)
                offset += 1
        return out

    first = publications(1)
    assert len(first) > 30
    seven = publications(7)
    assert set(seven) <= set(first) and seven[-1] == first[-1], "a worker knowing of later points skips to them"
    assert publications(1000) == [first[-1]], "every point known at once: one publication, at the last"


def test_a_worker_behind_publishes_at_the_last_point_it_knows_of_not_at_each() -> None:
    points = Points()
    points.read(100, True)
    points.read(200, True)
    assert not points.resolves(120), "a later point is known: no publication here"
    assert list(points.requests) == [200]
    assert points.resolves(199) and not points.requests


def test_a_cut_needs_every_partition_at_one_point_and_only_moves_forward() -> None:
    assembly = Assembly(["v"], partitions=3)
    assembly.add("v", 100, 0, 5)
    assembly.add("v", 100, 1, 7)
    assert assembly.cuts() == []
    assembly.add("v", 200, 0, 6)
    assembly.add("v", 100, 2, 2)
    assert assembly.cuts() == [Cut("v", 100, {0: 5, 1: 7, 2: 2})]
    assert assembly.cuts() == []  # made once
    for partition in range(3):
        assembly.add("v", 300, partition, 10 + partition)
    assembly.add("v", 200, 1, 8)
    assembly.add("v", 200, 2, 3)
    assert assembly.cuts() == [Cut("v", 300, {0: 10, 1: 11, 2: 12})]  # the newest whole point
    for partition in range(3):
        assembly.add("v", 250, partition, 9)  # older than the last cut: never a cut
    assert assembly.cuts() == []


def test_a_cut_read_back_at_start_is_not_made_again() -> None:
    assembly = Assembly(["v", "w"], partitions=1)
    assembly.seen("v", 500)
    assembly.add("v", 400, 0, 1)
    assembly.add("w", 400, 0, 1)
    assert assembly.cuts() == [Cut("w", 400, {0: 1})]


def test_points_come_no_sooner_than_the_slowest_publication_took_nor_the_floor() -> None:
    pace = Pace(floor=0.05)
    assert pace.due(0.0)
    pace.point(0.0, 10)
    assert not pace.due(0.04) and pace.due(0.05)
    pace.report("a", 0.01, 0.05)
    pace.report("b", 2.0, 0.06)  # one worker's publication took 2 s
    assert not pace.due(1.0) and pace.due(2.0)
    assert pace.gap(200.0) == 0.05  # a worker not heard from for a minute no longer counts


def test_a_publication_longer_than_a_minute_still_sets_the_gap_until_the_next_report() -> None:
    """The 720k-row shop's publications took ~65 s: forgetting them after 60 s made the gap the floor,
    and a point in flight then waited PATIENCE_FLOOR only, so workers published every few seconds' changes."""
    pace = Pace(floor=0.05, parts=[("v", 0)])
    pace.report("a", 65.0, 100.0)
    pace.point(100.0, 5_000)
    assert pace.gap(170.0) == 65.0 and not pace.due(170.0), "the point is still being published"
    pace.published(5_000, [("v", 0)])
    pace.report("a", 66.0, 171.0)
    assert pace.due(171.0)
    assert pace.gap(171.0 + 3 * 66.0 + 1) == 0.05, "a writer silent for three of its publications no longer counts"


def test_one_point_in_flight_a_worker_behind_finds_one_point_ahead_not_one_per_gap() -> None:
    """The next point waits until every part was published at or past the last one; a worker far behind
    thus publishes once when it catches up, at the raw end the point was announced at."""
    parts = [("v", 0), ("v", 1)]
    pace = Pace(floor=0.05, parts=parts)
    pace.point(0.0, 100)
    assert not pace.due(1.0), "partition 1 has not published at 99 yet"
    pace.published(99, [("v", 0)])
    pace.published(98, [("v", 1)])  # an older point
    assert not pace.due(2.0)
    assert pace.missing() == [("v", 1)], "the part holding the point back, for the owner's warning"
    pace.published(140, [("v", 1)])  # a transaction's end past 99: the first consistent point at or after it
    assert pace.due(2.0) and pace.missing() == []
    pace.point(2.0, 500)
    assert not pace.due(4.0)


def test_a_worker_that_resumed_past_the_point_in_flight_asks_itself_once_when_caught_up() -> None:
    """Seen at 720k after a kill -9: the restarted worker read the points topic from its last records, all
    announcing ends without a point (one was in flight), so it never published the one in flight and the next
    waited PATIENCE x the survivor's 158 s publication. Once caught up it owes a publication: its fragment lets
    the pace go on."""
    pace = Pace(floor=0.05, parts=[("v", 0), ("v", 1)])
    pace.point(0.0, 100)  # in flight: partition 0 publishes it, partition 1's worker is away
    pace.published(99, [("v", 0)])
    points = Points()  # partition 1's worker resumes at raw offset 80, reading ends announced since: no point
    for end in (150, 210, 260):
        points.read(end, False)
    assert not points.owe(200), "not caught up: offsets up to 259 may be applied"
    assert not points.resolves(230)
    assert points.owe(260) and list(points.requests) == [260]
    assert not points.owe(260), "asked once"
    assert not points.resolves(258) and points.resolves(259)  # its next consistent point (259 ends a transaction)
    pace.published(259, [("v", 1)])
    assert pace.due(1.0), "every part passed the point in flight: the next comes after the gap, not the patience"


def test_a_worker_with_a_point_ahead_or_no_barrier_yet_owes_nothing() -> None:
    points = Points()
    assert not points.owe(0), "no points record read: no barrier, nothing known"
    points.read(50, True)
    assert not points.owe(50), "a point is asked for: it publishes there"


def test_a_point_some_part_never_publishes_holds_the_next_back_only_a_while() -> None:
    """A part whose worker is gone or replays publishes nothing: after PATIENCE gaps (at least
    PATIENCE_FLOOR seconds) the next point is announced anyway."""
    pace = Pace(floor=0.05, parts=[("v", 0), ("v", 1)])
    pace.point(0.0, 100)
    pace.published(100, [("v", 0)])
    assert not pace.due(PATIENCE_FLOOR - 0.01) and pace.due(PATIENCE_FLOOR)
    pace.report("slow", 3.0, PATIENCE_FLOOR)  # publications take 3 s: wait 4 of them
    assert not pace.due(PATIENCE * 3.0 - 0.01) and pace.due(PATIENCE * 3.0)


def test_a_quick_publication_after_a_long_one_does_not_cut_a_point_in_flights_wait_short() -> None:
    """Seen on the 720k shop: the snapshot's publication took ~67 s, the next few points ~2.5 s, then the
    load's took ~65 s again; waiting 4 x 2.5 s put a point every 10 s and each publication carried 10 s."""
    pace = Pace(floor=0.05, parts=[("v", 0)])
    pace.report("a", 67.0, 100.0)
    pace.report("a", 2.5, 110.0)
    assert pace.gap(111.0) == 2.5, "the points' spacing follows the last publication"
    pace.point(111.0, 9_000)
    assert pace.patience(112.0) == PATIENCE * 67.0 and not pace.due(111.0 + 4 * 2.5)
    assert pace.due(111.0 + PATIENCE * 67.0)
    pace.report("a", 3.0, 120.0)
    assert [took for took, _ in pace.took["a"]] == [67.0, 3.0], "2.5 s is outweighed, 67 s still counts"


def test_without_parts_points_never_wait_for_a_publication() -> None:
    pace = Pace(floor=0.05)
    pace.point(0.0, 100)
    assert pace.due(0.05)


def test_points_handed_over_come_first_and_their_copies_read_back_are_dropped() -> None:
    """The announcer beside the views hands each record over as it writes it; the topic then brings the copies
    (in the order told) among other writers' records, which are kept. A re-ask equal to an earlier record is a
    record of its own: each copy answers one record told."""
    handoff = HandOff()
    assert handoff.take([]) == []
    handoff.tell(b"a")
    handoff.tell(b"ask")
    assert handoff.take([b"other"]) == [b"a", b"ask", b"other"]
    handoff.tell(b"ask")  # the same request again (the pace's patience ran out)
    assert handoff.take([b"a", b"ask"]) == [b"ask"]  # the copies of the first two
    assert handoff.take([b"ask", b"ask"]) == [b"ask"]  # the re-ask's copy, then another writer's equal record


def test_a_handed_record_whose_write_failed_does_not_hold_back_the_next_copies() -> None:
    handoff = HandOff()
    for value in (b"lost", b"b", b"c"):
        handoff.tell(value)
    assert handoff.take([]) == [b"lost", b"b", b"c"]
    assert handoff.take([b"b"]) == []  # "lost" never came: passed over
    assert handoff.take([b"lost", b"c"]) == [b"lost"]  # not awaited any more: another writer's
    assert len(handoff.awaited) == 0


def test_a_handed_record_applied_before_the_topic_brings_it_publishes_once() -> None:
    """The views read a handed request, publish where it lands, then read its copy: dropped, so no second request
    (which would publish again at the next consistent point)."""
    handoff, points = HandOff(), Points()
    handoff.tell(b"10,1")
    for value in handoff.take([]):
        points.read(*map(int, value.split(b",")))
    assert points.resolves(12) and not points.requests
    for value in handoff.take([b"10,1"]):
        points.read(*map(int, value.split(b",")))
    assert not points.requests

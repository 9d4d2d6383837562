"""The fan-out's routing and replay decisions (pure)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sortedcontainers import SortedDict

from streams.fanout import (
    Change,
    FanOut,
    Move,
    Output,
    Rekey,
    Truncate,
    behind,
    disordered,
    header_position,
    live_keys,
    newest,
    rekey_moves,
    rekey_outputs,
    truncate_outputs,
)
from streams.writer import Landed, Stray
from tables.partition import partition_for

pytestmark = pytest.mark.unit

TOPIC = "p.customers"


def key(n: int) -> bytes:
    return b"\0\0\0\0\x07" + bytes([n * 2])  # framed Avro long n (small n)


def row(n: int, v: str = "x") -> bytes:
    return b"\0\0\0\0\x08" + bytes([n * 2]) + v.encode()


def change(
    op: str, lsn: int, pos: int, k: int | None = 1, before: bytes | None = None, after: bytes | None = b""
) -> Change:
    value = None if op in ("DELETE", "TRUNCATE") else (after or row(k or 0))
    return Change(op, "public", "customers", TOPIC, lsn, pos, None if k is None else key(k), before, value)


def only(routed: list[Output] | Truncate) -> Output:
    assert isinstance(routed, list) and len(routed) == 1
    return routed[0]


def test_insert_update_delete_become_row_row_tombstone_in_the_key_partition() -> None:
    fan = FanOut(partitions=6)
    inserted = only(fan.route(change("INSERT", 100, 0), offset=0))
    updated = only(fan.route(change("UPDATE", 200, 0, after=row(1, "y")), offset=1))
    deleted = only(fan.route(change("DELETE", 300, 0), offset=2))
    assert (inserted.key, inserted.value) == (key(1), row(1))
    assert updated.value == row(1, "y") and deleted.value is None
    assert {inserted.partition, updated.partition, deleted.partition} == {partition_for(key(1), 6)}
    assert dict(deleted.headers)["hw.lsn"] == b"300" and header_position(deleted.headers) == (2, 0)


def test_a_change_capture_sent_twice_is_written_once() -> None:
    fan = FanOut(partitions=4)
    first = [fan.route(change("INSERT", 100, p, k=p), offset=p) for p in range(3)]
    assert all(first)
    # capture crashed and replays from the last confirmed commit: same (commit_lsn, position), later offsets
    replayed = [fan.route(change("INSERT", 100, p, k=p), offset=10 + p) for p in range(3)]
    assert replayed == [[], [], []] and fan.counters.duplicates == 3
    assert only(fan.route(change("INSERT", 101, 0, k=9), offset=13)).key == key(9)


def test_snapshot_reads_in_any_order_are_all_written() -> None:
    fan = FanOut(partitions=4)
    for offset, position in enumerate([7, 2, 9, 0]):  # parallel snapshot workers interleave
        assert only(fan.route(change("READ", 50, position, k=position), offset=offset))
    assert fan.counters.duplicates == 0


def test_consistent_points_end_transactions_and_backfill_chunks_never_snapshot_rows() -> None:
    """A backfill writes each chunk as a transaction of READ rows: its last row is a consistent point (views
    publish there); the initial snapshot's rows (tx_size 0) are not, SNAPSHOT_END is."""
    streamed = [change("UPDATE", 10, p)._replace(tx_size=3) for p in range(3)]
    chunk = [change("READ", 20, p)._replace(tx_size=2) for p in range(2)]
    snapshot = [change("READ", 5, p) for p in range(3)] + [change("DELETE", 5, 3)]
    assert [c.ends_transaction for c in streamed + chunk] == [False, False, True, False, True]
    assert not any(c.ends_transaction for c in snapshot)
    assert Change("SNAPSHOT_END", "", "", "", 5, 4, None, None, None).ends_transaction
    fan = FanOut(partitions=4)  # the chunk's READs are written, and move no watermark
    assert all(fan.route(c, offset=i) for i, c in enumerate(chunk)) and fan.watermark == (-1, -1)


def test_records_already_in_their_partition_are_not_written_again() -> None:
    partition = partition_for(key(1), 4)
    fan = FanOut(partitions=4, tails={(TOPIC, partition): (5, 0)})  # the last record there came from offset 5
    assert fan.route(change("INSERT", 100, 0), offset=4) == []
    assert fan.route(change("UPDATE", 101, 0), offset=5) == []
    assert only(fan.route(change("UPDATE", 102, 0), offset=6))
    assert fan.counters.replayed == 2


def test_key_change_tombstones_the_old_key_first() -> None:
    fan = FanOut(partitions=4)
    routed = fan.route(change("UPDATE", 100, 0, k=2, before=key(1)), offset=0)
    assert isinstance(routed, list)
    assert [(o.key, o.value is None) for o in routed] == [(key(1), True), (key(2), False)]
    assert [header_position(o.headers) for o in routed] == [(0, 0), (0, 1)]


def test_replica_identity_full_old_row_gives_the_old_key_through_the_extractor() -> None:
    fan = FanOut(partitions=4, key_of_row=lambda old, new: key(old[5] // 2))
    routed = fan.route(change("UPDATE", 100, 0, k=2, before=row(1)), offset=0)
    assert isinstance(routed, list) and routed[0].key == key(1) and routed[0].value is None
    same_key = fan.route(change("UPDATE", 101, 0, k=2, before=row(2)), offset=1)
    assert isinstance(same_key, list) and len(same_key) == 1


def test_unkeyed_tables_and_snapshot_end_write_nothing() -> None:
    fan = FanOut(partitions=4)
    assert fan.route(change("INSERT", 100, 0, k=None), offset=0) == []
    assert fan.route(change("SNAPSHOT_END", 50, 0, k=None), offset=1) == []
    assert fan.unkeyed == {"public.customers"}


def test_truncate_tombstones_every_key_live_before_it() -> None:
    fan = FanOut(partitions=4)
    routed = fan.route(change("TRUNCATE", 100, 3, k=None), offset=20)
    assert routed == Truncate(TOPIC, 20, 100, 3)
    scanned = [(key(1), row(1), (3, 0)), (key(2), row(2), (4, 0)), (key(2), None, (5, 0)),
               (key(3), row(3), (21, 0)), (key(4), row(4), None)]  # fmt: skip
    keys = list(live_keys(scanned, 20, SortedDict()))
    assert keys == [key(1), key(4)]  # 2 deleted already; 3 came after the truncate
    out = list(truncate_outputs(fan, routed, keys))
    assert [(o.key, o.value, header_position(o.headers)) for o in out] == [
        (key(1), None, (20, 0)),
        (key(4), None, (20, 1)),
    ]
    # after a crash halfway: the partition of key 1 already has its tombstone
    again = FanOut(partitions=4, tails={(TOPIC, out[0].partition): (20, 0)})
    redo = list(truncate_outputs(again, routed, keys))
    assert [o.key for o in redo] == [key(4)]


def test_the_newest_record_of_each_key_a_stray_touched_is_its_last_route_or_a_truncate_after_it() -> None:
    fan = FanOut(partitions=4)
    changes = [change("INSERT", 100, 0, k=1), change("UPDATE", 101, 0, k=1, after=row(1, "y")),
               change("INSERT", 102, 0, k=2), change("DELETE", 103, 0, k=2), change("INSERT", 104, 0, k=3),
               change("TRUNCATE", 105, 0, k=None), change("INSERT", 106, 0, k=3, after=row(3, "z"))]  # fmt: skip
    routed = [fan.route(c, offset=i) for i, c in enumerate(changes)]
    at = {n: (TOPIC, partition_for(key(n), 4)) for n in (1, 2, 3, 4)}
    keys: dict[tuple[str, int], set[bytes]] = {}
    for n in (1, 2, 3, 4):
        keys.setdefault(at[n], set()).add(key(n))
    found = {o.key: (o.value, header_position(o.headers)) for o in newest(routed, keys)}
    assert found == {key(1): (None, (5, 0)), key(2): (None, (5, 0)), key(3): (row(3, "z"), (6, 0)),
                     key(4): (None, (5, 0))}  # truncated: 1 updated before it, 4 never written  # fmt: skip
    assert newest(routed[:2], {at[1]: {key(1)}})[0].value == row(1, "y")
    assert newest(routed[:2], {at[2]: {key(2)}}) == [], "a key no change in the range wrote: nothing to write"


def test_records_land_one_after_another_and_another_writers_between_them_are_a_stray() -> None:
    landed = Landed()
    landed.expect({(TOPIC, 0): 10, (TOPIC, 1): 0}, [TOPIC])
    for partition, offset in [(0, 10), (0, 11), (1, 0), (0, 14), (2, 5), (2, 6), ("other", 3)]:
        if partition == "other":
            landed.landed("p.other", 0, offset)  # a topic not watched: not checked
        else:
            landed.landed(TOPIC, int(partition), offset)
    assert landed.take() == [Stray(TOPIC, 0, 12, 14)]  # partition 2: held nothing at the start, first one anywhere
    assert landed.take() == []
    landed.landed(TOPIC, 2, 9)
    landed.landed(TOPIC, 0, 14)  # reported again (a retry Kafka recognised): no step back, no stray
    landed.landed(TOPIC, 0, 15)
    assert landed.take() == [Stray(TOPIC, 2, 7, 9)]
    landed.expect({(TOPIC, 0): 40}, [TOPIC])  # read again after a rebalance: partition 2 starts over
    landed.landed(TOPIC, 0, 40)
    landed.landed(TOPIC, 2, 50)
    assert landed.take() == []
    landed.tail(TOPIC, 0, 41)  # Kafka's end, nothing in flight: just past this writer's last record
    landed.tail(TOPIC, 2, 53)  # past it: another writer's records at the tail, up to the end
    landed.tail("p.other", 0, 99)
    assert landed.take() == [Stray(TOPIC, 2, 51, -1)]
    landed.reach(TOPIC, 2, 53)  # read back to the end
    landed.landed(TOPIC, 2, 53)
    assert landed.take() == []


def test_a_partition_is_verified_up_to_its_end_but_not_past_a_stray_until_what_was_written_over_it_landed() -> None:
    landed = Landed()
    landed.expect({(TOPIC, 0): 10, (TOPIC, 1): 20, (TOPIC, 2): 30}, [TOPIC])
    landed.unexamined({(TOPIC, 0): 10, (TOPIC, 1): 17, (TOPIC, 2): 31, ("p.other", 0): 2})  # the last writer's
    assert landed.verified() == {(TOPIC, 0): 10, (TOPIC, 1): 17, (TOPIC, 2): 30}, "1: 17 to 20 not examined yet"
    handed = landed.take()
    assert handed == [Stray(TOPIC, 1, 17, 20, handed=True)]
    for offset in (10, 11, 14):
        landed.landed(TOPIC, 0, offset)
    assert landed.verified()[(TOPIC, 0)] == 12, "a stray at 12 and 13: not past it"
    strays = landed.take()
    landed.release(handed)  # what was written over 17-20 is acknowledged
    assert landed.verified() == {(TOPIC, 0): 12, (TOPIC, 1): 20, (TOPIC, 2): 30}
    landed.release(strays)
    assert landed.verified()[(TOPIC, 0)] == 15
    landed.landed(TOPIC, 2, 33)
    ahead = landed.take()
    assert ahead == [Stray(TOPIC, 2, 30, 33)]
    landed.freeze(ahead[0], until=60)  # its writer was ahead of this one, up to raw offset 60
    landed.release(ahead)
    landed.thaw(60)
    assert landed.verified()[(TOPIC, 2)] == 30, "this one vouches no further until it wrote up to 60 itself"
    landed.thaw(61)
    assert landed.verified()[(TOPIC, 2)] == 34
    landed.freeze(Stray(TOPIC, 2, 30, 33), until=60)
    landed.expect({(TOPIC, 2): 34}, [TOPIC])  # read again: started over
    assert landed.verified() == {(TOPIC, 2): 34}


def test_past_the_last_writers_checkpoint_only_keys_written_out_of_raw_order_are_written_again() -> None:
    records = [(None, (50, 0)), (key(1), (51, 0)), (key(2), (52, 1)), (key(3), (40, 0)), (key(2), (53, 0)),
               (key(1), (52, 0)), (key(4), None), (key(5), (60, 0))]  # fmt: skip
    # the record before them stood at raw offset 50: 3 (from 40) and 1 (52, after 53) came from behind it;
    # 4 does not say; 2 and 5 came in order, as one fan-out writes them
    assert disordered(records, since=30) == {key(3): 40, key(1): 52, key(4): 30}
    assert disordered(records[1:3] + records[4:5], since=30) == {}, "the last writer's own records: none again"
    assert disordered([(key(1), (3, 0))], since=0) == {}, "nothing before it: in order"
    assert disordered([(key(1), (20, 0)), (key(2), (31, 0))], since=30) == {key(1): 20}, "older than the checkpoint"


def test_keys_another_writer_left_behind_this_fan_out_are_mended_and_those_it_is_ahead_of_are_left() -> None:
    records = [(key(1), (40, 0)), (key(2), (41, 0)), (key(1), (45, 1)), (key(3), (60, 0)), (key(2), (62, 0)),
               (key(4), None), (None, (44, 0))]  # fmt: skip
    # this fan-out stands at raw offset 50, having started at 30: 1 is behind it (written from 40 on);
    # 2 and 3 last came from ahead of it (it writes them itself, or a newer change, on its way); 4 does not say
    assert behind(records, stop=50, since=30) == {key(1): 40, key(4): 30}
    assert behind(records, stop=70, since=30) == {key(1): 40, key(2): 41, key(3): 60, key(4): 30}
    assert behind([], stop=70, since=30) == {}


def wide(n: int) -> bytes:
    return b"\0\0\0\0\x09" + bytes([n * 2, 0])  # the same key under key schema 9 (other bytes: another type)


def rekeyed(n: int, op: str = "UPDATE", offset: int = 10) -> tuple[FanOut, Rekey]:
    fan = FanOut(partitions=4, frames={TOPIC: key(0)[:5]})
    routed = fan.route(Change(op, "public", "customers", TOPIC, 500, 0, wide(n), None,
                              None if op == "DELETE" else row(n, "new")), offset)  # fmt: skip
    assert isinstance(routed, Rekey)
    return fan, routed


def reframe(old: bytes) -> bytes | None:
    return None if old[5] == 2 * 9 else wide(old[5] // 2)  # key 9 does not fit the new key schema


def at(offset: int) -> tuple[int, int]:
    return offset, 0


def planned(rekey: Rekey, topic: list[Any], moved: Callable[[bytes], bytes | None]) -> tuple[list[Move], int]:
    """``rekey_moves`` over in-memory scratch maps (the worker's are RocksDB's, in key order too)."""
    moves, stuck = rekey_moves(rekey, topic, moved, SortedDict(), SortedDict())
    return list(moves), stuck


def test_a_change_keyed_under_a_new_key_schema_moves_the_topics_rows_to_it_once() -> None:
    fan, rekey = rekeyed(1)
    assert [(o.key, o.value) for o in rekey.outputs] == [(wide(1), row(1, "new"))], "the change's own record first"
    topic = [(key(1), row(1), at(0)), (key(2), row(2), at(1)), (key(3), row(3), at(2)), (key(3), None, at(3)),
             (key(4), row(4), at(4)), (wide(4), None, at(5)),  # deleted under its new key (written before this run)
             (key(9), row(9), at(6)), (wide(1), row(1, "new"), at(10)), (key(5), row(5), at(11))]  # fmt: skip
    planned_moves, stuck = planned(rekey, topic, reframe)
    moves = list(rekey_outputs(fan, rekey, planned_moves))
    assert [(o.key, o.value) for o in moves] == [
        (key(1), None),  # the change's own key: its record stands
        (key(2), None), (wide(2), row(2)),
        (key(4), None),  # its new key's tombstone stands
    ]  # fmt: skip
    assert stuck == 1, "a key the new schema cannot hold (9) stays as it is"
    assert [header_position(o.headers) for o in moves] == [(10, 2), (10, 3), (10, 4), (10, 5)]
    assert all(o.partition == partition_for(o.key, 4) for o in moves)
    assert dict(moves[2].headers)["hw.lsn"] == b"500"
    assert fan.frames == {TOPIC: wide(1)[:5]}
    again = fan.route(change("UPDATE", 600, 0, k=None, after=row(2))._replace(key=wide(2)), offset=11)
    assert isinstance(again, list), "the topic's frame is the new one: no re-key again"


def test_a_replayed_rekey_writes_only_what_the_crashed_run_did_not() -> None:
    topic = [(key(1), row(1), at(0)), (key(2), row(2), at(1)), (key(3), row(3), at(2))]
    fan, rekey = rekeyed(7)
    first = list(rekey_outputs(fan, rekey, planned(rekey, topic, reframe)[0]))
    tails = {(TOPIC, o.partition): header_position(o.headers) for o in first[:3]}
    written = topic + [(o.key, o.value, header_position(o.headers)) for o in first[:3]]  # the crash: 3 of 6 landed
    replay = FanOut(partitions=4, tails={k: v for k, v in tails.items() if v is not None}, frames={TOPIC: key(0)[:5]})
    routed = replay.route(Change("UPDATE", "public", "customers", TOPIC, 500, 0, wide(7), None, row(7)), 10)
    assert isinstance(routed, Rekey)
    again = list(rekey_outputs(replay, routed, planned(routed, written, reframe)[0]))
    assert len(first) == 6
    assert [(o.key, o.value, header_position(o.headers)) for o in again] == [
        (o.key, o.value, header_position(o.headers)) for o in first[3:]]  # fmt: skip


def test_a_topic_the_fan_out_does_not_know_takes_its_next_changes_key_schema() -> None:
    fan = FanOut(partitions=4)
    assert isinstance(fan.route(change("INSERT", 100, 0, k=1), offset=0), list)
    assert fan.frames == {TOPIC: key(1)[:5]}
    fan.frames.clear()
    assert isinstance(fan.route(Change("INSERT", "public", "customers", TOPIC, 200, 0, wide(1), None, row(1)), 1), list)
    _, rekey = rekeyed(3, op="DELETE")
    assert rekey.own == frozenset({wide(3)}) and rekey.outputs[0].value is None


def test_a_key_schema_changed_and_changed_back_moves_the_rows_back_and_resurrects_no_delete() -> None:
    """A (``key``) made B (``wide``), then A again: B's rows go back under A, a row deleted under B stays deleted,
    and the row the first re-key's own change wrote under B (its old key's tombstone came after it, for the same raw
    offset: that move took it away) goes back too."""
    topic = [(key(1), row(1), at(0)), (key(2), row(2), at(1)), (key(3), row(3), at(2)),
             (wide(3), row(3, "new"), (5, 0)),  # the first re-key's own change
             (key(1), None, (5, 2)), (wide(1), row(1), (5, 3)), (key(2), None, (5, 4)), (wide(2), row(2), (5, 5)),
             (key(3), None, (5, 6)), (wide(2), None, at(6))]  # fmt: skip
    fan = FanOut(partitions=4, frames={TOPIC: wide(0)[:5]})
    rekey = fan.route(Change("INSERT", "public", "customers", TOPIC, 700, 0, key(4), None, row(4)), 8)
    assert isinstance(rekey, Rekey)
    moves, stuck = planned(rekey, topic, lambda k: key(k[5] // 2))
    assert moves == [(wide(1), None), (key(1), row(1)), (wide(3), None), (key(3), row(3, "new"))] and not stuck


def test_of_two_old_keys_giving_one_new_key_the_newest_row_moves() -> None:
    topic = [(key(1), row(1, "older"), at(0)), (b"\0\0\0\0\x06\x02", row(1, "newer"), at(3))]
    _, rekey = rekeyed(7)
    moves, _ = planned(rekey, topic, lambda k: wide(1))
    assert moves == [(b"\0\0\0\0\x06\x02", None), (wide(1), row(1, "newer")), (key(1), None)]


def test_a_row_whose_record_does_not_say_its_position_moves_too() -> None:
    """A record without the ``hw.raw`` header (another writer's) is older than any that says, not lost."""
    _, rekey = rekeyed(7)
    moves, stuck = planned(rekey, [(key(1), row(1), None), (key(2), row(2), None), (wide(2), None, at(3))], reframe)
    assert moves == [(key(1), None), (wide(1), row(1)), (key(2), None)] and not stuck


def test_each_old_key_is_reframed_once_and_its_moves_follow_that_answer() -> None:
    asked: list[bytes] = []

    def once(old: bytes) -> bytes | None:  # a registry that stops answering after the first look
        asked.append(old)
        return wide(old[5] // 2) if asked.count(old) == 1 else None

    _, rekey = rekeyed(7)
    moves, stuck = planned(rekey, [(key(1), row(1), at(0)), (key(2), row(2), at(1))], once)
    assert moves == [(key(1), None), (wide(1), row(1)), (key(2), None), (wide(2), row(2))] and not stuck
    assert sorted(asked) == [key(1), key(2)]

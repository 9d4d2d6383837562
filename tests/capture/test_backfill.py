"""Backfills, the pure part: windows between watermarks, the visibility race, signals, predicates, progress."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest

from capture.backfill import (
    Backfill,
    Progress,
    Recent,
    Request,
    SignalError,
    Snapshot,
    Touch,
    Window,
    check_predicate,
    follows_or_equals,
    hashable,
    parse_signal,
    qualify,
    suspects,
    vouches,
)

pytestmark = pytest.mark.unit
T = ("public", "hot")
KEY_FRAME, OTHER_FRAME, ROW_FRAME = b"\0\0\0\0\x07", b"\0\0\0\0\x09", b"\0\0\0\0\x08"


def key(n: int, frame: bytes = KEY_FRAME) -> bytes:
    return frame + bytes([n])


def values(image: bytes) -> list[Any]:
    """A key's value: its byte under ``KEY_FRAME``; tenths under ``OTHER_FRAME`` (as when a numeric's scale
    changed: the same bytes, another value)."""
    return [image[5] if image[:5] == KEY_FRAME else Decimal(image[5]) / 10]


def window(*keys: int, op: str = "READ") -> Window:
    return Window(1, T, "s:1", op, [(key(k), b"row%d" % k) for k in keys], values)


def no_old_key(before: bytes) -> bytes | None:
    raise AssertionError("not a full old row")


def test_a_streamed_change_to_a_key_in_the_window_drops_the_chunk_row() -> None:
    w = window(1, 2, 3, 4, 5)
    w.see("UPDATE", key(2), None, no_old_key)
    w.see("DELETE", key(3), None, no_old_key)  # deleted in the window: stays deleted
    w.see("INSERT", key(9), None, no_old_key)  # a key the chunk did not read: nothing to drop
    assert [k for k, _ in w.result()] == [key(1), key(4), key(5)] and w.read == 5


def test_a_key_under_another_key_schema_id_drops_the_row_of_its_value_not_of_its_bytes() -> None:
    """A key column's type changed while the chunk was read: 1.0 under the new key schema is row 1's key (other
    bytes), 0.2 is no row's (row 2's bytes)."""
    w = window(1, 2, 3)
    w.see("UPDATE", key(10, OTHER_FRAME), None, no_old_key)
    w.see("DELETE", key(2, OTHER_FRAME), None, no_old_key)
    assert [k for k, _ in w.result()] == [key(2), key(3)]
    widened = Window(1, T, "s:1", "READ", [(key(k), b"r") for k in (1, 2)], lambda image: [image[5]])
    widened.see("UPDATE", key(1, OTHER_FRAME), None, no_old_key)  # int made bigint: the same bytes, the same key
    assert [k for k, _ in widened.result()] == [key(2)]


def test_keys_framed_as_every_touched_key_are_compared_by_their_bytes_and_not_decoded() -> None:
    def undecodable(image: bytes) -> list[Any]:
        raise AssertionError(f"decoded {image!r}")

    w = Window(1, T, "s:6", "DELETE", [(key(1), b""), (key(2), b""), (None, b"")], undecodable)
    w.see("INSERT", key(2), None, no_old_key)
    assert w.result() == [(key(1), b""), (None, b"")]


def test_decoded_keys_are_made_hashable_arrays_and_intervals_too() -> None:
    assert hashable([1, [2, [3]], {"months": 1, "days": 2}]) == (1, (2, (3,)), (("months", 1), ("days", 2)))
    assert hashable([Decimal("1.50")]) == hashable([Decimal("1.500")])


def test_a_retraction_batch_of_keys_under_two_key_schema_ids_compares_each_by_its_value() -> None:
    """The raw topic's keys of a table whose key changed come framed both ways: a streamed change takes out the
    DELETEs of its own key (by value), not of another key with its bytes."""
    deletes = [(key(1), b""), (key(3), b""), (key(30), b""), (key(30, OTHER_FRAME), b"")]
    w = Window(1, T, "s:5", "DELETE", deletes, values)
    w.see("INSERT", key(30, OTHER_FRAME), None, no_old_key)  # 3.0: key 3 (under the old id) is it, key 30 is not
    assert w.result() == [(key(1), b""), (key(30), b"")]


def test_an_update_that_moves_a_key_drops_the_old_key_too() -> None:
    w = window(1, 2, 3)
    w.see("UPDATE", key(7), key(1), no_old_key)  # old key image (same key schema): key 1 became 7
    full_rows = {ROW_FRAME + b"old-2": key(2)}
    w.see("UPDATE", key(8), ROW_FRAME + b"old-2", lambda before: full_rows[before])  # REPLICA IDENTITY FULL
    assert [k for k, _ in w.result()] == [key(3)]


def test_in_the_json_format_an_old_row_is_always_read_for_its_key() -> None:
    """JSON images carry no schema id: a key image and a full old row look alike, so the old key is taken
    from ``before`` either way."""
    w = Window(1, T, "s:3", "READ", [(b'{"id":1}', b"r1"), (b'{"id":2}', b"r2")], None, framed=False)
    w.see("UPDATE", b'{"id":9}', b'{"id":1,"v":"old"}', lambda before: b'{"id":1}' if b'"id":1' in before else None)
    assert w.result() == [(b'{"id":2}', b"r2")]


def test_a_truncate_in_the_window_drops_every_row() -> None:
    w = Window(1, T, "s:1", "READ", [(key(1), b"row1"), (None, b"unkeyed"), (key(2), b"row2")], values)
    w.see("TRUNCATE", None, None, no_old_key)
    assert w.result() == []


def test_the_stream_may_change_keys_before_the_chunk_is_read() -> None:
    """A chunk is read while the stream goes on: a change between the watermarks may come through before the
    read's rows are in the window; it drops them all the same."""
    w = Window(1, T, "s:4", "READ", (), values)
    w.see("DELETE", key(2), None, no_old_key)
    w.fill([(key(1), b"row1"), (key(2), b"row2"), (None, b"unkeyed")])
    assert w.result() == [(key(1), b"row1"), (None, b"unkeyed")] and w.read == 3


def test_rows_without_key_are_kept_as_read() -> None:
    w = Window(1, T, "s:2", "READ", [(None, b"a"), (None, b"b")], values)
    w.see("UPDATE", None, None, no_old_key)
    assert w.result() == [(None, b"a"), (None, b"b")]


def test_snapshots_read_as_32_bit_xids_and_compare_across_wraparound() -> None:
    snap = Snapshot.parse(f"{2**32 + 100}:{2**32 + 110}:{2**32 + 101},{2**32 + 105}")
    assert (snap.xmin, snap.xmax, snap.xip) == (100, 110, frozenset({101, 105}))
    assert snap.invisible(101) and snap.invisible(110) and snap.invisible(4000) and not snap.invisible(104)
    assert follows_or_equals(3, 2**32 - 5) and not follows_or_equals(2**32 - 5, 3)
    assert Snapshot.parse("5:5:") == Snapshot(5, 5, frozenset())


def touched(*keys: int) -> Touch:
    return Touch({key(k) for k in keys})


def test_a_transaction_streamed_before_the_low_watermark_yet_invisible_to_the_read_is_a_suspect() -> None:
    """Its changes are on the topic before the chunk, and the chunk read the rows as they were before it: the
    keys it changed are dropped from the chunk."""
    recent = Recent(limit=3)
    for xid, touch in [(90, touched(1)), (91, None), (95, touched(2, 3))]:
        recent.commit(xid, touch)
    low = recent.seq + 1  # the low watermark's commit
    recent.commit(99, None)
    recent.commit(96, touched(4))  # after the low watermark: the window's own business
    assert suspects(recent, low, Snapshot.parse("92:97:96")) == []
    assert suspects(recent, low, Snapshot.parse("90:97:95,96")) == [touched(2, 3)]  # 95 streamed, yet not seen
    assert suspects(recent, low, Snapshot.parse("90:95:96")) == [touched(2, 3)]  # 95 at or past xmax: not seen
    for xid in range(200, 210):
        recent.commit(xid, touched(xid))
    assert len(recent.xids) == 3 and min(recent.xids) == 207, "only the last few are kept"


def test_a_suspects_keys_leave_the_chunk() -> None:
    w = window(1, 2, 3, 4)
    w.touch.merge(touched(2))
    w.touch.merge(Touch())
    assert [k for k, _ in w.result()] == [key(1), key(3), key(4)]
    w.touch.merge(Touch(truncated=True))
    assert w.result() == []


def test_a_change_records_its_key_its_old_key_a_truncate_and_rows_without_key() -> None:
    touch = Touch()
    touch.add("UPDATE", key(7), key(1), True, no_old_key)
    touch.add("DELETE", key(3, OTHER_FRAME), None, True, no_old_key)
    assert touch == Touch({key(7), key(1), key(3, OTHER_FRAME)})
    touch.add("INSERT", None, None, True, no_old_key)
    touch.add("TRUNCATE", None, None, True, no_old_key)
    assert touch.unkeyed and touch.truncated


def test_a_chunk_written_forgets_the_commits_before_its_low_watermark_that_its_read_saw() -> None:
    """Every later read (a newer snapshot) sees them too: they can make no chunk after it suspect. One its read
    could not see (a commit still waiting, e.g. for a synchronous standby) stays a suspect of the next ones."""
    recent = Recent()
    for xid in (89, 90, 91):
        recent.commit(xid, touched(xid))
    recent.commit(92, None)  # the chunk's low watermark
    low = recent.seq
    recent.commit(93, touched(1))  # inside its window
    recent.prune(low, Snapshot.parse("89:93:89"))  # its read saw 90 and 91, not 89
    assert list(recent.xids) == [89, 93]
    assert suspects(recent, recent.seq + 1, Snapshot.parse("94:94:")) == []
    assert suspects(recent, recent.seq + 1, Snapshot.parse("89:95:89,93")) == [touched(89), touched(1)]


@pytest.mark.parametrize(
    ("kind", "data", "expected"),
    [
        ("execute-snapshot", '{"data-collections": ["public.orders", "items"], "type": "incremental"}',
         Request("snapshot", ("public.orders", "items"))),
        ("execute-snapshot", json.dumps({"data-collections": ["orders"], "additional-conditions": [
            {"data-collection": "orders", "filter": "id > 5"}]}), Request("snapshot", ("orders",), "id > 5")),
        ("execute-snapshot", '{"data-collections": ["orders"], "filter": "id < 3"}',
         Request("snapshot", ("orders",), "id < 3")),
        ("pause-snapshot", None, Request("pause")),
        ("resume-snapshot", "", Request("resume")),
        ("stop-snapshot", '{"data-collections": ["orders"]}', Request("cancel", ("orders",))),
    ],
)  # fmt: skip
def test_signal_rows_read_as_debezium_writes_them(kind: str, data: str | None, expected: Request) -> None:
    assert parse_signal(kind, data) == expected


@pytest.mark.parametrize(
    ("kind", "data", "says"),
    [
        ("snapshot-now", None, "unknown signal type"),
        ("execute-snapshot", "{not json", "not JSON"),
        ("execute-snapshot", "[1]", "JSON object"),
        ("execute-snapshot", '{"data-collections": ["a"], "type": "blocking"}', "only incremental"),
        ("execute-snapshot", '{"data-collections": "a"}', "list of table names"),
        ("execute-snapshot", '{"data-collections": []}', "at least one table"),
        ("execute-snapshot", json.dumps({"data-collections": ["a", "b"], "additional-conditions": [
            {"data-collection": "a", "filter": "x"}, {"data-collection": "b", "filter": "y"}]}), "one filter"),
        ("execute-snapshot", json.dumps({"data-collections": ["a", "b"], "additional-conditions": [
            {"data-collection": "a", "filter": "x"}]}), "exactly the tables"),
        ("pause-snapshot", '{"filter": "x"}', "goes with a snapshot only"),
    ],
)  # fmt: skip
def test_bad_signals_are_refused_saying_what_to_fix(kind: str, data: str | None, says: str) -> None:
    with pytest.raises(SignalError, match=says):
        parse_signal(kind, data)


def test_table_names() -> None:
    assert qualify("orders") == ("public", "orders") and qualify('shop."Orders"') == ("shop", "Orders")
    for bad in ("", "a.b.c", ".x"):
        with pytest.raises(SignalError, match="not a table name"):
            qualify(bad)


@pytest.mark.parametrize(
    "predicate",
    ["id > 5", "status = 'a;b' AND note <> 'it''s (fine'", '"Odd;Name" IN (1, 2)', "body = $$x ) -- y$$",
     "(a OR b) AND (c)", "created > now() - interval '1 day'"],
)  # fmt: skip
def test_predicates_that_stay_inside_their_parentheses_pass(predicate: str) -> None:
    assert check_predicate(f"  {predicate} ") == predicate


@pytest.mark.parametrize(
    ("predicate", "says"),
    [
        ("", "empty"),
        ("true) OR (true", "parentheses"),
        ("(id > 5", "parentheses"),
        ("id > 5; DROP TABLE orders", "no ';'"),
        ("id > 5 -- and more", "comments"),
        ("id > 5 /* x */", "comments"),
        ("note = 'open", "unterminated"),
        ('"col = 1', "unterminated"),
    ],
)
def test_predicates_that_could_escape_are_refused(predicate: str, says: str) -> None:
    with pytest.raises(SignalError, match=says):
        check_predicate(predicate)


def test_requests_say_what_is_missing() -> None:
    with pytest.raises(SignalError, match="at least one table"):
        Request("snapshot")
    with pytest.raises(SignalError, match="unknown action"):
        Request("restart", ("a",))


def test_progress_rate_and_eta() -> None:
    b = Backfill(3, "public.orders", "id > 5", status="running", estimate=1000)
    b.begin(now=100.0)
    b.rows = 250
    assert b.rate(now=110.0) == 25.0 and b.eta(25.0) == 30.0
    progress = Progress.of(b, now=110.0)
    assert (progress.rows, progress.rate, progress.eta, progress.table) == (250, 25.0, 30.0, "public.orders")
    line = b.describe(rate=25.0)
    assert line.startswith("#3 public.orders where id > 5: running, 250/~1000 rows, 25 rows/s, ETA 30 s")
    b.status = "paused"
    assert b.eta(25.0) is None and "rows/s" not in b.describe(rate=25.0)
    assert Backfill(4, "public.x").describe() == "#4 public.x: queued (request)"
    b.status, b.rows, b.started_at, b.finished_at = "done", 444, 1.0, 1.5
    assert b.describe().startswith("#3 public.orders where id > 5: done, 444 rows, in 0.5 s")  # no guess once counted


def test_a_chunk_vouches_for_its_keys_only_if_no_change_streamed_before_them_can_be_unseen() -> None:
    """The retraction skips keys a chunk read only when the chunk's read saw every transaction begun before the
    table was watched, deletes and truncates are published, and the race check forgot no commit."""
    recent = Recent(limit=2)

    def read(xmin: int) -> Snapshot:
        return Snapshot(xmin, (xmin + 5) & 0xFFFFFFFF, frozenset())

    assert vouches(100, recent, read(100)) and vouches(100, recent, read(150))
    assert not vouches(100, recent, read(99))  # a transaction begun before the watch may commit unseen
    assert not vouches(None, recent, read(150))  # the publication does not carry deletes or truncates
    assert vouches(0xFFFFFFF0, recent, read(5))  # xids wrap around
    for xid in (1, 2, 3):
        recent.commit(xid, Touch())
    assert recent.full and not vouches(100, recent, read(150))

"""Backfills, the pure part: windows between watermarks, the visibility race, signals, predicates, progress."""

from __future__ import annotations

import json

import pytest

from capture.backfill import (
    Backfill,
    Progress,
    Recent,
    Request,
    SignalError,
    Snapshot,
    Window,
    check_predicate,
    follows_or_equals,
    parse_signal,
    qualify,
    suspect,
)
from tables.wire import body

pytestmark = pytest.mark.unit
T = ("public", "hot")
KEY_FRAME, OTHER_FRAME, ROW_FRAME = b"\0\0\0\0\x07", b"\0\0\0\0\x09", b"\0\0\0\0\x08"


def key(n: int, frame: bytes = KEY_FRAME) -> bytes:
    return frame + bytes([n])


def window(*keys: int) -> Window:
    return Window(1, T, "s:1", "READ", [(key(k), b"row%d" % k) for k in keys], body)


def no_old_key(before: bytes) -> bytes | None:
    raise AssertionError("not a full old row")


def test_a_streamed_change_to_a_key_in_the_window_drops_the_chunk_row() -> None:
    w = window(1, 2, 3, 4, 5)
    w.see("UPDATE", key(2), None, no_old_key)
    w.see("DELETE", key(3), None, no_old_key)  # deleted in the window: stays deleted
    w.see("INSERT", key(9), None, no_old_key)  # a key the chunk did not read: nothing to drop
    w.see("UPDATE", key(1, OTHER_FRAME), None, no_old_key)  # the same key under a newer key schema id
    assert [k for k, _ in w.result()] == [key(4), key(5)] and w.read == 5


def test_an_update_that_moves_a_key_drops_the_old_key_too() -> None:
    w = window(1, 2, 3)
    w.see("UPDATE", key(7), key(1), no_old_key)  # old key image (same key schema): key 1 became 7
    full_rows = {ROW_FRAME + b"old-2": key(2)}
    w.see("UPDATE", key(8), ROW_FRAME + b"old-2", lambda before: full_rows[before])  # REPLICA IDENTITY FULL
    assert [k for k, _ in w.result()] == [key(3)]


def test_in_the_json_format_an_old_row_is_always_read_for_its_key() -> None:
    """JSON images carry no schema id: a key image and a full old row look alike, so the old key is taken
    from ``before`` either way."""
    w = Window(1, T, "s:3", "READ", [(b'{"id":1}', b"r1"), (b'{"id":2}', b"r2")], lambda k: k, framed=False)
    w.see("UPDATE", b'{"id":9}', b'{"id":1,"v":"old"}', lambda before: b'{"id":1}' if b'"id":1' in before else None)
    assert w.result() == [(b'{"id":2}', b"r2")]


def test_a_truncate_in_the_window_drops_every_row() -> None:
    w = window(1, 2)
    w.unkeyed.append((None, b"unkeyed"))
    w.see("TRUNCATE", None, None, no_old_key)
    assert w.result() == []


def test_rows_without_key_are_kept_as_read() -> None:
    w = Window(1, T, "s:2", "READ", [(None, b"a"), (None, b"b")], body)
    w.see("UPDATE", None, None, no_old_key)
    assert w.result() == [(None, b"a"), (None, b"b")]


def test_snapshots_read_as_32_bit_xids_and_compare_across_wraparound() -> None:
    snap = Snapshot.parse(f"{2**32 + 100}:{2**32 + 110}:{2**32 + 101},{2**32 + 105}")
    assert (snap.xmin, snap.xmax, snap.xip) == (100, 110, frozenset({101, 105}))
    assert snap.invisible(101) and snap.invisible(110) and snap.invisible(4000) and not snap.invisible(104)
    assert follows_or_equals(3, 2**32 - 5) and not follows_or_equals(2**32 - 5, 3)
    assert Snapshot.parse("5:5:") == Snapshot(5, 5, frozenset())


def test_a_transaction_streamed_before_the_low_watermark_yet_invisible_to_the_read_makes_it_suspect() -> None:
    recent = Recent(limit=3)
    for xid, touched in [(90, True), (91, False), (95, True)]:
        recent.commit(xid, touched)
    low = recent.seq + 1  # the low watermark's commit
    recent.commit(99, False)
    recent.commit(96, True)  # after the low watermark: the window's own business
    assert not suspect(recent, low, Snapshot.parse("92:97:96"))
    assert suspect(recent, low, Snapshot.parse("90:97:95,96"))  # 95 streamed, but the read could not see it
    assert suspect(recent, low, Snapshot.parse("90:95:96"))  # 95 at or past xmax: not visible either
    for xid in range(200, 210):
        recent.commit(xid, True)
    assert len(recent.xids) == 3 and min(recent.xids) == 207, "only the last few are kept"


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

"""A stream's offsets: their JSON, starting offsets, bounded batches and the cut a view's batch ends at (pure)."""

from __future__ import annotations

import json

import pytest

from analytics.offsets import NO_CUT, CutAt, Position, Start, admit, at_cut, backlog, next_cut, parse_start
from tables.errors import HeadwaterError

pytestmark = pytest.mark.unit


def test_positions_are_sparks_kafka_offsets_and_read_back_the_same() -> None:
    at = Position("p.orders", {10: 5, 2: 7})
    assert json.dumps(at.encode()) == '{"p.orders": {"2": 7, "10": 5}}'  # partitions in order: Spark compares text
    assert Position.decode(json.loads(json.dumps(at.encode())), "p.orders", view=False) == at
    view = Position("p.views.v", {0: 3}, CutAt(0x1A7A908, {0: 3}, 12))
    assert view.encode() == {"p.views.v": {"0": 3}, "cut": {"lsn": "0/1A7A908", "commit_lsn": 0x1A7A908, "next": 12}}
    assert Position.decode(view.encode(), "p.views.v", view=True) == view
    with pytest.raises(HeadwaterError, match="checkpointLocation"):
        Position.decode(at.encode(), "p.customers", view=False)


def test_starting_offsets_earliest_latest_per_partition_and_a_views_lsn() -> None:
    assert parse_start(None, "t", view=False) == Start("earliest")
    assert parse_start("LATEST", "t", view=False) == Start("latest")
    assert parse_start('{"t": {"0": 23, "1": -2}}', "t", view=False) == Start("partitions", {0: 23, 1: -2})
    assert parse_start("0/1A7A908", "v", view=True) == Start("lsn", lsn=0x1A7A908)
    for text in ('{"u": {"0": 1}}', '{"t": {"0": -3}}', "[1]", "soon", '{"t": {"x": 1}}'):
        with pytest.raises(HeadwaterError, match=r'-1: latest'):
            parse_start(text, "t", view=False)
    with pytest.raises(HeadwaterError, match="a view is read cut by cut"):
        parse_start('{"v": {"0": 1}}', "v", view=True)


def test_a_bound_is_shared_by_backlog_and_always_moves() -> None:
    assert admit({0: 0, 1: 0}, {0: 50, 1: 10}, None) == {0: 50, 1: 10}
    assert admit({0: 0, 1: 0}, {0: 50, 1: 10}, 100) == {0: 50, 1: 10}
    assert admit({0: 0, 1: 0, 2: 0}, {0: 200, 1: 200, 2: 200}, 100) == {0: 34, 1: 33, 2: 33}
    assert admit({0: 10, 1: 0}, {0: 90, 1: 20}, 10) == {0: 18, 1: 2}  # 80:20 of the backlog
    assert admit({0: 5, 1: 5}, {0: 6, 1: 6}, 1) == {0: 6, 1: 5}  # a bound below the partitions' count
    assert admit({0: 5}, {0: 5, 1: 3}, 1) == {0: 5, 1: 1}  # a new partition counts from 0
    assert admit({0: 9, 3: 4}, {0: 7}, 5) == {0: 9, 3: 4}  # never backwards; a partition not listed stays
    assert backlog({0: 5}, {0: 9, 1: 2}) == 6


def test_a_views_batch_ends_at_the_newest_cut_within_the_bound_else_at_the_next_cut() -> None:
    cuts = [CutAt(100, {0: 10, 1: 4}, 1), CutAt(200, {0: 12, 1: 9}, 2), CutAt(300, {0: 40, 1: 9}, 3)]
    start = Position("v", {0: 0, 1: 0}, NO_CUT)
    assert next_cut(start, cuts, None) == cuts[2]
    assert next_cut(start, cuts, 21) == cuts[1]
    assert next_cut(start, cuts, 5) == cuts[0]  # over the bound: a batch still ends at a cut
    at = at_cut(start, cuts[1])
    assert at == Position("v", {0: 12, 1: 9}, CutAt(200, {0: 12, 1: 9}, 2))
    assert next_cut(at, list(reversed(cuts)), 1) == cuts[2]
    assert next_cut(at_cut(at, cuts[2]), cuts, None) is None
    assert at_cut(Position("v", {0: 3, 2: 8}, NO_CUT), CutAt(7, {0: 5}, 9)).offsets == {0: 5, 2: 8}

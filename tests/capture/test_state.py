"""Capture's state file: what a later version adds to a file an earlier one wrote, and backfills' progress."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest

from capture.state import State

EARLIER = """
CREATE TABLE checkpoint (
    slot TEXT PRIMARY KEY, consistent_point INTEGER NOT NULL, snapshot_done INTEGER NOT NULL,
    confirmed_lsn INTEGER NOT NULL, last_commit_lsn INTEGER NOT NULL DEFAULT 0,
    last_commit_time INTEGER NOT NULL DEFAULT 0, events INTEGER NOT NULL DEFAULT 0, rate REAL NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL
);
CREATE TABLE backfills (
    id INTEGER PRIMARY KEY AUTOINCREMENT, tbl TEXT NOT NULL, predicate TEXT, origin TEXT NOT NULL,
    status TEXT NOT NULL, phase TEXT NOT NULL, cursor TEXT, upto TEXT, rows_done INTEGER NOT NULL,
    rows_estimate INTEGER NOT NULL, retracted INTEGER NOT NULL, message TEXT NOT NULL, created_at REAL NOT NULL,
    started_at REAL, finished_at REAL, rate REAL NOT NULL DEFAULT 0, updated_at REAL NOT NULL DEFAULT 0
);
INSERT INTO backfills (tbl, origin, status, phase, cursor, rows_done, rows_estimate, retracted, message, created_at)
    VALUES ('public.t', 'request', 'running', 'chunks', '["41"]', 41, 100, 0, '', 1.0);
"""


@pytest.mark.unit
def test_a_state_file_of_an_earlier_version_gains_the_columns_and_keeps_its_backfills(tmp_path: Path) -> None:
    """A backfill saved by a version without ``dropped`` and ``keys_end`` goes on after an upgrade: its progress
    is read as it was, and the raw topic's end its retraction reads to is saved from then on."""
    (tmp_path / "state").mkdir(mode=0o700)
    earlier = sqlite3.connect(tmp_path / "state" / "s.sqlite")
    earlier.executescript(EARLIER)
    earlier.close()
    state = State(tmp_path / "state", "s")
    try:
        [backfill] = state.backfills(unfinished=True)
        assert (backfill.cursor, backfill.rows, backfill.dropped, backfill.keys_end) == (["41"], 41, 0, None)
        assert backfill.vouched is None  # not known: a restart looks its rows' keys up
        backfill.keys_end = 1_028_129
        with state.db:
            state.save_backfill(backfill)
        assert state.backfills()[0].keys_end == 1_028_129
        assert state.load() is None  # the checkpoint table gained ``settled`` too: it is read without error
    finally:
        state.close()


@pytest.mark.unit
def test_a_backfill_that_stopped_vouching_stays_so_whatever_copy_is_saved_later(tmp_path: Path) -> None:
    """``unvouch`` is committed before a chunk's rows are written; a copy of the backfill taken before it and saved
    once Kafka acknowledged its chunk does not make it vouched again."""
    state = State(tmp_path / "state", "s")
    try:
        backfill = state.add_backfill("public.t", None, "request")
        backfill.vouched, backfill.keys_end = True, 10
        with state.db:
            state.save_backfill(backfill)
        assert state.backfills()[0].vouched is True
        earlier = dataclasses.replace(backfill)
        state.unvouch(backfill.id)
        with state.db:
            state.save_backfill(earlier)
        assert state.backfills()[0].vouched is False
        assert state.db.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL again after the synced commit
        others = [state.add_backfill(table, None, "request") for table in ("public.u", "public.t", "public.u")]
        assert [b.id for b in state.backfills(table="public.t", limit=1)] == [backfill.id, others[1].id]
    finally:
        state.close()

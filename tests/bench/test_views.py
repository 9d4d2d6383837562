"""The views benchmark's latency arithmetic, as a pure function, and its look at the broker's CPU."""

from __future__ import annotations

import os
import time

import pytest

from bench import views
from bench.views import STAGES, Sample, Seen, broker_shares, latencies, stage_lines, until_shown

pytestmark = pytest.mark.unit


def seen_at(times: dict[str, float]) -> Seen:
    seen = Seen()
    seen.at.update(times)
    return seen


def test_an_overwritten_commit_counts_until_its_successor_shows() -> None:
    committed = {"a1": (0.0, 1), "a2": (0.1, 1), "a3": (0.2, 1), "b1": (0.05, 2)}
    seen = seen_at({"a2": 0.5, "a3": 0.4, "b1": 0.15})  # a1 never shown: a2 showed a state past it
    assert latencies(committed, seen) == (pytest.approx([100.0, 200.0, 400.0]), 1)
    shown, _ = until_shown(committed, seen)
    # a1: first of a2/a3 shown at 0.4 -> 400 ms; a2: 0.4 (a3 came first) -> 300 ms; a3: 200 ms; b1: 100 ms
    assert shown == pytest.approx([100.0, 200.0, 300.0, 400.0])


def test_a_commit_nothing_after_showed_is_not_timed() -> None:
    assert until_shown({"a1": (0.0, 1), "a2": (0.1, 1)}, seen_at({"a1": 0.3})) == (pytest.approx([300.0]), 0)


def test_a_hidden_workers_stages_are_left_out() -> None:
    """A worker restarted by a fault counts from 0 again: its lines are left out, the others' kept."""
    stage = next(iter(STAGES))
    counts = {stage: 100.0, f"{stage}_busy": 2.0, f"{stage}_cpu": 1.0}
    before = Sample(0.0, {}, [{}, {}, {}])
    after = Sample(10.0, {}, [counts, counts, counts])
    shown = stage_lines(before, after, hidden={1: 3.5})
    assert [line.split(":")[0].strip() for line in shown] == [f"worker 0 {stage}", f"worker 2 {stage}"]
    assert "capacity      50/s" in shown[0] and "100/CPU-s" in shown[0]


def test_the_broker_share_is_taken_each_interval_of_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process busy on one core for the whole block shows a good share of a core in every interval (not all of one:
    the test suite runs beside other work on the machine's cores)."""
    monkeypatch.setattr(views, "BROKER_EVERY", 0.2)
    with broker_shares(os.getpid()) as shares:
        until = time.monotonic() + 0.9
        while time.monotonic() < until:
            pass
    assert 3 <= len(shares) <= 4  # 0.2, 0.4, 0.6, 0.8 s (the last may come after the block ended on a busy machine)
    assert all(0.2 < share <= 1.5 for share in shares), shares


def test_no_broker_process_gives_no_shares() -> None:
    with broker_shares(None) as shares:
        pass
    assert shares == []

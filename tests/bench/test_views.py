"""The views benchmark's latency arithmetic, as a pure function, and its look at the broker's CPU."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest

from bench import views
from bench.views import (
    STAGES,
    Phase,
    Sample,
    Seen,
    broker_line,
    broker_shares,
    latencies,
    ratio_lines,
    stage_lines,
    until_shown,
)
from tables.config import check_prefix

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


def test_each_workers_views_are_set_against_the_one_fan_out() -> None:
    """Two workers: the fan-out runs on the raw partition's owner only; each worker's views per CPU-second are
    divided by its changes per CPU-second."""
    owner = {"fanout": 1000.0, "fanout_cpu": 0.02, "views": 1000.0, "views_cpu": 0.08}
    other = {"views": 1000.0, "views_cpu": 0.05}
    phase = Phase({}, Sample(0.0, {}, [{}, {}]), Sample(1.0, {}, [owner, other]))
    assert ratio_lines(phase) == ["    worker 0 views / fan-out, changes per CPU-s: 0.25",
                                  "    worker 1 views / fan-out, changes per CPU-s: 0.40"]


def scripted_samples(monkeypatch: pytest.MonkeyPatch, fanouts: list[float]) -> None:
    """``views.sample`` gives a worker whose fan-out counter goes through ``fanouts`` (then stays), at once."""
    left = iter(fanouts)
    last = [0.0]

    def sample(*_: object) -> Sample:  # the mirror's CPU moves at idle too
        last[0] = next(left, last[0])
        return Sample(time.monotonic(), {}, [{"fanout": last[0], "mirror_cpu": time.monotonic()}])

    monkeypatch.setattr(views, "sample", sample)
    monkeypatch.setattr(views.time, "sleep", lambda _: None)


def test_a_drain_is_done_once_the_fan_out_routed_it_all_and_nothing_moved(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fan-out stands still a while before its last batch is counted: that pause is not the end."""
    scripted_samples(monkeypatch, [10, 50, 50, 50, 90, 110, 110])
    done = views.settled(Sample(0.0, {}, [{"fanout": 10.0}]), {}, 1, {}, changes=100)
    assert done.counters[0]["fanout"] == 110.0


def test_a_drain_never_done_says_how_far_the_fan_out_got(monkeypatch: pytest.MonkeyPatch) -> None:
    scripted_samples(monkeypatch, [10, 50])
    with pytest.raises(RuntimeError, match="routed 40 of 100 changes"):
        views.settled(Sample(0.0, {}, [{"fanout": 10.0}]), {}, 1, {}, changes=100, timeout=0.05)


def test_no_fan_out_gives_no_ratio() -> None:
    phase = Phase({}, Sample(0.0, {}, [{}]), Sample(1.0, {}, [{"views": 10.0, "views_cpu": 0.1}]))
    assert ratio_lines(phase) == []


def scripted(values: list[float]) -> Callable[..., float]:
    """A reading that gives ``values`` in turn, then raises ``OSError`` (the process ended)."""
    left = iter(values)

    def read(*_: object) -> float:
        try:
            return next(left)
        except StopIteration:
            raise OSError("no such process") from None

    return read


def shares_until(pid: int | None, read: Callable[..., float], clock: Callable[[], float], count: int,
                 within: float = 5.0) -> list[float]:  # fmt: skip
    """``broker_shares`` over a block that lasts until ``count`` shares came or ``within`` seconds passed."""
    with broker_shares(pid, read, clock) as shares:
        deadline = time.monotonic() + within
        while len(shares) < count and time.monotonic() < deadline:
            time.sleep(0.001)
    return list(shares)


def test_each_share_is_the_cpu_over_the_time_that_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A look that came late divides by the time that passed, not by the interval it was due after."""
    monkeypatch.setattr(views, "BROKER_EVERY", 0.001)
    asked: list[object] = []
    cpu = scripted([10.0, 10.5, 12.0])

    def read(pid: object) -> float:
        asked.append(pid)
        return cpu()

    shares = shares_until(4242, read, scripted([100.0, 101.0, 103.0]), 2)
    assert shares == pytest.approx([0.5, 0.75])
    assert set(asked) == {4242}


def test_the_looks_stop_when_the_broker_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(views, "BROKER_EVERY", 0.001)
    shares = shares_until(4242, scripted([1.0, 1.5]), scripted([0.0, 1.0, 2.0, 3.0]), 5, within=0.3)
    assert shares == pytest.approx([0.5])  # the third reading found no process: no share, no error


def test_no_broker_process_gives_no_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(views, "BROKER_EVERY", 0.001)
    assert shares_until(None, scripted([1.0, 2.0, 3.0]), scripted([0.0, 1.0, 2.0]), 1, within=0.3) == []


def test_the_shares_are_printed_in_order_with_two_decimals() -> None:
    assert broker_line([0.314, 0.5]) == "  the broker's share of a core, each 10 s of the load: 0.31 0.50"


def test_a_run_on_a_kafka_of_your_own_has_a_prefix_of_its_own_and_says_its_profile() -> None:
    prefix = views.run_prefix("127.0.0.1:9092", clock=lambda: 1_764_500_000.5)
    assert prefix == f"hwbench-1764500000-{os.getpid()}"
    check_prefix("topic_prefix", prefix)
    where = views.Where("b", "r", "u", prefix)
    assert (where.raw, where.topic) == (f"{prefix}.changes", f"{prefix}.views.orders_enriched")
    assert views.run_prefix("") == views.PREFIX  # the bench stack's broker, made afresh
    footer = views.profile_text("kafka")
    assert "kafka profile (linger 5 ms)" in footer and "tansu" not in footer
    assert "tansu profile (linger 50 ms)" in views.profile_text("tansu")

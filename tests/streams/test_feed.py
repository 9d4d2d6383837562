"""The feeds' retry loop: a stalled reader is replaced at once, other failures pause, and the pause
grows only while nothing is read."""

from __future__ import annotations

import time

import pytest

from streams.feed import Follower
from tables.errors import FatalError
from tables.kafka import Stalled

pytestmark = pytest.mark.unit


class Script(Follower):
    """A follower whose runs do what ``steps`` say: 'stall', 'fail', 'read+fail' or 'stop'."""

    def __init__(self, steps: list[str]) -> None:
        self.fatal: list[FatalError] = []
        super().__init__("script", self.fatal.append)
        self.steps = steps
        self.starts: list[float] = []

    def _follow(self) -> None:
        self.starts.append(time.monotonic())
        step = self.steps.pop(0)
        if step == "stop":
            self.stopping.set()
        elif step == "stall":
            raise Stalled("reading [('t', 0)] stalled below the known end")
        else:
            self.progressed = step.startswith("read")
            raise RuntimeError("broker hiccup")


def gaps(steps: list[str]) -> list[float]:
    follower = Script(steps)
    follower.run()
    return [b - a for a, b in zip(follower.starts, follower.starts[1:], strict=False)]


def test_a_stalled_reader_is_replaced_without_a_pause() -> None:
    assert all(gap < 0.5 for gap in gaps(["stall", "stall", "stall", "stop"]))


def test_the_pause_doubles_while_nothing_is_read_and_starts_again_after_a_read() -> None:
    first, second, third = gaps(["fail", "fail", "read+fail", "stop"])
    assert 0.9 < first < 1.5 and 1.9 < second < 2.5  # 1 s, then 2 s: nothing read
    assert 0.9 < third < 1.5  # the run read something before failing: back to 1 s

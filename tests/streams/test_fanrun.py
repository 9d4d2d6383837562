"""The fan-out's runtime without its host: what it says of its progress."""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import pytest

from streams.config import load_streams_config
from streams.fanout import FanOut
from streams.fanrun import FanOutRun

pytestmark = pytest.mark.unit


def test_the_progress_line_after_a_resume_counts_from_the_new_counters(caplog: pytest.LogCaptureFixture) -> None:
    run = FanOutRun(load_streams_config({"HEADWATER_STREAMS_TOPIC_PREFIX": "p"}), cast(Any, None), cast(Any, None), ())
    run.fanout = FanOut(4)  # a resume loaded the fan-out again: its counters start at 0
    run.fanout.counters.changes = 200
    run.reported = (time.monotonic() - 20.0, 189_708)  # the last line, of the counters before the resume
    with caplog.at_level(logging.INFO, logger="headwater.streams"):
        run.report(202_959)
    (line,) = [r.getMessage() for r in caplog.records if "fan-out at raw offset 202959" in r.getMessage()]
    rate = float(line.split(": ", 1)[1].split(" changes/s")[0])
    assert 0 < rate <= 10.5, line

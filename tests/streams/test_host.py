"""The worker's Faust host: how the process around the engine ends."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.plugins.capture import Capture
from tests.plugins.streams import Worker
from tests.streams.test_metrics import captured


@pytest.mark.slow
def test_faust_s_own_stop_is_cut_short_stop_timeout_after_the_engine_closed(
    shop_db: Any, pg_database: str, capture_factory: Callable[..., Capture], worker_factory: Callable[..., Worker]
) -> None:
    """Faust's own stop after the engine closed takes at least a second (its worker's sentinel sleep), so a
    0.2 s bound always ends the process early: with 0, after the engine's stop line, saying why."""
    capture = captured(pg_database, capture_factory)
    worker = worker_factory(capture.cfg.topic_prefix, stop_timeout=0.2).start()
    assert worker.process is not None
    worker.process.send_signal(signal.SIGTERM)
    began = time.monotonic()
    assert worker.process.wait(timeout=60) == 0, worker.tail()
    lines = worker.log.read_text().splitlines()
    stopped = next(i for i, line in enumerate(lines) if "streams worker stopped: its readers and stores" in line)
    cut = [i for i, line in enumerate(lines) if re.search(r"WARNING .*did not end within 0.2 s.*exiting with 0", line)]
    assert cut and cut[0] > stopped, worker.tail()
    assert not any("Closing event loop" in line for line in lines[stopped:]), "Faust's stop ended on its own"
    assert time.monotonic() - began < 30

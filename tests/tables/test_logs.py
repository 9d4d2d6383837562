"""Headwater's log lines: the level and format chosen, the JSON and text formats, episodes, librdkafka's lines."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Iterator

import pytest

from tables import logs
from tables.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.fixture
def logger() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    """A logger of its own writing to a buffer (the root logger is left to pytest)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log = logging.getLogger("headwater.test-logs")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    yield log, out, handler
    log.removeHandler(handler)


def test_options_flag_then_environment_then_default() -> None:
    env = {logs.LEVEL_ENV: "DEBUG", logs.FORMAT_ENV: "json"}
    assert logs.log_options(None, None, {}) == logs.LogOptions("info", "text")
    assert logs.log_options(None, None, {}, default="warning").level == "warning"
    assert logs.log_options(None, None, env) == logs.LogOptions("debug", "json")
    assert logs.log_options("error", "text", env) == logs.LogOptions("error", "text")
    assert logs.LogOptions("warning").number == logging.WARNING


def test_bad_options_name_where_they_came_from() -> None:
    with pytest.raises(ConfigError, match=logs.LEVEL_ENV) as caught:
        logs.log_options(None, None, {logs.LEVEL_ENV: "loud"})
    assert caught.value.exit_code == 2
    with pytest.raises(ConfigError, match="--log-format"):
        logs.log_options(None, "xml", {})


def test_json_lines_carry_time_level_component_message_and_facts(logger: tuple) -> None:
    log, out, handler = logger
    logs.restyle(handler, "capture", logs.LogOptions("info", "json"))
    log.warning("slot %s behind", "s1", extra=logs.facts(slot="s1", table="public.orders", lsn=0x1A2B3C, offset=7))
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{"))
    assert first["level"] == "WARNING" and first["component"] == "capture" and first["message"] == "slot s1 behind"
    assert first["logger"] == "headwater.test-logs" and first["time"].endswith("Z") and "T" in first["time"]
    assert (first["slot"], first["table"], first["lsn"], first["offset"]) == ("s1", "public.orders", "0/1A2B3C", 7)
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exception"]


def test_text_lines_show_the_facts_after_the_message(logger: tuple) -> None:
    log, out, handler = logger
    logs.restyle(handler, "streams", logs.LogOptions())
    log.info("read", extra=logs.facts(topic="hw.changes", offset=12))
    log.info("plain")
    read, plain = out.getvalue().splitlines()
    assert read.endswith("INFO streams headwater.test-logs: read [topic=hw.changes offset=12]"), read
    assert plain.endswith("INFO streams headwater.test-logs: plain")


def test_facts_are_a_closed_list() -> None:
    assert logs.facts(table="t", lsn=None) == {"table": "t"}
    with pytest.raises(ValueError, match="FACTS"):
        logs.facts(colour="red")


def test_an_episode_is_said_once_when_it_begins_and_once_when_it_ends() -> None:
    episode = logs.Episode(after=5)
    said = [episode.update(bad, now) for bad, now in
            [(False, 0), (True, 1), (True, 3), (True, 6), (True, 7), (True, 30), (False, 31), (False, 32)]]  # fmt: skip
    assert said == [None, None, None, "began", None, None, "ended", None]
    assert episode.update(True, 40) is None and episode.update(False, 41) is None  # too short: never said
    instant = logs.Episode()
    assert instant.update(True, 0) == "began" and instant.lasted(4) == 4


def test_the_kafka_gate_counts_connection_failures_instead_of_logging_them(logger: tuple) -> None:
    log, out, _ = logger
    gate = logs.KafkaLogGate(loggers=(log.name,))
    log.addFilter(gate)
    log.setLevel(logging.INFO)
    try:
        for _ in range(3):
            log.error("FAIL [rdkafka#producer-1] 127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: "
                      "Connection refused (after 0ms in state CONNECT)")  # fmt: skip
        log.warning("CONFWARN [rdkafka#producer-1] Configuration property x is ignored")
    finally:
        log.removeFilter(gate)
    count, _, detail = gate.last()
    assert count == 3 and "Connection refused" in detail
    assert out.getvalue().splitlines() == ["CONFWARN [rdkafka#producer-1] Configuration property x is ignored"]


def test_an_episode_counts_from_when_it_began_if_that_is_known() -> None:
    """A broker found silent at 3 s that stopped answering at 0 s is announced at 5 s, not at 8 s."""
    episode = logs.Episode(after=5)
    assert episode.update(True, 3, since=0) is None and episode.lasted(3) == 3
    assert episode.update(True, 5, since=2) == "began"  # the first ``since`` holds for the episode
    assert episode.update(False, 6) == "ended"
    assert episode.update(True, 7, since=9) is None and episode.lasted(7) == 0  # never later than now


def test_a_client_set_up_for_another_listener_is_not_a_broker_away(logger: tuple) -> None:
    """librdkafka words a security.protocol, TLS or SASL mismatch with "Disconnected": the gate keeps those."""
    misconfigured = [
        "FAIL [rdkafka#producer-1] 127.0.0.1:9093/bootstrap: Disconnected while requesting ApiVersion: might be "
        "caused by incorrect security.protocol configuration (connecting to a SSL listener?) or broker version is "
        "< 0.10 (see api.version.request) (after 3ms in state APIVERSION_QUERY)",
        "FAIL [rdkafka#producer-1] 127.0.0.1:9092/bootstrap: SSL handshake failed: Disconnected: connecting to a "
        "PLAINTEXT broker listener? (after 4ms in state SSL_HANDSHAKE)",
        "FAIL [rdkafka#producer-1] 127.0.0.1:9092/bootstrap: Disconnected: verify that security.protocol is correctly "
        "configured, broker might require SASL authentication (after 310ms in state UP)",
    ]
    assert not any(logs.unreachable(text) for text in misconfigured)
    assert logs.unreachable("127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused")
    assert logs.unreachable("127.0.0.1:9092/1: Disconnected (after 12034ms in state UP)")
    assert logs.unreachable("127.0.0.1:9092/1: ApiVersionRequest failed: Local: Timed out: probably due to broker "
                            "version < 0.10 (see api.version.request configuration) (after 10005ms in state "
                            "APIVERSION_QUERY)"), "a paused broker, whatever librdkafka guesses"  # fmt: skip
    assert logs.unreachable("GETPID [rdkafka#producer-6] [thrd:main]: Failed to acquire idempotence PID from broker "
                            "127.0.0.1:56049/bootstrap: Local: Broker handle destroyed without termination: retrying"
                            ), "a producer made while the broker was paused"  # fmt: skip
    log, out, _ = logger
    gate = logs.KafkaLogGate(loggers=(log.name,))
    log.addFilter(gate)
    try:
        for line in misconfigured:
            log.error(line)
    finally:
        log.removeFilter(gate)
    assert out.getvalue().splitlines() == misconfigured and gate.last()[0] == 0


def test_the_gate_on_a_handler_takes_only_the_kafka_clients_lines(logger: tuple) -> None:
    """On Faust's handler: aiokafka's connection errors (one every 100 ms) and librdkafka's to DEBUG; a line
    of anything else that happens to say "timed out" keeps its level."""
    log, out, handler = logger
    gate = logs.KafkaLogGate()
    handler.addFilter(gate)
    try:
        logging.getLogger("aiokafka.conn").addHandler(handler)
        logging.getLogger("aiokafka.conn").propagate = False
        logging.getLogger("aiokafka.conn").error("Unable connect to node with id 1: [Errno 111] Connect call failed")
        log.error("lost the PostgreSQL connection: timed out")
    finally:
        handler.removeFilter(gate)
        logging.getLogger("aiokafka.conn").removeHandler(handler)
        logging.getLogger("aiokafka.conn").propagate = True
    assert out.getvalue().splitlines() == ["lost the PostgreSQL connection: timed out"]
    assert gate.last()[0] == 1 and "Connect call failed" in gate.last()[2]


@pytest.fixture
def root_kept() -> Iterator[None]:
    """The root logger's handlers and level (and the Kafka gate) as they were, after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger(logs.KAFKA_LOGGER).removeFilter(logs.KAFKA_GATE)


def test_setup_is_remembered_for_the_processes_it_starts(root_kept: None) -> None:
    """Capture's snapshot workers log as capture does: ``current()`` is what ``setup`` was given."""
    logs.setup("capture", logs.LogOptions("warning", "json"), stream=io.StringIO())
    assert logs.current() == ("capture", logs.LogOptions("warning", "json"))


def test_setup_writes_to_stderr_as_it_is_when_a_record_comes(root_kept: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that swaps ``sys.stderr`` (pytest, for each test) and closes the old one: a thread's later
    record goes to the new one, not to a closed file (CI printed "Logging error ... closed file")."""
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logs.setup("capture", logs.LogOptions("warning", "text"))
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    first.close()
    logging.getLogger("headwater.capture").warning("capture stopped (%s)", "asked to stop")
    assert "capture stopped (asked to stop)" in second.getvalue()

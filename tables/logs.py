"""Headwater's log lines: one format for capture, the stream workers and the registry.

Promise: ``setup(component, options)`` makes every log record of the process (Headwater's,
librdkafka's through ``headwater.kafka``, Faust's, aiohttp's) one line on stderr, in one of two
formats: ``text`` — ``<time> <LEVEL> <component> <logger>: <message> [fact=value ...]`` — or
``json``, one object per line with ``time`` (ISO-8601, UTC), ``level``, ``component``,
``logger``, ``message``, the facts a line carries (``FACTS``: table, LSN, topic, partition,
offset, ...) and ``exception`` when there is one. ``facts(...)`` builds a record's facts
(``extra=``), an LSN written as PostgreSQL writes it. The level and format come from
``--log-level`` / ``--log-format`` (``options``), else ``HEADWATER_LOG_LEVEL`` /
``HEADWATER_LOG_FORMAT``, else ``info`` and ``text``; a bad value is a ``ConfigError`` naming it.

``Episode`` is the pure core of "logged once when it begins and once when it ends": a
condition (a broker away, a slot behind, a cut not advancing) is announced when it has
lasted ``after`` seconds (counted from when it began, which the caller may know to be earlier
than its first look) and ended when it clears, never once per check. ``KafkaLogGate`` keeps
librdkafka's connection failures — repeated while a broker is away, each identical one at most
every 30 s — out of the log (at DEBUG), keeping the last for whoever announces the episode; a
failure that points at the client's settings (security protocol, TLS, SASL) is not a broker
away and keeps its level.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import IO, Any

from pythonjsonlogger.json import JsonFormatter

from tables.errors import ConfigError
from tables.wire import lsn_text

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
LEVEL_ENV, FORMAT_ENV = "HEADWATER_LOG_LEVEL", "HEADWATER_LOG_FORMAT"
# the facts a line may carry, in the order the text format shows them
FACTS = ("slot", "table", "lsn", "topic", "partition", "offset", "view", "seconds", "error")
KAFKA_LOGGER = "headwater.kafka"  # librdkafka's own lines (the clients' ``logger`` setting)


@dataclass(frozen=True)
class LogOptions:
    """The level and format a process logs with."""

    level: str = "info"
    format: str = "text"

    @property
    def number(self) -> int:
        return int(getattr(logging, self.level.upper()))


def log_options(level: str | None = None, fmt: str | None = None, environ: Mapping[str, str] | None = None,
                default: str = "info") -> LogOptions:  # fmt: skip
    """The flag's value, else the environment's, else the default; checked."""
    env = os.environ if environ is None else environ
    chosen = LogOptions(
        (level or env.get(LEVEL_ENV) or default).lower(), (fmt or env.get(FORMAT_ENV) or "text").lower()
    )
    if chosen.level not in LEVELS:
        where = "--log-level" if level else LEVEL_ENV
        raise ConfigError(f"{where}: unknown log level {chosen.level!r}", hint=f"use one of {', '.join(LEVELS)}")
    if chosen.format not in FORMATS:
        where = "--log-format" if fmt else FORMAT_ENV
        raise ConfigError(f"{where}: unknown log format {chosen.format!r}", hint="use text or json")
    return chosen


def facts(*, lsn: int | None = None, **known: Any) -> dict[str, Any]:
    """A record's facts for ``extra=``: those given (None left out), an LSN as ``0/1A2B3C``."""
    unknown = set(known) - set(FACTS)
    if unknown:
        raise ValueError(f"not a log fact: {sorted(unknown)} (add it to tables.logs.FACTS)")
    out = {k: v for k, v in known.items() if v is not None}
    if lsn is not None:
        out["lsn"] = lsn_text(lsn)
    return out


def iso_time(created: float) -> str:
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> <component> <logger>: <message> [fact=value ...]`` (and the traceback, if any)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(component)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return iso_time(record.created)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        shown = [f"{k}={getattr(record, k)}" for k in FACTS if getattr(record, k, None) is not None]
        return f"{line} [{' '.join(shown)}]" if shown else line


class JsonLineFormatter(JsonFormatter):
    """One JSON object per line: time, level, component, logger, message, the facts, exception."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(component)s %(name)s %(message)s",
                         rename_fields={"asctime": "time", "levelname": "level", "name": "logger",
                                        "exc_info": "exception"},
                         json_ensure_ascii=False)  # fmt: skip

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return iso_time(record.created)


class Component(logging.Filter):
    """Names the process's component on every record (``component`` in both formats)."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "component"):
            record.component = self.component
        return True


def formatter(options: LogOptions) -> logging.Formatter:
    return JsonLineFormatter() if options.format == "json" else TextFormatter()


_last_setup: list[tuple[str, LogOptions]] = []


def current() -> tuple[str, LogOptions] | None:
    """The component and options ``setup`` was last given in this process (a process it starts logs alike)."""
    return _last_setup[0] if _last_setup else None


class StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record comes, not as it was when the handler was made: a
    process that swaps it (a test runner capturing each test's output) never has a thread write to a closed one."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr


def setup(component: str, options: LogOptions, stream: IO[str] | None = None) -> logging.Handler:
    """Send every record of the process to ``stream`` (stderr) in ``options``' format and level."""
    _last_setup[:] = [(component, options)]
    handler = StderrHandler() if stream is None else logging.StreamHandler(stream)
    restyle(handler, component, options)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(options.number)
    logging.getLogger("httpx").setLevel(max(logging.WARNING, options.number))  # one line per request otherwise
    logging.getLogger(KAFKA_LOGGER).addFilter(KAFKA_GATE)
    return handler


def restyle(handler: logging.Handler, component: str, options: LogOptions) -> None:
    """Give an existing handler (Faust's) Headwater's format and component."""
    handler.setFormatter(formatter(options))
    for old in [f for f in handler.filters if isinstance(f, Component)]:
        handler.removeFilter(old)
    handler.addFilter(Component(component))


class Episode:
    """A condition that begins and ends: ``update`` says ``"began"`` once it has lasted ``after`` seconds,
    ``"ended"`` once it clears after that, and None otherwise (pure: the caller gives the time)."""

    def __init__(self, after: float = 0.0) -> None:
        self.after = after
        self.since: float | None = None
        self.announced = False

    def update(self, bad: bool, now: float, since: float | None = None) -> str | None:
        """``since``: when the condition began, if known to be before ``now`` (the first look)."""
        if bad:
            if self.since is None:
                self.since = now if since is None else min(since, now)
            if not self.announced and now - self.since >= self.after:
                self.announced = True
                return "began"
            return None
        ended = self.announced
        self.since, self.announced = None, False
        return "ended" if ended else None

    def lasted(self, now: float) -> float:
        """Seconds since the condition began (0 when it is not on)."""
        return 0.0 if self.since is None else now - self.since


# librdkafka's words for a broker it cannot reach or lost (its log lines and error_cb's messages; "Broker handle
# destroyed without termination": a request, such as an idempotent producer's PID, on a connection librdkafka
# gave up while the broker did not answer, retried: seen with the broker paused)
UNREACHABLE = ("connection refused", "connect to", "disconnected", "all broker connections are down",
               "timed out", "broker transport failure", "failed to resolve", "connection reset",
               "brokers are down", "broker handle destroyed")  # fmt: skip
# ... unless the words point at the client's own settings: "Disconnected while requesting ApiVersion: might
# be caused by incorrect security.protocol", "SSL handshake failed: Disconnected: connecting to a PLAINTEXT
# broker listener?", "verify that security.protocol is correctly configured, broker might require SASL"
MISCONFIGURED = ("security.protocol", "ssl", "sasl", "authenticat", "certificate", "api.version.request")
# Faust's client (aiokafka) words it its own way, at ERROR, every 100 ms while the broker is away
AIOKAFKA_UNREACHABLE = ("connect call failed", "unable to update metadata", "nodenotready", "coordinatornotavailable",
                        "kafkaconnectionerror", "connection refused", "connection reset", "not available")  # fmt: skip


def unreachable(text: str) -> bool:
    """The librdkafka message says a broker cannot be reached (not that something else failed, nor that the
    client's security settings do not match the broker's listener: that is logged as it comes)."""
    low = text.lower()
    if "local: timed out" in low:  # a broker that took the connection and never answered (paused, overloaded)
        return True
    return any(word in low for word in UNREACHABLE) and not any(word in low for word in MISCONFIGURED)


class KafkaLogGate(logging.Filter):
    """Turns the Kafka clients' connection-failure lines into a count (they repeat while a broker is away):
    the line goes to DEBUG, ``last()`` tells whoever announces the episode. It acts on the records of
    ``loggers`` (librdkafka's ``KAFKA_LOGGER`` and aiokafka, Faust's client, by default) and lets every
    other record through, so it can sit on a logger or on a handler."""

    def __init__(self, loggers: tuple[str, ...] = (KAFKA_LOGGER, "aiokafka")) -> None:
        super().__init__()
        self.loggers = loggers
        self.lock = threading.Lock()
        self.count = 0
        self.at = 0.0
        self.detail = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno <= logging.DEBUG or not self.noise(record):
            return True
        self.seen(record.getMessage())
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)

    def noise(self, record: logging.LogRecord) -> bool:
        if not any(record.name == name or record.name.startswith(name + ".") for name in self.loggers):
            return False
        if record.name.split(".", 1)[0] == "aiokafka":
            low = record.getMessage().lower()
            return any(word in low for word in AIOKAFKA_UNREACHABLE) and not any(w in low for w in MISCONFIGURED)
        return unreachable(record.getMessage())

    def seen(self, detail: str, now: float | None = None) -> None:
        """A connection failure (from a log line or an error callback), at ``now`` (monotonic)."""
        with self.lock:
            self.count += 1
            self.at = time.monotonic() if now is None else now
            self.detail = detail

    def last(self) -> tuple[int, float, str]:
        """(failures so far, monotonic time of the last one, its text)."""
        with self.lock:
            return self.count, self.at, self.detail


KAFKA_GATE = KafkaLogGate()  # one per process: every librdkafka client logs through headwater.kafka

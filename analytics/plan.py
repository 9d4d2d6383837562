"""What a read of a Headwater topic will do, fixed on the driver before any task runs.

Promise: ``Request.from_options`` turns the data source's options (over the
``[analytics]`` config and the local stack's defaults) into one validated request:
which topic (``topic``, ``table`` or ``view``), which mode (``changes``: every message;
``latest``: last value per key; a ``cut``: a view exactly at a published commit LSN),
with or without metadata columns. ``value_schema`` fetches the topic's newest value
schema; ``plan`` lists the topic's partitions and fixes each one's start and end offset
(true ends, found by fetching), one ``Slice`` per partition — split into ranges of at
most ``task_records`` messages in ``changes`` mode. ``find_cut`` picks the newest cut
of a view topic at or before a commit LSN. Errors name the topic and say what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition
from pyspark.sql.datasource import InputPartition

from analytics.config import AnalyticsConfig, load_analytics_config
from analytics.errors import SourceError, SourceUnavailable
from tables.errors import HeadwaterError, RetryableError
from tables.kafka import fetched_ends, read_on, reader
from tables.registry import Registry
from tables.topics import cuts_topic, table_topic, view_topic
from tables.views import decode_cut
from tables.wire import lsn_text, parse_lsn

MODES = ("changes", "latest")
READER_SETTINGS = {"fetch.wait.max.ms": 50, "queued.max.messages.kbytes": 65536}


@dataclass(frozen=True)
class Request:
    """One read, as the options asked for it."""

    topic: str
    mode: str
    cut: int | None  # a commit LSN (the newest cut at or before it); -1: the newest cut
    metadata: bool
    kafka: dict[str, Any] = field(compare=False, repr=False)  # may hold SASL secrets
    registry: str
    prefix: str
    task_records: int
    timeout: float
    view: str | None = None  # the view's name when the topic is a view's

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> Request:
        opts = {k.lower(): v for k, v in options.items()}
        cfg = _config(opts)
        prefix = opts.get("prefix", cfg.topic_prefix)
        topic = _topic(opts, prefix)
        cut = _cut(opts.get("cut"), topic)
        mode = opts.get("mode", "latest" if cut is not None else "changes").lower()
        if mode not in MODES:
            raise SourceError(f"unknown mode {mode!r}", topic=topic, hint=f"use one of: {', '.join(MODES)}")
        if cut is not None and mode != "latest":
            raise SourceError("a cut is a state: it reads in mode 'latest'", topic=topic,
                              hint="drop the mode option or set it to 'latest'")  # fmt: skip
        kafka: dict[str, Any] = {"bootstrap.servers": opts.get("bootstrap", cfg.bootstrap), **READER_SETTINGS}
        kafka.update(cfg.kafka)
        kafka.update({k[len("kafka.") :]: v for k, v in opts.items() if k.startswith("kafka.")})
        return cls(
            topic=topic, mode=mode, cut=cut, metadata=_flag(opts, "metadata", topic), kafka=kafka,
            registry=opts.get("registry", cfg.registry_url), prefix=prefix,
            task_records=number(opts, "task_records", cfg.task_records, topic),
            timeout=float(number(opts, "timeout", cfg.timeout, topic)), view=opts.get("view") or None,
        )  # fmt: skip

    @property
    def registry_hint(self) -> str:
        return f"start the schema registry at {self.registry} or pass the right URL as the 'registry' option"


def _config(opts: Mapping[str, str]) -> AnalyticsConfig:
    explicit = opts.get("config")
    if explicit is not None and not Path(explicit).is_file():
        raise SourceError(f"config file {explicit} does not exist", topic=opts.get("topic", "?"))
    return load_analytics_config(explicit)


def _topic(opts: Mapping[str, str], prefix: str) -> str:
    given = [k for k in ("topic", "table", "view") if opts.get(k)]
    if len(given) != 1:
        raise HeadwaterError(
            "the headwater data source reads one topic: set exactly one of the options topic, table or view",
            hint='e.g. .option("table", "public.orders") or .option("view", "orders_enriched")',
        )
    if "topic" in given:
        return opts["topic"]
    if "view" in given:
        return view_topic(prefix, opts["view"])
    schema, _, table = opts["table"].rpartition(".")
    return table_topic(prefix, schema or "public", table)


def _cut(text: str | None, topic: str) -> int | None:
    if text is None:
        return None
    if text.lower() == "latest":
        return -1
    try:
        return parse_lsn(text) if "/" in text else int(text)
    except ValueError:
        raise SourceError(f"cut {text!r} is not a commit LSN", topic=topic,
                          hint="give 'latest', an LSN like 0/1A7A908, or an LSN as an integer") from None  # fmt: skip


def _flag(opts: Mapping[str, str], name: str, topic: str) -> bool:
    text = opts.get(name, "false").lower()
    if text not in ("true", "false"):
        raise SourceError(f"option {name} must be true or false, got {text!r}", topic=topic)
    return text == "true"


def number(opts: Mapping[str, str], name: str, default: float, topic: str) -> int:
    """Option ``name`` as a whole number of at least 1 (``default`` when it is not given)."""
    try:
        value = int(float(opts.get(name, default)))
    except ValueError:
        raise SourceError(f"option {name} must be a number, got {opts[name]!r}", topic=topic) from None
    if value < 1:
        raise SourceError(f"option {name} must be at least 1, got {value}", topic=topic)
    return value


# ---- schemas ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ValueSchema:
    """The topic's newest value schema: records written with another id are resolved to it."""

    schema_id: int
    schema: dict[str, Any]


def value_schema(req: Request) -> ValueSchema:
    """The newest schema registered as ``<topic>-value`` (a missing topic or subject is a ``SourceError``)."""
    registry = Registry(req.registry)
    try:
        found = registry.latest(f"{req.topic}-value")
        by_record = [] if found else [s for s in registry.subjects() if s.startswith(f"{req.topic}-") and s not in
                                      (f"{req.topic}-key", f"{req.topic}-value")]  # fmt: skip
    except RetryableError as exc:
        raise SourceUnavailable(exc.message, topic=req.topic, hint=req.registry_hint) from exc
    if found is None:
        partitions(req)  # a topic Kafka does not have is the better message
        if by_record:  # TopicRecordNameStrategy: the raw topic with nested row images
            raise SourceError(f"{req.topic} registers a schema per record type ({', '.join(sorted(by_record)[:3])}"
                              f"{', ...' if len(by_record) > 3 else ''}), and a DataFrame has one",
                              topic=req.topic, hint="read the table topics (option 'table'), or capture with "
                              "[capture] raw_images = 'framed' to read the raw topic")  # fmt: skip
        raise SourceError(f"no schema is registered under {req.topic}-value in {req.registry}", topic=req.topic,
                          hint="Headwater reads Avro topics written by capture or the streams workers")  # fmt: skip
    return ValueSchema(*found)


# ---- offsets ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Slice(InputPartition):
    """Offsets ``start`` to ``end - 1`` of one partition: what one Spark task reads."""

    topic: str
    partition: int
    start: int
    end: int


def open_consumer(req: Request) -> Consumer:
    """A reader with the request's Kafka settings (``SourceError`` if librdkafka refuses them)."""
    try:
        return reader(req.kafka)
    except KafkaException as exc:
        raise SourceError(f"bad Kafka settings: {exc}", topic=req.topic,
                          hint="check the kafka.* options and [analytics] kafka") from exc  # fmt: skip


@contextlib.contextmanager
def _using(req: Request, consumer: Consumer | None) -> Iterator[Consumer]:
    """The caller's consumer, or one made (and closed) for this call."""
    if consumer is not None:
        yield consumer
        return
    made = open_consumer(req)
    try:
        yield made
    finally:
        made.close()


def partitions(req: Request, consumer: Consumer | None = None) -> list[int]:
    """The topic's partition numbers (listing every topic: asking for one may create it)."""
    with _using(req, consumer) as using:
        try:
            topics = using.list_topics(timeout=min(req.timeout, 15)).topics
        except KafkaException as exc:
            raise SourceUnavailable(f"Kafka at {req.kafka['bootstrap.servers']} does not answer: {exc}",
                                    topic=req.topic, hint="start the broker or pass the right 'bootstrap' option"
                                    ) from exc  # fmt: skip
    meta = topics.get(req.topic)
    if meta is None or meta.error is not None:
        near = sorted(t for t in topics if t.startswith(req.prefix) and not t.startswith("_"))[:20]
        raise SourceError(f"the topic does not exist on {req.kafka['bootstrap.servers']}", topic=req.topic,
                          hint=f"topics there with prefix {req.prefix!r}: {', '.join(near) or 'none'}")  # fmt: skip
    return sorted(meta.partitions)


def plan(req: Request) -> list[Slice]:
    """The slices of the read: the planned offsets of every partition, split in ``changes`` mode."""
    consumer = open_consumer(req)
    try:
        numbers = partitions(req, consumer)
        marks = {p: consumer.get_watermark_offsets(TopicPartition(req.topic, p), timeout=15) for p in numbers}
        starts = {p: low for p, (low, _) in marks.items()}
        if req.cut is not None:
            ends = find_cut(req, consumer).ends
        else:
            reported = {(req.topic, p): high for p, (_, high) in marks.items()}
            ends = {p: end for (_, p), end in fetched_ends(req.kafka, reported, timeout=req.timeout).items()}
    except (KafkaException, RetryableError) as exc:
        raise SourceUnavailable(f"cannot find the partitions' offsets: {exc}", topic=req.topic) from exc
    finally:
        consumer.close()
    step = req.task_records if req.mode == "changes" else None
    return [s for p in numbers for s in split(req.topic, p, starts[p], ends.get(p, 0), step)]


def split(topic: str, partition: int, start: int, end: int, step: int | None) -> list[Slice]:
    """Offsets ``start`` to ``end - 1`` of a partition as slices of at most ``step`` messages (None: one)."""
    if end <= start:
        return []
    step = step or end - start
    return [Slice(topic, partition, a, min(a + step, end)) for a in range(start, end, step)]


# ---- cuts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cut:
    """A view topic read up to ``ends`` is the view exactly at ``commit_lsn``."""

    view: str
    commit_lsn: int
    topic: str
    ends: dict[int, int]

    @property
    def lsn(self) -> str:
        return lsn_text(self.commit_lsn)


def find_cut(req: Request, consumer: Consumer | None = None) -> Cut:
    """The newest cut of ``req.topic`` at or before ``req.cut`` (-1: the newest there is)."""
    where = cuts_topic(req.prefix)
    with _using(req, consumer) as using:
        cuts = [_decoded(msg.value()) for msg in _all(using, where, req)]
    mine = [c for c in cuts if c is not None and c.topic == req.topic]
    fit = [c for c in mine if req.cut is None or req.cut < 0 or c.commit_lsn <= req.cut]
    if not fit:
        oldest = min((c.commit_lsn for c in mine), default=None)
        raise SourceError(
            f"no cut of this view on {where}" + (f" at or before {lsn_text(req.cut or 0)}" if mine else ""),
            topic=req.topic,
            hint=f"the oldest cut still there is at {lsn_text(oldest)}"
            if oldest is not None
            else "cuts are published by a streams worker running the view (see README 'Views')",
        )
    return max(fit, key=lambda c: c.commit_lsn)


def _all(consumer: Consumer, topic: str, req: Request) -> list[Any]:
    try:
        metadata = consumer.list_topics(timeout=15).topics.get(topic)
        if metadata is None:
            return []
        return list(read_on(req.kafka, {(topic, p): 0 for p in metadata.partitions}, timeout=req.timeout))
    except (KafkaException, RetryableError) as exc:
        raise SourceUnavailable(f"cannot read the cuts on {topic}: {exc}", topic=req.topic) from exc


def _decoded(value: bytes | None) -> Cut | None:
    if value is None:
        return None
    raw = decode_cut(value)
    return Cut(raw["view"], int(raw["commit_lsn"]), raw["topic"], {int(e["partition"]): int(e["offset"])
                                                                 for e in raw["ends"]})  # fmt: skip

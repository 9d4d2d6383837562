"""The fan-out's runtime: batches of raw changes in, table-topic records out, a checkpoint behind them.

Promise: ``FanOutRun.handle`` routes a batch of the raw topic (``streams.fanout``) and writes it
without waiting; the fan-out's own checkpoint (``<prefix>.changes.fanout``) moves only to where
Kafka acknowledged every record, and a (re)started fan-out resumes from it — so a crash replays
what was unacknowledged, which the fan-out recognises (partition tails, watermark) and does not
write twice. The checkpoint names the raw topic's Kafka id: a raw topic deleted and made again while the
table topics stayed (their records' positions are offsets of the old one) stops the fan-out with a
``FatalError`` saying what to delete. A message that cannot be decoded goes to ``<prefix>.changes.dlq`` with its offset
and the reason, is counted and logged, and the stream goes on. With ``[streams] debezium`` each
change is also written in Debezium's format (``streams.dbzrun``) in the same batch. Records another
writer put among the fan-out's on a table topic or a Debezium-format one (a zombie: a worker paused past its
session, sending old records late; ``streams.writer.Landed``) are read back, and each key they touched gets
the record of its newest change written again (``mend``), so an old one never stays a key's newest. The checkpoint
says how far each partition it wrote was examined (``Landed.verified``); the next run examines the rest, and writes
again the keys of records there written out of raw order (``streams.fanout.disordered``). A change keyed under a
new key schema (``streams.fanout.Rekey``) is written, then its topic is read and its rows under older key schemas
are moved to the new one (``rekey``: like a TRUNCATE, once per key change; the topic is read whole). Its
collaborators (settings, registry, writer) are passed in: it runs without a host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from streams import rocks
from streams.config import StreamsConfig
from streams.cursor import Cursor, Raw
from streams.dbzrun import DebeziumRun
from streams.fanout import (
    STREAMED,
    Change,
    FanOut,
    Output,
    Position,
    Rekey,
    Truncate,
    behind,
    disordered,
    headers,
    live_keys,
    newest,
    rekey_moves,
    rekey_outputs,
    truncate_outputs,
)
from streams.metrics import StreamsMetrics, clock
from streams.writer import Checkpoint, Pending, Stray, TableWriter
from tables.change import ChangeReader
from tables.errors import FatalError
from tables.logs import facts
from tables.registry import Registry
from tables.wire import (
    FRAME_SIZE,
    HEADER_ERROR,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    UndecodableMessage,
    avro_body,
    frame,
    schema_id,
)

log = logging.getLogger("headwater.streams")
OPS = frozenset({*STREAMED, "READ", "SNAPSHOT_END"})


class FanOutRun:
    """The fan-out's state between batches; reloaded from Kafka after a rebalance.

    Batches are written without waiting; a checkpoint is written for the newest batch
    Kafka acknowledged with all before it, and a (re)started fan-out reads from it. Only
    the fan-out's feed thread calls ``resume``, ``handle`` and ``tick``.
    """

    def __init__(self, cfg: StreamsConfig, schemas: Registry, writer: TableWriter, served: Collection[str],
                 metrics: StreamsMetrics | None = None) -> None:  # fmt: skip
        self.cfg, self.schemas, self.writer, self.served = cfg, schemas, writer, frozenset(served)
        self.metrics = metrics or StreamsMetrics()
        self.fanout: FanOut | None = None
        self.cursor = Cursor(cfg.changes_topic, "fan-out", lambda: writer.low_watermark(cfg.changes_topic))
        self.saved = -1  # raw offset of the last checkpoint written
        self.resumed = 0  # raw offset this run of the fan-out resumed from
        self.ready = 0  # raw offset past every table partition's tail at the start: mends wait until it is read
        self.last: Checkpoint | None = None  # the newest checkpoint, saved or read
        self.vouched: dict[tuple[str, int], int] = {}  # the examined offsets last saved
        self.look_every = 10.0  # seconds between two looks at the table topics' ends (``TableWriter.look``)
        self.looked = time.monotonic()
        self.raw_id = ""  # Kafka's id of the raw topic read (the checkpoints name it)
        self.warned: set[str] = set()
        self.batches = 0
        self.busy = 0.0  # seconds spent handling batches since the last report
        self.reported = (time.monotonic(), 0)
        self.fan_key = KeyOfRow(schemas)
        self.read = ChangeReader(schemas)  # framed or nested images, as framed bytes
        self.scratch = cfg.state_dir / f"{cfg.app_id}-scratch"  # whole-topic work: a TRUNCATE's keys, a re-key's rows
        self.debezium = DebeziumRun(cfg, schemas, writer, self._old_key, self.decode) if cfg.debezium else None

    def decode(self, value: bytes | None) -> Change:
        return decode(self.read, value)

    def _old_key(self, change: Change) -> bytes | None:
        return (self.fanout or self.load()).old_key(change)

    def load(self) -> FanOut:
        rocks.clear(self.scratch)  # a TRUNCATE's or re-key's that a crash cut short
        self.writer.drain(30.0)  # this writer's records in flight land before the tails are read: none is a stray
        saved, self.raw_id = self.writer.checkpoint(), self.writer.raw_topic_id()
        if saved is not None and saved.raw_topic_id and saved.raw_topic_id != self.raw_id:
            raise other_raw_topic(self.cfg, saved.raw_topic_id, self.raw_id)
        start, watermark = (saved.raw_offset, saved.watermark) if saved else (0, (-1, -1))
        self.cursor.reset(start)
        self.saved = self.resumed = start
        self.last = saved
        named = self.debezium.kept(saved.verified, self.served) if self.debezium is not None and saved else []
        kept = self.writer.ensure_topics(named, create=False)  # those still there; none made again
        tails = self.writer.tails([*sorted(self.served), self.cfg.dlq_topic, *kept])
        frames = {topic: frame(key) for topic, key in saved.key_schemas.items()} if saved else {}
        self.fanout = FanOut(self.cfg.partitions, watermark, tails, self.fan_key, frames)
        self.reported = (self.reported[0], 0)  # its counters start at 0
        self.ready = 1 + max((at[0] for at in tails.values()), default=-1)
        self.writer.landed.unexamined(saved.verified if saved else {})
        if self.debezium is not None:
            self.debezium.reset(kept)
        log.info("fan-out resumes: raw offsets below %d done, watermark %s", start, watermark)
        return self.fanout

    def resume(self) -> int:
        """Reload tails and checkpoint (another worker may have written meanwhile): the raw offset to read next."""
        self.load()
        return self.cursor.next

    def stop(self) -> None:
        """The raw partition is given up: what was written lands before its next owner reads the tails, and the
        checkpoint says how far this fan-out examined each table partition (the next owner examines the rest)."""
        was, self.fanout = self.fanout, None
        self.writer.drain(10.0)
        if was is not None:
            self.save_last()

    def handle(self, batch: Sequence[Raw]) -> None:
        """Route and write a batch of raw changes (offset, key, value) in offset order."""
        started = clock()
        self._handle(batch)
        if self.fanout is not None:
            self.metrics.fanned(self.fanout.counters)  # per batch, not per change
        self.checkpoint()
        self.busy += self.metrics.spent("fanout", started)
        self.batches += 1
        self.report(batch[-1][0])

    def _past_tails(self) -> bool:
        """Whether the raw topic is read past every tail found (at the start, or at a Debezium topic's first write):
        before, a mend could write a key's record older than one a crashed run already wrote there."""
        late = self.debezium.ready if self.debezium is not None else 0
        return self.cursor.next >= max(self.ready, late)

    def tick(self) -> None:
        """Checkpoint what Kafka acknowledged since the last batch (called while no batch comes)."""
        if self.fanout is not None:
            self.checkpoint(quiet=True)

    def checkpoint(self, *, quiet: bool = False) -> None:
        """Settle, look and mend, and save the newest acknowledged batch's checkpoint (``quiet``: no batch comes;
        also when only the examined offsets moved)."""
        done = self.writer.settle()
        fan = self.fanout if self._past_tails() else None
        if fan is not None and time.monotonic() - self.looked > self.look_every and self.writer.look():
            self.looked = time.monotonic()  # records a zombie left after this fan-out's last of a partition
        if fan is not None and self.writer.landed.found:
            self.mend(fan, self.writer.landed.take())
        if done is not None and done.end > self.saved:
            self.save(done)
        elif quiet and done is None and self.vouched != self.writer.landed.verified():
            self.save(None)  # what was examined or written over since the last checkpoint

    def save(self, done: Pending | None) -> None:
        """Write the checkpoint of ``done`` (the newest acknowledged batch; None: the last one again), with how
        far each table partition was examined."""
        if done is not None:
            self.last = Checkpoint(done.end, done.watermark, self.raw_id, {},
                                   {topic: schema_id(key) for topic, key in done.frames.items()})  # fmt: skip
        if self.last is not None:
            self.vouched = self.writer.landed.verified()
            self.writer.save_checkpoint(self.last._replace(verified=self.vouched))
            self.saved = self.last.raw_offset

    def save_last(self) -> None:
        """Once the final records are acknowledged: the checkpoint once more, nothing mended any more."""
        try:
            self.save(self.writer.settle())
        except FatalError as exc:
            log.warning("fan-out stops without a last checkpoint: %s", exc)
            return
        self.writer.drain(5.0)

    def mend(self, fan: FanOut, strays: list[Stray]) -> None:
        """Write again the newest record of every key another writer's records left older than this fan-out's.

        Called only once this fan-out stands past every partition's tail as it found them at its start: the
        changes up to there it does not write again, so the newest of a key must include them."""
        keys: dict[tuple[str, int], set[bytes]] = {}
        start = self.cursor.next
        for stray, records in zip(strays, self.writer.records(strays), strict=True):
            self.found(stray, records)
            if stray.topic in self.served or (self.debezium is not None and self.debezium.owns(stray.topic)):
                old = self.older(stray, records)
                keys.setdefault((stray.topic, stray.partition), set()).update(old)
                start = min(start, *old.values()) if old else start
        debezium = any(some and topic not in self.served for (topic, _), some in keys.items())
        outputs = newest(self._routes(start, debezium), keys) if any(keys.values()) else []
        pending = self.writer.open_batch()
        self.writer.write(outputs, pending)
        pending.end, pending.watermark, pending.strays = self.cursor.next, fan.watermark, tuple(strays)
        level = logging.WARNING if outputs or not all(s.handed for s in strays) else logging.INFO
        log.log(level, "fan-out: %d keys they touched written again, as of their newest change up to raw offset %d "
                "(read back from raw offset %d)", len(outputs), self.cursor.next, start)  # fmt: skip

    def older(self, stray: Stray, records: list[tuple[bytes | None, Position | None]]) -> dict[bytes, int]:
        """The keys of a stray to write again: any its writer left behind this fan-out, or, past the last writer's
        checkpoint, any written out of raw order (``disordered``: the last writer's own, in order, are left)."""
        if stray.handed:
            return disordered(records, self.resumed)
        ahead = max((at[0] for _, at in records if at is not None), default=-1)
        if ahead >= self.cursor.next:
            self.writer.landed.freeze(stray, ahead)  # its writer is ahead of this one: this one may be the zombie
        return behind(records, self.cursor.next, self.resumed)

    def found(self, stray: Stray, records: list[tuple[bytes | None, Position | None]]) -> None:
        where = facts(topic=stray.topic, partition=stray.partition, offset=stray.start)
        if stray.handed:
            log.info("fan-out: %d records in %s[%d] from offset %d on, written after the last writer's checkpoint, "
                     "examined", sum(k is not None for k, _ in records), stray.topic, stray.partition, stray.start,
                     extra=where)  # fmt: skip
            return
        self.metrics.fanout_strays.inc(len(records))
        log.warning("fan-out: another writer put %d records among this fan-out's in %s[%d] (a worker that lost "
                    "the raw partition and had not noticed yet)", len(records), stray.topic, stray.partition,
                    extra=where)  # fmt: skip

    def _routes(self, start: int, debezium: bool = False) -> Iterator[list[Output] | Truncate | Rekey]:
        """The routes of the raw changes from ``start`` up to where this fan-out stands, none left out as written;
        with ``debezium``, each change's Debezium-format records after them."""
        fan = FanOut(self.cfg.partitions, key_of_row=self.fan_key)
        again = self.debezium.again() if debezium and self.debezium is not None else None
        for offset, _, value in self.writer.raw(start, self.cursor.next):
            try:
                change = self.decode(value)
                fresh = again is not None and not fan.duplicate(change)
                yield fan.route(change, offset)
            except UndecodableMessage:
                continue  # a dead letter: no record
            if fresh and again is not None:
                yield again.events(change, offset, time.time_ns() // 1000)

    def report(self, offset: int, every: float = 10.0) -> None:
        """A progress line every ``every`` seconds: rate, batches, time busy, counters."""
        then, changes = self.reported
        now = time.monotonic()
        if now - then < every or self.fanout is None:
            return
        c = self.fanout.counters
        changes = changes if c.changes >= changes else 0  # a reload (a resume) started the counters again
        log.info("fan-out at raw offset %d: %.0f changes/s, %d batches (%.0f%% busy); %s", offset,
                 (c.changes - changes) / (now - then), self.batches, 100 * self.busy / (now - then),
                 ", ".join(f"{k} {v}" for k, v in vars(c).items()),
                 extra=facts(topic=self.cfg.changes_topic, offset=offset))  # fmt: skip
        self.reported, self.batches, self.busy = (now, c.changes), 0, 0.0

    def _handle(self, batch: Sequence[Raw]) -> None:
        fan = self.fanout or self.load()
        pending = self.writer.open_batch()
        debezium = self.debezium  # None unless [streams] debezium: the default path pays one test per change
        for offset, key, value in self.cursor.admit(batch):
            try:
                change = self.decode(value)
            except UndecodableMessage as exc:
                self.dead_letter(fan, offset, key, value, str(exc), pending)
                continue
            fresh = debezium is not None and not fan.duplicate(change)
            routed = fan.route(change, offset)
            if isinstance(routed, Truncate):
                self.truncate(fan, routed, pending)
            elif isinstance(routed, Rekey):
                self.rekey(fan, routed, pending)
            elif routed:
                self.ensure(routed[0].topic)
                self.writer.write(routed, pending)
            if fresh:
                debezium.emit(fan, change, offset, pending)  # type: ignore[union-attr]
        if fan.unkeyed - self.warned:
            log.warning("tables without key are not fanned out: %s", ", ".join(sorted(fan.unkeyed - self.warned)))
            self.warned |= fan.unkeyed
        pending.end, pending.watermark, pending.frames = self.cursor.next, fan.watermark, dict(fan.frames)

    def ensure(self, topic: str) -> None:
        if topic not in self.writer.known:
            self.writer.ensure_topics([topic])
            if topic not in self.served and self.cfg.discover_every:
                log.info("new table topic %s: the workers serve it once they find its table in the registry "
                         "(they look every %g s)", topic, self.cfg.discover_every)  # fmt: skip
            elif topic not in self.served:
                log.warning("new table topic %s: restart the workers to serve it over the endpoint "
                            "([streams] discover_every is 0)", topic)  # fmt: skip
        if topic not in self.writer.landed.watched:  # first written in this run (made now, or served since)
            self.writer.tails([topic])  # where it ends: another writer's records there are found from now on

    def truncate(self, fan: FanOut, truncate: Truncate, pending: Pending) -> None:
        self.ensure(truncate.topic)
        self.writer.flush()  # everything before the truncate is on the topic
        with rocks.scratch(self.scratch) as latest:
            keys = live_keys(self.writer.scan(truncate.topic), truncate.offset, latest)
            self.writer.write(truncate_outputs(fan, truncate, keys), pending)

    def rekey(self, fan: FanOut, rekey: Rekey, pending: Pending) -> None:
        """A change keyed under a new key schema: its records, then the topic's keys of the old one moved to it."""
        self.ensure(rekey.topic)
        self.writer.write(rekey.outputs, pending)
        self.writer.flush()  # everything before the re-key is on the topic
        started, written, where = time.monotonic(), fan.counters.written, facts(topic=rekey.topic, offset=rekey.offset)
        log.warning("%s is keyed with key schema %d from raw offset %d on: reading the topic to move its rows keyed "
                    "under an older key schema to it", rekey.topic, schema_id(rekey.frame), rekey.offset, extra=where)
        with rocks.scratch(self.scratch) as latest, rocks.scratch(self.scratch) as target:
            moves, stuck = rekey_moves(rekey, self.writer.scan(rekey.topic), self._reframe(rekey.frame), latest, target)
            read = time.monotonic() - started
            self.writer.write(rekey_outputs(fan, rekey, moves), pending)
        log.warning("%s: %d records moved its rows to key schema %d (the topic read in %.1f s, the moves written in "
                    "%.1f s)", rekey.topic, fan.counters.written - written, schema_id(rekey.frame), read,
                    time.monotonic() - started - read, extra=where)  # fmt: skip
        if stuck:
            log.error("%s: %d rows keyed under an older key schema cannot be keyed with schema %d (their key values "
                      "do not fit it) and stay under their old keys", rekey.topic, stuck, schema_id(rekey.frame),
                      extra=where)  # fmt: skip

    def _reframe(self, frame: bytes) -> Callable[[bytes], bytes | None]:
        """An old key made the key ``frame`` names: its columns, by name, encoded with that schema (None: they are not
        the same columns, or a value does not fit)."""
        names = sorted(self.fan_key.columns(frame))

        def reframe(key: bytes) -> bytes | None:
            try:
                record = self.schemas.decode(key)
                if sorted(record) != names:  # a column renamed, another primary key: not the same key
                    return None
                return self.fan_key.under(record, frame)
            except (UndecodableMessage, ValueError, TypeError, OverflowError):
                return None

        return reframe

    def dead_letter(
        self, fan: FanOut, offset: int, key: bytes | None, value: bytes | None, reason: str, pending: Pending
    ) -> None:
        fan.counters.dead_letters += 1
        raw, dlq = self.cfg.changes_topic, self.cfg.dlq_topic
        log.error("raw message at %s offset %d cannot be decoded (%s): sent to %s", raw, offset, reason, dlq,
                  extra=facts(topic=raw, partition=0, offset=offset))  # fmt: skip
        if fan.fresh(dlq, 0, (offset, 0)):
            meta = [(HEADER_SOURCE_TOPIC, raw.encode()), (HEADER_SOURCE_PARTITION, b"0"),
                    (HEADER_SOURCE_OFFSET, b"%d" % offset), (HEADER_ERROR, reason.encode()[:1000])]  # fmt: skip
            self.writer.produce(dlq, 0, key, value, headers("DEAD", offset, 0, 0, 0)[1:2] + meta, pending)


class KeyOfRow:
    """The old key of an update under REPLICA IDENTITY FULL: key columns of the old row."""

    def __init__(self, registry: Registry) -> None:
        self.schemas = registry

    def __call__(self, old_row: bytes, new_key: bytes) -> bytes:
        return self.under(self.schemas.decode(old_row), new_key[:FRAME_SIZE])

    def columns(self, frame: bytes) -> list[str]:
        """The key columns of the key schema ``frame`` names."""
        return [f["name"] for f in self.schemas.parsed(schema_id(frame))["fields"]]

    def under(self, row: dict[str, Any], frame: bytes) -> bytes:
        """``row``'s key columns, by name, encoded with the key schema ``frame`` names (KeyError: one is missing)."""
        schema = self.schemas.parsed(schema_id(frame))
        return frame + avro_body(schema, {f["name"]: row[f["name"]] for f in schema["fields"]})


def decode(read: Callable[[bytes], dict[str, Any]], value: bytes | None) -> Change:
    """A raw message's change record, its images framed (``read``: a ``tables.change.ChangeReader``;
    UndecodableMessage: not one this fan-out can route)."""
    if value is None:
        raise UndecodableMessage("empty value")
    record = read(value)
    try:
        change = Change.from_record(record)
    except (KeyError, TypeError) as exc:
        raise UndecodableMessage(f"not a change record: missing {exc}") from exc
    if change.op not in OPS:
        raise UndecodableMessage(f"unknown operation {change.op!r}")
    return change


def other_raw_topic(cfg: StreamsConfig, was: str, now: str) -> FatalError:
    """The checkpoint and the table topics were written from another incarnation of the raw topic."""
    return FatalError(
        f"{cfg.changes_topic} is not the raw topic the fan-out's checkpoint and the table topics were written from "
        f"(topic id {was}, now {now or 'none'}): it was deleted and made again while they stayed, so their records "
        "cannot be told apart from the new topic's",
        hint=f"capture started over on a new raw topic: delete the other topics under {cfg.topic_prefix}. too "
        f"(table topics, {cfg.progress_topic}, the views' topics), then start the workers again; they rebuild "
        "everything from the new raw topic",
    )

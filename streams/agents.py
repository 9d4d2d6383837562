"""The stream agents: the fan-out of the raw topic, and the table agent behind the Faust tables.

Promise: ``fanout`` reads ``<prefix>.changes`` in order, in batches; each batch is
routed (``streams.fanout``) and written without waiting; the fan-out's own checkpoint
(``<prefix>.changes.fanout``) moves only to where Kafka acknowledged every record, and
a (re)started fan-out seeks back to it — so a crash replays what was unacknowledged,
which the fan-out recognises (partition tails, watermark) and does not write twice. A message
that cannot be decoded goes to ``<prefix>.changes.dlq`` with its offset and the reason,
is counted and logged, and the stream goes on. ``table_rows`` applies each table
topic's records to its Faust table (a tombstone deletes).
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import fastavro
from faust.types import TP

from headwater.topics import UndecodableMessage
from streams.app import app, cfg
from streams.catalog import Schemas
from streams.fanout import STREAMED, Change, FanOut, Truncate, header_lsn, headers, live_keys, truncate_outputs
from streams.rows import pack
from streams.tables import rows
from streams.topics import TABLES, changes, schemas, table_topics, writer
from streams.writer import Pending

log = logging.getLogger("headwater.streams")
OPS = frozenset({*STREAMED, "READ", "SNAPSHOT_END"})


class Runtime:
    """The fan-out's state between batches; reloaded from Kafka after a rebalance.

    Batches are written without waiting; a checkpoint is written for the newest batch
    Kafka acknowledged with all before it. Faust may acknowledge raw offsets beyond
    that, so on (re)start the fan-out seeks back to its own checkpoint.
    """

    def __init__(self) -> None:
        self.fanout: FanOut | None = None
        self.next = 0  # the raw offset to handle next; everything below is handled
        self.seeking: int | None = None  # a seek back to this offset was asked for
        self.saved = -1  # raw offset of the last checkpoint written
        self.lock = threading.Lock()  # handle() runs in an executor thread, tick() in the loop
        self.warned: set[str] = set()
        self.batches = 0
        self.busy = 0.0  # seconds spent handling batches since the last report
        self.reported = (time.monotonic(), 0)

    def load(self) -> FanOut:
        saved = writer.checkpoint()
        self.next, watermark = saved if saved else (0, (-1, -1))
        self.saved, self.seeking = self.next, None
        topics = [t.topic for t in TABLES] + [cfg.dlq_topic]
        keys = KeyOfRow(schemas)
        self.fanout = FanOut(cfg.partitions, watermark, writer.tails(topics), keys)
        log.info("fan-out resumes: raw offsets below %d done, watermark %s", self.next, watermark)
        return self.fanout

    def handle(self, batch: Sequence[tuple[int, bytes | None, bytes | None]]) -> int | None:
        """Route and write a batch; the raw offset to seek back to, if Faust skipped ahead."""
        started = time.monotonic()
        with self.lock:
            seek = self._handle(batch)
            self.checkpoint()
        self.busy += time.monotonic() - started
        self.batches += 1
        self.report(batch[-1][0])
        return seek

    def tick(self) -> None:
        """Checkpoint what Kafka acknowledged since the last batch (called on a timer)."""
        with self.lock:
            if self.fanout is not None:
                self.checkpoint()

    def checkpoint(self) -> None:
        done = writer.settle()
        if done is not None and done.end > self.saved:
            writer.save_checkpoint(done.end, done.watermark)
            self.saved = done.end

    def report(self, offset: int, every: float = 10.0) -> None:
        """A progress line every ``every`` seconds: rate, batches, time busy, counters."""
        then, changes = self.reported
        now = time.monotonic()
        if now - then < every or self.fanout is None:
            return
        c = self.fanout.counters
        log.info("fan-out at raw offset %d: %.0f changes/s, %d batches (%.0f%% busy); %s", offset,
                 (c.changes - changes) / (now - then), self.batches, 100 * self.busy / (now - then),
                 ", ".join(f"{k} {v}" for k, v in vars(c).items()))  # fmt: skip
        self.reported, self.batches, self.busy = (now, c.changes), 0, 0.0

    def gap(self, offset: int) -> int | None:
        """Faust delivered ``offset`` beyond ``self.next``: seek back, or accept what retention deleted."""
        if self.seeking == self.next:
            return None  # already asked: drop what was fetched before the seek
        low = writer.low_watermark(cfg.changes_topic)
        if low > self.next:
            log.error("raw offsets %d..%d were deleted (retention) before the fan-out wrote them; going on at %d",
                      self.next, low - 1, low)  # fmt: skip
            self.next = low
            return None if offset == low else self.gap(offset)
        self.seeking = self.next
        log.info("raw offset %d delivered, %d expected: seeking back to the checkpoint", offset, self.next)
        return self.next

    def _handle(self, batch: Sequence[tuple[int, bytes | None, bytes | None]]) -> int | None:
        fan = self.fanout or self.load()
        pending = writer.open_batch()
        seek = None
        for offset, key, value in batch:
            if offset < self.next:
                continue  # handled already
            if offset > self.next:
                seek = self.gap(offset) or seek
                if offset > self.next:
                    continue  # fetched before the seek back: it comes again in order
            self.seeking, self.next = None, offset + 1
            try:
                change = decode(value)
            except UndecodableMessage as exc:
                self.dead_letter(fan, offset, key, value, str(exc), pending)
                continue
            routed = fan.route(change, offset)
            if isinstance(routed, Truncate):
                self.truncate(fan, routed, pending)
            elif routed:
                self.ensure(routed[0].topic)
                writer.write(routed, pending)
        if fan.unkeyed - self.warned:
            log.warning("tables without key are not fanned out: %s", ", ".join(sorted(fan.unkeyed - self.warned)))
            self.warned |= fan.unkeyed
        pending.end, pending.watermark = self.next, fan.watermark
        return seek

    def ensure(self, topic: str) -> None:
        if topic not in writer.known:
            writer.ensure_topics([topic])
            if topic not in {t.topic for t in TABLES}:
                log.warning("new table topic %s: restart the workers to serve it over the endpoint", topic)

    def truncate(self, fan: FanOut, truncate: Truncate, pending: Pending) -> None:
        self.ensure(truncate.topic)
        writer.flush()  # everything before the truncate is on the topic
        keys = live_keys(writer.scan(truncate.topic), truncate.offset)
        writer.write(truncate_outputs(fan, truncate, keys), pending)

    def dead_letter(
        self, fan: FanOut, offset: int, key: bytes | None, value: bytes | None, reason: str, pending: Pending
    ) -> None:
        fan.counters.dead_letters += 1
        log.error("raw message at %s offset %d cannot be decoded (%s): sent to %s",
                  cfg.changes_topic, offset, reason, cfg.dlq_topic)  # fmt: skip
        if fan.fresh(cfg.dlq_topic, 0, (offset, 0)):
            meta = [("hw.source.topic", cfg.changes_topic.encode()), ("hw.source.partition", b"0"),
                    ("hw.source.offset", b"%d" % offset), ("hw.error", reason.encode()[:1000])]  # fmt: skip
            writer.produce(cfg.dlq_topic, 0, key, value, headers("DEAD", offset, 0, 0, 0)[1:2] + meta, pending)


class KeyOfRow:
    """The old key of an update under REPLICA IDENTITY FULL: key columns of the old row."""

    def __init__(self, registry: Schemas) -> None:
        self.schemas = registry

    def __call__(self, old_row: bytes, new_key: bytes) -> bytes:
        row = self.schemas.decode(old_row)
        key_schema = self.schemas.schema(int.from_bytes(new_key[1:5], "big"))
        out = io.BytesIO()
        fastavro.schemaless_writer(out, key_schema, {f["name"]: row[f["name"]] for f in key_schema["fields"]})
        return new_key[:5] + out.getvalue()


def decode(value: bytes | None) -> Change:
    if value is None:
        raise UndecodableMessage("empty value")
    record = schemas.decode(value)
    try:
        change = Change.from_record(record)
    except (KeyError, TypeError) as exc:
        raise UndecodableMessage(f"not a change record: missing {exc}") from exc
    if change.op not in OPS:
        raise UndecodableMessage(f"unknown operation {change.op!r}")
    return change


runtime = Runtime()


@app.on_partitions_revoked.connect  # type: ignore[arg-type]  # mode types the handler too narrowly
async def _revoked(sender: Any, *args: Any, **kwargs: Any) -> None:
    runtime.fanout = None  # another worker may write meanwhile: reload tails and checkpoint


@app.agent(changes, name="fanout")
async def fanout(stream: Any) -> None:
    loop = asyncio.get_running_loop()
    async for events in stream.take_events(cfg.batch_size, within=cfg.batch_wait):
        batch = [(e.message.offset, e.message.key, e.message.value) for e in events]
        seek = await loop.run_in_executor(None, runtime.handle, batch)
        if seek is not None:  # Faust re-delivers offsets above the one sought
            await app.consumer.seek(TP(cfg.changes_topic, 0), max(seek - 1, 0))


@app.timer(0.2)
async def fanout_checkpoint() -> None:
    """Checkpoint acknowledged progress while no batch comes to do it."""
    await asyncio.get_running_loop().run_in_executor(None, runtime.tick)


if table_topics is not None:

    @app.agent(table_topics, name="table_rows")
    async def table_rows(stream: Any) -> None:
        async for events in stream.take_events(cfg.batch_size, within=cfg.batch_wait):
            for event in events:
                message = event.message
                table = rows[message.topic]
                if message.value is None:
                    table.pop(message.key, None)
                else:
                    lsn, position = header_lsn(message.headers)
                    table[message.key] = pack(lsn, position, message.value)
